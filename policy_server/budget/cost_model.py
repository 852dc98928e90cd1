"""Online cost model: robust per-shape estimates of what one tick's calls and stages cost (ms).

Three costs matter for a tick of N steps and P CFG passes with F full calls (spec §4):
``T = c_fixed + F * c_full + (N * P - F) * c_skip`` (ms), where ``c_full`` is one call whose GEN stack runs,
``c_skip`` one call whose stack is skipped (embed, SEA indicator, extrapolation, heads), and ``c_fixed`` the
sum of the fixed stages (encode, prefill, decode, ...).

Costs are keyed by what they depend on (the caller's key: embodiment, clip length, text length), and
each finished tick adds *one* sample per cost: the median of its full calls, the median of its skipped
calls, each stage it ran. An estimate is the median of the last ``window`` samples, with their median
absolute deviation as the spread, so callers can plan on ``median + k * deviation``. One slow tick
(a long instruction, a stall) is one sample among ``window`` and cannot move what other ticks are
planned on; a lasting slowdown takes over once it fills half the window. Warmup fills the model
before the server reports SERVING.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field


def _check_ms(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite duration >= 0 ms, got {value!r}")
    return float(value)


class WindowStat:
    """Median and median absolute deviation of the last ``window`` samples of a duration (ms)."""

    def __init__(self, window: int) -> None:
        self._samples: deque[float] = deque(maxlen=window)

    def update(self, value: float) -> None:
        self._samples.append(value)

    @property
    def samples(self) -> int:
        return len(self._samples)

    @property
    def median(self) -> float:
        return statistics.median(self._samples)

    @property
    def deviation(self) -> float:
        center = self.median
        return statistics.median(abs(v - center) for v in self._samples)


@dataclass(frozen=True)
class CallCosts:
    """A snapshot of the costs of one request shape (ms); ``*_dev_ms`` are their spreads."""

    full_ms: float
    skip_ms: float
    fixed_ms: Mapping[str, float] = field(default_factory=dict)
    full_dev_ms: float = 0.0
    skip_dev_ms: float = 0.0
    fixed_dev_ms: Mapping[str, float] = field(default_factory=dict)

    @property
    def fixed_total_ms(self) -> float:
        return sum(self.fixed_ms.values())

    def cautious(self, devs: float) -> CallCosts:
        """The same costs raised by ``devs`` deviations each (for planning with a safety margin)."""
        return CallCosts(
            full_ms=self.full_ms + devs * self.full_dev_ms,
            skip_ms=self.skip_ms + devs * self.skip_dev_ms,
            fixed_ms={k: v + devs * self.fixed_dev_ms.get(k, 0.0) for k, v in self.fixed_ms.items()},
            full_dev_ms=self.full_dev_ms,
            skip_dev_ms=self.skip_dev_ms,
            fixed_dev_ms=dict(self.fixed_dev_ms),
        )

    def without(self, stage: str) -> CallCosts:
        """The costs of a tick that skips the fixed ``stage`` (e.g. ``prefill`` when the text K/V are reused)."""
        return CallCosts(
            full_ms=self.full_ms, skip_ms=self.skip_ms,
            fixed_ms={k: v for k, v in self.fixed_ms.items() if k != stage},
            full_dev_ms=self.full_dev_ms, skip_dev_ms=self.skip_dev_ms,
            fixed_dev_ms={k: v for k, v in self.fixed_dev_ms.items() if k != stage},
        )


@dataclass
class _ShapeCosts:
    full: WindowStat
    skip: WindowStat
    stages: dict[str, WindowStat]


class CostModel:
    """Per request-shape estimates of c_full, c_skip and each fixed stage (ms), one sample per tick.

    key: any hashable description of what the costs depend on.
    window: ticks each estimate looks back over.
    """

    def __init__(self, window: int = 32) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._shapes: dict[Hashable, _ShapeCosts] = {}
        self._lock = threading.Lock()  # the model worker writes while request threads plan and admit

    def observe_tick(self, key: Hashable, calls: Iterable[tuple[bool, float]],
                     stages: Mapping[str, float] | None = None) -> None:
        """One finished tick: its calls ``(ran_full, ms)`` and the fixed ``stages`` it ran (name -> ms)."""
        with self._lock:
            self._observe(key, calls, stages or {})

    def _observe(self, key: Hashable, calls: Iterable[tuple[bool, float]], stages: Mapping[str, float]) -> None:
        entry = self._shapes.get(key)
        if entry is None:
            entry = self._shapes[key] = _ShapeCosts(WindowStat(self.window), WindowStat(self.window), {})
        full, skip = [], []
        for ran_full, ms in calls:
            (full if ran_full else skip).append(_check_ms("call duration", ms))
        if full:
            entry.full.update(statistics.median(full))
        if skip:
            entry.skip.update(statistics.median(skip))
        for stage, ms in stages.items():
            if not isinstance(stage, str) or not stage:
                raise ValueError(f"stage must be a non-empty name, got {stage!r}")
            entry.stages.setdefault(stage, WindowStat(self.window)).update(_check_ms(f"stage {stage!r}", ms))

    def is_warm(self, key: Hashable) -> bool:
        """Whether full calls have been observed for this shape."""
        with self._lock:
            return self._warm(key)

    def _warm(self, key: Hashable) -> bool:
        entry = self._shapes.get(key)
        return entry is not None and entry.full.samples > 0

    def samples(self, key: Hashable) -> dict[str, int]:
        """Ticks observed per cost for this shape (``full``, ``skip`` and each stage)."""
        with self._lock:
            return self._samples(key)

    def _samples(self, key: Hashable) -> dict[str, int]:
        entry = self._shapes.get(key)
        if entry is None:
            return {"full": 0, "skip": 0}
        return {"full": entry.full.samples, "skip": entry.skip.samples,
                **{k: e.samples for k, e in entry.stages.items()}}

    def costs(self, key: Hashable) -> CallCosts:
        """Current estimates for this shape; raises if no full call has been observed. Until a skipped call
        has been, a skip is taken to cost what a full call does (caching is not counted on to save time)."""
        with self._lock:
            return self._costs(key)

    def _costs(self, key: Hashable) -> CallCosts:
        if not self._warm(key):
            raise LookupError(f"no cost samples for request shape {key!r}; run warmup for this shape first")
        entry = self._shapes[key]
        skip = entry.skip if entry.skip.samples else entry.full
        return CallCosts(
            full_ms=entry.full.median,
            skip_ms=skip.median,
            fixed_ms={k: e.median for k, e in entry.stages.items()},
            full_dev_ms=entry.full.deviation,
            skip_dev_ms=skip.deviation,
            fixed_dev_ms={k: e.deviation for k, e in entry.stages.items()},
        )
