"""`ThrottledLog`: log lines that a client can provoke in a loop, at most one per kind each period."""

from __future__ import annotations

import logging
import threading
import time


class ThrottledLog:
    """Writes at most one line per key each `period_s`, saying how many it held back since the last one: a client
    that repeats a refused request in a loop would otherwise write a line per request (the metrics count each)."""

    def __init__(self, logger: logging.Logger, level: int, period_s: float):
        self.logger, self.level, self.period_s = logger, level, period_s
        self._lock = threading.Lock()
        self._quiet_until: dict[object, float] = {}  # by key: monotonic s
        self._held: dict[object, int] = {}

    def __call__(self, key: object, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._quiet_until.get(key, 0.0):
                self._held[key] = self._held.get(key, 0) + 1
                return
            self._quiet_until[key] = now + self.period_s
            held = self._held.pop(key, 0)
        more = f" ({held} more since the last such line)" if held else ""
        self.logger.log(self.level, message + "%s", *args, more)
