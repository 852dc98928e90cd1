"""In-tick deadline guard: forces SKIP when running FULL now would miss the deadline or fall behind the plan.

Before a call at step ``s`` that the cache gate wants to run FULL, the guard answers True (SeaCache then
skips, when it has a residual) in two cases:

* the deadline would become unreachable: ``now + rest of this call as FULL + (remaining non-final calls) *
  c_skip + (final step, all FULL) + reserve_after`` exceeds it. This bounds the tick even when the gate would
  refresh every step.
* the tick would fall behind its plan: ``now + (this step's calls and the later middle steps') * the plan's
  average cost of a middle call + (final step, all FULL) + reserve_after`` exceeds it, the average raised by
  the slowdown seen in this tick. The first and last steps always run full, so the average is over the calls
  between them.
  A tick that runs slow (a slower machine, a gate that wants more refreshes than planned) so gives up a few
  refreshes spread over the tick instead of a run of skips at its end, which costs far less action error
  (one refresh skipped in a cap-bounded pattern versus extrapolating a residual over many steps).

A step's full calls run as one batch, so a call that joins another full call of its step costs only
``c_pair - c_full`` more, and a final step with both branches costs ``c_pair``. The planned final step is
reserved as FULL and never forced.

Before each sampler step the guard ``pace``s it: the plan's CFG branches of the step, and whether it is the
last. When even skipping every call left cannot meet the deadline (a stall, a machine slower than the cost
model knows), the tick gives up quality in the planner's fallback order: first the uncond pass of the
remaining steps, then the remaining steps themselves (the sampler jumps to its clean estimate). Both are
listed in ``late_fallbacks``.

The guard also times every step (from one ``pace`` to the next, so the embedding, heads, CFG combine and
sampler update around the stacks count), and ``on_call`` tells it what the step's calls were. So the cost
model learns c_full, c_pair and c_skip from real ticks (``step_samples``), and a slowdown seen earlier in the
same tick raises every estimate for the rest of it, ``reserve_after`` included (the stages after the loop run on
the same device, and their costs, learned once per tick, take half the cost model's window to follow a lasting
slowdown): the median of the timed steps' wall times against their calls' estimates, weighted by those estimates
(never below the cost model's). The last step is not timed: nothing follows it inside the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

from .cost_model import CallCosts, step_samples
from .planner import DENOISE_STAGE, TickPlan

# What ``pace`` gives up when even skipping every call left cannot meet the deadline (``late_fallbacks``).
LATE_DROP_UNCOND = "late_drop_uncond_from_step"
LATE_FINISH = "late_finish_at_step"
LATE_FALLBACKS = frozenset({LATE_DROP_UNCOND, LATE_FINISH})


def monotonic_ms() -> float:
    return time.perf_counter() * 1000.0


class _Decision(Protocol):
    """What the guard reads from a cache decision (``policy_server.cache.controller.StepDecision``)."""

    step: int
    full: bool


@dataclass(frozen=True)
class StepTiming:
    """One sampler step as timed by the guard: its calls as cost samples ``(kind, ms)`` (``step_samples``)."""

    step: int
    samples: tuple[tuple[str, float], ...]


def _middle_call_ms(plan: TickPlan, costs: CallCosts) -> float:
    """The plan's average cost of a call between its first step and its last, whose calls always run full (ms)."""
    ends = {0, plan.num_steps - 1}
    ends_ms = sum(costs.pair_ms if len(plan.branches(s)) == 2 else costs.full_ms for s in ends)
    middle = plan.calls - sum(len(plan.branches(s)) for s in ends)
    if middle == 0:
        return 0.0
    # A plan's full-call count may be a fractional estimate (a profile point's), so its loop may be predicted
    # below its ends plus skips; a middle call never costs less than a skip.
    return max(plan.predicted_stage_ms[DENOISE_STAGE] - ends_ms, middle * costs.skip_ms) / middle


