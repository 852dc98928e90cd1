"""Deadline guard, tick loop and tick record, with a fake clock and a fake model whose calls advance it.

The fake model: every call costs CALL_MS (embed, indicator, heads); a full call adds the stack time. So
c_full = CALL_MS + stack and c_skip = CALL_MS, exactly what the guard and the planner assume.
"""

import json

import pytest
import torch

from policy_server.budget.cost_model import CallCosts, CostModel
from policy_server.budget.guard import DeadlineGuard
from policy_server.budget.history import SessionHistory
from policy_server.budget.planner import plan_tick
from policy_server.budget.record import TickRecord
from policy_server.budget.tick import TickBudget
from policy_server.cache.seacache import SeaCache, SeaCacheConfig

CALL_MS, STACK_MS, ENCODE_MS, DECODE_MS = 1.0, 9.0, 5.0, 5.0
COSTS = CallCosts(full_ms=CALL_MS + STACK_MS, skip_ms=CALL_MS, fixed_ms={"encode": ENCODE_MS, "decode": DECODE_MS})
KEY = ("fake", 2, 4, 4)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += ms


def rough_latents(num_steps, distance=0.5):
    """Latents whose SEA indicators move by ``distance`` rel-L1 per step: the gate refreshes every step."""
    base = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    return [base * (1 + distance) ** i for i in range(num_steps)]


def run_denoise(clock, plan, cache, stack_ms=lambda step: STACK_MS, pacer=None, stall_ms=lambda step: 0.0):
    """The sampler loop of one tick on the fake model; the plan fixes steps and CFG branches, and `pacer`
    (the guard) may drop the uncond pass or end the loop. `stall_ms(step)` passes before the step.
    Returns the branches run per step."""
    latents = rough_latents(plan.num_steps)
    gen_in = torch.zeros(3, 2)
    ran = []

    def full_for(step):
        def full():
            clock.advance(stack_ms(step))
            return gen_in + 1.0

        return full

    with torch.no_grad():
        for step in range(plan.num_steps):
            clock.advance(stall_ms(step))
            branches, last = plan.branches(step), False
            if pacer is not None:
                use_uncond, last = pacer.pace(step, len(branches) == 2)
                branches = branches if use_uncond else branches[:1]
            for branch in branches:
                clock.advance(CALL_MS)
                cache.run_stack(step, branch, 0.5, [latents[step]], gen_in, full_for(step))
            ran.append(branches)
            if last:
                break
    return ran


def run_tick(clock, budget, plan, guarded=True, stack_ms=lambda step: STACK_MS, stall_ms=lambda step: 0.0):
    """encode → arm guard → denoise → decode; returns (cache record, stage times in ms, guard)."""
    start = clock()
    clock.advance(ENCODE_MS)
    guard = budget.arm(plan, KEY, start)
    cache = SeaCache(
        SeaCacheConfig(threshold=plan.thresholds, max_consecutive_cached=plan.cap),
        force_skip=guard.force_skip if guarded else None,
        on_decision=guard.on_decision,
    )
    cache.begin(plan.num_steps)
    t0 = clock()
    run_denoise(clock, plan, cache, stack_ms, guard if guarded else None, stall_ms)
    t1 = clock()
    clock.advance(DECODE_MS)
    return cache.record(), {"encode": ENCODE_MS, "denoise": t1 - t0, "decode": DECODE_MS}, guard


def warm_budget(clock):
    model = CostModel()
    for _ in range(3):
        model.observe_tick(KEY, [(True, COSTS.full_ms), (False, COSTS.skip_ms)],
                           {"encode": ENCODE_MS, "decode": DECODE_MS})
    assert model.is_warm(KEY)
    return TickBudget(model, clock=clock, post_stages=("decode",))


def test_guard_holds_the_deadline_when_the_gate_refreshes_every_step():
    clock = FakeClock()
    budget = warm_budget(clock)
    plan = budget.plan(KEY, 120.0, 10, 2, None, prefill=False)
    assert plan.setting == "t0.25-c2" and plan.fits  # the prior expects 8 of 20 calls full

    unguarded, stages, _ = run_tick(clock, budget, plan, guarded=False)
    assert unguarded.full_calls == 20  # the gate wants a refresh every step
    assert sum(stages.values()) == pytest.approx(210.0)

    rec, stages, guard = run_tick(clock, budget, plan)
    total = sum(stages.values())
    assert total <= 120.0
    assert rec.forced_skips > 0 and rec.forced_skips == guard.forced_skips
    assert rec.sequence("cond")[-1] == "F" and rec.sequence("uncond")[-1] == "F"  # final step kept full
    # Every forced skip was needed: a guard that forced one fewer would have missed.
    assert total + (COSTS.full_ms - COSTS.skip_ms) > 120.0


