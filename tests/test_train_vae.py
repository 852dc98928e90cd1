"""The VAE training script runs end to end and saves a loadable, normalised tokenizer."""

import json

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


def test_cli_rejects_bad_clip_length(tmp_path, capsys):
    try:
        main(["--data", str(tmp_path), "--out", str(tmp_path / "o"), "--frames", "4"])
    except SystemExit as exit_:
        assert exit_.code == 2
    assert "4k + 1" in capsys.readouterr().err
