"""Admission control: which sessions fit on one model worker, and how long each tick may hold it.

Ticks run one batch at a time on the worker, in arrival order, and a session has at most one tick
queued or running (``engine.act`` refuses a second one). So the worst a tick can meet is every other
session's tick queued just before it, plus one piece of background work (a reasoner step) already
running, whatever the arrival pattern. Each session gets a *slot*: the model time its ticks are
planned in. The set of sessions is admitted when

    blocking + sum(slot_j) <= budget_i   for every session i        (each tick meets its budget)
    sum(rate_j * slot_j) <= max_utilization                          (each declared rate is sustained)

A session that declares a rate asks no faster than that (``RateLimiter``); rate 0 declares a closed
loop (a simulation asking again as soon as it is answered), which the deadline test covers on its own.

with every slot at least the session's cheapest tick (the planner's floor: maximal caching and every
fallback). Slots then grow from that floor toward the uncached tick by one common fraction, as far as
both conditions allow. Micro-batching only shortens this worst case: ticks that run as one batch
each end within their own slot from the batch's start.
"""

from __future__ import annotations

from dataclasses import dataclass

# Of the worker's time, what declared rates may claim: the rest absorbs timing noise and the transport.
MAX_UTILIZATION = 0.9


@dataclass(frozen=True)
class Demand:
    """What one session asks of the worker (ms, Hz).

    floor_ms: its cheapest tick; ceiling_ms: its uncached tick (no slot needs more).
    """

    budget_ms: float
    rate_hz: float
    floor_ms: float
    ceiling_ms: float


def assign_slots(demands: list[Demand], blocking_ms: float,
                 max_utilization: float = MAX_UTILIZATION) -> list[float] | None:
    """One slot (ms) per demand, in order, or None when the demands cannot all be met."""
    if not demands:
        return []
    room = min(d.budget_ms for d in demands) - blocking_ms
    floor = sum(d.floor_ms for d in demands)
    load = sum(d.rate_hz * d.floor_ms for d in demands) / 1e3
    if floor > room or load > max_utilization:
        return None
    growth = [max(d.ceiling_ms - d.floor_ms, 0.0) for d in demands]
    rate_growth = sum(d.rate_hz * g for d, g in zip(demands, growth, strict=True)) / 1e3
    fraction = 1.0
    if sum(growth) > 0:
        fraction = min(fraction, (room - floor) / sum(growth))
    if rate_growth > 0:
        fraction = min(fraction, (max_utilization - load) / rate_growth)
    return [d.floor_ms + fraction * g for d, g in zip(demands, growth, strict=True)]


def sessions_that_fit(open_demands: list[Demand], new: Demand, blocking_ms: float, limit: int,
                      max_utilization: float = MAX_UTILIZATION) -> int:
    """How many sessions like ``new`` fit beside ``open_demands`` (at most ``limit``)."""
    count = 0
    while count < limit and assign_slots([*open_demands, *[new] * (count + 1)], blocking_ms,
                                         max_utilization) is not None:
        count += 1
    return count


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


def default_rate_hz(control_hz: float, actions_per_chunk: int) -> float:
    """The chunk-request rate of a client that executes ``actions_per_chunk`` actions per chunk."""
    return control_hz / actions_per_chunk
