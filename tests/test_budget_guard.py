"""Deadline guard and the guarded tick loop, with a fake clock and a fake model whose calls advance it.

The fake model: every call costs CALL_MS (embed, indicator, heads); a step's full calls add the stack time,
STACK_MS for one alone, PAIR_STACK_MS for both branches as one batch. So c_full = CALL_MS + STACK_MS,
c_pair = 2 * CALL_MS + PAIR_STACK_MS and c_skip = CALL_MS, exactly what the guard and the planner assume.
"""

import dataclasses

import pytest
import torch

from policy_server.budget.cost_model import FULL, PAIR, SKIP, CallCosts, CostModel
from policy_server.budget.guard import DeadlineGuard
from policy_server.budget.history import SessionHistory
from policy_server.budget.planner import plan_tick
from policy_server.budget.profile import ProfilePoint, TickConfig
from policy_server.budget.tick import PREVIEW_STAGE, SLOWDOWN_LEVELS, SLOWDOWN_WINDOW, GuardedSteps, TickBudget
from policy_server.cache.controller import CacheRecord, StepDecision
from policy_server.cache.seacache import SeaCache, SeaCacheConfig
from policy_server.pipeline.policy import FixedSteps

CALL_MS, STACK_MS, PAIR_STACK_MS, ENCODE_MS, DECODE_MS = 1.0, 9.0, 14.0, 5.0, 5.0
COSTS = CallCosts(full_ms=CALL_MS + STACK_MS, skip_ms=CALL_MS, fixed_ms={"encode": ENCODE_MS, "decode": DECODE_MS},
                  pair_ms=2 * CALL_MS + PAIR_STACK_MS)
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


def run_denoise(clock, steps, stack_ms=lambda step: STACK_MS, stall_ms=lambda step: 0.0, num_steps=None):
    """The sampler loop of one tick on the fake model, driving ``steps`` (a ``GuardedSteps``) as the pipeline
    does: the guard names each step's branches and may end the loop early; every branch is asked, then the
    calls that run go as one batch (which costs ``PAIR_STACK_MS / STACK_MS`` times one alone).
    ``stall_ms(step)`` passes before the step. Returns the branches run per step."""
    num_steps = steps.plan.num_steps if num_steps is None else num_steps
    latents = rough_latents(num_steps)
    gen_in = torch.zeros(3, 2)
    ran = []
    with torch.no_grad():
        for step in range(num_steps):
            clock.advance(stall_ms(step))
            branches, last = steps.before_step(step)
            full = []
            for branch in branches:
                clock.advance(CALL_MS)
                if steps.estimate(step, branch, 0.5, [latents[step]], gen_in) is None:  # the call runs
                    full.append(branch)
            if full:
                clock.advance(stack_ms(step) * (PAIR_STACK_MS / STACK_MS if len(full) == 2 else 1.0))
                steps.ran({branch: gen_in + 1.0 for branch in full})
            ran.append(branches)
            if last:
                break
    return ran


def run_unguarded(clock, plan, cache, stack_ms=lambda step: STACK_MS):
    """The same loop without a guard: a plain SeaCache on the plan's steps and branches."""
    run_denoise(clock, FixedSteps(plan.num_steps, plan.uncond_steps, cache), stack_ms, num_steps=plan.num_steps)


def plan_cache(plan):
    return SeaCache(SeaCacheConfig(threshold=plan.thresholds, max_consecutive_cached=plan.cap))


def run_tick(clock, budget, plan, guarded=True, stack_ms=lambda step: STACK_MS, stall_ms=lambda step: 0.0):
    """encode → guarded steps → denoise → decode; returns (cache record, stage times in ms, the GuardedSteps or
    None when unguarded, the branches run per step)."""
    start = clock()
    clock.advance(ENCODE_MS)
    cache = plan_cache(plan)
    steps, ran = None, None
    t0 = clock()
    if guarded:
        steps = budget.guarded_steps(plan, KEY, start, cache, plan.deadline_ms)
        assert isinstance(steps, GuardedSteps) and steps.plan is plan
        ran = run_denoise(clock, steps, stack_ms, stall_ms)
    else:
        run_unguarded(clock, plan, cache, stack_ms)
    t1 = clock()
    clock.advance(DECODE_MS)
    return cache.record(), {"encode": ENCODE_MS, "denoise": t1 - t0, "decode": DECODE_MS}, steps, ran


