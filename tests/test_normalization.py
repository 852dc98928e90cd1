"""Action/state normalisers: formulas, exact round trips, clipping and stats-file errors."""

import json

import numpy as np
import pytest
import torch

from policy_server.pipeline.normalization import (
    NormalizationSpec,
    NormalizationStatsError,
    build_normalizers,
    load_stats,
    make_normalizer,
    parse_stats,
)

STATS = {
    "action": {
        "min": [-2.0, 0.0, 10.0],
        "max": [2.0, 1.0, 30.0],
        "mean": [0.5, 0.25, 20.0],
        "std": [1.0, 0.5, 4.0],
        "q01": [-1.0, 0.1, 12.0],
        "q99": [1.0, 0.9, 28.0],
    },
    "state": {"min": [0.0, -1.0], "max": [4.0, 1.0], "q01": [0.5, -0.5], "q99": [3.5, 0.5]},
}


@pytest.fixture
def stats_file(tmp_path):
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(STATS))
    return path


def test_minmax_maps_range_to_unit_interval(stats_file):
    norm = make_normalizer("minmax", load_stats(stats_file)["action"], 3)
    x = np.array([[-2.0, 0.0, 10.0], [2.0, 1.0, 30.0], [0.0, 0.5, 20.0]])
    np.testing.assert_allclose(norm.normalize(x), [[-1, -1, -1], [1, 1, 1], [0, 0, 0]], atol=1e-7)


def test_meanstd_formula(stats_file):
    norm = make_normalizer("meanstd", load_stats(stats_file)["action"], 3)
    x = np.array([1.5, 1.25, 28.0])
    np.testing.assert_allclose(norm.normalize(x), [1.0, 2.0, 2.0], rtol=1e-6)


def test_quantile_maps_and_clips_both_ways(stats_file):
    norm = make_normalizer("quantile", load_stats(stats_file)["action"], 3)
    x = np.array([[-1.0, 0.1, 12.0], [1.0, 0.9, 28.0], [5.0, -3.0, 20.0]])
    np.testing.assert_allclose(norm.normalize(x), [[-1, -1, -1], [1, 1, 1], [1, -1, 0]], atol=1e-7)
    # generated values past ±1 come back at the quantile bounds
    out = norm.denormalize(np.array([3.0, -7.0, 0.0]))
    np.testing.assert_allclose(out, [1.0, 0.1, 20.0], atol=1e-6)


@pytest.mark.parametrize("method", ["minmax", "meanstd", "quantile", "none"])
@pytest.mark.parametrize("as_torch", [False, True])
def test_round_trip(stats_file, method, as_torch):
    norm = make_normalizer(method, load_stats(stats_file)["action"], 3)
    rng = np.random.default_rng(0)
    # inside the quantile bounds so clipping does not apply
    x = rng.uniform([-1.0, 0.1, 12.0], [1.0, 0.9, 28.0], size=(16, 3)).astype(np.float32)
    if as_torch:
        x = torch.from_numpy(x)
    back = norm.denormalize(norm.normalize(x))
    assert type(back) is type(x) and back.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), atol=1e-5)
    z = rng.uniform(-1, 1, size=(4, 3)).astype(np.float32)
    np.testing.assert_allclose(norm.normalize(norm.denormalize(z)), z, atol=1e-5)


def test_constant_channel_stays_finite():
    stats = parse_stats({"action": {"min": [1.0, 0.0], "max": [1.0, 2.0]}})
    norm = make_normalizer("minmax", stats["action"], 2)
    y = norm.normalize(np.array([1.0, 1.0]))
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(norm.denormalize(y), [1.0, 1.0])


def test_passthrough_channels_are_untouched(stats_file):
    norm = make_normalizer("quantile", load_stats(stats_file)["action"], 3, passthrough=(1,))
    x = np.array([0.0, 5.0, 20.0])
    y = norm.normalize(x)
    assert y[1] == 5.0  # neither scaled nor clipped
    np.testing.assert_allclose(norm.denormalize(y), x)


def test_build_normalizers_for_action_and_state(stats_file):
    spec = NormalizationSpec(method="minmax", stats_path=stats_file)
    norms = build_normalizers(spec, action_dim=3, state_dim=2)
    np.testing.assert_allclose(norms.state.normalize(np.array([4.0, 0.0])), [1.0, 0.0], atol=1e-7)
    assert norms.action.dim == 3
    assert build_normalizers(spec, action_dim=3, state_dim=0).state is None
    identity = build_normalizers(NormalizationSpec(), action_dim=2, state_dim=1)
    assert np.array_equal(identity.action.denormalize(np.array([3.0, -4.0])), [3.0, -4.0])


