"""The preview stage (decoding a tick's predicted frames) in the budget loop: planned, reserved by the guard and
learned only for the ticks that run it, so sessions without preview are planned exactly as before."""

import pytest

from policy_server.budget.cost_model import FULL, SKIP, CostModel
from policy_server.budget.tick import PREVIEW_STAGE, TickBudget
from policy_server.cache.seacache import SeaCache

KEY = ("shape",)
STAGES_MS = {"encode": 2.0, "prefill": 3.0, "decode": 0.5, PREVIEW_STAGE: 7.0}


@pytest.fixture
def budget():
    model = CostModel()
    model.observe_tick(KEY, [(FULL, 4.0)] * 4 + [(SKIP, 1.0)] * 4, STAGES_MS)
    return TickBudget(model, post_stages=("decode", PREVIEW_STAGE))


def test_a_preview_tick_plans_and_reserves_its_decode(budget):
    plain = budget.plan(KEY, 1000.0, 10, 2, None, prefill=False)
    preview = budget.plan(KEY, 1000.0, 10, 2, None, prefill=False, preview=True)
    assert PREVIEW_STAGE not in plain.predicted_stage_ms
    assert preview.predicted_stage_ms[PREVIEW_STAGE] == 7.0
    assert preview.predicted_ms == pytest.approx(plain.predicted_ms + 7.0)  # both uncached: the stage is the difference
    for plan, reserve_after in ((preview, 0.5 + 7.0), (plain, 0.5)):
        guard = budget.guarded_steps(plan, KEY, 0.0, SeaCache(), plan.deadline_ms).guard
        assert guard._reserve_after == pytest.approx(reserve_after)


def test_the_preview_stage_makes_a_tight_budget_cache_more(budget):
    plain = budget.plan(KEY, 60.0, 10, 2, None, prefill=False)
    preview = budget.plan(KEY, 60.0, 10, 2, None, prefill=False, preview=True)
    assert preview.full_calls_max < plain.full_calls_max
    assert preview.predicted_ms <= 60.0 and plain.predicted_ms <= 60.0