def expected_samples(record, steps):
    """The cost samples of the first ``steps`` steps of ``record`` at the fake model's costs."""
    samples = []
    for step in range(steps):
        full = [d.full for d in record.decisions if d.step == step]
        if all(full) and len(full) == 2:
            samples.append((PAIR, pytest.approx(COSTS.pair_ms)))
        else:
            samples += [(FULL if f else SKIP, pytest.approx(COSTS.full_ms if f else COSTS.skip_ms)) for f in full
                        if f or not any(full)]
    return samples


def warm_budget(clock, guided=range):
    model = CostModel()
    for _ in range(3):
        model.observe_tick(KEY, [(FULL, COSTS.full_ms), (SKIP, COSTS.skip_ms), (PAIR, COSTS.pair_ms)],
                           {"encode": ENCODE_MS, "decode": DECODE_MS})
    assert model.is_warm(KEY)
    return TickBudget(model, clock=clock, post_stages=("decode",), guided=guided)


COST_OF = {FULL: COSTS.full_ms, PAIR: COSTS.pair_ms, SKIP: COSTS.skip_ms}


def test_guard_holds_the_deadline_when_the_gate_refreshes_every_step():
    clock = FakeClock()
    budget = warm_budget(clock)
    plan = budget.plan(KEY, 100.0, 10, 2, None, prefill=False)
    assert plan.setting == "t0.25-c2" and plan.fits  # the prior expects 8 of 20 calls full

    unguarded, stages, _, _ = run_tick(clock, budget, plan, guarded=False)
    assert unguarded.full_calls == 20  # the gate wants a refresh every step
    assert sum(stages.values()) == pytest.approx(ENCODE_MS + 10 * COSTS.pair_ms + DECODE_MS)

    rec, stages, steps, ran = run_tick(clock, budget, plan)
    total = sum(stages.values())
    assert total <= 100.0
    assert ran == [plan.branches(s) for s in range(10)] and steps.fallbacks == ()
    assert rec.full_calls + rec.skipped_calls == plan.calls
    # The gate skipped nothing on these latents: every skip is one the guard forced.
    assert rec.forced_skips > 0 and rec.skipped_calls == rec.forced_skips
    assert not any(d.fail_open for d in rec.decisions)
    assert steps.record() is rec
    assert rec.sequence("cond")[-1] == "F" and rec.sequence("uncond")[-1] == "F"  # final step kept full
    # Every forced skip was needed: a guard that forced one fewer (the cheapest: one joining a full call of its
    # step) would have missed.
    assert total + (COSTS.pair_ms - COSTS.full_ms - COSTS.skip_ms) > 100.0
    # The guard timed every step but the last, each call at its cost: a step with both branches full as one pair.
    timings = steps.guard.call_timings()
    assert timings == expected_samples(rec, plan.num_steps - 1)
    assert any(kind == PAIR for kind, _ in timings)


def test_guard_adapts_to_a_slowdown_within_the_tick():
    clock = FakeClock()
    budget = warm_budget(clock)
    plan = budget.plan(KEY, 150.0, 10, 2, None, prefill=False)
    slow = lambda step: STACK_MS if step < 3 else 2 * STACK_MS  # noqa: E731
    rec, stages, steps, _ = run_tick(clock, budget, plan, stack_ms=slow)
    assert sum(stages.values()) <= 150.0
    # Timed steps 0-2 at the usual costs, the later ones with their stacks twice as slow.
    timings = steps.guard.call_timings()
    assert timings[:3] == [(PAIR, pytest.approx(COSTS.pair_ms))] * 3
    slow = {FULL: CALL_MS + 2 * STACK_MS, PAIR: 2 * CALL_MS + 2 * PAIR_STACK_MS, SKIP: CALL_MS}
    assert all(ms == pytest.approx(slow[kind]) for kind, ms in timings[3:])
    assert any(kind != SKIP for kind, _ in timings[3:])


