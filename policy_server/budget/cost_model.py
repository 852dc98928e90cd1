"""Online cost model: EWMA of the per-call and fixed costs of a request, keyed by request shape.

Three costs matter for a tick of N steps and P CFG passes with F full calls (spec §4):
``T = c_fixed + F * c_full + (N * P - F) * c_skip`` (ms), where ``c_full`` is one call whose GEN stack runs,
``c_skip`` one call whose stack is skipped (embed, SEA indicator, extrapolation, heads), and ``c_fixed`` the
sum of the fixed stages (encode, prefill, decode, ...). Each cost is an exponentially weighted moving
average with a matching average absolute deviation (as in TCP's RTT estimator), so callers can plan on
``mean + k * deviation``. Warmup fills the model before the server reports SERVING.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field


def _check_ms(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite duration >= 0 ms, got {value!r}")
    return float(value)


@dataclass
class Ewma:
    """EWMA of a duration (ms) and of its absolute deviation from the running mean."""

    alpha: float
    mean: float = 0.0
    deviation: float = 0.0
    samples: int = 0

    def update(self, value: float) -> None:
        if self.samples == 0:
            self.mean, self.deviation = value, 0.0
        else:
            error = value - self.mean
            self.mean += self.alpha * error
            self.deviation += self.alpha * (abs(error) - self.deviation)
        self.samples += 1

    def upper(self, devs: float) -> float:
        """``mean + devs * deviation`` (ms): a cautious estimate."""
        return self.mean + devs * self.deviation


@dataclass(frozen=True)
class CallCosts:
    """A snapshot of the costs of one request shape (ms); ``*_dev_ms`` are mean absolute deviations."""

    full_ms: float
    skip_ms: float
    fixed_ms: Mapping[str, float] = field(default_factory=dict)
    full_dev_ms: float = 0.0
    skip_dev_ms: float = 0.0
    fixed_dev_ms: Mapping[str, float] = field(default_factory=dict)
    full_samples: int = 0
    skip_samples: int = 0

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
            full_samples=self.full_samples,
            skip_samples=self.skip_samples,
        )


@dataclass
class _ShapeCosts:
    full: Ewma
    skip: Ewma
    stages: dict[str, Ewma]


class CostModel:
    """Per request-shape EWMA of c_full, c_skip and each fixed stage (ms).

    key: any hashable description of the request shape that changes the costs, e.g.
        ``("pusht", 96, 96, cfg_passes)``: the model, image resolution and packed sequence length.
    alpha: EWMA weight of a new sample (0 < alpha <= 1).
    warm_samples: samples of each of c_full and c_skip needed before ``is_warm``.
    """

    def __init__(self, alpha: float = 0.2, warm_samples: int = 3) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if warm_samples < 1:
            raise ValueError(f"warm_samples must be >= 1, got {warm_samples}")
        self.alpha = alpha
        self.warm_samples = warm_samples
        self._shapes: dict[Hashable, _ShapeCosts] = {}

    def _entry(self, key: Hashable) -> _ShapeCosts:
        entry = self._shapes.get(key)
        if entry is None:
            entry = self._shapes[key] = _ShapeCosts(Ewma(self.alpha), Ewma(self.alpha), {})
        return entry

    def observe_full(self, key: Hashable, ms: float) -> None:
        """One call that ran the GEN stack took ``ms``."""
        self._entry(key).full.update(_check_ms("full call duration", ms))

    def observe_skip(self, key: Hashable, ms: float) -> None:
        """One call whose GEN stack was skipped took ``ms``."""
        self._entry(key).skip.update(_check_ms("skipped call duration", ms))

    def observe_stage(self, key: Hashable, stage: str, ms: float) -> None:
        """A fixed stage (``encode``, ``prefill``, ``decode``, ...) of one request took ``ms``."""
        if not isinstance(stage, str) or not stage:
            raise ValueError(f"stage must be a non-empty name, got {stage!r}")
        entry = self._entry(key)
        entry.stages.setdefault(stage, Ewma(self.alpha)).update(_check_ms(f"stage {stage!r} duration", ms))

    def observe_calls(self, key: Hashable, calls: Iterable[tuple[bool, float]]) -> None:
        """Feed per-call timings ``(ran_full, ms)``, e.g. from ``DeadlineGuard.call_timings()``."""
        for ran_full, ms in calls:
            (self.observe_full if ran_full else self.observe_skip)(key, ms)

    def is_warm(self, key: Hashable) -> bool:
        """Whether both call costs have at least ``warm_samples`` samples for this shape."""
        entry = self._shapes.get(key)
        return (
            entry is not None
            and entry.full.samples >= self.warm_samples
            and entry.skip.samples >= self.warm_samples
        )

    def samples(self, key: Hashable) -> dict[str, int]:
        """Sample counts per cost for this shape (``full``, ``skip`` and each stage)."""
        entry = self._shapes.get(key)
        if entry is None:
            return {"full": 0, "skip": 0}
        return {"full": entry.full.samples, "skip": entry.skip.samples,
                **{k: e.samples for k, e in entry.stages.items()}}

    def costs(self, key: Hashable) -> CallCosts:
        """Current estimates for this shape; raises if c_full or c_skip has never been observed."""
        entry = self._shapes.get(key)
        if entry is None or entry.full.samples == 0 or entry.skip.samples == 0:
            raise LookupError(
                f"no cost samples for request shape {key!r} (full and skipped calls are both needed); "
                "run warmup for this shape first"
            )
        return CallCosts(
            full_ms=entry.full.mean,
            skip_ms=entry.skip.mean,
            fixed_ms={k: e.mean for k, e in entry.stages.items()},
            full_dev_ms=entry.full.deviation,
            skip_dev_ms=entry.skip.deviation,
            fixed_dev_ms={k: e.deviation for k, e in entry.stages.items()},
            full_samples=entry.full.samples,
            skip_samples=entry.skip.samples,
        )
