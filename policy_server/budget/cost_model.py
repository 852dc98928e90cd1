"""Online cost model: robust per-shape estimates of what one tick's calls and stages cost (ms).

Four costs matter for a tick (spec §4): ``c_full``, one call whose GEN stack runs alone; ``c_pair``, a
step's cond and uncond calls whose stacks run together as one batch; ``c_skip``, one call whose stack is
skipped (embed, SEA indicator, extrapolation, heads); and ``c_fixed``, the sum of the fixed stages (encode,
prefill, decode, ...). A tick of N steps and U uncond passes with F full calls, P of the steps running both
branches full, takes ``T = c_fixed + (F - 2P) * c_full + P * c_pair + (N + U - F) * c_skip``.

Costs are keyed by what they depend on (the caller's key: embodiment, clip length, text length), and
each finished tick adds *one* sample per cost: the median of its calls of each kind, each stage it ran.
An estimate is the median of the last ``window`` samples, with their median absolute deviation as the
spread, so callers can plan on ``median + k * deviation``. One slow tick (a long instruction, a stall) is
one sample among ``window`` and cannot move what other ticks are planned on; a lasting slowdown takes over
once it fills half the window. Warmup fills the model before the server reports SERVING.

The model also holds the *background reserve* (``background_ms``): the longest piece of background work a tick may
find running (a reasoner step, a dynamics piece), which admission adds to every tick's wait. Warmup times those
pieces right after the ticks of the shapes it measures, whose costs then are the reference; every later tick of such
a shape adds one sample of how much slower (or faster) than the reference its calls ran, and the reserve is the
timed piece scaled by the median of the last ``window`` such slowdowns. The timed pieces themselves rarely run live
(they are the longest: the longest prompt, the longest clip), but the ticks run all the time on the same device, so
a lasting slowdown (a GPU throttling, another process on the machine) raises the reserve as it raises the costs, and
its end lowers it again; one slow tick cannot move it.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace

# What one timed call was (``CostModel.observe_tick``): a stack run alone, a cond + uncond pair run as one
# batch (one sample for both calls), or a skipped stack.
FULL, PAIR, SKIP = "full", "pair", "skip"
CALL_KINDS = (FULL, PAIR, SKIP)


def step_samples(runs: int, skips: int, batched: bool, ms: float,
                 skip_ms: float | None = None) -> list[tuple[str, float]]:
    """One sampler step's calls as cost samples ``(kind, ms)`` from the step's wall time ``ms``: ``runs`` calls
    whose stack ran (as one batch when ``batched``) and ``skips`` skipped ones. A step with calls of both kinds
    gives its full call the step less ``skip_ms`` per skip; without that estimate it gives nothing."""
    if runs == 0:
        return [(SKIP, ms / skips)] * skips
    if batched:
        return [(PAIR, ms)]
    if skips == 0:
        return [(FULL, ms / runs)] * runs
    return [] if skip_ms is None else [(FULL, max(ms - skips * skip_ms, 0.0))]


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


def _filled(window: int, value: float) -> WindowStat:
    """A window of ``window`` samples, each ``value``."""
    stat = WindowStat(window)
    for _ in range(window):
        stat.update(value)
    return stat


@dataclass(frozen=True)
class CallCosts:
    """A snapshot of the costs of one request shape (ms); ``*_dev_ms`` are their spreads. ``pair_ms``: both CFG
    branches of a step run full as one batch (None: as two calls alone, ``2 * full_ms``)."""

    full_ms: float
    skip_ms: float
    fixed_ms: Mapping[str, float] = field(default_factory=dict)
    full_dev_ms: float = 0.0
    skip_dev_ms: float = 0.0
    fixed_dev_ms: Mapping[str, float] = field(default_factory=dict)
    pair_ms: float | None = None
    pair_dev_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.pair_ms is None:
            object.__setattr__(self, "pair_ms", 2 * self.full_ms)
            object.__setattr__(self, "pair_dev_ms", 2 * self.full_dev_ms)

    @property
    def fixed_total_ms(self) -> float:
        return sum(self.fixed_ms.values())

    @property
    def pair_saving_ms(self) -> float:
        """What a step saves by running its two full calls as one batch: ``2 * c_full - c_pair``."""
        return 2 * self.full_ms - self.pair_ms

    def cautious(self, devs: float) -> CallCosts:
        """The same costs raised by ``devs`` deviations each (for planning with a safety margin)."""
        return replace(
            self,
            full_ms=self.full_ms + devs * self.full_dev_ms,
            skip_ms=self.skip_ms + devs * self.skip_dev_ms,
            pair_ms=self.pair_ms + devs * self.pair_dev_ms,
            fixed_ms={k: v + devs * self.fixed_dev_ms.get(k, 0.0) for k, v in self.fixed_ms.items()},
        )

    def without(self, stage: str) -> CallCosts:
        """The costs of a tick that skips the fixed ``stage`` (e.g. ``prefill`` when the text K/V are reused)."""
        return replace(self, fixed_ms={k: v for k, v in self.fixed_ms.items() if k != stage},
                       fixed_dev_ms={k: v for k, v in self.fixed_dev_ms.items() if k != stage})


@dataclass
class _ShapeCosts:
    calls: dict[str, WindowStat]  # by call kind
    stages: dict[str, WindowStat]


def _lower(mine: WindowStat | None, theirs: WindowStat) -> WindowStat:
    """Of two timings of one cost, the one with samples and the lower median."""
    if mine is None or not mine.samples or (theirs.samples and theirs.median <= mine.median):
        return theirs
    return mine


class CostModel:
    """Per request-shape estimates of c_full, c_pair, c_skip and each fixed stage (ms), one sample per tick.

    key: any hashable description of what the costs depend on.
    window: ticks each estimate looks back over.
    """

    def __init__(self, window: int = 32) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._shapes: dict[Hashable, _ShapeCosts] = {}
        self._background_ms = 0.0  # the longest background piece, timed with the reference costs
        self._reference: dict[Hashable, CallCosts] = {}  # by key: the costs of its calls when it was timed
        self._slowdowns = _filled(window, 1.0)  # live ticks' calls against the reference
        self._lock = threading.Lock()  # the model worker writes while request threads plan and admit

    def observe_tick(self, key: Hashable, calls: Iterable[tuple[str, float]],
                     stages: Mapping[str, float] | None = None) -> None:
        """One finished tick: its calls ``(kind, ms)`` (``FULL``, ``PAIR``, ``SKIP``) and the fixed ``stages`` it
        ran (name -> ms)."""
        with self._lock:
            self._observe(key, calls, stages or {})

    def _observe(self, key: Hashable, calls: Iterable[tuple[str, float]], stages: Mapping[str, float]) -> None:
        entry = self._shapes.get(key)
        if entry is None:
            entry = self._shapes[key] = _ShapeCosts({kind: WindowStat(self.window) for kind in CALL_KINDS}, {})
        by_kind: dict[str, list[float]] = {}
        for kind, ms in calls:
            if kind not in entry.calls:
                raise ValueError(f"call kind must be one of {CALL_KINDS}, got {kind!r}")
            by_kind.setdefault(kind, []).append(_check_ms("call duration", ms))
        for kind, samples in by_kind.items():
            entry.calls[kind].update(statistics.median(samples))
        if key in self._reference and by_kind:
            reference = self._reference[key]
            cost_of = {FULL: reference.full_ms, PAIR: reference.pair_ms, SKIP: reference.skip_ms}
            self._slowdowns.update(sum(map(sum, by_kind.values()))
                                   / sum(cost_of[kind] * len(samples) for kind, samples in by_kind.items()))
        for stage, ms in stages.items():
            if not isinstance(stage, str) or not stage:
                raise ValueError(f"stage must be a non-empty name, got {stage!r}")
            entry.stages.setdefault(stage, WindowStat(self.window)).update(_check_ms(f"stage {stage!r}", ms))

    def adopt_lower(self, key: Hashable, other: CostModel) -> None:
        """From now on each cost of ``key`` is the lower of what this model and ``other`` learned of it (by median):
        a shape timed again, where a busy moment only slows what it times. So timing again can undo timings a busy
        moment inflated, and a busy moment while it times raises none."""
        with self._lock, other._lock:
            mine, theirs = self._shapes.get(key), other._shapes[key]
            if mine is None:
                self._shapes[key] = theirs
                return
            self._shapes[key] = _ShapeCosts(
                {kind: _lower(mine.calls[kind], stat) for kind, stat in theirs.calls.items()},
                {stage: _lower(mine.stages.get(stage), stat) for stage, stat in theirs.stages.items()})

    @property
    def background_ms(self) -> float:
        """The longest piece of background work a tick may find running (ms; 0 until timed): as timed, scaled by
        the median slowdown of the last ``window`` ticks against the reference costs."""
        with self._lock:
            return self._background_ms * self._slowdowns.median

    def time_background(self, ms: float, keys: Iterable[Hashable]) -> None:
        """The longest background piece, ``ms``, timed just after the ticks of ``keys``, whose current costs become
        the reference later ticks of those keys are compared with. The timing counts as a full window of ticks at
        the reference speed, so a lasting slowdown moves the reserve once it fills half the window, as it moves a
        cost."""
        with self._lock:
            self._background_ms = _check_ms("background piece", ms)
            self._reference = {key: self._costs(key) for key in keys}
            self._slowdowns = _filled(self.window, 1.0)

    def lower_background(self, ms: float, key: Hashable, fresh: CostModel) -> None:
        """The longest background piece timed again, ``ms``, just after the ticks of ``key`` that ``fresh`` timed:
        where it is below the reserve now, those become the reference, as at warmup (`time_background`), so later
        ticks move the reserve from what the machine did at the timing, not from the slowdown of the sessions before
        it (a retiming runs only with none open); else nothing changes. So timing again can undo a reserve a busy
        moment inflated, and a busy moment while it times raises none (`adopt_lower` for the costs). Until ticks of
        the other shapes are timed with a piece again, only ``key``'s ticks move the reserve."""
        with self._lock, fresh._lock:
            if _check_ms("background piece", ms) < self._background_ms * self._slowdowns.median:
                self._background_ms = ms
                self._reference = {key: fresh._costs(key)}
                self._slowdowns = _filled(self.window, 1.0)

    def is_warm(self, key: Hashable) -> bool:
        """Whether full calls (alone or in pairs) have been observed for this shape."""
        with self._lock:
            return self._warm(key)

    def _warm(self, key: Hashable) -> bool:
        entry = self._shapes.get(key)
        return entry is not None and (entry.calls[FULL].samples > 0 or entry.calls[PAIR].samples > 0)

    def samples(self, key: Hashable) -> dict[str, int]:
        """Ticks observed per cost for this shape (each call kind and each stage)."""
        with self._lock:
            return self._samples(key)

    def _samples(self, key: Hashable) -> dict[str, int]:
        entry = self._shapes.get(key)
        if entry is None:
            return dict.fromkeys(CALL_KINDS, 0)
        return {**{k: e.samples for k, e in entry.calls.items()}, **{k: e.samples for k, e in entry.stages.items()}}

    def costs(self, key: Hashable) -> CallCosts:
        """Current estimates for this shape; raises if no full call has been observed. What has not been observed
        is bounded by what has: until a skipped call has been, a skip costs what a full call does; until a pair
        has been, a pair two full calls; until a call alone has been, it costs what a pair does (caching is not
        counted on to save time, nor batching to cost nothing)."""
        with self._lock:
            return self._costs(key)

    def _costs(self, key: Hashable) -> CallCosts:
        if not self._warm(key):
            raise LookupError(f"no cost samples for request shape {key!r}; run warmup for this shape first")
        entry = self._shapes[key]
        pair = entry.calls[PAIR]
        full = entry.calls[FULL] if entry.calls[FULL].samples else pair
        skip = entry.calls[SKIP] if entry.calls[SKIP].samples else full
        return CallCosts(
            full_ms=full.median,
            skip_ms=skip.median,
            fixed_ms={k: e.median for k, e in entry.stages.items()},
            full_dev_ms=full.deviation,
            skip_dev_ms=skip.deviation,
            fixed_dev_ms={k: e.deviation for k, e in entry.stages.items()},
            pair_ms=pair.median if pair.samples else None,
            pair_dev_ms=pair.deviation if pair.samples else 0.0,
        )