def test_the_stages_after_the_loop_are_reserved_at_the_slowdown_seen_in_the_tick():
    """A machine twice as slow as the cost model's medians (a slowdown they take half a window of ticks to learn)
    runs a tick's every call twice as slow, and the stages after its loop too: its actions' decode and its preview's
    frames, 5 + 20 ms planned. The guard raised the calls' estimates by the slowdown it saw, but reserved those stages
    at the medians, so the loop ran into their time and the tick ended 167 ms into its 150 ms deadline; they are now
    reserved at the tick's slowdown too."""
    clock, preview_ms = FakeClock(), 20.0
    model = CostModel()
    for _ in range(3):
        model.observe_tick(KEY, [(FULL, COSTS.full_ms), (SKIP, COSTS.skip_ms), (PAIR, COSTS.pair_ms)],
                           {"encode": ENCODE_MS, "decode": DECODE_MS, PREVIEW_STAGE: preview_ms})
    budget = TickBudget(model, clock=clock, post_stages=("decode", PREVIEW_STAGE))
    plan = budget.plan(KEY, 150.0, 10, 2, None, prefill=False, preview=True)
    clock.advance(ENCODE_MS)
    steps = budget.guarded_steps(plan, KEY, 0.0, plan_cache(plan), plan.deadline_ms)
    # Every step twice its cost: the stack's time, and its two calls' embedding and heads (before the next step).
    run_denoise(clock, steps, stack_ms=lambda step: 2 * STACK_MS, stall_ms=lambda step: 2 * CALL_MS if step else 0.0)
    assert steps.guard._slowdown == pytest.approx(2.0)
    clock.advance(2 * (DECODE_MS + preview_ms))
    assert clock() <= plan.deadline_ms == 150.0
    assert steps.fallbacks == ("late_drop_uncond_from_step=2",)  # what the time for those stages cost


@pytest.mark.parametrize(
    ("stall", "late", "cond_calls", "uncond_calls"),
    [
        (0.0, (), 10, 10),  # on time: the tick runs as planned
        (10.0, (), 10, 10),  # the stall lands in step 3's time: skipping refreshes makes it up
        (20.0, ("late_drop_uncond_from_step=4",), 10, 4),  # dropping the rest's uncond pass is enough
        (30.0, ("late_finish_at_step=4/10",), 5, 4),  # it is not: ending the tick at step 4 is
    ],
)
def test_guard_paces_a_stalled_tick_into_its_deadline(stall, late, cond_calls, uncond_calls):
    """The guard balances this plan exactly on its 100 ms deadline; a stall before step 4 costs the rest of
    the tick refreshes, its uncond pass or its remaining steps, in that order, and the deadline still holds."""
    clock = FakeClock()
    budget = warm_budget(clock)
    plan = budget.plan(KEY, 100.0, 10, 2, None, prefill=False)
    assert plan.fallbacks == ()
    record, stages, steps, ran = run_tick(clock, budget, plan, stall_ms=lambda step: stall if step == 4 else 0.0)
    assert sum(stages.values()) <= 100.0
    assert steps.fallbacks == steps.guard.late_fallbacks == late
    assert len(record.sequence("cond")) == cond_calls and len(record.sequence("uncond")) == uncond_calls
    assert len(ran) == cond_calls and sum(len(b) for b in ran) == cond_calls + uncond_calls
    assert all(branches == ("cond",) for branches in ran[uncond_calls:])


