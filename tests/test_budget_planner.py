"""Per-tick planner: no caching when it fits, more aggressive settings as the budget shrinks, learning from
the session, and the infeasible path with its fallbacks in fixed order."""

import pytest

from policy_server.budget.cost_model import CallCosts
from policy_server.budget.history import SessionHistory
from policy_server.budget.planner import (
    DEFAULT_LADDER,
    MAX_CACHING,
    CacheSetting,
    PlannerConfig,
    expected_error,
    min_full_calls,
    plan_on_frontier,
    plan_tick,
)
from policy_server.budget.profile import Cut, ProfilePoint, TickConfig

# c_full 10 ms, c_skip 1 ms, 10 ms fixed. N = 10 with CFG: 20 calls, 210 ms uncached.
COSTS = CallCosts(full_ms=10.0, skip_ms=1.0, fixed_ms={"encode": 5.0, "decode": 5.0})
LADDER_NAMES = [s.name for s in DEFAULT_LADDER]


@pytest.mark.parametrize(
    "n, per_cap",
    [(4, (3, 2, 2)), (10, (6, 4, 4)), (20, (11, 8, 6)), (30, (16, 11, 9)), (35, (18, 13, 10))],
)
def test_min_full_calls_matches_the_spec_table(n, per_cap):
    assert tuple(min_full_calls(n, range(0), 1, 1, cap) for cap in (1, 2, 3)) == per_cap
    assert min_full_calls(n, range(n), 1, 1, 2) == 2 * per_cap[1]  # both CFG branches
    assert min_full_calls(n, range(0), 1, 1, 0) == 2  # maximal caching: retention + cache end


def test_min_full_calls_with_uncond_dropped_late():
    # uncond on steps 0..3: full at 0 (retention), then never reaches the cache end.
    assert min_full_calls(10, range(4), 1, 1, 0) == 2 + 1
    assert min_full_calls(10, range(4), 1, 1, 2) == 4 + 2  # uncond: F S S F


def test_min_full_calls_with_uncond_starting_late():
    # uncond on steps 3..9 (a guidance interval): its first call has no residual, its last is the cache end.
    assert min_full_calls(10, range(3, 10), 1, 1, 0) == 2 + 2
    assert min_full_calls(10, range(3, 10), 1, 1, 2) == 4 + 3  # uncond: F S S F S S F
    assert min_full_calls(10, range(3, 6), 1, 1, 0) == 2 + 1  # uncond on 3..5 only: never reaches the end


def test_no_caching_when_the_uncached_tick_fits():
    plan = plan_tick(250.0, 10, 2, COSTS)
    assert plan.setting == "none" and not plan.caching
    assert plan.thresholds == (0.0,) * 10 and plan.cap == 0
    assert plan.expected_full_calls == plan.calls == 20
    assert plan.predicted_ms == pytest.approx(210.0)
    assert plan.predicted_stage_ms == {"encode": 5.0, "decode": 5.0, "denoise": 200.0}
    assert plan.feasible and plan.fits and plan.fallbacks == ()


def test_settings_get_more_aggressive_as_the_budget_shrinks():
    chosen = []
    for deadline in range(250, 60, -10):
        plan = plan_tick(float(deadline), 10, 2, COSTS)
        assert plan.fits and plan.feasible
        chosen.append(-1 if plan.setting == "none" else LADDER_NAMES.index(plan.setting))
        assert plan.expected_full_calls <= plan.full_calls_max
    assert chosen == sorted(chosen)
    assert chosen[0] == -1 and chosen[-1] == LADDER_NAMES.index("max")
    assert len(set(chosen)) >= 3


def test_prior_is_the_best_case_of_the_cap():
    # F_max = floor((120 - 10 - 20) / 9) = 10: cap 1 needs 12, cap 2 needs 8.
    plan = plan_tick(120.0, 10, 2, COSTS)
    assert plan.full_calls_max == 10
    assert plan.setting == "t0.25-c2" and plan.cap == 2 and plan.thresholds == (0.25,) * 10
    assert plan.expected_full_calls == 8
    assert plan.predicted_ms == pytest.approx(10 + 8 * 10 + 12 * 1)


