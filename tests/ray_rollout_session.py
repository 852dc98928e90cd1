"""Test helper (not a test module): `policy-rollout --ray`'s stops, in one Ray session inside the network namespace
this process was started in (Ray listens on every interface).

    unshare -rn python tests/ray_rollout_session.py OUTDIR

It brings `lo` up, starts Ray (2 CPUs) and prints one JSON line of what it saw:
- `refused`: `run_on_ray` whose worker 1 is refused at the third tick of seed index 3: [cause, ended episodes];
- `killed`: the same, the worker's process killed there (SIGKILL, as the OOM killer): [cause, ended episodes];
- `execute`: `python -m robots.rollout --ray 1 --execute 9` against a fake server: [exit code, stderr];
- `ctrl_c`: `python -m robots.rollout --ray 2 --episodes 4` against a fake server whose ticks of seed indices 1 and 3
  (each worker's second episode) are slow, given SIGINT once both have ticked: [exit code, stderr, sessions left
  open on the server]; its report is OUTDIR/ctrl_c.json.
The rollouts join this Ray session (RAY_ADDRESS).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from fake_engine import FakeEngine, serve_fake
from ray_cluster import loopback_up

from robots.envs import HELDOUT_SEED_OFFSET, REACH_ID

PORT = 52080  # in the namespace: nothing else listens there


class SlowSeedsEngine(FakeEngine):
    """Each tick of a session on one of `seeds` takes `SLOW_S` more; `reached` is set once all have ticked."""

    SLOW_S = 0.5

    def __init__(self, seeds: set[int]):
        super().__init__()
        self.seeds, self.ticked, self.reached = seeds, set(), threading.Event()

    def act(self, session_id, *args, **kwargs):
        seed = self.session(session_id).seed
        if seed in self.seeds:
            self.ticked.add(seed)
            if self.ticked == self.seeds:
                self.reached.set()
            time.sleep(self.SLOW_S)
        return super().act(session_id, *args, **kwargs)


def rollout(*flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "robots.rollout", "--server", f"127.0.0.1:{PORT}", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # SIGINT's default action, as under a terminal
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def stopped_run(policy) -> list:
    from test_rollout import EXECUTE

    from robots.ray_rollout import run_on_ray
    from robots.rollout import RolloutStopped

    try:  # worker 0 runs seed indices 0 and 1, worker 1 2 and 3
        run_on_ray(policy, REACH_ID, range(4), 2, 1, EXECUTE)
    except RolloutStopped as stopped:
        return [str(stopped), [(r.seed, r.instruction, r.success, r.steps, len(r.ticks)) for r in stopped.finished]]
    return ["not stopped", []]


def main(out: Path) -> None:
    loopback_up()
    import ray
    from test_rollout import REFUSED, FailingPolicy, KilledPolicy

    ray.init(num_cpus=2, include_dashboard=False)
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    seen = {"refused": stopped_run(functools.partial(FailingPolicy, 3, REFUSED)),
            "killed": stopped_run(functools.partial(KilledPolicy, 3))}
    with serve_fake(FakeEngine(), port=PORT):
        done = rollout("--ray", "1", "--execute", "9", "--episodes", "1", "--out", str(out / "execute.json"))
        error = done.communicate(timeout=120)[1]
        seen["execute"] = [done.returncode, error]
    engine = SlowSeedsEngine({HELDOUT_SEED_OFFSET + 1, HELDOUT_SEED_OFFSET + 3})
    with serve_fake(engine, port=PORT):
        interrupted = rollout("--ray", "2", "--episodes", "4", "--out", str(out / "ctrl_c.json"))
        engine.reached.wait(120)
        os.killpg(interrupted.pid, signal.SIGINT)
        _, error = interrupted.communicate(timeout=120)
        seen["ctrl_c"] = [interrupted.returncode, error, engine.stats().sessions]
    ray.shutdown()
    print(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
