"""`policy-rollout --ray N`: the episodes of a rollout spread over N Ray workers.

Each worker runs `run_episodes` on a contiguous part of the episodes with a policy of its own, built on the worker
from `make_policy` (an in-process engine, or a client of a server or of a Ray Serve application). An episode's seed
depends only on its index, so the merged results equal a local run's, episode for episode; the report merges every
worker's ticks into one latency distribution. A worker that stops (`RolloutStopped`) leaves the others to finish, and
the rollout stops with every worker's ended episodes, as a local run does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import ray
from ray.experimental import tqdm_ray

from policy_server.ray_serve.address import gcs_address
from robots.rollout import EpisodeResult, RolloutStopped, run_episodes


# One task per worker process: the engine it built goes with the process.
@ray.remote(max_calls=1)
def _run_part(make_policy: Callable, env_id: str, indices: list[int], num_envs: int, execute: int,
              videos: int, worker: int, delay: int, commit: bool) -> list[EpisodeResult]:
    policy = make_policy()
    # Ray's bar for a task: the driver draws every worker's, one line each.
    progress = tqdm_ray.tqdm(desc=f"worker {worker} episodes", total=len(indices), unit="ep", position=worker)
    try:
        return run_episodes(policy, env_id, indices, num_envs, execute, videos, progress, delay, commit)
    finally:
        progress.close()


def run_on_ray(make_policy: Callable, env_id: str, indices: Sequence[int], workers: int, num_envs: int,
               execute: int, videos: int = 0, address: str | None = None, gpus_per_worker: float = 0.0,
               cpus_per_worker: float = 1.0, delay: int = 0, commit: bool = False) -> list[EpisodeResult]:
    """`run_episodes` over `workers` Ray workers (each with `num_envs` environments and `gpus_per_worker` GPUs) of
    the cluster at `address` (unset: as `ray.init` finds it, `gcs_address`); the results in the order of
    `indices`, the first `videos` of them recorded; ConnectionError where `address` names no running Ray. Workers
    that stopped part way raise `RolloutStopped` with the first one's cause and every worker's ended episodes; a
    worker's error before its episodes (building its policy: a server that never serves, a checkpoint refused) is
    raised as such, as a local run's."""
    if not ray.is_initialized():
        ray.init(address=gcs_address(address))
    parts = [part.tolist() for part in np.array_split(np.asarray(indices), min(workers, len(indices)))]
    starts = np.cumsum([0] + [len(part) for part in parts[:-1]])
    task = _run_part.options(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker)
    refs = [task.remote(make_policy, env_id, part, num_envs, execute, int(np.clip(videos - start, 0, len(part))),
                        worker, delay, commit) for worker, (part, start) in enumerate(zip(parts, starts, strict=True))]
    ended, stops, failures = [], [], []
    for ref in refs:  # each one read, so that Ray has no error left to log as unhandled
        try:
            ended += ray.get(ref)
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, RolloutStopped):  # part way: the episodes it ended stand
                ended += error.cause.finished
                stops.append(error.cause)
            else:
                failures.append(error.cause)
    if failures:
        raise failures[0] from None
    if stops:
        raise RolloutStopped(stops[0].cause, ended)
    return ended
