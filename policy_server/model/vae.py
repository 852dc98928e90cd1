"""Video tokenizer interface and the small causal video VAE of the embedded model.

The interface follows the Cosmos3 (Wan2.2) tokenizer: a video ``[B, 3, T, H, W]`` in [-1, 1] with
``T = 4k + 1`` frames becomes latents ``[B, C, T_lat, H/s, W/s]`` with ``T_lat = (T - 1)/4 + 1``:
frame 0 is encoded on its own and every later group of four frames becomes one latent frame.
Latents are normalised per channel, ``z = (mu - latents_mean) / latents_std``, so the diffusion
model sees roughly unit-variance inputs; ``decode`` undoes the normalisation.

The small VAE is causal in time: latent frame j depends on pixel frames up to ``4j`` only. Frame 0
is replicated three times in front of the clip so that it forms a group of four by itself, which
lets one set of weights serve the first frame and the later groups alike.

Checkpoints use the diffusers model layout: ``config.json`` plus
``diffusion_pytorch_model.safetensors`` in one folder (``<model>/vae/`` in a pipeline folder).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.nn import functional as F

from policy_server.json_file import read_json
from policy_server.model.checkpoint import CheckpointError, non_finite, show_names

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"


def latent_frames(num_frames: int, temporal_compression: int) -> int:
    """T_lat = (T - 1) / tc + 1 for a causal video VAE that keeps frame 0, on T = tc*k + 1 frames."""
    tc = temporal_compression
    if num_frames < 1 or (num_frames - 1) % tc:
        raise ValueError(f"num_frames={num_frames}; expected {tc}k + 1 frames (1, {tc + 1}, {2 * tc + 1}, ...)")
    return (num_frames - 1) // tc + 1


@runtime_checkable
class VideoTokenizer(Protocol):
    """What the pipeline needs from a video tokenizer."""

    spatial_compression: int
    temporal_compression: int
    latent_channels: int

    def encode(self, video: Tensor) -> Tensor:
        """[B, 3, T, H, W] in [-1, 1] -> normalised latents [B, C, (T-1)/tc + 1, H/sc, W/sc]."""
        ...

    def decode(self, latents: Tensor) -> Tensor:
        """Normalised latents [B, C, T_lat, h, w] -> video [B, 3, (T_lat-1)*tc + 1, h*sc, w*sc] in [-1, 1]."""
        ...


@dataclass
class SmallVideoVAEConfig:
    """Hyper-parameters of ``SmallVideoVAE`` (serialised to ``config.json``)."""

    in_channels: int = 3
    latent_channels: int = 16
    # Channels of the frame encoder after each stride-2 stage; one stage per factor 2 of spatial
    # compression, so len(block_channels) = log2(spatial_compression).
    block_channels: tuple[int, ...] = (16, 32, 64)
    temporal_compression: int = 4
    group_norm_groups: int = 8
    # Per-channel statistics of the raw posterior means over the training data (set by training).
    latents_mean: list[float] = field(default_factory=list)
    latents_std: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.block_channels = tuple(int(c) for c in self.block_channels)
        if not self.latents_mean:
            self.latents_mean = [0.0] * self.latent_channels
        if not self.latents_std:
            self.latents_std = [1.0] * self.latent_channels
        for name in ("latents_mean", "latents_std"):
            values = getattr(self, name)
            if len(values) != self.latent_channels:
                raise ValueError(f"{name} has {len(values)} entries; expected latent_channels={self.latent_channels}")
        if min(self.latents_std) <= 0:
            raise ValueError(f"latents_std must be positive, got {self.latents_std}")
        if any(c % self.group_norm_groups for c in self.block_channels):
            raise ValueError(
                f"block_channels {self.block_channels} must be multiples of group_norm_groups={self.group_norm_groups}"
            )

    @property
    def spatial_compression(self) -> int:
        return 2 ** len(self.block_channels)

    def to_json_dict(self) -> dict:
        data = asdict(self)
        data["block_channels"] = list(self.block_channels)
        return {"_class_name": SmallVideoVAE.__name__, **data}

    @classmethod
    def from_json_dict(cls, data: dict) -> SmallVideoVAEConfig:
        class_name = data.get("_class_name", SmallVideoVAE.__name__)
        if class_name != SmallVideoVAE.__name__:
            raise ValueError(f"config is for {class_name!r}; expected {SmallVideoVAE.__name__!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"_class_name"})
        if unknown:
            raise ValueError(f"unknown SmallVideoVAE config keys {unknown}; expected some of {sorted(known)}")
        return cls(**{k: v for k, v in data.items() if k in known})


class ResBlock(nn.Module):
    """Pre-norm residual block of two 3x3 convolutions, [N, C, H, W] -> same."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return x + h


