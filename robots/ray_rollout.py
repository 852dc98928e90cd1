"""`policy-rollout --ray N`: the episodes of a rollout spread over N Ray workers.

Each worker runs `episodes_as_they_end` on a contiguous part of the episodes with a policy of its own, built on the
worker from `make_policy` (an in-process engine, or a client of a server or of a Ray Serve application), and streams
each episode to the driver as it ends (a Ray generator task). An episode's seed depends only on its index, so the
merged results equal a local run's, episode for episode; the report merges every worker's ticks into one latency
distribution. A worker that stops (`RolloutStopped`), fails (building its policy: a server that never serves, a
checkpoint it cannot load; or any other error of its own) or dies (its process killed, out of memory, its node lost)
leaves the others to finish, and the rollout stops with every worker's ended episodes, as a local run does. Ctrl-C
cancels the workers' tasks (each stops as a local run does, closing its sessions), ends those still running
`CANCEL_GRACE_S` later (a second Ctrl-C: at once), closing their sessions on the server, and stops the rollout with
every episode a worker had ended (a cancelled task's stream drops those the driver had not taken: the driver takes
what the streams hold before it cancels, and a cancelled worker hands its ended episodes over again).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import ray
from ray.experimental import tqdm_ray

from policy_server.client.errors import PolicyServerError
from policy_server.ray_serve.address import gcs_address
from robots.envs import HELDOUT_SEED_OFFSET
from robots.rollout import EpisodeResult, RolloutStopped, ServerPolicy, episodes_as_they_end

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
    """What the workers tell the driver besides their streams: the server sessions each holds open (the driver closes
    those of a worker it ended where it was), and the episodes each had ended when cancelled (a cancelled task's
    stream drops those the driver had not taken)."""

    def __init__(self):
        # worker -> (a client of its server: `ServerPolicy.connect`, {session id: the request id that opened it})
        self.sessions: dict[int, tuple[Callable, dict[str, str]]] = {}
        self.ended: list[EpisodeResult] = []

    def opened(self, worker: int, connect: Callable, session_id: str, request_id: str) -> None:
        self.sessions.setdefault(worker, (connect, {}))[1][session_id] = request_id

    def closed(self, worker: int, session_id: str) -> None:
        del self.sessions[worker][1][session_id]

    def held(self, worker: int) -> tuple[Callable, dict[str, str]] | None:
        return self.sessions.get(worker)

    def hand_over(self, results: list[EpisodeResult]) -> None:
        self.ended += results

    def handed_over(self) -> list[EpisodeResult]:
        return self.ended


class _Registered:
    """A worker's `ServerPolicy` whose open sessions the mailbox knows: they outlive the worker's process where the
    driver ends it (in a call that does not return), and the driver then closes them."""

    def __init__(self, policy: ServerPolicy, mailbox, worker: int):
        self.policy, self.mailbox, self.worker = policy, mailbox, worker

    def __getattr__(self, name: str):  # act, wait_until_serving
        return getattr(self.policy, name)

    def open(self, instruction: str, seed: int, preview: bool, request_id: str):
        session = self.policy.open(instruction, seed, preview, request_id)
        ray.get(self.mailbox.opened.remote(self.worker, self.policy.connect, session.session_id, request_id))
        return session

    def close(self, session) -> None:
        self.policy.close(session)
        ray.get(self.mailbox.closed.remote(self.worker, session.session_id))


def _close_held(connect: Callable, sessions: dict[str, str]) -> None:
    """Close the sessions a worker held open (`_Mailbox.held`) through a client `connect` makes; where the server does
    not answer within `CLOSE_WAIT_S`, the rest are left to its idle timeout."""
    with connect(timeout_s=CLOSE_WAIT_S) as client:
        for session_id, request_id in sessions.items():
            try:  # behind Ray Serve the request id is the session's routing key
                client.close_session(session_id, routing_key=request_id)
            except PolicyServerError as error:  # SESSION_NOT_FOUND: gone with a restarted server
                if error.no_answer:
                    return


# One task per worker process: the engine it built goes with the process.
@ray.remote(max_calls=1, max_retries=0)
def _run_part(make_policy: Callable, mailbox, env_id: str, indices: list[int], num_envs: int, execute: int,
              videos: int, worker: int, delay: int, commit: bool) -> Iterator[tuple[int, EpisodeResult]]:
    policy = make_policy()
    if isinstance(policy, ServerPolicy):  # an in-process engine's sessions end with the process
        policy = _Registered(policy, mailbox, worker)
    # Ray's bar for a task: the driver draws every worker's, one line each.
    progress = tqdm_ray.tqdm(desc=f"worker {worker} episodes", total=len(indices), unit="ep", position=worker)
    sent: list[EpisodeResult] = []
    # The driver's cancel stops the episodes as a Ctrl-C stops a local run's, their sessions closed; its stream then
    # drops the episodes the driver had not taken, so they go by the mailbox too.
    try:
        with contextlib.closing(episodes_as_they_end(policy, env_id, indices, num_envs, execute, videos, progress,
                                                     delay, commit)) as episodes:
            for position, result in episodes:
                sent.append(result)
                yield position, result
    except RolloutStopped as stopped:
        if isinstance(stopped.cause, KeyboardInterrupt):  # cancelled within an episode
            ray.get(mailbox.hand_over.remote(stopped.finished))
        raise
    except GeneratorExit:  # cancelled as it streamed an episode
        ray.get(mailbox.hand_over.remote(sent))
        raise
    finally:
        progress.close()


def run_on_ray(make_policy: Callable, env_id: str, indices: Sequence[int], workers: int, num_envs: int,
               execute: int, videos: int = 0, address: str | None = None, gpus_per_worker: float = 0.0,
               cpus_per_worker: float = 1.0, delay: int = 0, commit: bool = False) -> list[EpisodeResult]:
    """`run_episodes` over `workers` Ray workers (each with `num_envs` environments and `gpus_per_worker` GPUs) of
    the cluster at `address` (unset: as `ray.init` finds it, `gcs_address`); the results in the order of
    `indices`, the first `videos` of them recorded; ConnectionError where `address` names no running Ray. Workers
    that stopped part way, failed (building its policy, before any episode, included) or died raise `RolloutStopped`
    with the first one's cause (a failure or death as `WorkerFailed`) and every worker's ended episodes, once the
    others have finished; Ctrl-C (KeyboardInterrupt) cancels every worker's task, waits for them to stop, at most
    `CANCEL_GRACE_S` (a second Ctrl-C: no longer), ends those still running and raises `RolloutStopped` with the
    episodes that had ended, every worker's (the sessions of those it ended closed on their server)."""
    if not ray.is_initialized():
        ray.init(address=gcs_address(address))
    parts = [part.tolist() for part in np.array_split(np.asarray(indices), min(workers, len(indices)))]
    starts = np.cumsum([0] + [len(part) for part in parts[:-1]])
    task = _run_part.options(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker)
    mailbox = _Mailbox.remote()
    streams = {task.remote(make_policy, mailbox, env_id, part, num_envs, execute,
                           int(np.clip(videos - start, 0, len(part))), worker, delay, commit): (worker, int(start))
               for worker, (part, start) in enumerate(zip(parts, starts, strict=True))}
    results: list[EpisodeResult | None] = [None] * len(indices)
    stops: list[BaseException] = []  # what stopped a worker, as each did

    def take(stream) -> None:
        """The next item of a worker's stream, ready: an ended episode, or how the worker's task ended."""
        worker, start = streams[stream]
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
            else:  # building its policy (a server that never serves, a checkpoint it cannot load), or a bug
                stops.append(WorkerFailed(f"Ray worker {worker}: {type(error.cause).__name__}: {error.cause}"))
            return
        except _LOST as error:
            stops.append(WorkerFailed(f"Ray worker {worker} died ({type(error).__name__}: "
                                      f"{str(error).strip().splitlines()[0]}); the episodes it ended are reported"))
            return
        results[start + position] = result

    def take_all() -> None:
        while streams:
            for stream in ray.wait(list(streams), num_returns=1)[0]:
                take(stream)

    def take_ready() -> None:
        """Take what the streams hold already."""
        while streams and (ready := ray.wait(list(streams), num_returns=len(streams), timeout=0)[0]):
            for stream in ready:
                take(stream)

    def running_after(timeout_s: float) -> dict:
        """The streams whose task has not ended within `timeout_s` (Ray's wait takes a cancelled task's stream as
        ready before the task has ended: its completion, once it has), with their worker and first position."""
        completions = {stream.completed(): stream for stream in streams}
        running = ray.wait(list(completions), num_returns=len(completions), timeout=timeout_s)[1] if streams else []
        return {completions[ref]: streams[completions[ref]] for ref in running}

    try:
        take_all()
    except KeyboardInterrupt as interrupt:
        stops.insert(0, interrupt)
        print(f"policy-rollout: interrupted; waiting up to {CANCEL_GRACE_S:g} s for the Ray workers to end their "
              "ticks and close their sessions (Ctrl-C again to end them at once)", file=sys.stderr, flush=True)
        with contextlib.suppress(KeyboardInterrupt):  # asked twice: no longer
            take_ready()  # a cancel drops what a stream holds that the driver had not taken
            for stream in streams:  # each worker stops as a local run does (its sessions closed)
                ray.cancel(stream)
            running_after(CANCEL_GRACE_S)
        stuck = running_after(0.0)  # in a call or a load that does not see the cancel: ended where it is
        for stream in stuck:
            ray.cancel(stream, force=True)
        with contextlib.suppress(KeyboardInterrupt):
            take_all()  # how each task ended
            for worker, _ in stuck.values():  # its sessions would hold the server's places until they idled out
                if held := ray.get(mailbox.held.remote(worker)):  # none where it was building its policy
                    _close_held(*held)
            positions = {HELDOUT_SEED_OFFSET + index: position for position, index in enumerate(indices)}
            for result in ray.get(mailbox.handed_over.remote()):  # among them those the cancelled streams dropped
                results[positions[result.seed]] = result
    if stops:
        raise RolloutStopped(stops[0], [result for result in results if result is not None])
    return results
