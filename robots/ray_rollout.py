"""`policy-rollout --ray N`: the episodes of a rollout spread over N Ray workers.

Each worker runs `episodes_as_they_end` on a contiguous part of the episodes with a policy of its own, built on the
worker from `make_policy` (an in-process engine, or a client of a server or of a Ray Serve application), and streams
each episode to the driver as it ends (a Ray generator task). An episode's seed depends only on its index, so the
merged results equal a local run's, episode for episode; the report merges every worker's ticks into one latency
distribution. A worker that stops (`RolloutStopped`) or dies (its process killed, out of memory, its node lost:
`WorkerLost`) leaves the others to finish, and the rollout stops with every worker's ended episodes, as a local run
does. Ctrl-C cancels the workers' tasks (each stops as a local run does, closing its sessions) and stops the rollout
with the episodes that had reached the driver.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import ray
from ray.experimental import tqdm_ray

from policy_server.ray_serve.address import gcs_address
from robots.rollout import EpisodeResult, RolloutStopped, episodes_as_they_end

# A worker's process that died: its task is not run again (its episodes would run twice), the rollout stops.
_LOST = (ray.exceptions.WorkerCrashedError, ray.exceptions.OutOfMemoryError, ray.exceptions.NodeDiedError,
         ray.exceptions.ObjectLostError)


class WorkerLost(RuntimeError):
    """A Ray worker's process died mid-run (killed, out of memory, its node lost); the message says which worker and
    Ray's account."""


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
    that stopped part way or died raise `RolloutStopped` with the first one's cause and every worker's ended episodes,
    once the others have finished; Ctrl-C (KeyboardInterrupt) cancels every worker's task, waits for them to stop
    (a second Ctrl-C: no longer) and raises `RolloutStopped` with the episodes that had ended. A worker's error before
    its episodes (building its policy: a server that never serves, a checkpoint refused) is raised as such, as a local
    run's."""
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
    failures: list[BaseException] = []  # errors before any episode

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
            else:
                failures.append(error.cause)
            return
        except _LOST as error:
            stops.append(WorkerLost(f"Ray worker {worker} died ({type(error).__name__}: "
                                    f"{str(error).strip().splitlines()[0]}); the episodes it ended are reported"))
            return
        results[start + position] = result

    try:
        while streams:
            for stream in ray.wait(list(streams), num_returns=1)[0]:
                take(stream)
    except KeyboardInterrupt as interrupt:
        stops.insert(0, interrupt)
        for stream in streams:
            ray.cancel(stream)
        try:  # each worker stops as a local run does (its sessions closed); the episodes on the way still come
            while streams:
                for stream in ray.wait(list(streams), num_returns=1)[0]:
                    take(stream)
        except KeyboardInterrupt:  # asked twice: the workers are ended where they are
            for stream in streams:
                ray.cancel(stream, force=True)
    if failures:
        raise failures[0] from None
    if stops:
        raise RolloutStopped(stops[0], [result for result in results if result is not None])
    return results
