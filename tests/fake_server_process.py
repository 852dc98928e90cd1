"""Test helper (not a test module): a real gRPC server around a `FakeEngine` in a process of its own, which a test can
kill and start again on the same port, as a server is restarted or redeployed.

    python tests/fake_server_process.py PORT [DIE_AT_TICK]

It serves on 127.0.0.1:PORT until SIGTERM (then stops) or SIGKILL; with DIE_AT_TICK it kills itself (SIGKILL, as
kill -9 or the OOM killer would) as its tick number DIE_AT_TICK (from 1) starts, leaving that call unanswered.
"""

from __future__ import annotations

import os
import signal
import sys

from fake_engine import FakeEngine, serve_fake


class DyingEngine(FakeEngine):
    def __init__(self, die_at_tick: int):
        super().__init__()
        self.die_at_tick, self.ticks_started = die_at_tick, 0

    def act(self, *args, **kwargs):
        # Counted as each starts: ticks of two sessions at once both saw the same count of those ended, and none died.
        with self._lock:
            self.ticks_started += 1
            dying = self.ticks_started == self.die_at_tick
        if dying:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().act(*args, **kwargs)


if __name__ == "__main__":
    port, *die_at_tick = (int(arg) for arg in sys.argv[1:])
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # for sigwait, in the server's threads too
    with serve_fake(DyingEngine(*die_at_tick) if die_at_tick else FakeEngine(), port=port):
        signal.sigwait({signal.SIGTERM})
