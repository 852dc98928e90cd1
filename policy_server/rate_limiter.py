"""`RateLimiter`: a token bucket, for the engine's declared session rates and the transports' own bounds."""

from __future__ import annotations


class RateLimiter:
    """A token bucket: ``rate_hz`` ticks per second with a burst of ``burst`` ticks, so a robot whose
    ticks jitter around its declared rate is never refused. Also measures the rate it sees.

    Times are ``time.monotonic()`` seconds.
    """

    def __init__(self, rate_hz: float, now_s: float, burst: float = 2.0) -> None:
        """``rate_hz`` 0: a closed loop, never refused."""
        self.rate_hz = rate_hz
        self.burst = burst
        self._tokens = burst
        self._updated_s = now_s
        self._last_arrival_s: float | None = None
        self.measured_hz = 0.0  # EWMA of 1 / inter-arrival time

    def take(self, now_s: float) -> float:
        """Spend one token for a tick at ``now_s``: 0 when allowed, else the seconds until one is due."""
        if self._last_arrival_s is not None and now_s > self._last_arrival_s:
            instant_hz = 1.0 / (now_s - self._last_arrival_s)
            self.measured_hz = instant_hz if self.measured_hz == 0 else 0.8 * self.measured_hz + 0.2 * instant_hz
        self._last_arrival_s = now_s
        if self.rate_hz == 0:
            return 0.0
        self._tokens = min(self.burst, self._tokens + (now_s - self._updated_s) * self.rate_hz)
        self._updated_s = now_s
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate_hz
