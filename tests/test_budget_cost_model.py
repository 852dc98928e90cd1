"""Cost model: one sample per tick per cost, medians over a window, per shape key."""

from __future__ import annotations

import math

import pytest

from policy_server.budget.cost_model import FULL, PAIR, SKIP, CallCosts, CostModel, WindowStat


def test_window_stat_is_the_median_and_median_absolute_deviation():
    stat = WindowStat(window=5)
    for value in (10.0, 12.0, 11.0, 30.0, 9.0):
        stat.update(value)
    assert stat.samples == 5
    assert stat.median == 11.0
    assert stat.deviation == 1.0  # |10-11|, |12-11|, 0, 19, 2 -> median 1
    for value in (50.0, 50.0, 50.0):  # a lasting change takes over once it fills half the window
        stat.update(value)
    assert stat.samples == 5 and stat.median == 50.0


def test_each_tick_is_one_sample_of_each_cost():
    model = CostModel(window=8)
    key, other = ("pusht", 9, 32), ("pusht", 17, 32)
    model.observe_tick(key, [(FULL, 10.0), (SKIP, 2.0), (FULL, 14.0), (FULL, 11.0)], {"encode": 3.0})
    assert model.samples(key) == {"full": 1, "pair": 0, "skip": 1, "encode": 1}
    assert not model.is_warm(other) and model.samples(other) == {"full": 0, "pair": 0, "skip": 0}
    costs = model.costs(key)
    assert (costs.full_ms, costs.skip_ms, costs.fixed_ms) == (11.0, 2.0, {"encode": 3.0})
    with pytest.raises(LookupError, match="warmup"):
        model.costs(other)
    model.observe_tick(other, [(FULL, 7.0)])  # no skip seen yet: a skip is not counted on to save time
    assert model.costs(other).skip_ms == 7.0
    assert model.costs(other).pair_ms == 14.0  # no pair seen yet: nor is batching


def test_pairs_are_their_own_cost_and_bound_what_was_not_seen():
    model = CostModel(window=8)
    model.observe_tick("k", [(PAIR, 12.0), (PAIR, 13.0), (SKIP, 2.0)])
    assert model.is_warm("k")
    costs = model.costs("k")
    # A call alone costs at most what a pair of them does, until one is seen.
    assert (costs.pair_ms, costs.full_ms, costs.skip_ms) == (12.5, 12.5, 2.0)
    model.observe_tick("k", [(FULL, 7.0), (PAIR, 12.5)])
    costs = model.costs("k")
    assert (costs.full_ms, costs.pair_ms, costs.pair_saving_ms) == (7.0, 12.5, 1.5)
    assert costs.cautious(1.0).pair_ms == 12.5 + costs.pair_dev_ms
    with pytest.raises(ValueError, match="call kind"):
        model.observe_tick("k", [("both", 3.0)])


def test_one_slow_tick_does_not_move_the_estimates():
    model = CostModel(window=16)
    key = ("pusht", 9, 32)
    for _ in range(10):
        model.observe_tick(key, [(FULL, 10.0)] * 4 + [(SKIP, 2.0)] * 4, {"prefill": 3.0})
    before = model.costs(key)
    model.observe_tick(key, [(FULL, 900.0)] * 40 + [(SKIP, 400.0)] * 4, {"prefill": 900.0})
    after = model.costs(key)
    assert (after.full_ms, after.skip_ms, after.fixed_ms["prefill"]) == (before.full_ms, before.skip_ms, 3.0)
    assert after.full_dev_ms == before.full_dev_ms == 0.0


