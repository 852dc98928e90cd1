"""Test helper (not a test module): `policy-rollout --ray`'s stops, in one Ray session inside the network namespace
this process was started in (Ray listens on every interface).

    unshare -rn python tests/ray_rollout_session.py OUTDIR

It brings `lo` up, starts Ray (2 CPUs) and prints one JSON line of what it saw:
- `refused`: `run_on_ray` whose worker 1 is refused at the third tick of seed index 3: [cause, ended episodes];
- `killed`: `run_on_ray` of clients of a fake server whose worker 1's process is killed (SIGKILL, as the OOM killer)
  at the third tick of seed index 3, its session open: [cause, ended episodes, the server's `policy_server_sessions`
  after];
- `unbuilt`: `run_on_ray` whose one worker of two cannot build its policy (a client whose token file is missing
  there, as on a node without it), the other running its episodes: [cause, ended episodes];
- `sent`: `run_on_ray` given Ctrl-C (SIGUSR1, whose handler here raises KeyboardInterrupt 3 s later) by worker 0 as it
  ends its first episode, which reaches the driver meanwhile, not taken: [cause, ended episodes];
- `ending`: `run_on_ray` of seed indices 0, 1, 2, 0 given Ctrl-C at once as worker 0 closes the session of its first
  episode (seed index 0, ended, whose ticks are slow), in a close that does not see the cancel: the worker is ended
  there, `CANCEL_GRACE_S` (here 2 s) later;
- `execute`: `python -m robots.rollout --ray 1 --execute 9` against a fake server: [exit code, stderr];
- `ctrl_c`: `python -m robots.rollout --ray 2 --episodes 4` against a fake server whose ticks of seed index 1 (worker
  0's second episode) are slow and whose tick of seed index 3 (worker 1's second) does not return, given SIGINT once
  both have ticked, and again once it says it waits for the workers: [exit code, stderr, the server's
  `policy_server_sessions` once it has exited, seconds from the second SIGINT to its exit]; its report is
  OUTDIR/ctrl_c.json.
The rollouts join this Ray session (RAY_ADDRESS). Each check's start goes to stderr; a session still running after
`HANG_S` dumps every thread's stack there and exits 1 (the test's timeout would kill it with nothing said).
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from fake_engine import FakeEngine, serve_fake
from ray_cluster import loopback_up

from robots.envs import HELDOUT_SEED_OFFSET, REACH_ID
from robots.ray_rollout import CANCEL_GRACE_S

PORT, METRICS_PORT = 52080, 52081  # in the namespace: nothing else listens there
HANG_S = 300
STARTED = time.monotonic()


class SlowAndStuckEngine(FakeEngine):
    """Each tick of a session on seed `slow` takes `SLOW_S` more; a tick on seed `stuck` is held until `release` is
    set (a call that does not return, as to a server that stopped answering); `reached` is set once both have ticked."""

    SLOW_S, STUCK_S = 0.5, 180.0

    def __init__(self, slow: int, stuck: int):
        super().__init__()
        self.slow, self.stuck = slow, stuck
        self.ticked, self.reached, self.release = set(), threading.Event(), threading.Event()

    def act(self, session_id, *args, **kwargs):
        seed = self.session(session_id).seed
        if seed in (self.slow, self.stuck):
            self.ticked.add(seed)
            if len(self.ticked) == 2:
                self.reached.set()
            if seed == self.slow:
                time.sleep(self.SLOW_S)
            else:
                self.release.wait(self.STUCK_S)
        return super().act(session_id, *args, **kwargs)


def rollout(*flags: str, stdout=subprocess.PIPE, stderr=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "robots.rollout", "--server", f"127.0.0.1:{PORT}", *flags],
                            stdout=stdout, stderr=stderr, text=True, start_new_session=True)


def seeker_in_one_process(marker: Path, token_file: Path):
    """A scripted policy in the first process to call this (the one that creates `marker`); in any other, a client
    with `token_file`, which fails to read it."""
    from test_rollout import EXECUTE, SeekerPolicy

    from robots.rollout import ServerPolicy

    try:
        marker.touch(exist_ok=False)
    except FileExistsError:
        return ServerPolicy(f"127.0.0.1:{PORT}", None, token_file, None, {}, EXECUTE, 0)
    return SeekerPolicy()


def stopped_run(policy, indices=range(4)) -> list:
    from test_rollout import EXECUTE

    from robots.ray_rollout import run_on_ray
    from robots.rollout import RolloutStopped

    try:  # worker 0 runs the first two seed indices, worker 1 the others
        run_on_ray(policy, REACH_ID, indices, 2, 1, EXECUTE)
    except RolloutStopped as stopped:
        return [str(stopped), [(r.seed, r.instruction, r.success, r.steps, len(r.ticks)) for r in stopped.finished]]
    return ["not stopped", []]


def ctrl_c_after(delay_s: float) -> None:
    """SIGUSR1 raises KeyboardInterrupt here `delay_s` later, as a Ctrl-C then would."""

    def interrupt(*_) -> None:
        time.sleep(delay_s)
        raise KeyboardInterrupt

    signal.signal(signal.SIGUSR1, interrupt)


def sessions_open() -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as response:
        (line,) = [line for line in response.read().decode().splitlines() if line.startswith("policy_server_sessions ")]
    return float(line.split()[1])


def started(check: str) -> None:
    print(f"ray_rollout_session: {time.monotonic() - STARTED:.1f} s: {check}", file=sys.stderr, flush=True)


def main(out: Path) -> None:
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    # Handled here, SIGINT takes its default action in the rollouts, as under a terminal (this process may have been
    # started ignoring it, as a shell's background job), with no `preexec_fn`: a child forked from this process,
    # whose Ray and gRPC threads hold locks, aborted before its exec (then died of the alarm the abort armed: 1 run
    # in 9), or could hang there.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    loopback_up()
    import ray
    from test_rollout import REFUSED, CtrlCPolicy, FailingPolicy, KilledPolicy

    from robots import ray_rollout

    ray.init(num_cpus=2, include_dashboard=False)
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    started("refused")
    seen = {"refused": stopped_run(functools.partial(FailingPolicy, 3, REFUSED))}
    started("killed")
    with serve_fake(FakeEngine(), port=PORT, metrics_port=METRICS_PORT):
        seen["killed"] = [*stopped_run(functools.partial(KilledPolicy, f"127.0.0.1:{PORT}", 3)), sessions_open()]
    started("sent")
    ctrl_c_after(3.0)
    seen["sent"] = stopped_run(functools.partial(CtrlCPolicy, os.getpid(), 0, hold_s=1.0))
    started("ending")
    ctrl_c_after(0.0)
    ray_rollout.CANCEL_GRACE_S = 2.0
    seen["ending"] = stopped_run(functools.partial(CtrlCPolicy, os.getpid(), 0, hold_s=60, stuck=True, slow_s=1.0),
                                 [0, 1, 2, 0])
    ray_rollout.CANCEL_GRACE_S = CANCEL_GRACE_S
    started("unbuilt")
    seen["unbuilt"] = stopped_run(functools.partial(seeker_in_one_process, out / "built", out / "missing_token"))
    started("execute")
    with serve_fake(FakeEngine(), port=PORT):
        done = rollout("--ray", "1", "--execute", "9", "--episodes", "1", "--out", str(out / "execute.json"))
        error = done.communicate(timeout=120)[1]
        seen["execute"] = [done.returncode, error]
    started("ctrl_c")
    engine = SlowAndStuckEngine(slow=HELDOUT_SEED_OFFSET + 1, stuck=HELDOUT_SEED_OFFSET + 3)
    with serve_fake(engine, port=PORT, metrics_port=METRICS_PORT), open(out / "ctrl_c.err", "w+") as stderr:
        try:
            interrupted = rollout("--ray", "2", "--episodes", "4", "--out", str(out / "ctrl_c.json"),
                                  stdout=subprocess.DEVNULL, stderr=stderr)  # waited for, not read as it runs
            engine.reached.wait(120)
            # Their first episodes, ended a tick before, reach the driver (a cancelled task's episodes not taken by
            # then are dropped); worker 0's second lasts 20 ticks of 0.5 s.
            time.sleep(1)
            os.killpg(interrupted.pid, signal.SIGINT)
            waiting_until = time.monotonic() + 60
            while ("waiting up to" not in Path(stderr.name).read_text() and interrupted.poll() is None
                   and time.monotonic() < waiting_until):
                time.sleep(0.1)
            os.killpg(interrupted.pid, signal.SIGINT)  # again, in the grace: the workers still running end at once
            again = time.monotonic()
            interrupted.wait(timeout=120)
            seen["ctrl_c"] = [interrupted.returncode, Path(stderr.name).read_text(), sessions_open(),
                              time.monotonic() - again]
        finally:
            engine.release.set()
    ray.shutdown()
    print(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
