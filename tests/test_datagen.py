"""Demonstration generation: file layout, content, determinism."""

import json

import numpy as np
import pytest

from robots.datagen import generate, main
from robots.dataset import METADATA_FILE, DatasetError, DemoDataset
from robots.envs import HELDOUT_SEED_OFFSET, REACH_EITHER_ID


def test_tiny_run_writes_consistent_episodes(tmp_path):
    metadata = generate(tmp_path / "a", episodes=3, seed_offset=10, progress=False)
    assert metadata["success_rate"] == 1.0 and metadata["embodiment"] == "pusht" and metadata["domain_id"] == 4
    data = DemoDataset(tmp_path / "a")
    assert len(data) == 3
    for index, episode in enumerate(data):
        steps = episode.num_steps
        assert episode.seed == 10 + index
        assert episode.frames.shape == (steps + 1, 64, 64, 3) and episode.frames.dtype == np.uint8
        assert episode.states.shape == (steps + 1, 2) and episode.states.dtype == np.float32
        assert episode.actions.shape == (steps, 2) and episode.actions.dtype == np.float32
        assert episode.instruction == f"reach the {episode.target_color} circle"
        # states follow the recorded actions (velocity integration at the control rate)
        dt = 1.0 / metadata["fps"]
        np.testing.assert_allclose(np.diff(episode.states, axis=0), episode.actions * dt, atol=1e-6)
    stats = metadata["action"]["stats"]
    assert len(stats["mean"]) == 2 and metadata["action"]["units"] == "m/s"


def test_same_seeds_give_identical_datasets(tmp_path):
    generate(tmp_path / "a", episodes=2, progress=False)
    generate(tmp_path / "b", episodes=2, progress=False)
    a, b = DemoDataset(tmp_path / "a"), DemoDataset(tmp_path / "b")
    for ep_a, ep_b in zip(a, b, strict=True):
        np.testing.assert_array_equal(ep_a.frames, ep_b.frames)
        np.testing.assert_array_equal(ep_a.actions, ep_b.actions)
    assert a.metadata == b.metadata
    assert (tmp_path / "a" / "episode_000000.safetensors").read_bytes() == (
        tmp_path / "b" / "episode_000000.safetensors"
    ).read_bytes()


def test_targets_per_scene_demonstrates_one_scene_once_per_object(tmp_path):
    generate(tmp_path, episodes=6, targets_per_scene=3, progress=False)
    episodes = list(DemoDataset(tmp_path))
    assert [e.seed for e in episodes] == [0, 0, 0, 1, 1, 1]
    for scene in (episodes[:3], episodes[3:]):
        assert len({e.target_color for e in scene}) == 3
        assert len({e.instruction for e in scene}) == 3
        assert all(np.array_equal(e.frames[0], scene[0].frames[0]) for e in scene)  # same first frame
        assert all(e.success for e in scene)
    with pytest.raises(ValueError, match="targets_per_scene"):
        generate(tmp_path / "bad", episodes=4, targets_per_scene=4, progress=False)


def test_refuses_to_overwrite_and_held_out_seeds(tmp_path):
    generate(tmp_path, episodes=1, progress=False)
    with pytest.raises(FileExistsError, match="overwrite"):
        generate(tmp_path, episodes=1, progress=False)
    generate(tmp_path, episodes=1, progress=False, overwrite=True)
    with pytest.raises(ValueError, match="held-out"):
        generate(tmp_path / "x", episodes=2, seed_offset=HELDOUT_SEED_OFFSET - 1, progress=False)


def test_cli(tmp_path, capsys):
    main(["--episodes", "2", "--out", str(tmp_path), "--no-progress"])
    assert "wrote 2 episodes" in capsys.readouterr().out
    metadata = json.loads((tmp_path / METADATA_FILE).read_text())
    assert [e["file"] for e in metadata["episodes"]] == [
        "episode_000000.safetensors",
        "episode_000001.safetensors",
    ]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--episodes", "3", "--targets-per-scene", "4"], "targets_per_scene=4"),
        (["--episodes", "3", "--targets-per-scene", "0"], "targets_per_scene=0; expected 1 to 3"),
        (["--episodes", "0"], "episodes=0"),
        (["--episodes", "-1"], "episodes=-1"),
        (["--episodes", "1.5"], "argument --episodes: invalid int value: '1.5'"),
        (["--episodes", "2", "--env-id", "CartPole-v1"], "argument --env-id: invalid choice: 'CartPole-v1'"),
        (["--episodes", "2", "--seed-offset", str(HELDOUT_SEED_OFFSET)], "held-out"),
    ],
)
def test_cli_names_a_bad_argument_in_one_line(tmp_path, capsys, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if "error:" in line] == [err.splitlines()[-1]]
    assert named in err.splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_cli_names_an_out_it_cannot_make(tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a folder")
    for out, named in ((tmp_path / "a_file" / "data", "Not a directory"), ("", "--out: expected a directory path")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--episodes", "1", "--out", str(out), "--no-progress"])
        assert exit_info.value.code == 2 and named in capsys.readouterr().err


def test_a_dataset_that_does_not_read_is_named(tmp_path):
    main(["--episodes", "2", "--out", str(tmp_path / "d"), "--no-progress"])
    (tmp_path / "d" / "episode_000001.safetensors").write_bytes(b"cut short")
    with pytest.raises(DatasetError, match="episode_000001.safetensors: not a readable safetensors file"):
        DemoDataset(tmp_path / "d")[1]
    (tmp_path / "d" / "dataset.json").write_text("{")
    with pytest.raises(DatasetError, match="dataset.json: not valid JSON"):
        DemoDataset(tmp_path / "d")


def test_cli_creates_nested_out_folders(tmp_path, capsys):
    main(["--episodes", "1", "--out", str(tmp_path / "runs" / "data" / "reach-1"), "--no-progress"])
    assert len(DemoDataset(tmp_path / "runs" / "data" / "reach-1")) == 1
    assert "wrote 1 episodes" in capsys.readouterr().out


def test_targets_per_scene_with_two_discs_of_the_named_colour_demonstrates_both(tmp_path):
    """ReachEither: the same first frame and instruction, once to each disc: the two modes the policy must learn."""
    generate(tmp_path, episodes=4, env_id=REACH_EITHER_ID, targets_per_scene=2, progress=False)
    episodes = list(DemoDataset(tmp_path))
    for first, second in (episodes[:2], episodes[2:]):
        assert first.seed == second.seed and first.instruction == second.instruction
        np.testing.assert_array_equal(first.frames[0], second.frames[0])
        assert first.success and second.success
        assert np.linalg.norm(first.states[-1] - second.states[-1]) > 0.1  # they end at different discs
    with pytest.raises(ValueError, match="discs of the named colour"):
        generate(tmp_path / "bad", episodes=3, env_id=REACH_EITHER_ID, targets_per_scene=3, progress=False)