def test_planner_learns_full_counts_from_the_session():
    history = SessionHistory(window=4)
    structure = (10, 10)
    history.observe("t0.25-c2", structure, 14)  # the gate refreshed more than the cap alone forces
    plan = plan_tick(120.0, 10, 2, COSTS, history)
    assert plan.setting == "t0.50-c2"  # never tried: prior raised to nothing (more aggressive unseen) -> 8
    history.observe("t0.50-c2", structure, 12)
    plan = plan_tick(120.0, 10, 2, COSTS, history)
    # t1.00-c3 is untried; its prior is its cap's best case (8), which fits.
    assert plan.setting == "t1.00-c3" and plan.expected_full_calls == 8
    # F_max 12: the cap-1 rungs' prior (12) is raised to the 14 that t0.25-c2 needed, so t0.50-c2 wins.
    plan = plan_tick(138.0, 10, 2, COSTS, history)
    assert plan.full_calls_max == 12
    assert plan.setting == "t0.50-c2" and plan.expected_full_calls == 12


def test_prior_is_raised_to_what_a_more_aggressive_setting_needed():
    history = SessionHistory()
    history.observe("max", (10, 10), 9)
    plan = plan_tick(120.0, 10, 2, COSTS, history)
    # Every rung above max now expects >= 9 full calls; cap-2 rungs' best case 8 is raised to 9.
    assert plan.setting == "t0.25-c2" and plan.expected_full_calls == 9


def test_learned_counts_use_a_high_quantile_of_the_window():
    history = SessionHistory(window=3)
    for count in (20, 8, 8, 9):  # the 20 falls out of the window
        history.observe("t0.25-c2", (10, 10), count)
    assert history.quantile("t0.25-c2", (10, 10), 1.0) == 9  # the 20 is gone
    assert history.quantile("t0.25-c2", (10, 10), 0.9) == 9
    assert history.quantile("t0.25-c2", (10, 10), 0.5) == 8
    assert history.quantile("other", (10, 10), 0.9) is None


def test_infeasible_reports_best_latency_and_drops_uncond_first():
    # Maximal caching at 10 steps with CFG: 4 full + 16 skip = 66 ms > 50 ms.
    plan = plan_tick(50.0, 10, 2, COSTS)
    assert not plan.feasible
    assert plan.best_achievable_ms == pytest.approx(66.0)
    # uncond on steps < k: 3 full calls + (7 + k) skips + 10 fixed = 47 + k <= 50
    assert plan.fallbacks == ("drop_uncond_from_step=3",)
    assert (plan.num_steps, plan.cfg_steps) == (10, 3)
    assert plan.uncond_steps == range(3) and plan.calls == 13
    assert plan.branches(2) == ("cond", "uncond") and plan.branches(3) == ("cond",)
    assert plan.fits and plan.predicted_ms <= 50.0
    assert "infeasible" in plan.summary() and "drop_uncond_from_step=3" in plan.summary()


def test_fewer_steps_only_after_dropping_uncond():
    plan = plan_tick(40.0, 10, 2, COSTS)
    assert not plan.feasible
    assert plan.fallbacks == ("drop_uncond_from_step=1", "num_steps=10->2")
    assert (plan.num_steps, plan.cfg_steps) == (2, 1)
    assert plan.uncond_steps == range(1) and plan.calls == 3
    assert plan.fits and plan.predicted_ms == pytest.approx(40.0)
    assert plan.requested_steps == 10


def test_nothing_fits_is_reported_not_hidden():
    plan = plan_tick(20.0, 10, 2, COSTS)
    assert not plan.feasible and not plan.fits
    assert plan.fallbacks == ("drop_uncond_from_step=1", "num_steps=10->2")
    assert plan.setting == MAX_CACHING.name
    assert plan.predicted_ms > 20.0
    assert "expected to be missed" in plan.summary()