def _weighted_median(samples: Sequence[tuple[float, float]]) -> float:
    """The value at half the total weight of ``(value, weight)`` samples, weights > 0."""
    ranked = sorted(samples)
    half = sum(weight for _, weight in ranked) / 2
    return next(value for (value, _), seen in zip(ranked, accumulate(w for _, w in ranked), strict=True)
                if seen >= half)


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
        self._prior = cautious
        self._middle_call_ms = _middle_call_ms(plan, costs)
        # Each timed step's wall time against its calls' priors, weighted by those priors (ms), after a pair's
        # worth of steps on plan: their weighted median is how much slower than planned this tick runs.
        self._step_ratios: list[tuple[float, float]] = [(1.0, cautious.pair_ms)]
        self._slowdown = 1.0
        self._step_mark = clock()  # when the current step began
        self._step_calls: list[_Decision] = []  # its decided calls, in order
        self._batched = False  # its full calls ran as one batch
        self._steps: list[StepTiming] = []
        self._uncond_stop: int | None = None  # first step without the uncond pass, set by ``pace``
        self._final_step: int | None = None  # an earlier last step, set by ``pace``
        self._late: list[str] = []

    # ---------------------------------------------------------------- before each step

    def pace(self, step: int) -> tuple[tuple[str, ...], bool]:
        """Before sampler step ``step``: the CFG branches to run (the plan's, less what a stall gave up) and
        whether to make this the last step."""
        self._time_step()
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
            self._late.append(f"{LATE_DROP_UNCOND}={step}")
            return branches[:1], False
        if self._uncond_stop is None:
            self._uncond_stop = step
        self._final_step = step
        self._late.append(f"{LATE_FINISH}={step}/{plan.num_steps}")
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
        return middle * self._skip_ms + self._full_step_ms(len(self._branches(last, uncond_stop))) + self._after_ms

    def _full_step_ms(self, calls: int) -> float:
        """A step whose ``calls`` (0, 1 or 2) all run full, as one batch."""
        return self._pair_ms if calls == 2 else calls * self._full_ms

    # ---------------------------------------------------------------- each call

    def force_skip(self, step: int, branch: str, joins_full: bool = False) -> bool:
        """True when a FULL call now would leave too little time for the rest of the tick. ``joins_full``: an
        earlier call of this step runs full, and this one would run in its batch."""
        plan = self._plan
        if step >= plan.num_steps - 1:
            return False  # the planned final step: reserved as FULL
        branches = self._branches(step)
        position = branches.index(branch)
        # This step if this call runs full and the later ones skip; its full calls run after all are decided.
        step_ms = (self._pair_ms if joins_full else self._full_ms) + (len(branches) - 1 - joins_full) * self._skip_ms
        final = plan.num_steps - 1 if self._final_step is None else self._final_step
        if step >= final:  # ``pace`` made this the last step: nothing follows it
            middle_calls, final_calls = 0, 0
        else:
            final_calls = len(self._branches(final))
            middle_calls = sum(len(self._branches(s)) for s in range(step + 1, final))
        now = self.clock()
        # What the step spent so far (the embedding, the earlier calls' gates) is part of `step_ms`; at most what
        # that many skipped calls cost, since anything longer was a stall, not progress on this step.
        rest_of_step = step_ms - min(now - self._step_mark, (position + 1) * self._skip_ms)
        needed = rest_of_step + middle_calls * self._skip_ms + self._full_step_ms(final_calls) + self._after_ms
        # This step's calls and the later middle steps' at the plan's pace, not this call at its full cost: the
        # plan's refreshes are lumps between runs of skips, and a tick on plan must not look behind at each one.
        on_pace = (len(branches) + middle_calls) * self._middle_call_ms * self._slowdown \
            + self._full_step_ms(final_calls) + self._after_ms
        return now + max(needed, on_pace) > self._deadline_at

    def on_call(self, decisions: Sequence[_Decision]) -> None:
        """The call just decided and done: one skipped call, one full call, or the full calls of the step that
        ran as one batch (timed with the step, at the next ``pace``)."""
        self._step_calls.extend(decisions)
        self._batched = self._batched or (len(decisions) == 2 and decisions[0].full)

    def _time_step(self) -> None:
        """Close the step that just ended: its cost samples; a slow one raises the estimates for the rest."""
        now = self.clock()
        calls, ms = self._step_calls, now - self._step_mark
        self._step_mark, self._step_calls, batched, self._batched = now, [], self._batched, False
        if not calls:
            return
        runs = sum(d.full for d in calls)
        skips = len(calls) - runs
        self._steps.append(StepTiming(calls[0].step, tuple(step_samples(runs, skips, batched, ms, self._skip_ms))))
        planned = (self._prior.pair_ms if batched else runs * self._prior.full_ms) + skips * self._prior.skip_ms
        self._step_ratios.append((ms / planned, planned))
        # A median: one slow step (a stall, a noisy timer) is time lost once, not a rate for the rest of the tick;
        # a lasting slowdown shows in most of its time, skipped steps included, so cutting refreshes cannot hide
        # it. Weighted: a skipped call is short and its timing the noisiest, so it counts for what it costs.
        self._slowdown = max(1.0, _weighted_median(self._step_ratios))

    # The rest of the tick's calls: their estimates at this tick's slowdown (ms).
    @property
    def _full_ms(self) -> float:
        return self._prior.full_ms * self._slowdown

    @property
    def _pair_ms(self) -> float:
        return self._prior.pair_ms * self._slowdown

    @property
    def _skip_ms(self) -> float:
        return self._prior.skip_ms * self._slowdown

    @property
    def _after_ms(self) -> float:
        # The stages after the loop (the actions' decode, a preview's frames) run on the same device as its calls.
        return self._reserve_after * self._slowdown

    # ---------------------------------------------------------------- what happened

    def call_timings(self) -> list[tuple[str, float]]:
        """``(kind, ms)`` of the timed steps' calls, for ``CostModel.observe_tick``."""
        return [sample for step in self._steps for sample in step.samples]

    @property
    def late_fallbacks(self) -> tuple[str, ...]:
        """What ``pace`` gave up in this tick, in order (empty when the tick ran as planned)."""
        return tuple(self._late)
