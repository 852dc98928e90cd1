"""`policy-rollout --ray N`: the episodes of a rollout spread over N Ray workers.

Each worker runs `episodes_as_they_end` on a contiguous part of the episodes with a policy of its own, built on the
worker from `make_policy` (an in-process engine, or a client of a server or of a Ray Serve application), and streams
each episode to the driver as it ends (a Ray generator task). An episode's seed depends only on its index, so the
merged results equal a local run's, episode for episode; the report merges every worker's ticks into one latency
distribution. A worker that stops (`RolloutStopped`), fails (building its policy: a server that never serves, a
checkpoint it cannot load; or any other error of its own) or dies (its process killed, out of memory, its node lost)
leaves the others to finish, and the rollout stops with every worker's ended episodes, as a local run does. Ctrl-C
cancels the workers' tasks (each stops as a local run does, closing its sessions), ends those still running
`CANCEL_GRACE_S` later (a second Ctrl-C: at once), and stops the rollout with every episode a worker had ended: each
goes to a mailbox actor as it ends, before its session is closed, then to the worker's stream (a cancelled task's
stream drops those the driver had not taken; a task ended where it was sends nothing more), and the mailbox keeps it
until the driver has taken it. The sessions a worker left
open (ended where it was, dead, or its cleanup cut short) the driver closes on their server once the workers ended.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import ray
from ray.experimental import tqdm_ray

from policy_server.client.errors import PolicyServerError
from policy_server.ray_serve.address import gcs_address
from robots.rollout import EpisodeResult, RolloutError, RolloutStopped, ServerPolicy, episodes_as_they_end

# A worker's process that died: its task is not run again (its episodes would run twice), the rollout stops.
_LOST = (ray.exceptions.WorkerCrashedError, ray.exceptions.OutOfMemoryError, ray.exceptions.NodeDiedError,
         ray.exceptions.ObjectLostError)
# After a Ctrl-C, how long the workers have to stop as a local run does (a tick, closing their sessions) before
# they are ended where they are (the driver then closes their sessions)
CANCEL_GRACE_S = 10.0
# How long the driver waits for the server to close a session of a worker it ended; one not answered in time leaves
# the rest to the server's idle timeout (a server that does not answer)
CLOSE_WAIT_S = 2.0


class WorkerFailed(RuntimeError):
    """A Ray worker that raised an error of its own (not a stop of its episodes) or whose process died mid-run
    (killed, out of memory, its node lost); the message says which worker and the error, or Ray's account."""


@ray.remote(num_cpus=0)
class _Mailbox:
    """What the workers tell the driver besides their streams: each ended episode (a cancelled task's stream drops
    those the driver had not taken; a task ended where it was sends none), and the server sessions each holds open
    (the driver closes those a worker left open: ended where it was, dead, or its cleanup cut short)."""

    def __init__(self):
        # worker -> (a client of its server: `ServerPolicy.connect`, {session id: the request id that opened it})
        self.sessions: dict[int, tuple[Callable, dict[str, str]]] = {}
        # its position in the driver's indices -> an ended episode the driver has not taken (video frames and all)
        self.ended: dict[int, EpisodeResult] = {}

    def opened(self, worker: int, connect: Callable, session_id: str, request_id: str) -> None:
        self.sessions.setdefault(worker, (connect, {}))[1][session_id] = request_id

    def closed(self, worker: int, session_id: str) -> None:
        del self.sessions[worker][1][session_id]

    def left_open(self) -> dict[int, tuple[Callable, dict[str, str]]]:
        return {worker: held for worker, held in self.sessions.items() if held[1]}

    def hand_over(self, position: int, result: EpisodeResult) -> None:
        self.ended[position] = result

    def taken(self, position: int) -> None:
        del self.ended[position]

    def handed_over(self) -> dict[int, EpisodeResult]:
        return self.ended


class _Registered:
    """A worker's `ServerPolicy` whose open sessions the mailbox knows: they outlive the worker's process where it is
    ended (in a call that does not return) or dies, and the driver then closes them."""

    def __init__(self, policy: ServerPolicy, mailbox, worker: int):
        self.policy, self.mailbox, self.worker = policy, mailbox, worker

    def wait_until_serving(self) -> None:
        self.policy.wait_until_serving()

    def open(self, instruction: str, seed: int, preview: bool, request_id: str):
        session = self.policy.open(instruction, seed, preview, request_id)
        ray.get(self.mailbox.opened.remote(self.worker, self.policy.connect, session.session_id, request_id))
        return session

    def act(self, session, obs: dict, step: int, want_video: bool = False, committed: np.ndarray | None = None):
        return self.policy.act(session, obs, step, want_video, committed)

    def close(self, session) -> None:
        try:
            self.policy.close(session)
        except PolicyServerError as error:
            if error.reason != "SESSION_NOT_FOUND":  # maybe open still: the driver closes it once the workers ended
                raise
        ray.get(self.mailbox.closed.remote(self.worker, session.session_id))  # closed, or gone already


