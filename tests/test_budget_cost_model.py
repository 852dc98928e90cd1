"""Online cost model: EWMA means and deviations per request shape, warmness, validation."""

import math

import pytest

from policy_server.budget.cost_model import CallCosts, CostModel, Ewma


def test_ewma_first_sample_then_weighted_updates():
    e = Ewma(alpha=0.25)
    e.update(8.0)
    assert (e.mean, e.deviation, e.samples) == (8.0, 0.0, 1)
    e.update(12.0)
    assert e.mean == pytest.approx(9.0)  # 8 + 0.25 * 4
    assert e.deviation == pytest.approx(1.0)  # 0 + 0.25 * (4 - 0)
    e.update(9.0)
    assert e.mean == pytest.approx(9.0)
    assert e.deviation == pytest.approx(0.75)
    assert e.upper(2.0) == pytest.approx(10.5)


def test_ewma_tracks_a_step_change():
    e = Ewma(alpha=0.2)
    for _ in range(5):
        e.update(10.0)
    for _ in range(30):
        e.update(20.0)
    assert e.mean == pytest.approx(20.0, abs=0.02)


def test_costs_per_shape_key_and_warmness():
    model = CostModel(alpha=0.5, warm_samples=2)
    key, other = ("pusht", 96, 96, 2), ("pusht", 64, 64, 2)
    with pytest.raises(LookupError, match="warmup"):
        model.costs(key)
    model.observe_calls(key, [(True, 10.0), (False, 2.0), (True, 14.0)])
    assert not model.is_warm(key)
    model.observe_skip(key, 4.0)
    assert model.is_warm(key) and not model.is_warm(other)
    model.observe_stage(key, "encode", 3.0)
    model.observe_stage(key, "decode", 5.0)
    costs = model.costs(key)
    assert costs.full_ms == pytest.approx(12.0)
    assert costs.skip_ms == pytest.approx(3.0)
    assert costs.fixed_ms == {"encode": 3.0, "decode": 5.0}
    assert costs.fixed_total_ms == 8.0
    assert (costs.full_samples, costs.skip_samples) == (2, 2)
    assert model.samples(key) == {"full": 2, "skip": 2, "encode": 1, "decode": 1}
    assert model.samples(other) == {"full": 0, "skip": 0}
    with pytest.raises(LookupError):
        model.costs(other)


def test_cautious_costs_add_deviations():
    costs = CallCosts(full_ms=10.0, skip_ms=2.0, fixed_ms={"decode": 4.0}, full_dev_ms=1.0, skip_dev_ms=0.5,
                      fixed_dev_ms={"decode": 2.0})
    c = costs.cautious(2.0)
    assert (c.full_ms, c.skip_ms, c.fixed_ms["decode"]) == (12.0, 3.0, 8.0)
    assert costs.cautious(0.0).full_ms == 10.0


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "3"])
def test_bad_durations_are_rejected(bad):
    model = CostModel()
    with pytest.raises(ValueError, match="duration"):
        model.observe_full("k", bad)
    with pytest.raises(ValueError, match="duration"):
        model.observe_stage("k", "decode", bad)


def test_bad_parameters_are_rejected():
    with pytest.raises(ValueError, match="alpha"):
        CostModel(alpha=0.0)
    with pytest.raises(ValueError, match="warm_samples"):
        CostModel(warm_samples=0)
    with pytest.raises(ValueError, match="stage"):
        CostModel().observe_stage("k", "", 1.0)
