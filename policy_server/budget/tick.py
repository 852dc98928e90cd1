"""One worker's budget loop: plan a tick, guard its step loop, then learn from the finished tick.

Usage by the engine (one instance per model worker, one ``SessionHistory`` per session)::

    plan = budget.plan(cost_key, time_left_ms, num_steps, passes, session_history, prefill=False)
    steps = budget.guarded_steps(plan, cost_key, tick_started_at_ms, SeaCache(...), deadline_ms)  # arms the guard
    ... the sampler asks steps.before_step(i) for each step's branches, and steps.estimate(...) for each call
    (None: it runs; the step's calls that run go as one batch, and steps.ran({branch: out}) gets their outputs) ...
    budget.learn(cost_key, steps, session_history, stage_ms)

Each tick gets its own guard, so ticks that run together (a micro-batch) each keep their own deadline.
``budget`` is pure Python: it hands the cache's tensors along without touching them.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING

from .cost_model import FULL, PAIR, SKIP, CostModel
from .guard import DeadlineGuard, monotonic_ms
from .history import SessionHistory
from .planner import DENOISE_STAGE, PlannerConfig, TickPlan, plan_on_frontier, plan_tick
from .profile import ProfilePoint

if TYPE_CHECKING:
    import torch

    from policy_server.cache.controller import CacheRecord
    from policy_server.cache.seacache import SeaCache

PREFILL_STAGE = "prefill"
PREVIEW_STAGE = "preview"  # decoding the predicted frames, for the sessions that asked for them
SLOWDOWN_WINDOW = 64  # recent ticks whose slowdowns the frontier planner prices cuts at
SLOWDOWN_LEVELS = 8  # ... as this many equally likely values, so that planning a tick stays cheap


class GuardedSteps:
    """The step loop of one planned tick: the plan names each step's CFG branches, the deadline guard paces
    the steps and turns a call the cache would run FULL into a skip when the deadline needs it. A step's full
    calls run as one batch (``batch_branches``), which is what the guard's and the planner's costs assume."""

    batch_branches = True

    def __init__(self, plan: TickPlan, guard: DeadlineGuard, cache: SeaCache) -> None:
        self.plan, self.guard, self.cache = plan, guard, cache
        self._full_in_step: tuple[int, int] = (-1, 0)  # (step, calls of it that run full)
        cache.begin(plan.num_steps)

    def before_step(self, step: int) -> tuple[tuple[str, ...], bool]:
        """The CFG branches of sampler step ``step`` and whether it is the last (``DeadlineGuard.pace``)."""
        return self.guard.pace(step)

    def estimate(self, step: int, branch: str, sigma: float, noisy_vision: Sequence[torch.Tensor],
                 gen_in: torch.Tensor) -> torch.Tensor | None:
        """The cache's estimate of one call when its gate or the guard skips it; None when it runs."""
        gate = self.cache.gate(step, branch, sigma, noisy_vision)
        full_so_far = self._full_in_step[1] if self._full_in_step[0] == step else 0
        out = self.cache.skip(gate, gen_in, gate.full and self.guard.force_skip(step, branch, full_so_far > 0))
        if out is None:
            self._full_in_step = (step, full_so_far + 1)
        else:
            self.guard.on_call(self.cache.record().decisions[-1:])
        return out

    def ran(self, outs: Mapping[str, torch.Tensor]) -> None:
        """The outputs of the calls that ran together: the cache keeps their residuals, the guard times them."""
        for branch, out in outs.items():
            self.cache.ran(branch, out)
        self.guard.on_call(self.cache.record().decisions[-len(outs):])

    def record(self) -> CacheRecord:
        return self.cache.record()

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """The planner's fallbacks, then what the guard gave up during the tick."""
        return self.plan.fallbacks + self.guard.late_fallbacks


