"""`ThrottledLog`: log lines that a client can provoke in a loop, at most one per kind each period."""

from __future__ import annotations

import logging
import threading
import time

MAX_KEYS = 32  # keys followed at once
_OTHER_KINDS = object()  # the key of the lines of kinds beyond `MAX_KEYS`


class ThrottledLog:
    """Writes at most one line per key each `period_s`, saying how many it held back since the last one: a client
    that repeats a refused request in a loop would otherwise write a line per request (the metrics count each).

    A key may be the client's to choose (a name it sends), so at most `MAX_KEYS` keys are followed at once: the lines
    of further keys share one throttle until a followed key has been quiet for a period and is forgotten (with its
    lines held back since its last one). Whatever names a client sends, it writes at most `MAX_KEYS` + 1 lines a
    period, and the table stays small."""

    def __init__(self, logger: logging.Logger, level: int, period_s: float):
        self.logger, self.level, self.period_s = logger, level, period_s
        self._lock = threading.Lock()
        self._quiet_until: dict[object, float] = {}  # by key: monotonic s
        self._held: dict[object, int] = {}

    def __call__(self, key: object, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            self._forget_quiet(now)
            if key not in self._quiet_until and len(self._quiet_until) >= MAX_KEYS:
                key = _OTHER_KINDS
            if now < self._quiet_until.get(key, 0.0):
                self._held[key] = self._held.get(key, 0) + 1
                return
            self._quiet_until[key] = now + self.period_s
            held = self._held.pop(key, 0)
        kinds = " of other kinds" if key is _OTHER_KINDS else ""
        more = f" ({held} more{kinds} since the last such line)" if held else ""
        self.logger.log(self.level, message + "%s", *args, more)

    def _forget_quiet(self, now: float) -> None:
        """Forget the keys without a line for a period past their quiet time (a client that stopped)."""
        for key in [key for key, until in self._quiet_until.items() if now >= until + self.period_s]:
            del self._quiet_until[key]
            self._held.pop(key, None)
