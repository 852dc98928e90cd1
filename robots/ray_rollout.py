"""`policy-rollout --ray N`: the episodes of a rollout spread over N Ray workers.

Each worker runs `episodes_as_they_end` on a contiguous part of the episodes with a policy of its own, built on the
worker from `make_policy` (an in-process engine, or a client of a server or of a Ray Serve application), and streams
each episode to the driver as it ends (a Ray generator task). An episode's seed depends only on its index, so the
merged results equal a local run's, episode for episode; the report merges every worker's ticks into one latency
distribution. A worker that stops (`RolloutStopped`), fails (building its policy: a server that never serves, a
checkpoint it cannot load; or any other error of its own) or dies (its process killed, out of memory, its node lost)
leaves the others to finish, and the rollout stops with every worker's ended episodes, as a local run does. Ctrl-C
cancels the workers' tasks (each stops as a local run does, closing its sessions), ends those still running
`CANCEL_GRACE_S` later (a second Ctrl-C: at once) and stops the rollout with the episodes that had reached the driver.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import ray
from ray.experimental import tqdm_ray

from policy_server.ray_serve.address import gcs_address
from robots.rollout import EpisodeResult, RolloutStopped, episodes_as_they_end

# A worker's process that died: its task is not run again (its episodes would run twice), the rollout stops.
_LOST = (ray.exceptions.WorkerCrashedError, ray.exceptions.OutOfMemoryError, ray.exceptions.NodeDiedError,
         ray.exceptions.ObjectLostError)
# After a Ctrl-C, how long the workers have to stop as a local run does (a tick, closing their sessions) before
# they are ended where they are (their sessions then left to the server's idle timeout)
CANCEL_GRACE_S = 10.0


class WorkerFailed(RuntimeError):
    """A Ray worker that raised an error of its own (not a stop of its episodes) or whose process died mid-run
    (killed, out of memory, its node lost); the message says which worker and the error, or Ray's account."""


# One task per worker process: the engine it built goes with the process.
@ray.remote(max_calls=1, max_retries=0)
def _run_part(make_policy: Callable, env_id: str, indices: list[int], num_envs: int, execute: int,
              videos: int, worker: int, delay: int, commit: bool) -> Iterator[tuple[int, EpisodeResult]]:
    policy = make_policy()
    # Ray's bar for a task: the driver draws every worker's, one line each.
    progress = tqdm_ray.tqdm(desc=f"worker {worker} episodes", total=len(indices), unit="ep", position=worker)
    try:  # the driver's cancel stops the episodes as a Ctrl-C stops a local run's, their sessions closed
        yield from episodes_as_they_end(policy, env_id, indices, num_envs, execute, videos, progress, delay, commit)
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
    episodes that had ended."""
    if not ray.is_initialized():
        ray.init(address=gcs_address(address))
    parts = [part.tolist() for part in np.array_split(np.asarray(indices), min(workers, len(indices)))]
    starts = np.cumsum([0] + [len(part) for part in parts[:-1]])
    task = _run_part.options(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker)
    streams = {task.remote(make_policy, env_id, part, num_envs, execute, int(np.clip(videos - start, 0, len(part))),
                           worker, delay, commit): (worker, int(start))
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

    try:
        take_all()
    except KeyboardInterrupt as interrupt:
        stops.insert(0, interrupt)
        for stream in streams:  # each worker stops as a local run does (its sessions closed)
            ray.cancel(stream)
        end = time.monotonic() + CANCEL_GRACE_S
        with contextlib.suppress(KeyboardInterrupt):  # asked twice: no longer
            for stream in streams:  # Ray's wait takes a cancelled task's stream as ready before the task has ended
                with contextlib.suppress(ray.exceptions.RayError):  # out of time, or how the task ended
                    ray.get(stream.completed(), timeout=max(0.0, end - time.monotonic()))
        for stream in streams:  # still running (in a call or a load that does not see the cancel): ended where it is
            ray.cancel(stream, force=True)
        with contextlib.suppress(KeyboardInterrupt):
            take_all()  # how each task ended; a cancel drops the episodes of a stream the driver had not taken
    if stops:
        raise RolloutStopped(stops[0], [result for result in results if result is not None])
    return results
