"""Embodiment registry: Cosmos3 seed, config files, typed errors and request checks."""

import json

import numpy as np
import pytest

from policy_server.pipeline.embodiments import (
    MAX_ACTION_DIM,
    Embodiment,
    EmbodimentConfigError,
    EmbodimentRegistry,
    load_registry,
)
from policy_server.pipeline.errors import (
    InvalidActions,
    InvalidChunkSize,
    InvalidState,
    PolicyInputError,
    UnregisteredEmbodiment,
)
from policy_server.pipeline.normalization import NormalizationSpec, build_normalizers


def spec_of(embodiment, canvas_hw=(64, 64), min_side=8):
    """`to_spec` with the model's own space as the normalisation (what the seed's embodiments use)."""
    identity = build_normalizers(NormalizationSpec(), embodiment.raw_action_dim, embodiment.state_dim)
    return embodiment.to_spec(canvas_hw, min_side, identity)


def test_seed_matches_the_reference_tables():
    omni = pytest.importorskip("diffusers.pipelines.cosmos.pipeline_cosmos3_omni")
    registry = EmbodimentRegistry.cosmos3()
    domain_ids = {name: i for name, i in omni._EMBODIMENT_TO_DOMAIN_ID.items() if name != "no_action"}
    assert {e.name: e.domain_id for e in registry} == domain_ids
    for name, width in omni._EMBODIMENT_TO_RAW_ACTION_DIM.items():
        assert registry.get(name).raw_action_dim == width
    assert registry.get("libero").raw_action_dim == 10  # the LIBERO recipe's Δpos + rot6d + gripper


def test_seeded_fields():
    registry = EmbodimentRegistry.cosmos3()
    pusht = registry.get("pusht")
    assert (pusht.domain_id, pusht.raw_action_dim, pusht.action_names) == (4, 2, ("x", "y"))
    assert pusht.state_dim == 0 and pusht.normalization.method == "none"
    droid = registry.get("droid_lerobot")
    assert (droid.fps, droid.default_chunk_size, droid.viewpoint) == (15.0, 32, "concat_view")
    hand = registry.get("hand_pose")
    assert len(hand.action_names) == len(set(hand.action_names)) == 57
    assert registry.get("galbot").action_names[0] == "a0"
    assert all(e.raw_action_dim <= MAX_ACTION_DIM and 0 <= e.domain_id < 32 for e in registry)


def test_unknown_embodiment_names_the_known_ones():
    registry = EmbodimentRegistry.cosmos3()
    with pytest.raises(UnregisteredEmbodiment) as info:
        registry.get("ur5e")
    err = info.value
    assert isinstance(err, PolicyInputError) and isinstance(err, ValueError)
    assert err.field == "embodiment"
    assert "'ur5e'" in str(err) and "pusht" in str(err) and "droid_lerobot" in str(err)
    assert "ur5e" not in registry and "pusht" in registry


