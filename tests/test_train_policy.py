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
from robots.train_policy import main, train


def test_train_a_few_steps_and_serve_the_result(tmp_path):
    generate(tmp_path / "demos", episodes=3, progress=False)
    out = tmp_path / "policy"
    summary = train(tmp_path / "demos", default_model_path() / "vae", out, steps=2, batch_size=4, log_every=1)
    assert summary["steps"] == 2 and summary["episodes"] == 3
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


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--save-every", "0"], "--save-every must be positive"),
        (["--steps", "0"], "must be positive"),
        ([], "dataset.json not found"),
    ],
)
def test_cli_names_a_bad_argument_in_one_line(tmp_path, capsys, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(tmp_path / "no-data"), "--out", str(tmp_path / "out"), *argv])
    assert exit_info.value.code == 2 and named in capsys.readouterr().err
