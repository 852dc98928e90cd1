"""The embedded-policy training script end to end at toy size: demonstrations -> a few optimiser steps
-> a pipeline folder that loads and answers a tick."""

import json

import numpy as np
import pytest
import torch

from policy_server.model import load_transformer
from policy_server.pipeline.policy import PolicyPipeline, PolicyRequest, default_model_path
from robots.datagen import generate
from robots.embedded import build_random_pipeline
from robots.envs import REACH_EITHER_ID
from robots.train_policy import main, train


def test_train_a_few_steps_and_serve_the_result(tmp_path):
    """Two datasets pooled (Reach and ReachEither, whose instructions differ) into one run."""
    generate(tmp_path / "demos", episodes=3, progress=False)
    generate(tmp_path / "either", episodes=2, env_id=REACH_EITHER_ID, targets_per_scene=2, progress=False)
    out = tmp_path / "policy"
    summary = train([tmp_path / "demos", tmp_path / "either"], default_model_path() / "vae", out, steps=2,
                    batch_size=4, log_every=1)
    assert summary["steps"] == 2 and summary["episodes"] == 5
    assert any(i.startswith("reach a ") for i in summary["instructions"])
    assert any(i.startswith("reach the ") for i in summary["instructions"])
    assert np.isfinite(summary["final_loss"])
    assert json.loads((out / "training.json").read_text())["windows"] == summary["windows"]

    pipe = PolicyPipeline.from_pretrained(out)
    assert pipe.served_embodiments == ["pusht"]
    rng = np.random.default_rng(0)
    result = pipe(PolicyRequest(images={"image": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)},
                                instruction="reach the red circle", embodiment="pusht",
                                state=np.array([0.2, 0.2], np.float32), num_steps=2))
    assert result.actions.shape == (8, 2) and np.all(np.isfinite(result.actions))


def test_pipeline_folder_is_a_diffusers_layout_root(tmp_path):
    pipe = build_random_pipeline(tmp_path, seed=5)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "Cosmos3OmniTransformer"]
    loaded = load_transformer(tmp_path)  # a pipeline root resolves to transformer/
    expected = pipe.transformer.state_dict()
    assert all(torch.equal(tensor, expected[key]) for key, tensor in loaded.state_dict().items())


def test_cli_trains_a_single_step(tmp_path, capsys):
    generate(tmp_path / "demos", episodes=1, progress=False)
    out = tmp_path / "runs" / "policy"  # parents are created
    main(["--data", str(tmp_path / "demos"), "--out", str(out), "--steps", "1", "--batch-size", "2"])
    summary = json.loads((out / "training.json").read_text())
    assert summary["steps"] == 1 and np.isfinite(summary["final_loss"])
    assert summary == json.loads(capsys.readouterr().out)
    assert PolicyPipeline.from_pretrained(out).served_embodiments == ["pusht"]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--save-every", "0"], "--save-every 0: expected a positive integer"),
        (["--steps", "0"], "--steps 0: expected a positive integer"),
        (["--steps", "-2"], "--steps -2: expected a positive integer"),
        (["--steps", "2.5"], "argument --steps: invalid int value: '2.5'"),
        (["--threads", "0"], "--threads 0: expected a positive integer"),
        (["--lr", "-1"], "--lr -1.0: expected a positive learning rate"),
        ([], "dataset.json not found"),
    ],
)
def test_cli_names_a_bad_argument_in_one_line(tmp_path, capsys, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(tmp_path / "no-data"), "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if "error:" in line] == [err.splitlines()[-1]]
    assert named in err.splitlines()[-1]


def test_cli_rejects_a_missing_init_folder_before_encoding(tmp_path, capsys):
    generate(tmp_path / "demos", episodes=1, progress=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(tmp_path / "demos"), "--out", str(tmp_path / "out"), "--init", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.splitlines()[-1].endswith(f"{tmp_path / 'nope'} is not a directory")
    assert "vae encode" not in err  # it failed before minutes of encoding on a real dataset
    assert not (tmp_path / "out").exists()


def _widen(tensors: dict, name: str) -> dict:
    """The episode's `name` with 7 channels (or frames of 96 px), as another robot's dataset has them."""
    value = tensors[name]
    if name == "frames":
        return {**tensors, name: np.zeros((len(value), 96, 96, 3), np.uint8)}
    return {**tensors, name: np.concatenate([value, np.zeros((len(value), 5), value.dtype)], axis=1)}


@pytest.mark.parametrize(("name", "named"), [
    ("actions", "actions of width 7; expected 2, the raw_action_dim of the embodiment it trains (pusht)"),
    ("states", "states of width 7; expected 2, the state_dim of the embodiment it trains (pusht)"),
    ("frames", "frames of 96x96 px; expected 64x64, the canvas of the embodiment it trains (pusht)"),
])
def test_cli_refuses_a_dataset_of_another_layout_before_encoding(tmp_path, capsys, name, named):
    """A 7-D arm's demonstrations trained 2 of their 7 action channels and wrote a pusht folder that no server
    loads (its stats have 7 channels): the trainer trains the embedded pusht embodiment only, and says so."""
    from safetensors.numpy import load_file, save_file

    generate(tmp_path / "demos", episodes=1, progress=False)
    path = tmp_path / "demos" / "episode_000000.safetensors"
    save_file(_widen(load_file(str(path)), name), str(path))
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(tmp_path / "demos"), "--out", str(tmp_path / "out"), "--steps", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and named in err.splitlines()[-1]
    assert "vae encode" not in err and not (tmp_path / "out").exists()


def test_cli_refuses_demonstrations_recorded_at_another_rate(tmp_path, capsys):
    """Demonstrations at 15 Hz were captioned and served as the embodiment's 10 Hz."""
    generate(tmp_path / "demos", episodes=1, progress=False)
    path = tmp_path / "demos" / "dataset.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "fps": 15}))
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(tmp_path / "demos"), "--out", str(tmp_path / "out"), "--steps", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "vae encode" not in err
    assert err.splitlines()[-1].endswith(f"{tmp_path / 'demos'}: recorded at 15 fps; expected 10.0, the fps of the "
                                         "embodiment it trains (pusht)")
