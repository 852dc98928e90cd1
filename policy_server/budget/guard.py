"""In-tick deadline guard: forces SKIP whenever running FULL now would make the deadline unreachable.

Before a call at step ``s`` that the cache gate wants to run FULL, the guard checks whether
``now + rest of this call as FULL + (remaining non-final calls) * c_skip + (final-step calls) * c_full
+ reserve_after`` exceeds the deadline; if so it answers True and SeaCache skips instead (when it has a
residual). The final step is reserved as FULL and never forced. This bounds the tick even when the gate
would refresh every step.

The guard also times every call (via ``on_decision``, which SeaCache calls after each call completes), so the
cost model learns c_full and c_skip from real ticks, and so a slowdown seen earlier in the same tick raises
the per-call estimates for the rest of it. A call's time runs from the end of the previous call (or the
start of the denoising loop) to its own end, so it includes the embedding, heads, CFG combine and sampler
update around the stack.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .cost_model import CallCosts
from .planner import TickPlan


def monotonic_ms() -> float:
    return time.perf_counter() * 1000.0


class _Decision(Protocol):
    """What the guard reads from a cache decision (``policy_server.cache.controller.StepDecision``)."""

    step: int
    branch: str
    full: bool
    reason: str


@dataclass(frozen=True)
class CallTiming:
    """One sampler call as timed by the guard (ms). The tick's first call also holds whatever ran between
    ``start`` and the loop (``includes_setup``), so it does not count as a cost sample."""

    step: int
    branch: str
    full: bool
    forced: bool
    ms: float
    includes_setup: bool = False


@dataclass(frozen=True)
class ForcedSkip:
    """A skip the guard asked for; ``overshoot_ms``: how far past the deadline a full call would have led."""

    step: int
    branch: str
    overshoot_ms: float


class DeadlineGuard:
    """Arm with ``start`` before the denoising loop of each tick; hand ``force_skip`` and ``on_decision``
    to the step controller.

    clock: monotonic time in ms (injectable for tests).
    cost_margin_devs: per-call estimates are ``mean + margin * deviation`` of the cost model.
    """

    def __init__(self, clock: Callable[[], float] = monotonic_ms, cost_margin_devs: float = 1.0) -> None:
        if cost_margin_devs < 0:
            raise ValueError(f"cost_margin_devs must be >= 0, got {cost_margin_devs}")
        self.clock = clock
        self.cost_margin_devs = cost_margin_devs
        self._plan: TickPlan | None = None
        self._deadline_at = 0.0
        self._reserve_after = 0.0
        self._full_ms = 0.0
        self._skip_ms = 0.0
        self._last_mark = 0.0
        self._started_at = 0.0
        self._calls: list[CallTiming] = []
        self._requested: list[ForcedSkip] = []

    def start(
        self, plan: TickPlan, costs: CallCosts, deadline_at_ms: float, reserve_after_ms: float = 0.0
    ) -> None:
        """Arm for one tick, at or shortly before the start of its denoising loop.

        deadline_at_ms: the tick's absolute deadline on ``clock``. reserve_after_ms: time the stages after the
        loop (decode, post-processing) need before the deadline.
        """
        if reserve_after_ms < 0:
            raise ValueError(f"reserve_after_ms must be >= 0, got {reserve_after_ms}")
        cautious = costs.cautious(self.cost_margin_devs)
        self._plan = plan
        self._deadline_at = float(deadline_at_ms)
        self._reserve_after = float(reserve_after_ms)
        self._full_ms = cautious.full_ms
        self._skip_ms = cautious.skip_ms
        self._started_at = self._last_mark = self.clock()
        self._calls = []
        self._requested = []

    # ---------------------------------------------------------------- hooks for the step controller

    def force_skip(self, step: int, branch: str) -> bool:
        """True when a FULL call now would leave too little time for the rest of the tick."""
        plan = self._plan
        if plan is None or step >= plan.num_steps - 1:
            return False  # unarmed, or the final step: reserved as FULL
        branches = plan.branches(step)
        if branch not in branches:
            raise ValueError(f"branch {branch!r} is not planned at step {step}; planned: {branches}")
        later_in_step = len(branches) - 1 - branches.index(branch)
        final_calls = len(plan.branches(plan.num_steps - 1))
        middle_calls = later_in_step + sum(len(plan.branches(s)) for s in range(step + 1, plan.num_steps - 1))
        now = self.clock()
        # Part of this call (its embedding, the previous call's heads and sampler update) is already spent.
        rest_of_this_call = max(0.0, self._full_ms - (now - self._last_mark))
        needed = (
            rest_of_this_call + middle_calls * self._skip_ms + final_calls * self._full_ms + self._reserve_after
        )
        overshoot = now + needed - self._deadline_at
        if overshoot > 0:
            self._requested.append(ForcedSkip(step, branch, overshoot))
            return True
        return False

    def on_decision(self, decision: _Decision) -> None:
        """Time the call that just completed; a slow call raises the estimates for the rest of the tick."""
        now = self.clock()
        ms = now - self._last_mark
        self._last_mark = now
        forced = not decision.full and decision.reason == "forced"
        first = not self._calls
        self._calls.append(CallTiming(decision.step, decision.branch, decision.full, forced, ms, first))
        if first:
            return
        if decision.full:
            self._full_ms = max(self._full_ms, ms)
        else:
            self._skip_ms = max(self._skip_ms, ms)

    # ---------------------------------------------------------------- what happened

    @property
    def calls(self) -> list[CallTiming]:
        return list(self._calls)

    def call_timings(self) -> list[tuple[bool, float]]:
        """``(ran_full, ms)`` per call after the first, for ``CostModel.observe_calls``."""
        return [(c.full, c.ms) for c in self._calls if not c.includes_setup]

    @property
    def forced_skips(self) -> int:
        """Forced skips the cache honoured."""
        return sum(c.forced for c in self._calls)

    @property
    def requested_skips(self) -> list[ForcedSkip]:
        """Every forced skip asked for (the cache cannot honour one without a residual history)."""
        return list(self._requested)

    @property
    def elapsed_ms(self) -> float:
        """From ``start`` to the end of the last call (ms)."""
        return self._last_mark - self._started_at
