"""Quality profile: the frontier kept, the JSON round trip, and profiles that must not be used."""

import json
import math

import pytest

from policy_server.budget.profile import (
    Calibration,
    Cut,
    ProfileError,
    ProfilePoint,
    QualityProfile,
    TickConfig,
    frontier,
)

DIGEST = "ab" * 32


def _point(steps, error, full, pairs, skipped, threshold=0.0):
    config = TickConfig(num_steps=steps, cfg_steps=steps, threshold=threshold, cap=2, residual_order=1)
    return ProfilePoint(config=config, error=error, error_p90=2 * error, full_calls=full, pairs=pairs,
                        skipped_calls=skipped, full_calls_p90=full, pairs_p90=pairs)


def _profile(points, digest=DIGEST):
    default = TickConfig(num_steps=20, cfg_steps=20, threshold=0.0, cap=0, residual_order=1)
    return QualityProfile(digest=digest, default=default, embodiments={"pusht": tuple(points)},
                          calibration=Calibration(observations=4, source="test", seconds=1.5))


def test_the_frontier_drops_only_what_another_point_beats_on_every_count():
    uncached = _point(20, 0.0, 0, 20, 0)
    cached = _point(20, 0.05, 0, 6, 28, threshold=0.25)
    fewer = _point(10, 0.08, 0, 10, 0)
    worse = _point(10, 0.09, 0, 10, 0, threshold=0.1)  # no cheaper than `fewer` in any count, and worse
    fewer_skips = _point(8, 0.30, 0, 8, 0)
    assert frontier([worse, fewer_skips, cached, uncached, fewer]) == (uncached, cached, fewer, fewer_skips)
    assert not fewer.dominates(fewer) and fewer.dominates(worse)


def test_a_point_on_slow_ticks_errs_as_its_measured_cuts_say():
    point = _point(20, 0.02, 0, 20, 0).model_copy(update={"cuts": (Cut(fraction=0.8, error=0.04),
                                                                    Cut(fraction=0.4, error=0.2))})
    assert point.error_at(1.0) == point.error_at(1.7) == 0.02  # all the time its calls take
    assert point.error_at(0.9) == pytest.approx(0.03) and point.error_at(0.8) == pytest.approx(0.04)
    assert point.error_at(0.6) == pytest.approx(0.12) and point.error_at(0.4) == pytest.approx(0.2)
    assert point.error_at(0.3) == pytest.approx(0.2)  # slower than any measured: priced as the slowest
    assert _point(20, 0.02, 0, 20, 0).error_at(0.5) == 0.02  # no slow tick measured: its error


def test_a_profile_round_trips_through_its_file(tmp_path):
    cut = _point(20, 0.0, 0, 20, 0).model_copy(update={"cuts": (Cut(fraction=0.6, error=0.03),)})
    profile = _profile([cut, _point(10, 0.1, 1, 4, 11, threshold=0.5)])
    path = tmp_path / "profiles" / "quality_profile.json"
    profile.save(path)
    assert QualityProfile.load(path, DIGEST) == profile
    assert profile.embodiments["pusht"][1].config.name == "n10-cfg10-t0.5-c2-o1"


def test_a_profile_of_other_weights_is_rejected(tmp_path):
    path = tmp_path / "quality_profile.json"
    _profile([_point(20, 0.0, 0, 20, 0)], digest="cd" * 32).save(path)
    with pytest.raises(ProfileError, match="measured on weights cdcdcdcdcdcd, not these .abababababab.; recalibrate"):
        QualityProfile.load(path, DIGEST)