def _close_left_open(left_open: dict[int, tuple[Callable, dict[str, str]]]) -> None:
    """Close the sessions the workers left open (`_Mailbox.left_open`) through a client each one's `connect` makes;
    where the server does not answer within `CLOSE_WAIT_S`, or no client can be made here (a token or TLS file this
    node lacks), a line on stderr says so and the rest are left to the server's idle timeout."""
    for worker, (connect, sessions) in left_open.items():
        try:
            with connect(timeout_s=CLOSE_WAIT_S) as client:
                for session_id, request_id in sessions.items():
                    try:  # behind Ray Serve the request id is the session's routing key
                        client.close_session(session_id, routing_key=request_id)
                    except PolicyServerError as error:  # SESSION_NOT_FOUND: gone already (closed, or a restart)
                        if error.no_answer:
                            raise
        except Exception as error:  # the report comes first: a session not closed idles out
            print(f"policy-rollout: could not close the {len(sessions)} session(s) Ray worker {worker} left open "
                  f"({type(error).__name__}: {error}); the server closes them once idle", file=sys.stderr, flush=True)
            return


# One task per worker process: the engine it built goes with the process.
@ray.remote(max_calls=1, max_retries=0)
def _run_part(make_policy: Callable, mailbox, env_id: str, indices: list[int], start: int, num_envs: int,
              execute: int, videos: int, worker: int, delay: int, commit: bool) -> Iterator[tuple[int, EpisodeResult]]:
    """The episodes of `indices` (the driver's from position `start` on), each with its position in the driver's."""
    policy = make_policy()
    if isinstance(policy, ServerPolicy):  # an in-process engine's sessions end with the process
        policy = _Registered(policy, mailbox, worker)
    # Ray's bar for a task: the driver draws every worker's, one line each.
    progress = tqdm_ray.tqdm(desc=f"worker {worker} episodes", total=len(indices), unit="ep", position=worker)
    # The driver's cancel stops the episodes as a Ctrl-C stops a local run's, their sessions closed. Each episode goes
    # to the mailbox as it ends (before its session is closed), then to the stream: a cancelled task's stream drops
    # the episodes the driver had not taken, and a task ended where it was sends nothing more.
    try:
        with contextlib.closing(episodes_as_they_end(policy, env_id, indices, num_envs, execute, videos, progress,
                                                     delay, commit)) as episodes:
            for position, result in episodes:
                ray.get(mailbox.hand_over.remote(start + position, result))
                yield start + position, result
    finally:
        progress.close()