def test_guard_adapts_to_a_slowdown_within_the_tick():
    clock = FakeClock()
    budget = warm_budget(clock)
    plan = budget.plan(KEY, 150.0, 10, 2, None, prefill=False)
    slow = lambda step: STACK_MS if step < 3 else 2 * STACK_MS  # noqa: E731
    rec, stages, guard = run_tick(clock, budget, plan, stack_ms=slow)
    assert sum(stages.values()) <= 150.0
    slow_fulls = [c for c in guard.calls if c.full and c.step >= 3]
    assert slow_fulls and all(c.ms == pytest.approx(CALL_MS + 2 * STACK_MS) for c in slow_fulls)


@pytest.mark.parametrize(
    ("stall", "late", "cond_calls", "uncond_calls"),
    [
        (0.0, (), 10, 10),  # on time: the tick runs as planned
        (10.0, ("late_drop_uncond_from_step=4",), 10, 4),  # dropping the rest's uncond pass is enough
        (25.0, ("late_finish_at_step=4/10",), 5, 4),  # only stopping now is
    ],
)
def test_guard_paces_a_stalled_tick_into_its_deadline(stall, late, cond_calls, uncond_calls):
    """The guard balances this plan exactly on its 120 ms deadline; a stall before step 4 costs the rest of
    the tick its uncond pass or its remaining steps, in that order, and the deadline still holds."""
    clock = FakeClock()
    budget = warm_budget(clock)
    plan = budget.plan(KEY, 120.0, 10, 2, None, prefill=False)
    record, stages, guard = run_tick(clock, budget, plan, stall_ms=lambda step: stall if step == 4 else 0.0)
    assert sum(stages.values()) <= 120.0
    assert guard.late_fallbacks == late
    assert len(record.sequence("cond")) == cond_calls and len(record.sequence("uncond")) == uncond_calls


def test_a_stall_no_fallback_can_absorb_is_reported_as_a_miss():
    clock = FakeClock()
    budget = warm_budget(clock)
    plan = budget.plan(KEY, 120.0, 10, 2, None, prefill=False)
    start = clock()
    cache_record, stages, guard = run_tick(clock, budget, plan, stall_ms=lambda step: 40.0 if step == 4 else 0.0)
    record = budget.finish(KEY, plan, guard, None, cache_record.counts_dict(), stages, actual_ms=clock() - start)
    assert record.fallbacks == ("late_finish_at_step=4/10",) and not record.deadline_met
    assert record.actual_ms == pytest.approx(131.0)  # 85 ms on time + 40 ms stall + 1 skipped call + decode


def test_guard_never_forces_the_final_step_and_checks_branches():
    clock = FakeClock()
    guard = DeadlineGuard(clock)
    plan = plan_tick(60.0, 4, 2, COSTS)
    assert guard.force_skip(1, "cond") is False  # not armed yet
    guard.start(plan, COSTS, deadline_at_ms=10.0)  # already hopeless
    assert guard.force_skip(0, "cond") is True
    assert guard.force_skip(3, "cond") is False
    with pytest.raises(ValueError, match="not planned"):
        guard.force_skip(0, "sideways")
    assert [r.step for r in guard.requested_skips] == [0]
    # full now + 5 skips (uncond at 0, steps 1-2) + 2 full final calls - deadline
    assert guard.requested_skips[0].overshoot_ms == pytest.approx(10.0 + 5 * 1.0 + 2 * 10.0 - 10.0)


def test_guard_does_not_force_when_time_is_ample():
    clock = FakeClock()
    guard = DeadlineGuard(clock)
    plan = plan_tick(500.0, 10, 2, COSTS)
    guard.start(plan, COSTS, deadline_at_ms=500.0)
    assert not any(guard.force_skip(s, b) for s in range(10) for b in plan.branches(s))