def test_the_calls_a_late_fallback_cut_count_as_refreshes_in_the_history():
    # Else the cut tick's count makes its point look cheaper than it is, the next tick is planned on it, and cut
    # again (a shape whose gate cannot skip at all, and whose guard dropped its uncond pass at step 0, did so for
    # tick after tick with time left).
    clock = FakeClock()
    budget = warm_budget(clock)
    history = SessionHistory()
    plan = budget.plan(KEY, 100.0, 10, 2, None, prefill=False)
    record, stages, steps, _ = run_tick(clock, budget, plan, stall_ms=lambda step: 30.0 if step == 4 else 0.0)
    budget.learn(KEY, steps, history, stages)
    assert steps.fallbacks == ("late_finish_at_step=4/10",) and plan.caching
    assert len(record.decisions) == 9 and plan.calls == 20
    assert history.quantile(plan.setting, plan.structure, 1.0) == record.wanted_full_calls + 11


def test_an_uncached_point_cut_by_the_guard_teaches_the_history_nothing():
    # Its gate wants every call (threshold 0), so its count is its calls; a cut tick's, whose runs of denied
    # refreshes count once, would plan the next tick on fewer.
    clock = FakeClock()
    budget = warm_budget(clock)
    history = SessionHistory()
    config = TickConfig(num_steps=10, cfg_steps=10, threshold=0.0, cap=0, residual_order=1)
    uncached = ProfilePoint(config=config, error=0.0, error_p90=0.0, full_calls=0, pairs=10, skipped_calls=0,
                            full_calls_p90=0, pairs_p90=10)
    plan = budget.plan(KEY, 175.0, 10, 2, history, prefill=False, frontier=(uncached,))
    record, stages, steps, _ = run_tick(clock, budget, plan, stall_ms=lambda step: 60.0 if step == 4 else 0.0)
    budget.learn(KEY, steps, history, stages)
    assert plan.setting == config.name and not plan.caching and record.forced_skips > 1
    assert not history.tally(plan.setting, plan.structure)


def test_a_stall_no_fallback_can_absorb_is_reported_as_a_miss():
    clock = FakeClock()
    budget = warm_budget(clock)
    plan = budget.plan(KEY, 100.0, 10, 2, None, prefill=False)
    start = clock()
    record, stages, steps, _ = run_tick(clock, budget, plan, stall_ms=lambda step: 60.0 if step == 4 else 0.0)
    actual_ms = clock() - start
    assert steps.fallbacks == ("late_finish_at_step=4/10",)
    assert actual_ms > plan.deadline_ms
    # Encode and 4 steps on time, the 60 ms stall, 1 skipped call, decode.
    first_steps_ms = sum(COST_OF[kind] for kind, _ in expected_samples(record, 4))
    assert actual_ms == pytest.approx(ENCODE_MS + first_steps_ms + 60.0 + COSTS.skip_ms + DECODE_MS)
    assert actual_ms == pytest.approx(sum(stages.values()))
    assert len(record.sequence("cond")) == 5 and len(record.sequence("uncond")) == 4


def test_guard_never_forces_the_final_step():
    clock = FakeClock()
    plan = plan_tick(60.0, 4, 2, COSTS)
    assert [plan.branches(s) for s in range(4)] == [("cond", "uncond")] * 4
    guard = DeadlineGuard(plan, COSTS, deadline_at_ms=10.0, clock=clock)  # already hopeless
    assert guard.force_skip(0, "cond") is True
    assert guard.force_skip(3, "cond") is False and guard.force_skip(3, "uncond") is False


def at_pace(plan, call_ms):
    """``plan`` with its step loop predicted at ``call_ms`` per call."""
    return dataclasses.replace(plan, predicted_stage_ms={**plan.predicted_stage_ms, "denoise": call_ms * plan.calls})