def test_the_background_reserve_follows_a_lasting_change_in_the_speed_of_the_ticks():
    """The longest background piece, timed with the ticks of some shapes, is scaled by how much slower or faster
    than those ticks' costs later ticks of those shapes run (each tick's calls weighed by their costs): a lasting
    change moves it once it fills half the window, one tick does not, and ticks of other shapes say nothing."""
    model = CostModel(window=4)
    timed, other = ("pusht", 9, 32), ("pusht", 3, 32)
    for key in (timed, other):
        model.observe_tick(key, [(FULL, 10.0), (SKIP, 2.0), (PAIR, 16.0)])
    assert model.background_ms == 0.0  # not timed yet
    model.time_background(5.0, [timed])
    assert model.background_ms == 5.0
    slow = [(FULL, 30.0), (SKIP, 6.0), (SKIP, 6.0), (PAIR, 48.0)]  # every call three times slower
    model.observe_tick(timed, slow)
    for _ in range(4):
        model.observe_tick(other, slow)  # not timed with the pieces: no reference
    assert model.background_ms == 5.0
    model.observe_tick(timed, slow)
    assert model.background_ms == pytest.approx(10.0)  # the median of 1, 1, 3, 3
    model.observe_tick(timed, slow)
    assert model.background_ms == pytest.approx(15.0)
    for _ in range(3):  # the pair back at its cost, the rest as slow: (30 + 6 + 16) / (10 + 2 + 16)
        model.observe_tick(timed, [(FULL, 30.0), (SKIP, 6.0), (PAIR, 16.0)])
    assert model.background_ms == pytest.approx(5.0 * 52.0 / 28.0)


def _timed(key: str, full_ms: float) -> CostModel:
    """What a retiming measures: a model that saw one tick of ``key``, its full call ``full_ms``."""
    fresh = CostModel(window=4)
    fresh.observe_tick(key, [(FULL, full_ms)])
    return fresh


def test_timing_the_background_piece_again_keeps_the_lower_reserve():
    """A busy moment while the pieces are timed again raises nothing; a quiet one lowers the reserve to what it
    timed, and later ticks move it from there. Was: rebased on the slowdown of the sessions before the retiming (it
    runs with none open), so quiet ticks after it took the reserve to a third of the piece."""
    model = CostModel(window=4)
    model.observe_tick("k", [(FULL, 10.0)])
    model.time_background(10.0, ["k"])
    for _ in range(3):
        model.observe_tick("k", [(FULL, 30.0)])  # the last sessions ran 3x slower
    assert model.background_ms == pytest.approx(30.0)
    model.lower_background(40.0, "k", _timed("k", 40.0))  # timed in a busy moment
    assert model.background_ms == pytest.approx(30.0)
    model.lower_background(10.0, "k", _timed("k", 10.0))  # timed on a quiet machine
    assert model.background_ms == pytest.approx(10.0)
    for _ in range(4):
        model.observe_tick("k", [(FULL, 10.0)])  # quiet ticks
    assert model.background_ms == pytest.approx(10.0)
    for _ in range(3):
        model.observe_tick("k", [(FULL, 30.0)])  # a lasting slowdown
    assert model.background_ms == pytest.approx(30.0)


def test_cautious_costs_add_deviations_and_a_stage_can_be_left_out():
    costs = CallCosts(full_ms=10.0, skip_ms=2.0, fixed_ms={"decode": 4.0, "prefill": 5.0}, full_dev_ms=1.0,
                      skip_dev_ms=0.5, fixed_dev_ms={"decode": 2.0})
    c = costs.cautious(2.0)
    assert (c.full_ms, c.skip_ms, c.fixed_ms["decode"], c.fixed_ms["prefill"]) == (12.0, 3.0, 8.0, 5.0)
    assert c.pair_ms == 24.0  # two calls alone, each raised
    assert costs.cautious(0.0).full_ms == 10.0
    reused = costs.without("prefill")
    assert reused.fixed_ms == {"decode": 4.0} and reused.fixed_total_ms == 4.0


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "3"])
def test_bad_durations_are_rejected(bad):
    model = CostModel()
    with pytest.raises(ValueError, match="duration"):
        model.observe_tick("k", [(FULL, bad)])
    with pytest.raises(ValueError, match="decode"):
        model.observe_tick("k", [], {"decode": bad})


def test_bad_parameters_are_rejected():
    with pytest.raises(ValueError, match="window"):
        CostModel(window=0)
    with pytest.raises(ValueError, match="stage"):
        CostModel().observe_tick("k", [], {"": 1.0})
