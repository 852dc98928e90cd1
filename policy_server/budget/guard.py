"""In-tick deadline guard: forces SKIP whenever running FULL now would make the deadline unreachable.

Before a call at step ``s`` that the cache gate wants to run FULL, the guard checks whether
``now + rest of this call as FULL + (remaining non-final calls) * c_skip + (final-step calls) * c_full
+ reserve_after`` exceeds the deadline; if so it answers True and SeaCache skips instead (when it has a
residual). The planned final step is reserved as FULL and never forced. This bounds the tick even when
the gate would refresh every step.

Before each sampler step the guard ``pace``s it: the plan's CFG branches of the step, and whether it is the
last. When even skipping every call left cannot meet the deadline (a stall, a machine slower than the cost
model knows), the tick gives up quality in the planner's fallback order: first the uncond pass of the
remaining steps, then the remaining steps themselves (the sampler jumps to its clean estimate). Both are
listed in ``late_fallbacks``.

The guard also times every call (``on_call``, after each call completes), so
the cost model learns c_full and c_skip from real ticks, and so a slowdown seen earlier in the same tick
raises the per-call estimates for the rest of it (c_full: the slowest full call so far; c_skip: the
median skipped call). A call's time runs from the end of the previous call (or the start of the denoising
loop) to its own end, so it includes the embedding, heads, CFG combine and sampler update around the stack.
"""

from __future__ import annotations

import statistics
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
    arming and the loop (``includes_setup``), so it does not count as a cost sample."""

    step: int
    branch: str
    full: bool
    forced: bool
    ms: float
    includes_setup: bool = False


class DeadlineGuard:
    """The deadline of one tick's denoising loop, armed at (or shortly before) the loop's start.

    deadline_at_ms: the tick's absolute deadline on ``clock`` (monotonic ms). reserve_after_ms: what the stages
    after the loop (decode, post-processing) need before it. Per-call estimates are the cost model's
    ``mean + cost_margin_devs * deviation``.
    """

    def __init__(self, plan: TickPlan, costs: CallCosts, deadline_at_ms: float, reserve_after_ms: float = 0.0,
                 clock: Callable[[], float] = monotonic_ms, cost_margin_devs: float = 1.0) -> None:
        cautious = costs.cautious(cost_margin_devs)
        self.clock = clock
        self._plan = plan
        self._deadline_at = float(deadline_at_ms)
        self._reserve_after = float(reserve_after_ms)
        self._full_ms = cautious.full_ms
        self._skip_ms = self._prior_skip_ms = cautious.skip_ms
        self._skip_samples: list[float] = []
        self._last_mark = clock()
        self._calls: list[CallTiming] = []
        self._uncond_stop: int | None = None  # first step without the uncond pass, set by ``pace``
        self._final_step: int | None = None  # an earlier last step, set by ``pace``
        self._late: list[str] = []

    # ---------------------------------------------------------------- before each step

    def pace(self, step: int) -> tuple[tuple[str, ...], bool]:
        """Before sampler step ``step``: the CFG branches to run (the plan's, less what a stall gave up) and
        whether to make this the last step."""
        plan = self._plan
        branches = self._branches(step)
        if step >= plan.num_steps - 1:
            return branches, False
        now = self.clock()
        if now + self._cheapest_rest(step, self._uncond_stop) <= self._deadline_at:
            return branches, False
        uncond_left = any(len(self._branches(s)) == 2 for s in range(step, plan.num_steps))
        if uncond_left and now + self._cheapest_rest(step, step) <= self._deadline_at:
            self._uncond_stop = step
            self._late.append(f"late_drop_uncond_from_step={step}")
            return branches[:1], False
        if self._uncond_stop is None:
            self._uncond_stop = step
        self._final_step = step
        self._late.append(f"late_finish_at_step={step}/{plan.num_steps}")
        return branches[:1], True

    def _branches(self, step: int, uncond_stop: int | None = None) -> tuple[str, ...]:
        """The branches run at ``step``: the plan's, without uncond from ``uncond_stop`` (default: as paced)."""
        uncond_stop = self._uncond_stop if uncond_stop is None else uncond_stop
        branches = self._plan.branches(step)
        return branches[:1] if uncond_stop is not None and step >= uncond_stop else branches

    def _cheapest_rest(self, step: int, uncond_stop: int | None) -> float:
        """Time from the start of ``step`` to the deadline-relevant end of the tick if every call but the final
        step's were skipped, with the uncond pass gone from ``uncond_stop`` on."""
        last = self._plan.num_steps - 1
        middle = sum(len(self._branches(s, uncond_stop)) for s in range(step, last))
        return middle * self._skip_ms + len(self._branches(last, uncond_stop)) * self._full_ms + self._reserve_after

    # ---------------------------------------------------------------- each call

    def force_skip(self, step: int, branch: str) -> bool:
        """True when a FULL call now would leave too little time for the rest of the tick."""
        plan = self._plan
        if step >= plan.num_steps - 1:
            return False  # the planned final step: reserved as FULL
        branches = self._branches(step)
        later_in_step = len(branches) - 1 - branches.index(branch)
        final = plan.num_steps - 1 if self._final_step is None else self._final_step
        if step >= final:  # ``pace`` made this the last step: nothing follows it
            middle_calls, final_calls = later_in_step, 0
        else:
            final_calls = len(self._branches(final))
            middle_calls = later_in_step + sum(len(self._branches(s)) for s in range(step + 1, final))
        now = self.clock()
        # Part of this call (its embedding, the previous call's heads and sampler update) is already spent;
        # at most what a skipped call costs, since anything longer was a stall, not progress on this call.
        rest_of_this_call = self._full_ms - min(now - self._last_mark, self._skip_ms)
        needed = (
            rest_of_this_call + middle_calls * self._skip_ms + final_calls * self._full_ms + self._reserve_after
        )
        return now + needed > self._deadline_at

    def on_call(self, decision: _Decision) -> None:
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
            # Skipped calls are many and short: one stall must not make every later one look slow (that
            # would end the tick early for nothing), so the estimate follows their median once there are a few.
            self._skip_samples.append(ms)
            if len(self._skip_samples) >= 3:
                self._skip_ms = max(self._prior_skip_ms, statistics.median(self._skip_samples))

    # ---------------------------------------------------------------- what happened

    def call_timings(self) -> list[tuple[bool, float]]:
        """``(ran_full, ms)`` per call after the first, for ``CostModel.observe_tick``."""
        return [(c.full, c.ms) for c in self._calls if not c.includes_setup]

    @property
    def late_fallbacks(self) -> tuple[str, ...]:
        """What ``pace`` gave up in this tick, in order (empty when the tick ran as planned)."""
        return tuple(self._late)