@pytest.mark.parametrize("reserve_ms", [0.0, 5.0])
def test_guard_forces_a_skip_exactly_when_a_full_call_would_overshoot(reserve_ms):
    # At step 0 cond: the step with this call full and uncond skipped (10 + 1), 4 skips (steps 1-2), the final
    # step's pair (16), then the reserve for the stages after the loop: 31 ms + reserve from now (0). The plan's
    # pace (every call a skip) is not what binds here.
    plan = at_pace(plan_tick(60.0, 4, 2, COSTS), COSTS.skip_ms)
    needed = 10.0 + 1.0 + 4 * 1.0 + 16.0 + reserve_ms
    on_time = DeadlineGuard(plan, COSTS, deadline_at_ms=needed, reserve_after_ms=reserve_ms, clock=FakeClock())
    late = DeadlineGuard(plan, COSTS, deadline_at_ms=needed - 0.1, reserve_after_ms=reserve_ms, clock=FakeClock())
    assert on_time.force_skip(0, "cond") is False
    assert late.force_skip(0, "cond") is True
    # Uncond after a skipped cond costs the same step; joining cond's full call makes the step a pair (16).
    assert on_time.force_skip(0, "uncond") is False
    assert on_time.force_skip(0, "uncond", joins_full=True) is True
    paired = DeadlineGuard(plan, COSTS, needed + 5.0, reserve_ms, FakeClock())
    assert paired.force_skip(0, "uncond", joins_full=True) is False


@pytest.mark.parametrize("reserve_ms", [0.0, 5.0])
def test_guard_forces_a_skip_exactly_when_a_full_call_would_put_the_tick_behind_its_plan(reserve_ms):
    """A tick whose gate wants more refreshes than planned, or whose calls run slower, gives up refreshes as it
    falls behind the plan's pace rather than all at its end: a full call is skipped when its step and the later
    middle steps at the plan's average cost of a middle call, then the final step full, would not fit, though
    skipping every later call still would."""
    plan = at_pace(plan_tick(60.0, 4, 2, COSTS), 10.0)
    # 80 ms planned for 8 calls; the first and last steps are pairs (16 each): 12 ms for each middle call.
    # At step 1 cond: steps 1 and 2 (4 calls) at 12 ms, the final pair, then the reserve.
    needed = 4 * 12.0 + COSTS.pair_ms + reserve_ms
    assert needed > 10.0 + 1.0 + 2 * 1.0 + 16.0 + reserve_ms  # the deadline alone would let the call run
    on_pace = DeadlineGuard(plan, COSTS, deadline_at_ms=needed, reserve_after_ms=reserve_ms, clock=FakeClock())
    behind = DeadlineGuard(plan, COSTS, deadline_at_ms=needed - 0.1, reserve_after_ms=reserve_ms, clock=FakeClock())
    assert on_pace.force_skip(1, "cond") is False and on_pace.force_skip(1, "uncond", joins_full=True) is False
    assert behind.force_skip(1, "cond") is True and behind.force_skip(1, "uncond", joins_full=True) is True


@pytest.mark.parametrize("passes", [1, 2])
def test_a_tick_on_its_plan_keeps_every_refresh(passes):
    """The plan's refreshes come as lumps between runs of skips (here every fourth step, as cap 3 forces), so
    right after one the tick is behind an even pace; the guard must not take that for a slow tick. A tick whose
    calls cost what was planned and whose gate refreshes as planned runs to its deadline uncut. (Without CFG a
    rule that counted the refresh at its full cost and the rest at the plan's average cut step 4.)"""
    plan = plan_tick(100.0, 9, passes, COSTS)
    step_ms = COSTS.pair_ms if passes == 2 else COSTS.full_ms
    denoise = 3 * step_ms + 6 * passes * COSTS.skip_ms  # full at steps 0, 4 and 8
    plan = dataclasses.replace(plan, thresholds=(1e6,) * 9, cap=3, deadline_ms=ENCODE_MS + denoise + DECODE_MS,
                               predicted_stage_ms={"encode": ENCODE_MS, "denoise": denoise, "decode": DECODE_MS})
    clock = FakeClock()
    record, stages, steps, _ = run_tick(clock, warm_budget(clock), plan)
    assert all(record.sequence(branch) == "FSSSFSSSF" for branch in plan.branches(0))
    assert record.forced_skips == 0 and sum(stages.values()) == pytest.approx(plan.deadline_ms)