class FrameEncoder(nn.Module):
    """One frame to a feature map: [N, 3, H, W] -> [N, block_channels[-1], H/s, W/s]."""

    def __init__(self, config: SmallVideoVAEConfig):
        super().__init__()
        channels = config.block_channels
        self.conv_in = nn.Conv2d(config.in_channels, channels[0], 3, padding=1)
        stages = []
        previous = channels[0]
        for width in channels:
            stages.append(nn.Conv2d(previous, width, 3, stride=2, padding=1))
            stages.append(ResBlock(width, config.group_norm_groups))
            previous = width
        self.stages = nn.Sequential(*stages)

    def forward(self, x: Tensor) -> Tensor:
        return self.stages(self.conv_in(x))


class FrameDecoder(nn.Module):
    """Feature map to one frame: [N, block_channels[-1], h, w] -> [N, 3, h*s, w*s]."""

    def __init__(self, config: SmallVideoVAEConfig):
        super().__init__()
        channels = config.block_channels[::-1]
        stages = []
        for width, next_width in zip(channels, channels[1:] + channels[-1:], strict=True):
            stages.append(ResBlock(width, config.group_norm_groups))
            stages.append(nn.Upsample(scale_factor=2, mode="nearest"))
            stages.append(nn.Conv2d(width, next_width, 3, padding=1))
        self.stages = nn.Sequential(*stages)
        self.norm_out = nn.GroupNorm(config.group_norm_groups, channels[-1])
        self.conv_out = nn.Conv2d(channels[-1], config.in_channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv_out(F.silu(self.norm_out(self.stages(x))))


class SmallVideoVAE(nn.Module):
    """Causal convolutional video VAE: spatial ÷2^len(block_channels), temporal ÷4, first frame kept.

    Shapes (sc = spatial_compression, tc = temporal_compression):
        ``encode``: [B, 3, T, H, W] in [-1, 1], T = tc*k + 1, H and W multiples of sc
                    -> normalised latents [B, C, k + 1, H/sc, W/sc]
        ``decode``: normalised latents [B, C, T_lat, h, w] -> [B, 3, tc*(T_lat - 1) + 1, h*sc, w*sc]
    """

    def __init__(self, config: SmallVideoVAEConfig | None = None):
        super().__init__()
        self.config = config or SmallVideoVAEConfig()
        cfg = self.config
        tc, feat = cfg.temporal_compression, cfg.block_channels[-1]
        self.frame_encoder = FrameEncoder(cfg)
        # A group of tc frames, stacked on the channel axis, becomes one latent frame.
        self.temporal_down = nn.Conv2d(tc * feat, feat, 1)
        self.group_block = ResBlock(feat, cfg.group_norm_groups)
        self.norm_moments = nn.GroupNorm(cfg.group_norm_groups, feat)
        self.to_moments = nn.Conv2d(feat, 2 * cfg.latent_channels, 3, padding=1)

        self.from_latent = nn.Conv2d(cfg.latent_channels, feat, 3, padding=1)
        self.latent_block = ResBlock(feat, cfg.group_norm_groups)
        self.temporal_up = nn.Conv2d(feat, tc * feat, 1)
        self.frame_decoder = FrameDecoder(cfg)

        stats_shape = (1, cfg.latent_channels, 1, 1, 1)
        # Not persistent: config.json is their single source of truth.
        self.register_buffer("latents_mean", torch.tensor(cfg.latents_mean).view(stats_shape), persistent=False)
        self.register_buffer("latents_std", torch.tensor(cfg.latents_std).view(stats_shape), persistent=False)

    # ------------------------------------------------------------------ interface

    @property
    def spatial_compression(self) -> int:
        return self.config.spatial_compression

    @property
    def temporal_compression(self) -> int:
        return self.config.temporal_compression

    @property
    def latent_channels(self) -> int:
        return self.config.latent_channels

    def num_latent_frames(self, num_frames: int) -> int:
        return latent_frames(num_frames, self.temporal_compression)

    def num_pixel_frames(self, num_latent_frames: int) -> int:
        """T = tc * (T_lat - 1) + 1."""
        if num_latent_frames < 1:
            raise ValueError(f"num_latent_frames={num_latent_frames}; expected at least 1")
        return self.temporal_compression * (num_latent_frames - 1) + 1

    def set_latent_stats(self, mean: Tensor, std: Tensor) -> None:
        """Install per-channel normalisation statistics ([C] each) in the buffers and the config."""
        shape = self.latents_mean.shape
        mean = mean.detach().to(torch.float32).reshape(-1)
        std = std.detach().to(torch.float32).reshape(-1)
        if mean.numel() != self.latent_channels or std.numel() != self.latent_channels:
            raise ValueError(f"latent stats have {mean.numel()}/{std.numel()} entries; expected {self.latent_channels}")
        self.config.latents_mean = mean.tolist()
        self.config.latents_std = std.tolist()
        self.latents_mean.copy_(mean.view(shape))
        self.latents_std.copy_(std.view(shape))

    def encode(self, video: Tensor, sample: bool = False, generator: torch.Generator | None = None) -> Tensor:
        """Normalised latents [B, C, T_lat, H/sc, W/sc] of ``video`` [B, 3, T, H, W] in [-1, 1].

        The posterior mean by default; ``sample=True`` draws from the posterior instead.
        """
        mean, logvar = self.encode_moments(video)
        if sample:
            noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
            mean = mean + torch.exp(0.5 * logvar) * noise
        return self.normalize(mean)

    def decode(self, latents: Tensor) -> Tensor:
        """Video [B, 3, T, H, W] in [-1, 1] from normalised latents [B, C, T_lat, h, w]."""
        self._check_latents(latents)
        return self.decode_raw(self.denormalize(latents)).clamp(-1.0, 1.0)

    def normalize(self, raw: Tensor) -> Tensor:
        return (raw - self.latents_mean.to(raw.dtype)) / self.latents_std.to(raw.dtype)

    def denormalize(self, latents: Tensor) -> Tensor:
        return latents * self.latents_std.to(latents.dtype) + self.latents_mean.to(latents.dtype)

    # ------------------------------------------------------------------ raw latent space (training)

    def encode_moments(self, video: Tensor) -> tuple[Tensor, Tensor]:
        """Posterior mean and log-variance in raw latent space, each [B, C, T_lat, h, w]."""
        self._check_video(video)
        b, c, t, h, w = video.shape
        tc = self.temporal_compression
        frames = video.transpose(1, 2).reshape(b * t, c, h, w)
        feats = self.frame_encoder(frames)  # [B*T, F, h', w']
        feat, hl, wl = feats.shape[1:]
        feats = feats.view(b, t, feat, hl, wl)
        # Replicate frame 0 in front so that it forms a group on its own: causal and first frame kept.
        feats = torch.cat([feats[:, :1].expand(b, tc - 1, feat, hl, wl), feats], dim=1)
        t_lat = (t - 1) // tc + 1
        groups = feats.reshape(b * t_lat, tc * feat, hl, wl)
        x = self.group_block(self.temporal_down(groups))
        moments = self.to_moments(F.silu(self.norm_moments(x)))
        moments = moments.view(b, t_lat, 2 * self.latent_channels, hl, wl).transpose(1, 2)
        mean, logvar = moments.chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def decode_raw(self, raw: Tensor) -> Tensor:
        """Unclamped video [B, 3, T, H, W] from raw (un-normalised) latents [B, C, T_lat, h, w]."""
        b, c, t_lat, hl, wl = raw.shape
        tc, feat = self.temporal_compression, self.config.block_channels[-1]
        x = raw.transpose(1, 2).reshape(b * t_lat, c, hl, wl)
        x = self.temporal_up(self.latent_block(self.from_latent(x)))  # [B*T_lat, tc*F, h, w]
        # Latent frame 0 expands to tc copies of frame 0; keep only the last of them.
        x = x.view(b, t_lat * tc, feat, hl, wl)[:, tc - 1 :]
        t = x.shape[1]
        frames = self.frame_decoder(x.reshape(b * t, feat, hl, wl))
        return frames.view(b, t, *frames.shape[1:]).transpose(1, 2)

    def forward(self, video: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Training pass: (reconstruction [B, 3, T, H, W] unclamped, posterior mean, log-variance)."""
        mean, logvar = self.encode_moments(video)
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        z = mean + torch.exp(0.5 * logvar) * noise
        return self.decode_raw(z), mean, logvar

    # ------------------------------------------------------------------ checks

    def _check_video(self, video: Tensor) -> None:
        sc, tc = self.spatial_compression, self.temporal_compression
        if not isinstance(video, Tensor) or not video.is_floating_point() or video.ndim != 5:
            raise ValueError(
                f"video must be a float tensor [B, 3, T, H, W] in [-1, 1], got "
                f"{type(video).__name__} {getattr(video, 'dtype', '')} {tuple(getattr(video, 'shape', ()))}"
            )
        _, c, t, h, w = video.shape
        if c != self.config.in_channels:
            raise ValueError(f"video has {c} channels at dim 1; expected {self.config.in_channels} ([B, 3, T, H, W])")
        if (t - 1) % tc:
            raise ValueError(f"video has T={t} frames; expected {tc}k + 1 (1, {tc + 1}, {2 * tc + 1}, ...)")
        if h % sc or w % sc:
            raise ValueError(f"video is {h}x{w}; expected height and width that are multiples of {sc}")

    def _check_latents(self, latents: Tensor) -> None:
        if not isinstance(latents, Tensor) or latents.ndim != 5 or latents.shape[1] != self.latent_channels:
            raise ValueError(
                f"latents must be [B, {self.latent_channels}, T_lat, h, w], got {tuple(getattr(latents, 'shape', ()))}"
            )

    # ------------------------------------------------------------------ checkpoint IO

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``config.json`` and ``diffusion_pytorch_model.safetensors`` into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(json.dumps(self.config.to_json_dict(), indent=2) + "\n")
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(
        cls, path: str | Path, subfolder: str | None = None, device: str | torch.device = "cpu"
    ) -> SmallVideoVAE:
        """Load a folder written by ``save_pretrained`` (``subfolder="vae"`` for a pipeline folder)."""
        directory = Path(path) / subfolder if subfolder else Path(path)
        config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
        for required in (config_path, weights_path):
            if not required.is_file():
                raise FileNotFoundError(f"{required} not found; expected {CONFIG_NAME} and {WEIGHTS_NAME} there")
        stored = read_json(config_path, CheckpointError)
        if not isinstance(stored, dict):
            raise CheckpointError(f"{config_path}: expected a JSON object of SmallVideoVAE config fields")
        try:
            config = SmallVideoVAEConfig.from_json_dict(stored)
        except (ValueError, TypeError) as error:  # a foreign config, bad values
            raise CheckpointError(f"{config_path}: {error}") from None
        model = cls(config)
        try:
            state = load_file(str(weights_path), device=str(device))
        except SafetensorError as error:
            raise CheckpointError(f"{weights_path}: not a readable safetensors file ({error})") from None
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        found = {k: tuple(v.shape) for k, v in state.items()}
        if expected != found:
            missing = sorted(set(expected) - set(found))
            unexpected = sorted(set(found) - set(expected))
            shared = set(found) & set(expected)
            resized = {k: (found[k], expected[k]) for k in shared if found[k] != expected[k]}
            raise CheckpointError(
                f"{weights_path} does not match {config_path}: missing {missing}, unexpected {unexpected}, "
                f"size (file, config) {resized}"
            )
        if bad := non_finite(state.items()):
            raise CheckpointError(f"{weights_path}: NaN or Inf values in {show_names(bad)}; expected finite weights")
        model.load_state_dict(state)
        return model.to(device).eval()


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def psnr(reference: Tensor, reconstruction: Tensor) -> float:
    """Peak signal-to-noise ratio in dB of two videos in [-1, 1] (peak-to-peak range 2)."""
    mse = torch.mean((reference.float() - reconstruction.float().clamp(-1, 1)) ** 2).item()
    return float("inf") if mse == 0 else 10.0 * math.log10(4.0 / mse)