def write(tmp_path, data, name="embodiments.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_config_adds_and_overrides(tmp_path):
    (tmp_path / "stats").mkdir()
    (tmp_path / "stats" / "pusht.json").write_text(
        json.dumps({
            "action": {"min": [-0.2, -0.2], "max": [0.2, 0.2]},
            "state": {"min": [0, 0], "max": [0.5, 0.5]},
        })
    )
    path = write(tmp_path, {"embodiments": [
        {"name": "pusht", "fps": 10, "state_dim": 2, "action_units": ["m/s", "m/s"],
         "action_low": [-0.2, -0.2], "action_high": [0.2, 0.2],
         "normalization": {"method": "minmax", "stats_path": "stats/pusht.json"}},
        {"name": "my_arm", "domain_id": 21, "raw_action_dim": 7, "viewpoint": "concat_view",
         "cameras": ["wrist", "front"]},
    ]})
    registry = load_registry(path)
    pusht = registry.get("pusht")
    assert (pusht.domain_id, pusht.raw_action_dim, pusht.action_names) == (4, 2, ("x", "y"))  # inherited
    assert (pusht.fps, pusht.state_dim, pusht.action_units) == (10.0, 2, ("m/s", "m/s"))
    assert pusht.normalization.stats_path == tmp_path / "stats" / "pusht.json"
    norms = pusht.load_normalizers()
    np.testing.assert_allclose(norms.action.normalize(np.array([0.2, -0.2])), [1.0, -1.0], atol=1e-6)
    np.testing.assert_allclose(norms.state.normalize(np.array([0.25, 0.0])), [0.0, -1.0], atol=1e-6)
    arm = registry.get("my_arm")
    assert arm.action_names == tuple(f"a{i}" for i in range(7)) and arm.viewpoint == "concat_view"
    assert arm.cameras == ("wrist", "front") and pusht.cameras == ("image",)
    # the default seed is untouched by loading into another registry
    assert EmbodimentRegistry.cosmos3().get("pusht").fps == 24.0


def test_width_change_drops_inherited_labels(tmp_path):
    registry = EmbodimentRegistry.cosmos3()
    registry.load_config(write(tmp_path, {"embodiments": [{"name": "pusht", "raw_action_dim": 3}]}))
    assert registry.get("pusht").action_names == ("a0", "a1", "a2")
    # new cameras drop the inherited camera sizes (back to the canvas share) rather than fail on them
    registry.load_config(write(tmp_path, {"embodiments": [{"name": "pusht", "camera_sizes": {"image": [48, 64]}}]}))
    registry.load_config(write(tmp_path, {"embodiments": [{"name": "pusht", "cameras": ["scene", "wrist"]}]}))
    assert registry.get("pusht").camera_sizes is None


def test_units_default_to_normalized_only_where_actions_stay_normalised(tmp_path):
    """Without stats (Cosmos3's seed, a diffusers folder) actions and state are in the model's normalised space;
    with stats they are de-normalised into the units of the data the stats came from, which only a declaration
    names: undeclared, ServerInfo claims no unit (empty, as for an embodiment without labels)."""
    registry = EmbodimentRegistry.cosmos3()
    seeded = spec_of(registry.get("bridge_orig_lerobot"))
    assert seeded.action.units == ("normalized",) * 10
    stats = {"method": "minmax", "stats_path": "stats.json"}
    registry.load_config(write(tmp_path, {"embodiments": [
        {"name": "bridge_orig_lerobot", "normalization": stats},  # stats given to a seeded embodiment
        {"name": "arm", "domain_id": 21, "raw_action_dim": 2, "state_dim": 1, "state_low": [-1.0],
         "state_high": [1.0], "normalization": stats},
        {"name": "declared", "domain_id": 22, "raw_action_dim": 2, "action_units": ["m/s", "m/s"], "state_dim": 1,
         "state_units": ["m"], "state_low": [-1.0], "state_high": [1.0], "normalization": stats},
    ]}))
    unknown = [spec_of(registry.get(name)) for name in ("bridge_orig_lerobot", "arm")]
    assert [(spec.action.units, spec.state_units) for spec in unknown] == [((), ()), ((), ())]
    declared = spec_of(registry.get("declared"))
    assert (declared.action.units, declared.state_units) == (("m/s", "m/s"), ("m",))


@pytest.mark.parametrize(
    "entry,match",
    [
        ({"name": "pusht", "raw_action_dim": 65},
         r"embodiments\[0\] \('pusht'\)\.raw_action_dim: .*less than or equal to 64"),
        ({"name": "pusht", "domain_id": 32}, r"\.domain_id: .*less than 32"),
        ({"name": "pusht", "colour": "red"}, r"\('pusht'\)\.colour: Extra inputs are not permitted"),
        ({"name": "new_bot", "raw_action_dim": 3},
         r"\('new_bot'\): not a known embodiment \(known: .*pusht.*\); a new one needs domain_id and raw_action_dim"),
        ({"name": "pusht", "action_low": [0, 0]}, "give both action_low and action_high"),
        ({"name": "pusht", "action_low": [0, 0], "action_high": [1]},
         "action_high has 1 entries; expected raw_action_dim=2"),
        ({"name": "pusht", "action_low": [1, 0], "action_high": [0, 1]},
         r"action_low > action_high or not finite for channels \[0\]"),
            ({"name": "pusht", "state_dim": 2, "state_low": [0, 0], "state_high": [1]},
             "state_high has 1 entries; expected state_dim=2"),
            ({"name": "pusht", "state_dim": 2, "state_low": [0, 0]}, "give both state_low and state_high"),
        ({"name": "pusht", "viewpoint": "top"}, "viewpoint 'top' is unknown; expected one of ego_view"),
        ({"name": "pusht", "cameras": []}, "must be distinct non-empty names"),
        ({"name": "pusht", "cameras": ["wrist", "wrist"]}, "must be distinct non-empty names"),
        ({"name": "pusht", "fps": 0}, r"\.fps: .*greater than 0"),
        ({"name": "pusht", "default_chunk_size": 80}, "default_chunk_size=80 exceeds max_chunk_size=64"),
        ({"name": "pusht", "normalization": {"method": "minmax"}}, "needs normalization.stats_path"),
        ({"name": "pusht", "normalization": {"method": "zscore", "stats_path": "s.json"}},
         "'zscore' is unknown"),
        ({"name": "pusht", "normalization": {"methd": "minmax"}}, r"normalization\.methd"),
        ({"name": "pusht", "state_dim": 4, "normalization": {"passthrough_action_channels": [3]}},
         r"passthrough_action_channels \[3\] are outside the actions' \[0, 2\)"),  # pusht has 2 actions
        ({"raw_action_dim": 2}, r"embodiments\[0\]\.name: required"),
        # numbers are not converted from strings (nor integers from floats)
        ({"name": "pusht", "raw_action_dim": "2"}, r"\('pusht'\)\.raw_action_dim: Input should be a valid integer$"),
        ({"name": "pusht", "domain_id": "4"}, r"\('pusht'\)\.domain_id: Input should be a valid integer$"),
        ({"name": "pusht", "state_dim": 2.0}, r"\('pusht'\)\.state_dim: Input should be a valid integer$"),
        ({"name": "pusht", "max_chunk_size": "8"}, r"\('pusht'\)\.max_chunk_size: Input should be a valid integer$"),
        ({"name": "pusht", "fps": "10"}, r"\('pusht'\)\.fps: Input should be a valid number$"),
        ({"name": "pusht", "action_low": ["-1", -1], "action_high": [1, 1]},
         r"\('pusht'\)\.action_low\.0: Input should be a valid number$"),
        ({"name": "pusht", "normalization": {"passthrough_action_channels": ["1"]}},
         r"passthrough_action_channels\.0: Input should be a valid integer$"),
        # camera_sizes: [height, width] px of each camera, as ServerInfo advertises them
        ({"name": "pusht", "cameras": ["scene", "wrist"], "camera_sizes": {"scene": [64, 64]}},
         r"camera_sizes names \['scene'\]; expected one \[height, width\] for each of cameras \['scene', 'wrist'\]"),
        ({"name": "pusht", "camera_sizes": {"image": [64, 64], "wrist": [64, 64]}},
         r"camera_sizes names \['image', 'wrist'\]; expected one \[height, width\] for each of cameras \['image'\]"),
        ({"name": "pusht", "camera_sizes": {"image": ["64", 64]}},
         r"\('pusht'\)\.camera_sizes\.image\.0: Input should be a valid integer$"),
    ],
)
def test_config_errors_name_the_key(tmp_path, entry, match):
    path = write(tmp_path, {"embodiments": [entry]})
    with pytest.raises(EmbodimentConfigError, match=match) as info:
        load_registry(path)
    assert str(path) in str(info.value)


def test_a_passthrough_channel_is_one_of_the_actions(tmp_path):
    entry = {"name": "pusht", "normalization": {"passthrough_action_channels": [1]}}  # pusht: 2 actions, no state
    assert load_registry(write(tmp_path, {"embodiments": [entry]})).get("pusht").normalization \
        .passthrough_action_channels == (1,)


def test_config_file_errors(tmp_path):
    with pytest.raises(EmbodimentConfigError, match="missing.json: cannot read"):
        load_registry(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[")
    with pytest.raises(EmbodimentConfigError, match="not valid JSON"):
        load_registry(bad)
    with pytest.raises(EmbodimentConfigError, match=r"\.robots: Extra inputs"):
        load_registry(write(tmp_path, {"embodiments": [], "robots": []}))
    with pytest.raises(EmbodimentConfigError, match="already registered"):
        EmbodimentRegistry.cosmos3().register(Embodiment(name="pusht", domain_id=4, raw_action_dim=2))


def test_a_bad_entry_leaves_the_registry_unchanged(tmp_path):
    registry = EmbodimentRegistry.cosmos3()
    path = write(tmp_path, {"embodiments": [{"name": "pusht", "fps": 5}, {"name": "pusht", "fps": -1}]})
    with pytest.raises(EmbodimentConfigError):
        registry.load_config(path)
    assert registry.get("pusht").fps == 24.0


def test_chunk_size_checks():
    pusht = EmbodimentRegistry.cosmos3().get("pusht")
    assert pusht.check_chunk_size(8) == 8
    assert pusht.check_chunk_size(np.int64(64)) == 64
    for bad in (0, 65, 2.0, True, "8", None):
        with pytest.raises(InvalidChunkSize, match=r"expected an integer in \[1, 64\]") as info:
            pusht.check_chunk_size(bad)
        assert info.value.field == "chunk_size"


def test_state_checks():
    arm = Embodiment(name="arm", domain_id=21, raw_action_dim=3, state_dim=2)
    np.testing.assert_array_equal(arm.check_state([1, 2]), np.array([1, 2], dtype=np.float32))
    assert arm.check_state(np.array([1.0, 2.0])).dtype == np.float32
    cases = [
        (None, "missing; embodiment 'arm' expects a finite float vector of length state_dim=2"),
        ([1.0, 2.0, 3.0], r"got shape \(3,\); expected"),
        ([[1.0, 2.0]], r"got shape \(1, 2\)"),
        ([np.nan, 1.0], r"entries \[0\] are NaN or infinite"),
        ([1.0, np.inf], r"entries \[1\] are NaN or infinite"),
        (["a", "b"], "has dtype <U1"),
    ]
    for value, match in cases:
        with pytest.raises(InvalidState, match=match) as info:
            arm.check_state(value)
        assert info.value.field == "state"
    no_state = Embodiment(name="cam", domain_id=2, raw_action_dim=9)
    assert no_state.check_state(None) is None
    with pytest.raises(InvalidState, match="takes no state"):
        no_state.check_state([0.0])


def test_to_spec_declares_one_label_per_channel():
    arm = Embodiment(name="arm", domain_id=21, raw_action_dim=2, action_units=("m/s", "m/s"),
                     action_low=(-1, -1), action_high=(1, 2), state_dim=1, state_units=("rad",),
                     state_low=(-3.0,), state_high=(3.0,), cameras=("front", "wrist"), fps=15.0,
                     default_chunk_size=4, max_chunk_size=8)
    spec = spec_of(arm, (64, 128), 16)
    assert spec.name == "arm" and spec.control_hz == 15.0
    assert (spec.default_chunk_size, spec.min_chunk_size, spec.max_chunk_size) == (4, 1, 8)
    assert [(c.name, c.height, c.width, c.min_side) for c in spec.cameras] == [("front", 64, 64, 16),
                                                                               ("wrist", 64, 64, 16)]
    assert spec.action.units == ("m/s", "m/s")  # one unit per channel, not one per character
    assert (spec.action.low, spec.action.high) == ((-1.0, -1.0), (1.0, 2.0))
    assert (spec.state_dim, spec.state_units, spec.state_low, spec.state_high) == (1, ("rad",), (-3.0,), (3.0,))
    for embodiment in EmbodimentRegistry.cosmos3():
        action = spec_of(embodiment, min_side=16).action
        assert action.dim == len(action.names) == len(action.units) == embodiment.raw_action_dim


def test_declared_camera_sizes_are_advertised_else_the_canvas_share():
    """A robot recorded (and trained) with two 64x64 cameras declares them so: ServerInfo advertises 64x64 each, not
    64x32, their share of a 64x64 canvas, to which a client sizing its frames from ServerInfo would squash them."""
    arm = Embodiment(name="arm", domain_id=21, raw_action_dim=2, cameras=("scene", "wrist"),
                     camera_sizes={"scene": (64, 64), "wrist": (48, 64)})
    spec = spec_of(arm)
    assert [(c.name, c.height, c.width, c.min_side) for c in spec.cameras] == [("scene", 64, 64, 8),
                                                                               ("wrist", 48, 64, 8)]
    assert arm.frame_sizes((64, 64)) == {"scene": (64, 64), "wrist": (48, 64)}
    undeclared = arm.model_copy(update={"camera_sizes": None})
    assert undeclared.frame_sizes((64, 64)) == {"scene": (64, 32), "wrist": (64, 32)}


def test_action_checks_and_limits():
    arm = Embodiment(name="arm", domain_id=21, raw_action_dim=2, action_low=(-1, -1), action_high=(1, 2))
    actions = arm.check_actions([[0.5, 3.0], [-2.0, 0.0]])
    assert actions.dtype == np.float32 and actions.shape == (2, 2)
    np.testing.assert_array_equal(arm.out_of_limits(actions), [[False, True], [True, False]])
    np.testing.assert_array_equal(arm.clip_to_limits(actions), [[0.5, 2.0], [-1.0, 0.0]])
    expected = r"got shape \(2, 3\); expected a finite float array \[T >= 1, 2\]"
    with pytest.raises(InvalidActions, match=expected):
        arm.check_actions(np.zeros((2, 3)))
    with pytest.raises(InvalidActions, match=r"rows \[1\] hold NaN") as info:
        arm.check_actions([[0, 0], [np.nan, 0]], field="history_actions")
    assert info.value.field == "history_actions"
    unbounded = Embodiment(name="free", domain_id=22, raw_action_dim=2)
    assert not unbounded.out_of_limits(np.full((3, 2), 1e9)).any()
    # float32 actions at a limit float32 cannot hold exactly (committed ones, as the wire takes them) are inside:
    # clipping leaves them as they are, and the record counts them as none clipped.
    pusht = Embodiment(name="p", domain_id=23, raw_action_dim=2, action_low=(-0.2, -0.2), action_high=(0.2, 0.2))
    at_limits = np.array([[-0.2, 0.2]], np.float32)
    assert np.array_equal(pusht.clip_to_limits(at_limits), at_limits)
    assert not pusht.out_of_limits(at_limits).any()
    # Given actions are accepted within the declared limits; without any, within what the model takes.
    declared, normalised = spec_of(arm).action, spec_of(unbounded).action
    assert (declared.given_low, declared.given_high) == ((-1.0, -1.0), (1.0, 2.0))
    assert (normalised.given_low, normalised.given_high) == ((-10.0, -10.0), (10.0, 10.0))  # identity: +-10