def test_one_slow_step_does_not_set_the_pace_of_the_rest():
    """The first pair runs 7 ms slow (a noisy timer, a page fault) and the tick has 7 ms to spare beyond its plan:
    that time is lost once, not a rate, so the tick keeps every refresh and ends on its deadline. (A guard that
    took the first step's ratio for the rest of the tick cut the refresh at step 4, and then every later one: a
    cut refresh leaves no full call to time, so nothing told it the tick was back on pace.)"""
    plan = plan_tick(100.0, 9, 2, COSTS)
    denoise = 3 * COSTS.pair_ms + 12 * COSTS.skip_ms  # full at steps 0, 4 and 8
    plan = dataclasses.replace(plan, thresholds=(1e6,) * 9, cap=3, deadline_ms=ENCODE_MS + denoise + 7.0 + DECODE_MS,
                               predicted_stage_ms={"encode": ENCODE_MS, "denoise": denoise, "decode": DECODE_MS})
    clock = FakeClock()
    slow_first = lambda step: STACK_MS + (7.0 * STACK_MS / PAIR_STACK_MS if step == 0 else 0.0)  # noqa: E731
    record, stages, steps, _ = run_tick(clock, warm_budget(clock), plan, stack_ms=slow_first)
    assert steps.guard.call_timings()[0] == (PAIR, pytest.approx(COSTS.pair_ms + 7.0))
    assert all(record.sequence(branch) == "FSSSFSSSF" for branch in plan.branches(0))
    assert record.forced_skips == 0 and sum(stages.values()) == pytest.approx(plan.deadline_ms)


@pytest.mark.parametrize(("pair_slowdown", "forced"), [(1.0, False), (2.0, True)])
def test_the_pace_weighs_each_kind_of_call_by_its_cost(pair_slowdown, forced):
    """Skipped calls twice as slow as planned slow the tick's pace by their share of its time only: with its pair
    on time, the tick keeps a refresh that would fit at that pace (not at twice the plan's average); with the
    pair twice as slow too, the whole tick is, and the refresh is skipped."""
    plan = at_pace(plan_tick(60.0, 10, 2, COSTS), 5.0)
    assert (plan.num_steps, len(plan.uncond_steps)) == (10, 10)
    on_time_pace = (COSTS.pair_ms + 6 * 2 * COSTS.skip_ms) / (COSTS.pair_ms + 6 * COSTS.skip_ms)  # 28 / 22
    step_4_at = COSTS.pair_ms * pair_slowdown + 6 * 2 * COSTS.skip_ms
    # Steps 4-8 (10 calls) at the plan's middle call (100 ms less the first and last pairs, over 16 calls), at a
    # pace between 28/22 and 2, then the final pair at the pairs' slowdown.
    middle_call_ms = (10 * 2 * 5.0 - 2 * COSTS.pair_ms) / 16
    deadline = step_4_at + 10 * middle_call_ms * (on_time_pace + 2.0) / 2 + COSTS.pair_ms * pair_slowdown
    clock = FakeClock()
    guard = DeadlineGuard(plan, COSTS, deadline_at_ms=deadline, clock=clock)
    guard.pace(0)
    guard.on_call([StepDecision(0, "cond", full=True, reason="threshold"),
                   StepDecision(0, "uncond", full=True, reason="threshold")])
    clock.advance(COSTS.pair_ms * pair_slowdown)
    for step in (1, 2, 3):
        guard.pace(step)
        for branch in ("cond", "uncond"):
            guard.on_call([StepDecision(step, branch, full=False, reason="gate")])
            clock.advance(2 * COSTS.skip_ms)
    guard.pace(4)
    assert clock() == pytest.approx(step_4_at)
    assert guard.force_skip(4, "cond") is forced


def test_guard_does_not_force_when_time_is_ample():
    clock = FakeClock()
    plan = plan_tick(500.0, 10, 2, COSTS)
    guard = DeadlineGuard(plan, COSTS, deadline_at_ms=500.0, clock=clock)
    assert not any(guard.force_skip(s, b) for s in range(10) for b in plan.branches(s))
    assert guard.pace(0) == (("cond", "uncond"), False) and guard.late_fallbacks == ()