def test_a_profile_of_a_checkpoint_guided_on_some_steps_loads(tmp_path):
    """Its ticks make a second call only on the steps inside the guidance interval: 5 of 20 here, 25 calls."""
    profile = _profile([_point(20, 0.0, 15, 5, 0)])
    profile.save(tmp_path / "quality_profile.json")
    assert QualityProfile.load(tmp_path / "quality_profile.json", DIGEST) == profile


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(version=7), "version 7; expected 3"),
    (lambda d: d["embodiments"]["pusht"][0].update(error=-1.0), r"embodiments\.pusht\.0\.error: Input should be"),
    (lambda d: d["embodiments"]["pusht"][0]["config"].update(num_steps=0), r"config\.num_steps"),
    (lambda d: d.update(extra=1), "extra: Extra inputs are not permitted"),
    (lambda d: d["embodiments"].update(pusht=[]), "embodiments.pusht: no configurations"),
    (lambda d: d["embodiments"]["pusht"][0].update(cuts=[{"fraction": 0.5, "error": 0.1},
                                                         {"fraction": 0.8, "error": 0.05}]),
     r"embodiments\.pusht\.0\.cuts: Value error, cut fractions must decrease, got \[0.5, 0.8\]"),
    (lambda d: d["embodiments"]["pusht"][0].update(cuts=[{"fraction": 1.0, "error": 0.1}]),
     r"cuts\.0\.fraction: Input should be less than 1"),
    # Both loaded: the infinite pair count made predicted_at_ms NaN.
    (lambda d: d["embodiments"]["pusht"][0].update(pairs=math.inf), r"embodiments\.pusht\.0\.pairs: Input should be a "
                                                                    "finite number"),
    (lambda d: d["embodiments"]["pusht"][0]["config"].update(cfg_steps=999),
     r"embodiments\.pusht\.0\.config: Value error, cfg_steps 999 is more than num_steps 20"),
    # Both loaded: the server ran 50-step ticks on a 20-step model, and planned a tick on fewer calls than it ran.
    (lambda d: d["embodiments"]["pusht"][0]["config"].update(num_steps=50),
     r"embodiments\.pusht\.0\.config: 50 sampler steps, 20 guided; more than the default's 20, 20 guided"),
    (lambda d: d["embodiments"]["pusht"][0].update(pairs=25),
     r"embodiments\.pusht\.0: 50 calls \(full_calls \+ 2 pairs \+ skipped_calls\); expected 20 to 40 for its config"),
    (lambda d: d["embodiments"]["pusht"][0].update(pairs=5),
     r"embodiments\.pusht\.0: 10 calls \(full_calls \+ 2 pairs \+ skipped_calls\); expected 20 to 40 for its config"),
])
def test_a_bad_profile_names_what_is_wrong(tmp_path, edit, message):
    path = tmp_path / "quality_profile.json"
    data = json.loads(_profile([_point(20, 0.0, 0, 20, 0)]).model_dump_json())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message):
        QualityProfile.load(path, DIGEST)


def test_an_unreadable_profile_names_its_file(tmp_path):
    path = tmp_path / "quality_profile.json"
    for content, fault in ((b"{not json", "not valid JSON"), (b"\x90\xff binary", "byte 0 is not UTF-8"),
                           (b"[1, 2]", r"expected a JSON object .* got \[1, 2\]"),  # not "version 'list'"
                           (b"null", "expected a JSON object .* got null")):
        path.write_bytes(content)
        with pytest.raises(ProfileError, match=f"quality_profile.json: {fault}"):
            QualityProfile.load(path, DIGEST)


def test_points_that_measured_alike_count_once():
    uncached = _point(10, 0.05, 0, 10, 0)
    unreached = _point(10, 0.05, 0, 10, 0, threshold=0.1)  # the gate never skipped: the same tick
    assert frontier([uncached, unreached]) == (uncached,)


def test_a_profile_says_what_it_was_calibrated_on_in_words():
    """It said "calibrated on 1 observations" (a one-observation calibrate, README's smallest)."""
    assert Calibration(observations=1, source="a", seconds=1).describe() == "calibrated on 1 observation of a"
    assert Calibration(observations=4, source="a", seconds=1).describe() == "calibrated on 4 observations of a"
