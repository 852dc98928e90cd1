"""The per-tick record: what was planned, what ran, and whether the deadline held (all times in ms)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from .planner import TickPlan


@dataclass(frozen=True)
class BranchTickCounts:
    """Calls of one CFG branch in one tick. ``skipped`` includes ``forced_skip``; ``full`` includes
    ``fail_open``."""

    full: int
    skipped: int
    forced_skip: int
    fail_open: int
    fail_open_reasons: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_counts(cls, branch: str, counts: Mapping[str, object]) -> BranchTickCounts:
        try:
            return cls(
                full=int(counts["full"]),
                skipped=int(counts["skipped"]),
                forced_skip=int(counts["forced_skip"]),
                fail_open=int(counts["fail_open"]),
                fail_open_reasons=dict(counts.get("fail_open_reasons", {})),
            )
        except KeyError as missing:
            raise ValueError(
                f"cache counts of branch {branch!r} lack {missing}; "
                "expected full, skipped, forced_skip, fail_open"
            ) from None


@dataclass(frozen=True)
class TickRecord:
    """One control tick, as reported to the client and the benchmark.

    budget_ms: the deadline the tick was planned for. predicted_* / actual_*: total and per stage (ms).
    setting / thresholds / cap: the cache knobs used (``"none"``: no caching). fallbacks: the planner's, then
    the guard's in-tick ones (``late_*``). sequences: per-branch decision strings (``F`` full, ``S`` skip)
    when the caller passes them.
    """

    budget_ms: float
    setting: str
    thresholds: tuple[float, ...]
    cap: int
    requested_steps: int
    num_steps: int
    cfg_steps: int
    expected_full_calls: int
    predicted_ms: float
    actual_ms: float
    predicted_stage_ms: dict[str, float]
    actual_stage_ms: dict[str, float]
    branches: dict[str, BranchTickCounts]
    feasible: bool
    best_achievable_ms: float
    fallbacks: tuple[str, ...]
    deadline_met: bool
    sequences: dict[str, str] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        plan: TickPlan,
        cache_counts: Mapping[str, Mapping[str, object]],
        actual_stage_ms: Mapping[str, float],
        actual_ms: float | None = None,
        sequences: Mapping[str, str] | None = None,
        late_fallbacks: tuple[str, ...] = (),
    ) -> TickRecord:
        """Assemble the record of a finished tick.

        cache_counts: ``CacheRecord.counts_dict()``. actual_stage_ms: measured stages (``denoise`` included).
        actual_ms: the tick's end-to-end latency; defaults to the sum of the stages. late_fallbacks: what the
        guard gave up during the tick (``DeadlineGuard.late_fallbacks``), listed after the planned ones.
        """
        for stage, ms in actual_stage_ms.items():
            if not isinstance(ms, int | float) or not math.isfinite(ms) or ms < 0:
                raise ValueError(f"actual_stage_ms[{stage!r}] must be a finite duration >= 0 ms, got {ms!r}")
        total = float(sum(actual_stage_ms.values()) if actual_ms is None else actual_ms)
        return cls(
            budget_ms=plan.deadline_ms,
            setting=plan.setting,
            thresholds=tuple(plan.thresholds),
            cap=plan.cap,
            requested_steps=plan.requested_steps,
            num_steps=plan.num_steps,
            cfg_steps=plan.cfg_steps,
            expected_full_calls=plan.expected_full_calls,
            predicted_ms=plan.predicted_ms,
            actual_ms=total,
            predicted_stage_ms=dict(plan.predicted_stage_ms),
            actual_stage_ms={k: float(v) for k, v in actual_stage_ms.items()},
            branches={b: BranchTickCounts.from_counts(b, c) for b, c in cache_counts.items()},
            feasible=plan.feasible,
            best_achievable_ms=plan.best_achievable_ms,
            fallbacks=tuple(plan.fallbacks) + tuple(late_fallbacks),
            deadline_met=total <= plan.deadline_ms,
            sequences=dict(sequences or {}),
        )

    @property
    def full_calls(self) -> int:
        return sum(c.full for c in self.branches.values())

    @property
    def skipped_calls(self) -> int:
        return sum(c.skipped for c in self.branches.values())

    @property
    def forced_skips(self) -> int:
        return sum(c.forced_skip for c in self.branches.values())

    @property
    def fail_opens(self) -> int:
        return sum(c.fail_open for c in self.branches.values())

    def to_dict(self) -> dict:
        """JSON-ready form (tuples become lists)."""
        data = asdict(self)
        data["thresholds"] = list(self.thresholds)
        data["fallbacks"] = list(self.fallbacks)
        return data