def test_forced_request_without_history_fails_open_and_is_not_counted_as_forced():
    clock = FakeClock()
    budget = warm_budget(clock)
    plan = budget.plan(KEY, 30.0, 10, 2, None, prefill=False)  # far too tight: the guard asks at step 0 already
    assert plan.fallbacks
    rec, _, steps, _ = run_tick(clock, budget, plan)
    assert rec.branches["cond"].fail_open_reasons.get("no_history") == 1
    # Only a forced skip without a residual ends as ``no_history``: the guard asked at step 0 and the call ran.
    first = rec.decisions[0]
    assert (first.step, first.branch, first.full, first.reason) == (0, "cond", True, "no_history")
    assert not first.forced and first.fail_open
    assert rec.forced_skips == sum(d.forced for d in rec.decisions)
    assert rec.full_calls == sum(d.full for d in rec.decisions)
    assert sum(b.fail_open for b in rec.branches.values()) >= 1
    assert steps.fallbacks[: len(plan.fallbacks)] == plan.fallbacks


def test_tick_loop_learns_costs_and_counts_and_keeps_every_deadline():
    clock = FakeClock()
    budget = warm_budget(clock)
    history = SessionHistory()
    ticks = []
    for _ in range(8):
        plan = budget.plan(KEY, 120.0, 10, 2, history, prefill=False)
        rec, stages, steps, _ = run_tick(clock, budget, plan)
        budget.learn(KEY, steps, history, stages)
        if not ticks:  # the history holds what the gate wanted: full calls plus the refreshes forced to skip
            assert rec.forced_skips > 0
            assert history.quantile(plan.setting, plan.structure, 1.0) == rec.wanted_full_calls > rec.full_calls
        ticks.append((plan, rec, sum(stages.values())))
    assert all(total <= plan.deadline_ms for plan, _, total in ticks)
    ladder = [s.name for s in budget.config.ladder]
    chosen = [ladder.index(plan.setting) for plan, _, _ in ticks]
    assert chosen[-1] > chosen[0]  # learned that the gate refreshes often on this trajectory
    assert ticks[-1][1].forced_skips < ticks[0][1].forced_skips
    costs = budget.cost_model.costs(KEY)
    assert (costs.full_ms, costs.pair_ms, costs.skip_ms) == pytest.approx((COSTS.full_ms, COSTS.pair_ms,
                                                                           COSTS.skip_ms))
    assert budget.cost_model.samples(KEY)["pair"] == 3 + 8  # warmup, then one sample per tick


def test_learn_without_costs_still_feeds_the_history():
    clock = FakeClock()
    budget = warm_budget(clock)
    history = SessionHistory()
    plan = budget.plan(KEY, 120.0, 10, 2, history, prefill=False)
    rec, stages, steps, _ = run_tick(clock, budget, plan)
    before = budget.cost_model.samples(KEY)
    budget.learn(KEY, steps, history, stages, learn_costs=False)  # a tick that shared its calls in a batch
    assert budget.cost_model.samples(KEY) == before
    assert history.quantile(plan.setting, plan.structure, 1.0) == rec.wanted_full_calls
    budget.learn(KEY, steps, None, stages)  # no session history: costs only
    assert budget.cost_model.samples(KEY)["pair"] == before["pair"] + 1


def test_setup_before_the_loop_is_in_no_cost_sample():
    clock = FakeClock()
    budget = warm_budget(clock)
    plan = budget.plan(KEY, 500.0, 4, 2, None, prefill=False)
    steps = budget.guarded_steps(plan, KEY, clock(), plan_cache(plan), plan.deadline_ms)
    clock.advance(50.0)  # setup between arming and the loop (encode), before the first step is paced
    run_denoise(clock, steps)
    rec = steps.record()
    assert len(rec.decisions) == plan.calls == 8
    assert steps.guard.call_timings() == [(PAIR, pytest.approx(COSTS.pair_ms))] * 3  # every step but the last