class TickBudget:
    """Planner + guard + cost-model learning for one model worker.

    post_stages: fixed stages that run after the denoising loop (the guard reserves the estimated time of
    those the plan includes). clock: monotonic ms, shared with the guard. guided: the steps of an n-step tick
    the uncond pass may run on (``PolicyPipeline.guided_steps``).
    """

    def __init__(
        self,
        cost_model: CostModel,
        config: PlannerConfig | None = None,
        clock: Callable[[], float] = monotonic_ms,
        post_stages: Sequence[str] = ("decode",),
        guided: Callable[[int], range] = range,
    ) -> None:
        self.cost_model = cost_model
        self.config = config or PlannerConfig()
        self.clock = clock
        self.post_stages = tuple(post_stages)
        self.guided = guided
        # How much slower than the cost model's medians the calls of recent ticks ran, and those as at most
        # SLOWDOWN_LEVELS equally likely values (ascending; each the mean of one slice of them, so the tail
        # counts): a tuple replaced whole, so admission may plan from another thread while the worker learns.
        self._recent_slowdowns: deque[float] = deque(maxlen=SLOWDOWN_WINDOW)
        self.slowdowns: tuple[float, ...] = ()

    def plan(
        self, key: Hashable, time_left_ms: float, num_steps: int, passes: int, history: SessionHistory | None,
        prefill: bool, preview: bool = False, frontier: Sequence[ProfilePoint] | None = None,
    ) -> TickPlan:
        """Plan a tick with ``time_left_ms`` > 0 left in it: on a quality profile's ``frontier`` when there is
        one (``plan_on_frontier``), else on the ladder (``plan_tick``). ``prefill``: whether it must prefill its
        text K/V (a new instruction) or reuses them; ``preview``: whether it decodes its predicted frames."""
        costs = self.cost_model.costs(key)
        if not prefill:
            costs = costs.without(PREFILL_STAGE)
        if not preview:
            costs = costs.without(PREVIEW_STAGE)
        if frontier:
            return plan_on_frontier(time_left_ms, frontier, costs, history, self.config, self.guided,
                                    self.slowdowns or (1.0,))
        return plan_tick(time_left_ms, num_steps, passes, costs, history, self.config, self.guided)

    def guarded_steps(self, plan: TickPlan, key: Hashable, tick_started_at_ms: float, cache: SeaCache,
                      deadline_ms: float) -> GuardedSteps:
        """The tick's step loop under a guard armed now; the deadline is ``tick_started_at_ms + deadline_ms``: the
        plan's, or longer for a tick of a micro-batch, which shares the worker with the batch's other ticks."""
        costs = self.cost_model.costs(key)
        reserve = costs.cautious(self.config.cost_margin_devs).fixed_ms
        reserve_after = sum(reserve.get(stage, 0.0) for stage in self.post_stages if stage in plan.predicted_stage_ms)
        guard = DeadlineGuard(plan, costs, tick_started_at_ms + deadline_ms, reserve_after, self.clock,
                              self.config.cost_margin_devs)
        return GuardedSteps(plan, guard, cache)

    def learn(
        self,
        key: Hashable,
        steps: GuardedSteps,
        history: SessionHistory | None,
        stage_ms: Mapping[str, float],
        learn_costs: bool = True,
        prefilled: bool = True,
    ) -> None:
        """Feed the tick's call and stage timings to the cost model (unless ``learn_costs`` is False: a tick
        that shared its calls with others in a batch is not a single tick's cost), and the full calls its gate
        wanted to the session history. ``stage_ms`` holds every stage including ``denoise``; ``prefilled``:
        whether the tick prefilled its text K/V (a reused prefix says nothing of that cost)."""
        if learn_costs:
            stages = {stage: ms for stage, ms in stage_ms.items()
                      if stage != DENOISE_STAGE and (prefilled or stage != PREFILL_STAGE)}
            timings = steps.guard.call_timings()
            if timings and self.cost_model.is_warm(key):
                expected = self.cost_model.costs(key)
                cost_of = {FULL: expected.full_ms, PAIR: expected.pair_ms, SKIP: expected.skip_ms}
                self._recent_slowdowns.append(sum(ms for _, ms in timings) / sum(cost_of[kind] for kind, _ in timings))
                ranked = sorted(self._recent_slowdowns)
                n, levels = len(ranked), min(SLOWDOWN_LEVELS, len(ranked))
                self.slowdowns = tuple(statistics.fmean(ranked[i * n // levels:(i + 1) * n // levels])
                                       for i in range(levels))
            self.cost_model.observe_tick(key, timings, stages)
        plan = steps.plan
        if history is not None and plan.caching:  # an uncached plan's count is its calls: nothing to learn
            # The calls a late fallback took out (the uncond pass, the last steps) were never gated: they count as
            # refreshes, so that a point the guard had to cut is not planned on as cheaper than its whole tick.
            record = steps.record()
            history.observe(plan.setting, plan.structure,
                            record.wanted_full_calls + plan.calls - len(record.decisions))