def test_disabled_fallbacks_leave_the_structure_alone():
    config = PlannerConfig(drop_uncond=False, fewer_steps=False)
    plan = plan_tick(50.0, 10, 2, COSTS, config=config)
    assert not plan.feasible and not plan.fits and plan.fallbacks == ()
    assert (plan.num_steps, plan.cfg_steps, plan.setting) == (10, 10, "max")


def test_without_cfg_only_fewer_steps_can_help():
    # 1 pass: maximal caching = 2 full + 8 skip + 10 fixed = 38 ms.
    plan = plan_tick(30.0, 10, 1, COSTS)
    assert not plan.feasible and plan.best_achievable_ms == pytest.approx(38.0)
    assert plan.fallbacks == ("num_steps=10->2",)
    assert plan.cfg_steps == 0 and plan.uncond_steps == range(0) and plan.fits
    assert plan.calls == 2 and plan.branches(0) == ("cond",)


def test_callable_threshold_schedule_in_a_custom_ladder():
    late_careful = CacheSetting("ramp", lambda step, n: 0.5 if step < n // 2 else 0.1, 2)
    plan = plan_tick(120.0, 10, 2, COSTS, config=PlannerConfig(ladder=(late_careful,)))
    assert plan.setting == "ramp"
    assert plan.thresholds == (0.5,) * 5 + (0.1,) * 5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"ladder": (CacheSetting("a", 0.5, 2), CacheSetting("b", 0.25, 2))}, "least to most"),
        ({"ladder": (CacheSetting("a", 0.5, 3), CacheSetting("b", 0.5, 2))}, "least to most"),
        ({"ladder": (CacheSetting("a", 0.5, 2), CacheSetting("a", 0.6, 2))}, "unique"),
        ({"count_quantile": 0.0}, "count_quantile"),
        ({"frontier_count_quantile": 1.5}, "frontier_count_quantile"),
        ({"frontier_cost_margin_devs": -1.0}, "frontier_cost_margin_devs"),
        ({"min_steps": 0}, "min_steps"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlannerConfig(**kwargs)


def test_guidance_interval_limits_the_uncond_pass_and_the_planned_calls():
    interval = lambda n: range(0, 3)  # noqa: E731
    plan = plan_tick(250.0, 10, 2, COSTS, guided=interval)
    assert plan.uncond_steps == range(0, 3) and plan.cfg_steps == 10 and plan.fallbacks == ()
    assert [plan.branches(s) for s in range(10)] == [("cond", "uncond")] * 3 + [("cond",)] * 7
    assert plan.setting == "none" and plan.calls == plan.expected_full_calls == 13
    assert plan.predicted_ms == pytest.approx(10 + 13 * 10)
    # 140 ms holds the uncached tick with the interval (13 calls), not without it (20 calls: 210 ms).
    assert plan_tick(140.0, 10, 2, COSTS, guided=interval).setting == "none"
    assert plan_tick(140.0, 10, 2, COSTS).caching
    # Fewer uncond calls need fewer full calls: at the same setting, 5 instead of 8 (cond F S S F S S F S S F,
    # uncond F S S), and maximal caching needs 3 (cond at 0 and 9, uncond at 0) instead of 4.
    config = PlannerConfig(ladder=(CacheSetting("t0.25-c2", 0.25, 2),))
    full_cfg = plan_tick(120.0, 10, 2, COSTS, config=config)
    guided = plan_tick(120.0, 10, 2, COSTS, config=config, guided=interval)
    assert full_cfg.setting == guided.setting == "t0.25-c2"
    assert (full_cfg.expected_full_calls, guided.expected_full_calls) == (8, 5)
    assert (full_cfg.min_full_calls, guided.min_full_calls) == (4, 3)
    assert guided.full_calls_max == (120 - 10 - 13) // 9
    assert guided.predicted_ms == pytest.approx(10 + 5 * 10 + 8 * 1)
    # Fallback 1 cuts the interval: maximal caching over 13 calls needs 50 ms, over 12 (uncond on 0..1) 49 ms.
    cut = plan_tick(49.0, 10, 2, COSTS, guided=interval)
    assert not cut.feasible and cut.best_achievable_ms == pytest.approx(50.0)
    assert cut.fallbacks == ("drop_uncond_from_step=2",) and cut.uncond_steps == range(0, 2)
    assert cut.calls == 12 and cut.branches(1) == ("cond", "uncond") and cut.branches(2) == ("cond",)


def test_guidance_interval_that_starts_late():
    plan = plan_tick(250.0, 10, 2, COSTS, guided=lambda n: range(4, n))
    assert plan.uncond_steps == range(4, 10) and plan.calls == 16
    assert plan.branches(3) == ("cond",) and plan.branches(4) == plan.branches(9) == ("cond", "uncond")
    assert plan.min_full_calls == 2 + 2  # uncond: full at 4 (no residual) and 9 (cache end)
    # The interval follows the step count: at 20 steps it is range(4, 20).
    assert plan_tick(500.0, 20, 2, COSTS, guided=lambda n: range(4, n)).uncond_steps == range(4, 20)


# The same calls, but a step's two full calls cost 12 ms as one batch (a pair saves 8 ms): 130 ms uncached.
PAIRED = CallCosts(full_ms=10.0, skip_ms=1.0, fixed_ms={"encode": 5.0, "decode": 5.0}, pair_ms=12.0)


def test_batched_cfg_pairs_count_in_what_fits():
    uncached = plan_tick(130.0, 10, 2, PAIRED, config=PlannerConfig(cost_margin_devs=0.0))
    assert uncached.setting == "none" and uncached.predicted_ms == pytest.approx(130.0)
    assert plan_tick(130.0, 10, 2, COSTS).setting != "none"  # two calls alone would need 210 ms
    # T(F) = 10 + 10 F + (20 - F) - floor(F / 2) * 8: F = 14 takes exactly 100 ms, F = 15 109 ms.
    plan = plan_tick(100.0, 10, 2, PAIRED)
    assert plan.full_calls_max == 14 and plan.setting == "t0.10-c1" and plan.expected_full_calls == 12
    assert plan.predicted_ms == pytest.approx(10 + 12 * 10 + 8 * 1 - 6 * 8)
    # Without CFG there is nothing to pair: the pair cost changes nothing.
    assert plan_tick(100.0, 10, 1, PAIRED) == plan_tick(100.0, 10, 1, COSTS)


# A synthetic frontier at PAIRED costs (10 ms fixed; full 10, pair 12, skip 1 ms).
def _point(steps, cfg, threshold, error, full, pairs, skipped, pairs_p90=None):
    """A point whose call counts do not vary over the calibration set, unless `pairs_p90` says otherwise."""
    config = TickConfig(num_steps=steps, cfg_steps=cfg, threshold=threshold, cap=2 if threshold else 0,
                        residual_order=1)
    return ProfilePoint(config=config, error=error, error_p90=error, full_calls=full, pairs=pairs,
                        skipped_calls=skipped, full_calls_p90=full, pairs_p90=pairs if pairs_p90 is None else pairs_p90)


FRONTIER = (
    _point(10, 10, 0.0, 0.00, 0, 10, 0),   # uncached: 10 + 10 * 12 = 130 ms
    _point(10, 10, 0.25, 0.03, 0, 4, 12),  # 10 + 48 + 12 = 70 ms
    _point(6, 6, 0.0, 0.05, 0, 6, 0),      # 10 + 72 = 82 ms
    _point(6, 3, 0.25, 0.09, 1, 2, 7),     # 10 + 10 + 24 + 7 = 51 ms
    _point(4, 1, 1e6, 0.20, 2, 1, 2),      # 10 + 20 + 12 + 2 = 44 ms
)


@pytest.mark.parametrize(("deadline", "chosen"), [(200.0, 0), (130.0, 0), (129.0, 1), (70.0, 1), (69.0, 3),
                                                   (51.0, 3), (50.0, 4), (44.0, 4)])
def test_the_frontier_planner_picks_the_least_error_that_fits(deadline, chosen):
    plan = plan_on_frontier(deadline, FRONTIER, PAIRED)
    point = FRONTIER[chosen]
    assert plan.setting == point.config.name and plan.expected_error == point.error
    assert plan.fits and plan.fallbacks == () and plan.predicted_ms <= deadline
    assert plan.predicted_ms == pytest.approx(point.predicted_ms(PAIRED))
    assert plan.num_steps == point.config.num_steps and plan.cfg_steps == point.config.cfg_steps
    assert plan.uncond_steps == range(point.config.cfg_steps) and plan.best_achievable_ms == pytest.approx(44.0)
    assert plan.thresholds == (point.config.threshold,) * plan.num_steps and plan.residual_order == 1


def test_a_point_that_fits_only_on_average_is_not_chosen():
    # 10 + 4 * 12 + 12 = 70 ms on average, but 10 + 6 * 12 + 8 = 90 ms on one observation in ten.
    varied = _point(10, 10, 0.25, 0.03, 0, 4, 12, pairs_p90=6)
    assert varied.predicted_ms(PAIRED) == pytest.approx(70.0) and varied.predicted_p90_ms(PAIRED) == pytest.approx(90.0)
    frontier = (FRONTIER[0], varied, *FRONTIER[2:])
    assert plan_on_frontier(80.0, frontier, PAIRED).setting == FRONTIER[3].config.name  # nor does 82 ms
    assert plan_on_frontier(85.0, frontier, PAIRED).setting == FRONTIER[2].config.name
    assert plan_on_frontier(90.0, frontier, PAIRED).setting == varied.config.name


def test_the_frontier_planner_falls_back_to_the_cheapest_point():
    plan = plan_on_frontier(30.0, FRONTIER, PAIRED)
    assert plan.setting == FRONTIER[4].config.name and not plan.fits and not plan.feasible
    assert plan.fallbacks == ("no_point_fits",) and plan.predicted_ms == pytest.approx(44.0)


def test_the_frontier_planner_keeps_the_guidance_interval():
    plan = plan_on_frontier(200.0, FRONTIER, PAIRED, guided=lambda n: range(2, n - 2))
    assert plan.uncond_steps == range(2, 8) and plan.calls == 16


def test_the_session_own_counts_replace_the_calibration_sets_once_it_has_run_a_point():
    varied = _point(10, 10, 0.25, 0.03, 0, 4, 12, pairs_p90=6)  # 90 ms at the calibration set's p90
    frontier = (FRONTIER[0], varied, *FRONTIER[2:])
    history = SessionHistory()
    assert plan_on_frontier(80.0, frontier, PAIRED, history=history).setting == FRONTIER[3].config.name  # not run
    structure = (varied.config.num_steps, varied.config.cfg_steps)
    history.observe(varied.config.name, structure, 8)  # this robot's scene: the gate wanted 8 calls, 4 pairs
    plan = plan_on_frontier(80.0, frontier, PAIRED, history=history)
    assert plan.setting == varied.config.name and plan.predicted_ms == pytest.approx(70.0)  # 10 + 4 * 12 + 12
    assert plan.expected_full_calls == 8 and plan.expected_error == varied.error  # errors stay the profile's
    history.observe(varied.config.name, structure, 16)  # a scene where it wants 16: 10 + 8 * 12 + 4 = 110 ms
    assert plan_on_frontier(100.0, frontier, PAIRED, history=history,
                            config=PlannerConfig(frontier_count_quantile=0.9)).setting == FRONTIER[2].config.name
    assert plan_on_frontier(100.0, frontier, PAIRED, history=history).setting == varied.config.name  # the median: 12


def test_ticks_whose_gate_wants_more_than_planned_price_the_cuts_they_take():
    """The plan fits the session's median count; the ticks that want more are cut as slower ones are."""
    harsh = Cut(fraction=0.8, error=0.2), Cut(fraction=0.5, error=0.3)
    varied = _point(10, 10, 0.25, 0.03, 0, 4, 12, pairs_p90=6).model_copy(update={"cuts": harsh})
    frontier = (FRONTIER[0], varied, *FRONTIER[2:])
    structure = (varied.config.num_steps, varied.config.cfg_steps)
    steady = SessionHistory()
    for _ in range(5):
        steady.observe(varied.config.name, structure, 8)  # 70 ms, 60 of them in the step loop
    plan = plan_on_frontier(80.0, frontier, PAIRED, history=steady)
    assert plan.setting == varied.config.name and plan.expected_error == pytest.approx(0.03)
    spread = SessionHistory()
    for count in (8, 16, 8, 16, 8):  # the median still 8, but two ticks in five want 16: a 100 ms step loop
        spread.observe(varied.config.name, structure, count)
    # Those two get 70% of the time they need: 0.2 + 0.1 / 3 each, so 0.111 on average, more than FRONTIER[3].
    plan = plan_on_frontier(80.0, frontier, PAIRED, history=spread)
    assert plan.setting == FRONTIER[3].config.name and plan.expected_error == pytest.approx(0.09)
    assert plan_on_frontier(200.0, frontier, PAIRED, history=spread).setting == FRONTIER[0].config.name


def test_a_point_runs_its_wanted_calls_alone_and_in_pairs_as_on_the_calibration_set():
    point = _point(6, 3, 0.25, 0.09, 1, 2, 7)  # 5 full calls of 12: 1 alone, 2 pairs
    assert point.predicted_at_ms(PAIRED, 5) == pytest.approx(point.predicted_ms(PAIRED))
    assert point.predicted_at_ms(PAIRED, 10) == pytest.approx(10 + 2 * 10 + 4 * 12 + 2 * 1)
    assert point.predicted_at_ms(PAIRED, 40) == point.predicted_at_ms(PAIRED, point.calls)  # no more than its calls


# Uncached, measured on slow ticks: 0.01 with 80% of the time its calls take, 0.06 with half.
SLOW = FRONTIER[0].model_copy(update={"cuts": (Cut(fraction=0.8, error=0.01), Cut(fraction=0.5, error=0.06))})


def test_slow_ticks_price_the_cuts_a_point_would_take_on_them():
    frontier = (SLOW, *FRONTIER[1:])
    assert plan_on_frontier(130.0, frontier, PAIRED, slowdowns=(1.0,)).setting == SLOW.config.name  # fits exactly
    plan = plan_on_frontier(130.0, frontier, PAIRED, slowdowns=(1.0, 1.25))  # the slower tick: cut to 80%
    assert plan.setting == SLOW.config.name and plan.expected_error == pytest.approx(0.005)
    # Every tick 1.6x slower: cut to 62.5% the uncached tick would err 0.039, more than 0.03 for a point that
    # still fits whole at that pace (one without measured cuts is priced at its error).
    plan = plan_on_frontier(130.0, frontier, PAIRED, slowdowns=(1.6, 1.6))
    assert plan.setting == FRONTIER[1].config.name and plan.expected_error == pytest.approx(0.03)
    assert plan.predicted_ms == pytest.approx(70.0) and plan.fits
    # With twice the time it needs, the uncached tick absorbs that slowdown whole.
    roomy = plan_on_frontier(250.0, frontier, PAIRED, slowdowns=(1.6, 1.6))
    assert roomy.setting == SLOW.config.name and roomy.expected_error == 0.0


def test_a_tick_slower_than_any_measured_is_priced_as_the_slowest():
    assert expected_error(SLOW, 1.0, (3.0,)) == pytest.approx(0.06)  # a third of its time, priced at half
    assert expected_error(SLOW, 2.0, (2.5,)) == pytest.approx(0.01)  # slack 2: 80% of what 2.5x needs
    assert expected_error(FRONTIER[1], 1.0, (2.0,)) == FRONTIER[1].error  # no cuts measured