def test_forced_request_without_history_fails_open_and_is_not_counted_as_forced():
    clock = FakeClock()
    budget = warm_budget(clock)
    plan = budget.plan(KEY, 30.0, 10, 2, None, prefill=False)  # far too tight: the guard asks at step 0 already
    rec, _, guard = run_tick(clock, budget, plan)
    assert rec.branches["cond"].fail_open_reasons.get("no_history") == 1
    assert any(r.step == 0 for r in guard.requested_skips)
    assert guard.forced_skips == rec.forced_skips


def test_tick_loop_learns_costs_and_counts_and_keeps_every_deadline():
    clock = FakeClock()
    budget = warm_budget(clock)
    history = SessionHistory()
    records = []
    for _ in range(8):
        plan = budget.plan(KEY, 120.0, 10, 2, history, prefill=False)
        cache_record, stages, guard = run_tick(clock, budget, plan)
        records.append(budget.finish(KEY, plan, guard, history, cache_record.counts_dict(), stages,
                                     sequences={b: cache_record.sequence(b) for b in ("cond", "uncond")}))
    assert all(r.deadline_met for r in records)
    ladder = [s.name for s in budget.config.ladder]
    chosen = [ladder.index(r.setting) for r in records]
    assert chosen[-1] > chosen[0]  # learned that the gate refreshes often on this trajectory
    assert records[-1].forced_skips < records[0].forced_skips
    costs = budget.cost_model.costs(KEY)
    assert costs.full_ms == pytest.approx(COSTS.full_ms) and costs.skip_ms == pytest.approx(COSTS.skip_ms)
    assert budget.cost_model.samples(KEY)["full"] == 3 + 8  # warmup, then one sample per tick


def test_tick_record_contents_and_json():
    plan = plan_tick(50.0, 10, 2, COSTS)
    counts = {
        "cond": {"full": 2, "skipped": 8, "forced_skip": 1, "fail_open": 0, "fail_open_reasons": {}},
        "uncond": {"full": 1, "skipped": 2, "forced_skip": 0, "fail_open": 1,
                   "fail_open_reasons": {"no_history": 1}},
    }
    rec = TickRecord.build(plan, counts, {"encode": 5.0, "denoise": 41.0, "decode": 5.0})
    assert rec.actual_ms == 51.0 and not rec.deadline_met
    assert (rec.full_calls, rec.skipped_calls, rec.forced_skips, rec.fail_opens) == (3, 10, 1, 1)
    assert rec.fallbacks == ("drop_uncond_from_step=3",) and not rec.feasible
    assert rec.best_achievable_ms == pytest.approx(66.0)
    assert rec.predicted_stage_ms["denoise"] == pytest.approx(plan.predicted_ms - 10.0)
    data = json.loads(json.dumps(rec.to_dict()))
    assert data["branches"]["uncond"]["fail_open_reasons"] == {"no_history": 1}
    assert data["setting"] == plan.setting and len(data["thresholds"]) == 10
    assert TickRecord.build(plan, counts, {"denoise": 30.0}, actual_ms=49.0).deadline_met
    with pytest.raises(ValueError, match="forced_skip"):
        TickRecord.build(plan, {"cond": {"full": 1, "skipped": 0}}, {"denoise": 1.0})
    with pytest.raises(ValueError, match="denoise"):
        TickRecord.build(plan, counts, {"denoise": -1.0})


def test_first_call_of_a_tick_is_not_a_cost_sample():
    clock = FakeClock()
    budget = warm_budget(clock)
    plan = budget.plan(KEY, 500.0, 4, 2, None, prefill=False)
    guard = budget.arm(plan, KEY, clock())
    clock.advance(50.0)  # setup between arming and the loop (encode) lands in the first call's time
    cache = SeaCache(SeaCacheConfig(threshold=plan.thresholds, max_consecutive_cached=plan.cap),
                     force_skip=guard.force_skip, on_decision=guard.on_decision)
    cache.begin(plan.num_steps)
    run_denoise(clock, plan, cache)
    calls = guard.calls
    assert calls[0].includes_setup and calls[0].ms == pytest.approx(50.0 + COSTS.full_ms)
    timings = guard.call_timings()
    assert len(timings) == len(calls) - 1
    assert all(ms == pytest.approx(COSTS.full_ms if full else COSTS.skip_ms) for full, ms in timings)