def test_torch_keeps_device_and_dtype(stats_file):
    norm = make_normalizer("meanstd", load_stats(stats_file)["action"], 3)
    x = torch.zeros(2, 3, dtype=torch.float64)
    y = norm.normalize(x)
    assert y.dtype == torch.float64 and y.device == x.device


def test_wrong_width_names_key_and_expected(stats_file):
    norm = make_normalizer("minmax", load_stats(stats_file)["action"], 3)
    with pytest.raises(ValueError, match=r"'action'.*last dimension of 3"):
        norm.normalize(np.zeros((4, 2)))


def test_stats_length_mismatch_names_field(stats_file):
    with pytest.raises(NormalizationStatsError, match=r"action\.min has 3 values; expected 4"):
        make_normalizer("minmax", load_stats(stats_file)["action"], 4)


def test_missing_stat_names_field_and_method(stats_file):
    with pytest.raises(NormalizationStatsError, match=r"'state' has no 'mean' array; method 'meanstd'"):
        make_normalizer("meanstd", load_stats(stats_file)["state"], 2)


def test_missing_feature_names_it(stats_file):
    spec = NormalizationSpec(method="minmax", stats_path=stats_file, state_key="proprio")
    with pytest.raises(NormalizationStatsError, match=r"no feature 'proprio'; present: action, state"):
        build_normalizers(spec, action_dim=3, state_dim=2)


@pytest.mark.parametrize(
    "data,match",
    [
        ({"action": {"min": [0.0, 1.0], "max": [1.0]}}, "differ in length"),
        ({"action": {"min": [0.0, float("nan")]}}, r"action\.min must be a non-empty list of finite"),
        ({"action": {"median": [0.0]}}, "unknown field 'median'"),
        ({"action": [1, 2]}, "feature 'action' must be an object"),
        ([], "non-empty JSON object"),
    ],
)
def test_malformed_stats(data, match):
    with pytest.raises(NormalizationStatsError, match=match):
        parse_stats(data)


def test_unreadable_files(tmp_path):
    with pytest.raises(NormalizationStatsError, match="missing.json: cannot read"):
        load_stats(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(NormalizationStatsError, match="not valid JSON"):
        load_stats(bad)
    with pytest.raises(NormalizationStatsError, match="needs a stats_path"):
        build_normalizers(NormalizationSpec(method="quantile"), action_dim=2, state_dim=0)
    with pytest.raises(NormalizationStatsError, match="unknown normalisation method 'zscore'"):
        make_normalizer("zscore", None, 2)


def test_inverted_bounds_rejected():
    stats = parse_stats({"action": {"q01": [1.0], "q99": [0.0]}})
    with pytest.raises(NormalizationStatsError, match="upper < lower"):
        make_normalizer("quantile", stats["action"], 1)


def test_a_lerobot_stats_file_serves_as_it_is(tmp_path):
    """A LeRobot dataset's meta/stats.json (count and q10/q50/q90 besides, images as [3, 1, 1], index columns) was
    refused: "feature 'observation.state' has unknown field 'count'". Only the features normalised are read."""
    def lerobot(stats: dict) -> dict:
        width = len(stats["min"])
        return {"count": [120], **stats, **{q: [0.0] * width for q in ("q10", "q50", "q90")}}
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({
        "action": lerobot(STATS["action"]),
        "observation.state": lerobot(STATS["state"]),
        "observation.images.wrist": {"count": [120], "min": [[[0.0]], [[0.0]], [[0.0]]], "max": [[[1.0]]] * 3},
        "timestamp": {"count": [120], "min": [0.0], "max": [7.9]},
    }))
    spec = NormalizationSpec(method="quantile", stats_path=path, state_key="observation.state")
    got = build_normalizers(spec, action_dim=3, state_dim=2)
    plain = parse_stats(STATS)
    for norm, expected in ((got.action, plain["action"]), (got.state, plain["state"])):
        reference = make_normalizer("quantile", expected, expected.dim)
        assert np.array_equal(norm.offset, reference.offset) and np.array_equal(norm.scale, reference.scale)