def run_on_ray(make_policy: Callable, env_id: str, indices: Sequence[int], workers: int, num_envs: int,
               execute: int, videos: int = 0, address: str | None = None, gpus_per_worker: float = 0.0,
               cpus_per_worker: float = 1.0, delay: int = 0, commit: bool = False) -> list[EpisodeResult]:
    """`run_episodes` over `workers` Ray workers (each with `num_envs` environments and `gpus_per_worker` GPUs) of
    the cluster at `address` (unset: as `ray.init` finds it, `gcs_address`); the results in the order of
    `indices`, the first `videos` of them recorded; ConnectionError where `address` names no running Ray. Workers
    that stopped part way, failed (building its policy, before any episode, included) or died raise `RolloutStopped`
    with the first one's cause (a failure or death as `WorkerFailed`, a `RolloutError` of its checks as it is) and
    every worker's ended episodes, once the others have finished; Ctrl-C (KeyboardInterrupt) cancels every worker's
    task, waits for them to stop, at most `CANCEL_GRACE_S` (a second Ctrl-C: no longer), ends those still running
    and raises `RolloutStopped` with the episodes that had ended, every worker's; from then on this process sets
    RAY_IGNORE_UNHANDLED_ERRORS (Ray would log each cancelled task's error, whose episodes come from the mailbox).
    Sessions a worker left open (ended, dead) are closed on their server (stderr says where that failed)."""
    if not ray.is_initialized():
        ray.init(address=gcs_address(address))
    parts = [part.tolist() for part in np.array_split(np.asarray(indices), min(workers, len(indices)))]
    starts = np.cumsum([0] + [len(part) for part in parts[:-1]])
    task = _run_part.options(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker)
    mailbox = _Mailbox.remote()
    streams = {task.remote(make_policy, mailbox, env_id, part, int(start), num_envs, execute,
                           int(np.clip(videos - start, 0, len(part))), worker, delay, commit): worker
               for worker, (part, start) in enumerate(zip(parts, starts, strict=True))}
    results: list[EpisodeResult | None] = [None] * len(indices)
    stops: list[BaseException] = []  # what stopped a worker, as each did

    def take(stream) -> None:
        """The next item of a worker's stream, ready: an ended episode, or how the worker's task ended."""
        worker = streams[stream]
        try:
            position, result = ray.get(next(stream))
        except StopIteration:
            del streams[stream]
            return
        except ray.exceptions.TaskCancelledError as error:  # by our Ctrl-C (which stops first), or from outside
            stops.append(error)
            return
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, RolloutStopped):  # part way: the episodes it ended came before
                stops.append(error.cause.cause)
            elif isinstance(error.cause, RolloutError):  # the options against the model: every worker's, the same
                stops.append(error.cause)
            else:  # building its policy (a server that never serves, a checkpoint it cannot load), or a bug
                stops.append(WorkerFailed(f"Ray worker {worker}: {type(error.cause).__name__}: {error.cause}"))
            return
        except _LOST as error:
            stops.append(WorkerFailed(f"Ray worker {worker} died ({type(error).__name__}: "
                                      f"{str(error).strip().splitlines()[0]}); the episodes it ended are reported"))
            return
        results[position] = result
        # Handed over before it was streamed, so this call comes after that one: the mailbox holds only the episodes
        # the driver lacks, not a second copy of every one.
        mailbox.taken.remote(position)

    def take_all() -> None:
        while streams:
            for stream in ray.wait(list(streams), num_returns=1)[0]:
                take(stream)

    def running_after(timeout_s: float) -> list:
        """The streams whose task has not ended within `timeout_s` (Ray's wait takes a cancelled task's stream as
        ready before the task has ended: its completion, once it has)."""
        completions = {stream.completed(): stream for stream in streams}
        running = ray.wait(list(completions), num_returns=len(completions), timeout=timeout_s)[1] if streams else []
        return [completions[ref] for ref in running]

    try:
        take_all()
    except KeyboardInterrupt as interrupt:
        stops.insert(0, interrupt)
        # A task cancelled mid-episode ends in its RolloutStopped, which its stream, cancelled, drops unread: Ray logs
        # each such error, traceback and all, as 'Unhandled error'. Its episodes come from the mailbox. Set for the
        # rest of the process, which reports and ends: the cancelled tasks' errors may come after this call.
        os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"
        print(f"policy-rollout: interrupted; waiting up to {CANCEL_GRACE_S:g} s for the Ray workers to end their "
              "ticks and close their sessions (Ctrl-C again to end them at once)", file=sys.stderr, flush=True)
        # Not recursive: a cancel of the worker's mailbox calls would fail them (TaskCancelledError, not the
        # KeyboardInterrupt that stops its episodes), and an episode or a session it opened would go untold.
        with contextlib.suppress(KeyboardInterrupt):  # asked twice: no longer
            for stream in streams:  # each worker stops as a local run does (its sessions closed)
                ray.cancel(stream, recursive=False)
            running_after(CANCEL_GRACE_S)
        for stream in running_after(0.0):  # in a call or a load that does not see the cancel: ended where it is
            ray.cancel(stream, force=True, recursive=False)
        # The streams are not read again: the mailbox holds every episode not taken, and how each task ended adds
        # nothing to the interrupt (a cancelled task's stream may never end: Ray's issue 62537).
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C here: the report as it stands
        if stops:  # the episodes a stopped task's stream dropped, or that one ended where it was had not sent
            for position, result in ray.get(mailbox.handed_over.remote()).items():
                results[position] = result
        # Those of a worker ended where it was or dead (OOM-killed, its node lost), or whose cleanup skipped them,
        # would hold the server's places until they idled out.
        _close_left_open(ray.get(mailbox.left_open.remote()))
    if stops:
        raise RolloutStopped(stops[0], [result for result in results if result is not None])
    return results
