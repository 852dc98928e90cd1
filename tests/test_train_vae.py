"""The VAE training script runs end to end and saves a loadable, normalised tokenizer."""

import json
import math

import pytest
import torch

from policy_server.model.vae import SmallVideoVAE
from robots.datagen import generate
from robots.dataset import DemoDataset
from robots.train_vae import ClipSampler, TrainVAEArgs, main, train


def test_train_a_few_steps_and_reload(tmp_path):
    generate(tmp_path / "data", episodes=3, progress=False)
    args = TrainVAEArgs(
        data=str(tmp_path / "data"),
        out=str(tmp_path / "vae"),
        steps=3,
        batch_size=2,
        latent_channels=4,
        block_channels=(8, 8, 16),
        stats_clips=16,
        progress=False,
    )
    model, report = train(args)
    assert report["steps"] == 3 and report["val_psnr_db"] > 0
    assert json.loads((tmp_path / "vae" / "train_report.json").read_text())["steps"] == 3
    loaded = SmallVideoVAE.from_pretrained(tmp_path / "vae")
    assert loaded.config.latents_std != [1.0] * 4  # statistics were estimated and saved
    # On the statistics clips (train() holds out episode 0 for validation and uses the others)
    # the normalised latents have zero mean and unit std per channel.
    episodes = [episode.frames for episode in DemoDataset(tmp_path / "data")]
    clips = ClipSampler(episodes[1:], args.frames, 0).all_clips(16)
    with torch.no_grad():
        latents = loaded.encode(clips).transpose(0, 1).reshape(4, -1)
    torch.testing.assert_close(latents.mean(1), torch.zeros(4), atol=1e-4, rtol=0)
    torch.testing.assert_close(latents.std(1), torch.ones(4), atol=1e-3, rtol=0)


def test_training_is_deterministic(tmp_path):
    generate(tmp_path / "data", episodes=2, progress=False)
    kwargs = dict(
        data=str(tmp_path / "data"),
        steps=2,
        batch_size=1,
        latent_channels=4,
        block_channels=(8, 8, 8),
        stats_clips=4,
        progress=False,
    )
    a, _ = train(TrainVAEArgs(out=str(tmp_path / "a"), **kwargs))
    b, _ = train(TrainVAEArgs(out=str(tmp_path / "b"), **kwargs))
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key


TINY = ["--batch-size", "1", "--latent-channels", "4", "--block-channels", "8,8,8", "--no-progress"]


@pytest.mark.parametrize("steps", [1, 2, 20, 21])  # 20: OneCycleLR's warmup would end at step 0
def test_cli_trains_any_positive_step_count(tmp_path, capsys, steps):
    generate(tmp_path / "data", episodes=2, progress=False)
    main(["--data", str(tmp_path / "data"), "--out", str(tmp_path / "runs" / "vae"), "--steps", str(steps), *TINY])
    report = json.loads((tmp_path / "runs" / "vae" / "train_report.json").read_text())
    assert report == json.loads(capsys.readouterr().out)
    assert report["steps"] == steps and math.isfinite(report["final_mse"]) and report["val_psnr_db"] > 0
    assert SmallVideoVAE.from_pretrained(tmp_path / "runs" / "vae").latent_channels == 4


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--frames", "4"], "--frames 4: expected 4k + 1"),
        (["--steps", "0"], "--steps 0: expected a positive integer"),
        (["--steps", "-5"], "--steps -5: expected a positive integer"),
        (["--steps", "1.5"], "argument --steps: invalid int value: '1.5'"),
        (["--batch-size", "0"], "--batch-size 0: expected a positive integer"),
        (["--threads", "0"], "--threads 0: expected a positive integer"),
        (["--lr", "-1"], "--lr -1.0: expected a positive learning rate"),
        (["--block-channels", "8,x"], "--block-channels 8,x: invalid literal"),
        (["--block-channels", "8,12"], "--block-channels 8,12: block_channels (8, 12) must be multiples"),
        ([], "dataset.json not found"),
    ],
)
def test_cli_names_a_bad_argument_in_one_line(tmp_path, capsys, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(tmp_path / "no-data"), "--out", str(tmp_path / "out"), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if "error:" in line] == [err.splitlines()[-1]]
    assert named in err.splitlines()[-1]
    assert not (tmp_path / "out").exists()