def test_guidance_interval_limits_the_guarded_ticks_uncond_pass():
    clock = FakeClock()
    budget = warm_budget(clock, guided=lambda n: range(0, 3))
    plan = budget.plan(KEY, 500.0, 10, 2, None, prefill=False)
    assert plan.uncond_steps == range(0, 3) and plan.calls == 13 and plan.setting == "none"
    rec, stages, steps, ran = run_tick(clock, budget, plan)
    assert ran == [("cond", "uncond")] * 3 + [("cond",)] * 7
    assert rec.sequence("cond") == "F" * 10 and rec.sequence("uncond") == "FFF"
    assert sum(stages.values()) == pytest.approx(ENCODE_MS + 3 * COSTS.pair_ms + 7 * COSTS.full_ms + DECODE_MS)
    assert steps.fallbacks == ()


def test_one_stalled_step_does_not_make_the_rest_of_the_tick_look_slow():
    """A 20 ms stall before step 3 makes step 2's sample 36 ms; the estimate follows the median of the tick's
    steps, so the remaining steps keep their full calls and the tick still ends inside its 200 ms."""
    clock = FakeClock()
    budget = warm_budget(clock)
    plan = budget.plan(KEY, 200.0, 10, 2, None, prefill=False)
    assert plan.setting == "none"  # uncached: 10 + 10 * 16 = 170 ms
    record, stages, steps, _ = run_tick(clock, budget, plan, stall_ms=lambda step: 20.0 if step == 3 else 0.0)
    assert record.forced_skips == 0 and record.full_calls == 20 and steps.fallbacks == ()
    assert sum(stages.values()) == pytest.approx(190.0)


def test_a_run_of_forced_skips_is_one_refresh_the_gate_wanted():
    """After a denied refresh the gate asks again on every step (its distance and cap count keep growing): the
    history counts the run once, per branch, so one cut tick does not make the setting look twice as costly."""
    record = CacheRecord(num_steps=6)
    for step, (cond, uncond) in enumerate(["FF", "SS", "XX", "XF", "XS", "FX"]):
        for branch, mark in (("cond", cond), ("uncond", uncond)):
            record.add(StepDecision(step, branch, full=mark == "F", reason={"F": "threshold", "S": "gate",
                                                                              "X": "forced"}[mark]))
    # cond: F S X X X F -> 2 full + 1 run; uncond: F S X F S X -> 2 full + 2 runs
    assert (record.full_calls, record.forced_skips, record.wanted_full_calls) == (4, 5, 7)


def test_learn_keeps_how_much_slower_than_expected_recent_ticks_ran():
    clock = FakeClock()
    budget = warm_budget(clock)
    assert budget.slowdowns == ()
    for stack_ms in (STACK_MS, 1.5 * STACK_MS):
        plan = budget.plan(KEY, 500.0, 10, 2, None, prefill=False)
        _, stages, steps, _ = run_tick(clock, budget, plan, stack_ms=lambda step, ms=stack_ms: ms)
        budget.learn(KEY, steps, None, stages)
    on_time, slow = budget.slowdowns  # ascending
    assert on_time == pytest.approx(1.0) and slow > 1.3
    for _ in range(SLOWDOWN_WINDOW - 2):  # 64 ticks: the slow one is in the slowest level's slice of 8
        plan = budget.plan(KEY, 500.0, 10, 2, None, prefill=False)
        _, stages, steps, _ = run_tick(clock, budget, plan)
        budget.learn(KEY, steps, None, stages)
    assert len(budget.slowdowns) == SLOWDOWN_LEVELS
    assert budget.slowdowns[:-1] == pytest.approx((1.0,) * (SLOWDOWN_LEVELS - 1))
    assert budget.slowdowns[-1] == pytest.approx((7 * 1.0 + slow) / 8)
    for _ in range(2):  # the 66th: the slow one, the second tick, is out of the window
        plan = budget.plan(KEY, 500.0, 10, 2, None, prefill=False)
        _, stages, steps, _ = run_tick(clock, budget, plan)
        budget.learn(KEY, steps, None, stages)
    assert max(budget.slowdowns) == pytest.approx(1.0)
