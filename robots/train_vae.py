"""Train the small video VAE on demonstration frames.

    python -m robots.train_vae --data runs/data/reach-400 --out runs/vae

Loss: mean squared reconstruction error plus a small KL term (the latents only need to be smooth,
not Gaussian). After training, the per-channel mean and standard deviation of the posterior means
over the training clips become ``latents_mean`` / ``latents_std`` in the saved config, so that
``encode`` returns roughly unit-variance latents. Writes ``config.json``,
``diffusion_pytorch_model.safetensors`` and ``train_report.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from policy_server.model.vae import SmallVideoVAE, SmallVideoVAEConfig, count_parameters, psnr
from robots.dataset import DatasetError, open_dataset


@dataclass
class TrainVAEArgs:
    data: str
    out: str
    steps: int = 3000
    batch_size: int = 8
    frames: int = 5  # clip length, 4k + 1; 5 covers both the lone first frame and a group of four
    lr: float = 2e-3
    kl_weight: float = 1e-4
    latent_channels: int = 16
    block_channels: tuple[int, ...] = (16, 32, 64)
    val_fraction: float = 0.05
    stats_clips: int = 512  # clips used to estimate latents_mean / latents_std
    seed: int = 0
    threads: int = 1
    progress: bool = True
    init: str | None = None  # fine-tune this VAE folder instead of training from scratch


class ClipSampler:
    """Random clips [B, 3, T, H, W] in [-1, 1] from a list of episodes' frames [T_i+1, H, W, 3] uint8.

    Clips running past the end of an episode repeat its last frame, which is what a policy sees once
    the effector has stopped.
    """

    def __init__(self, episodes: list[np.ndarray], frames: int, seed: int):
        if not episodes:
            raise ValueError("no episodes to sample clips from")
        self.episodes = [torch.from_numpy(e) for e in episodes]
        self.frames = frames
        self.rng = np.random.default_rng(seed)

    def clip(self, episode_index: int, start: int) -> torch.Tensor:
        episode = self.episodes[episode_index]
        index = torch.clamp(torch.arange(start, start + self.frames), max=len(episode) - 1)
        return episode[index].permute(3, 0, 1, 2)  # [3, T, H, W] uint8

    def sample(self, batch_size: int) -> torch.Tensor:
        clips = []
        for _ in range(batch_size):
            e = int(self.rng.integers(len(self.episodes)))
            clips.append(self.clip(e, int(self.rng.integers(len(self.episodes[e])))))
        return to_unit_range(torch.stack(clips))

    def all_clips(self, limit: int) -> torch.Tensor:
        """Deterministic evaluation set: clips starting at every ``frames``-th frame, at most ``limit``."""
        clips = [
            self.clip(e, s) for e, episode in enumerate(self.episodes) for s in range(0, len(episode), self.frames)
        ]
        return to_unit_range(torch.stack(clips[:limit]))


def to_unit_range(frames_uint8: torch.Tensor) -> torch.Tensor:
    return frames_uint8.to(torch.float32) / 127.5 - 1.0


def kl_divergence(mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """KL(q || N(0, 1)) averaged over latent elements."""
    return 0.5 * torch.mean(mean.pow(2) + logvar.exp() - 1.0 - logvar)


@torch.no_grad()
def evaluate(model: SmallVideoVAE, clips: torch.Tensor, batch_size: int = 32) -> float:
    """PSNR (dB) of posterior-mean reconstructions of ``clips`` [N, 3, T, H, W]."""
    model.eval()
    recon = torch.cat([model.decode(model.encode(clips[i : i + batch_size])) for i in range(0, len(clips), batch_size)])
    model.train()
    return psnr(clips, recon)


@torch.no_grad()
def latent_statistics(model: SmallVideoVAE, clips: torch.Tensor, batch_size: int = 32) -> tuple[torch.Tensor, ...]:
    """Per-channel mean and std [C] of the raw posterior means of ``clips``."""
    model.eval()
    means = [model.encode_moments(clips[i : i + batch_size])[0] for i in range(0, len(clips), batch_size)]
    flat = torch.cat(means).transpose(0, 1).reshape(model.latent_channels, -1)
    model.train()
    return flat.mean(1), flat.std(1).clamp_min(1e-4)


def train(args: TrainVAEArgs) -> tuple[SmallVideoVAE, dict]:
    """Train, set the latent statistics, save to ``args.out``; return the model and a report."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dataset = open_dataset(args.data)
    episodes = [episode.frames for episode in dataset]
    num_val = max(1, int(round(len(episodes) * args.val_fraction))) if len(episodes) > 1 else 0
    train_sampler = ClipSampler(episodes[num_val:], args.frames, args.seed)
    val_clips = ClipSampler(episodes[:num_val] or episodes, args.frames, args.seed).all_clips(256)

    if args.init is None:
        model = SmallVideoVAE(SmallVideoVAEConfig(latent_channels=args.latent_channels,
                                                  block_channels=tuple(args.block_channels)))
    else:
        model = SmallVideoVAE.from_pretrained(args.init).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    # OneCycleLR's warmup ends at step 0.05 * steps - 1 and it divides by that length, so runs of 20 steps
    # or fewer, too short for a warmup step, skip the warmup.
    warmup = 0.05 if args.steps > 20 else 0.0
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=warmup)
    generator = torch.Generator().manual_seed(args.seed)

    started = time.perf_counter()
    bar = tqdm(range(args.steps), desc="vae", unit="step", disable=not args.progress)
    for step in bar:
        clips = train_sampler.sample(args.batch_size)
        recon, mean, logvar = model(clips, generator=generator)
        mse = torch.mean((recon - clips) ** 2)
        kl = kl_divergence(mean, logvar)
        loss = mse + args.kl_weight * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 10 == 0 or step == args.steps - 1:
            bar.set_postfix(mse=f"{mse.item():.5f}", kl=f"{kl.item():.2f}", refresh=False)

    stats_clips = train_sampler.all_clips(args.stats_clips)
    model.set_latent_stats(*latent_statistics(model, stats_clips))
    out = Path(args.out)
    model.save_pretrained(out)
    report = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "frames": args.frames,
        "train_seconds": round(time.perf_counter() - started, 1),
        "parameters": count_parameters(model),
        "final_mse": mse.item(),
        "final_kl": kl.item(),
        "val_psnr_db": evaluate(model, val_clips),
        "val_clips": len(val_clips),
        "train_episodes": len(train_sampler.episodes),
        "data": str(args.data),
        "init": args.init or "scratch",
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return model, report


