"""One worker's budget loop: plan a tick, arm the in-tick guard, then learn from the finished tick.

Usage by the engine (one instance per model worker, one ``SessionHistory`` per session)::

    plan = budget.plan(shape_key, remaining_ms, num_steps, passes, session_history, prefill=False)
    guard = budget.arm(plan, shape_key, tick_started_at_ms)    # before the pipeline call
    cache = SeaCache(SeaCacheConfig(threshold=plan.thresholds, max_consecutive_cached=plan.cap),
                     force_skip=guard.force_skip, on_decision=guard.on_decision,
                     sea_filter=shared_sea_filter)             # keeps the gain cache across ticks
    ... run the pipeline with plan.num_steps steps, cfg_steps=plan.cfg_steps, pacer=guard ...
    record = budget.finish(shape_key, plan, guard, session_history, cache.record().counts_dict(), stage_ms)

Each tick gets its own guard, so ticks that run together (a micro-batch) each keep their own deadline.

``budget`` is pure Python: the cache classes are named above only to show the wiring.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence

from .cost_model import CostModel
from .guard import DeadlineGuard, monotonic_ms
from .history import SessionHistory, natural_full_calls
from .planner import PlannerConfig, TickPlan, plan_tick
from .record import TickRecord

DENOISE_STAGE = "denoise"
PREFILL_STAGE = "prefill"
PREVIEW_STAGE = "preview"  # decoding the predicted frames, for the sessions that asked for them


class TickBudget:
    """Planner + guard + cost-model learning for one model worker.

    post_stages: fixed stages that run after the denoising loop (the guard reserves the estimated time of
    those the plan includes). clock: monotonic ms, shared with the guard.
    """

    def __init__(
        self,
        cost_model: CostModel,
        config: PlannerConfig | None = None,
        clock: Callable[[], float] = monotonic_ms,
        post_stages: Sequence[str] = ("decode",),
    ) -> None:
        self.cost_model = cost_model
        self.config = config or PlannerConfig()
        self.clock = clock
        self.post_stages = tuple(post_stages)

    def plan(
        self, key: Hashable, deadline_ms: float, num_steps: int, passes: int, history: SessionHistory | None,
        prefill: bool, preview: bool = False,
    ) -> TickPlan:
        """Plan a tick with ``deadline_ms`` left in it (see ``plan_tick``); ``prefill``: whether it must prefill
        its text K/V (a new instruction) or reuses them; ``preview``: whether it decodes its predicted frames."""
        costs = self.cost_model.costs(key)
        if not prefill:
            costs = costs.without(PREFILL_STAGE)
        if not preview:
            costs = costs.without(PREVIEW_STAGE)
        return plan_tick(deadline_ms, num_steps, passes, costs, history, self.config)

    def arm(self, plan: TickPlan, key: Hashable, tick_started_at_ms: float) -> DeadlineGuard:
        """A guard started for this tick's denoising loop; the deadline is ``tick_started_at_ms + budget``."""
        costs = self.cost_model.costs(key)
        reserve = costs.cautious(self.config.cost_margin_devs).fixed_ms
        reserve_after = sum(reserve.get(stage, 0.0) for stage in self.post_stages if stage in plan.predicted_stage_ms)
        guard = DeadlineGuard(self.clock, cost_margin_devs=self.config.cost_margin_devs)
        guard.start(plan, costs, tick_started_at_ms + plan.deadline_ms, reserve_after)
        return guard

    def finish(
        self,
        key: Hashable,
        plan: TickPlan,
        guard: DeadlineGuard,
        history: SessionHistory | None,
        cache_counts: Mapping[str, Mapping[str, object]],
        actual_stage_ms: Mapping[str, float],
        actual_ms: float | None = None,
        sequences: Mapping[str, str] | None = None,
        learn_costs: bool = True,
        prefilled: bool = True,
    ) -> TickRecord:
        """Record the tick, feed its call and stage timings to the cost model (unless ``learn_costs`` is
        False: a tick that shared its calls with others in a batch is not a single tick's cost), and its
        full-call count to the session history. ``actual_stage_ms`` holds every stage including ``denoise``;
        ``prefilled``: whether the tick prefilled its text K/V (a reused prefix says nothing of that cost)."""
        record = TickRecord.build(plan, cache_counts, actual_stage_ms, actual_ms, sequences,
                                  late_fallbacks=guard.late_fallbacks)
        if learn_costs:
            stages = {stage: ms for stage, ms in actual_stage_ms.items()
                      if stage != DENOISE_STAGE and (prefilled or stage != PREFILL_STAGE)}
            self.cost_model.observe_tick(key, guard.call_timings(), stages)
        if history is not None and plan.caching:
            history.observe(plan.setting, plan.structure, natural_full_calls(cache_counts))
        return record