def main(argv: list[str] | None = None) -> None:
    defaults = TrainVAEArgs(data="", out="")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="dataset directory written by robots.datagen")
    parser.add_argument("--out", required=True, help="output folder (config.json + safetensors)")
    parser.add_argument("--steps", type=int, default=defaults.steps, help=f"training steps ({defaults.steps})")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help=f"clips per step ({defaults.batch_size})")
    parser.add_argument("--frames", type=int, default=defaults.frames, help="clip length, 4k+1")
    parser.add_argument("--lr", type=float, default=defaults.lr, help=f"learning rate ({defaults.lr:g})")
    parser.add_argument("--kl-weight", type=float, default=defaults.kl_weight,
                        help=f"weight of the KL term beside the MSE ({defaults.kl_weight:g})")
    parser.add_argument("--latent-channels", type=int, default=defaults.latent_channels,
                        help=f"latent channels ({defaults.latent_channels})")
    parser.add_argument(
        "--block-channels",
        default=",".join(map(str, defaults.block_channels)),
        help="encoder widths per stride-2 stage, comma separated (3 stages = spatial ÷8)",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help=f"seed ({defaults.seed})")
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch CPU threads")
    parser.add_argument("--init", default=None,
                        help="fine-tune this VAE folder (its architecture overrides --latent-channels and "
                        "--block-channels)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    ns = parser.parse_args(argv)
    if ns.frames < 1 or (ns.frames - 1) % 4:
        parser.error(f"--frames {ns.frames}: expected 4k + 1 (1, 5, 9, ...)")
    for flag, value in (("--steps", ns.steps), ("--batch-size", ns.batch_size), ("--threads", ns.threads),
                        ("--latent-channels", ns.latent_channels)):
        if value < 1:
            parser.error(f"{flag} {value}: expected a positive integer")
    if not ns.lr > 0:
        parser.error(f"--lr {ns.lr}: expected a positive learning rate")
    try:
        block_channels = tuple(int(c) for c in ns.block_channels.split(","))
        SmallVideoVAEConfig(latent_channels=ns.latent_channels, block_channels=block_channels)  # validates them
    except ValueError as error:
        parser.error(f"--block-channels {ns.block_channels}: {error}")
    args = TrainVAEArgs(
        data=ns.data,
        out=ns.out,
        steps=ns.steps,
        batch_size=ns.batch_size,
        frames=ns.frames,
        lr=ns.lr,
        kl_weight=ns.kl_weight,
        latent_channels=ns.latent_channels,
        block_channels=block_channels,
        seed=ns.seed,
        threads=ns.threads,
        progress=not ns.no_progress,
        init=ns.init,
    )
    try:
        _, report = train(args)
    except (OSError, DatasetError) as error:  # --data, --init or --out is not what it should be
        parser.error(str(error))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
