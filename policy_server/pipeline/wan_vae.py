"""The Wan2.2 video VAE of real Cosmos3 checkpoints, through diffusers' `AutoencoderKLWan`, behind the same
interface as the embedded `SmallVideoVAE` (`policy_server.model.vae.VideoTokenizer`).

diffusers is imported only when such a folder is loaded, so the embedded model's start-up does not pay for
it. Latents are normalised per channel with the config's `latents_mean` / `latents_std` and the posterior
mode is used, exactly as `Cosmos3OmniPipeline` encodes and decodes.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import torch
from torch import Tensor

from policy_server.json_file import read_json
from policy_server.model.checkpoint import CheckpointError, check_state_dict, index_tensors, non_finite, show_names
from policy_server.model.vae import latent_frames

WAN_VAE_CLASS = "AutoencoderKLWan"
# Config fields besides the class's arguments: Wan2.2's vae/config.json (which Cosmos3 ships) carries `clip_output`,
# which diffusers ignores; its decoder clamps to [-1, 1] regardless, as `WanVideoVAE.decode` does.
IGNORED_CONFIG_FIELDS = ("clip_output",)
# The JSON type of each AutoencoderKLWan argument: diffusers passes a config's values on unchecked, so a string
# where it takes an integer built a VAE of garbage sizes ('2' * 8) or failed inside it without naming the field.
_POSITIVE_INTS = ("base_dim", "z_dim", "num_res_blocks", "in_channels", "out_channels")
_OPTIONAL_POSITIVE_INTS = ("decoder_base_dim", "patch_size", "scale_factor_temporal", "scale_factor_spatial")
_NUMBER_LISTS = ("attn_scales", "latents_mean", "latents_std")


class WanVideoVAE(torch.nn.Module):
    """`AutoencoderKLWan` (z channels, spatial ÷16 with its 2×2 patchify, temporal ÷4 with frame 0 kept)."""

    def __init__(self, vae) -> None:
        super().__init__()
        self.vae = vae
        config = vae.config
        self.spatial_compression = int(config.scale_factor_spatial)
        self.temporal_compression = int(config.scale_factor_temporal)
        self.latent_channels = int(config.z_dim)
        shape = (1, -1, 1, 1, 1)
        like = {"dtype": vae.dtype, "device": vae.device}
        self.register_buffer("latents_mean", torch.tensor(config.latents_mean, **like).view(shape))
        self.register_buffer("latents_inv_std", 1.0 / torch.tensor(config.latents_std, **like).view(shape))

    @classmethod
    def from_pretrained(cls, folder: str | Path, device: str = "cpu", dtype: torch.dtype | None = None) -> WanVideoVAE:
        """Load `folder` (a pipeline's `vae/`) straight onto `device` in `dtype` (None: as stored); raises
        CheckpointError naming what is wrong."""
        try:
            from diffusers import AutoencoderKLWan  # lazy: only real checkpoints need diffusers
            from diffusers.utils import logging as diffusers_logging
        except ImportError:
            raise CheckpointError(f"{folder}: the {WAN_VAE_CLASS} needs diffusers; "
                                  "pip install 'policy-server[cosmos3]'") from None
        diffusers_logging.disable_progress_bar()  # the server's log is line-oriented
        path = Path(folder) / "config.json"
        stored = read_json(path, CheckpointError)
        if not isinstance(stored, dict):
            raise CheckpointError(f"{path}: expected a JSON object of {WAN_VAE_CLASS} config fields")
        # diffusers only warns about a field it does not know (a misspelt one would load the default instead).
        known = [name for name in inspect.signature(AutoencoderKLWan.__init__).parameters if name != "self"]
        if unknown := sorted(k for k in stored if not k.startswith("_") and k not in (*known, *IGNORED_CONFIG_FIELDS)):
            raise CheckpointError(f"{path}: unknown field(s) {unknown}; expected the {WAN_VAE_CLASS} arguments "
                                  f"{sorted(known)} (plus '_'-prefixed bookkeeping keys)")
        _check_config(Path(folder), stored, AutoencoderKLWan)
        try:
            # safetensors only: without it diffusers falls back to unpickling a .bin file.
            vae = AutoencoderKLWan.from_pretrained(str(folder), torch_dtype=dtype, device_map=str(device),
                                                   use_safetensors=True)
        except (OSError, ValueError, KeyError, RuntimeError) as error:
            raise CheckpointError(f"{folder}: cannot load the {WAN_VAE_CLASS} ({error})") from None
        if vae.device.type == "cpu":  # diffusers' CPU weights are views of the mapped files (see `read_tensor`)
            for tensor in (*vae.parameters(), *vae.buffers()):
                tensor.data = tensor.data.clone()
        if bad := non_finite((*vae.named_parameters(), *vae.named_buffers())):
            raise CheckpointError(f"{folder}: NaN or Inf values in {show_names(bad)}; expected finite weights")
        return cls(vae.eval())

    def num_latent_frames(self, num_frames: int) -> int:
        return latent_frames(num_frames, self.temporal_compression)

    def encode(self, video: Tensor) -> Tensor:
        """Normalised latents [B, z, T_lat, H/16, W/16] of `video` [B, 3, T, H, W] in [-1, 1] (posterior mode)."""
        raw = self.vae.encode(video.to(self.vae.dtype)).latent_dist.mode()
        return ((raw - self.latents_mean) * self.latents_inv_std).to(video.dtype)

    def decode(self, latents: Tensor) -> Tensor:
        """Video [B, 3, T, H, W] in [-1, 1] from normalised latents [B, z, T_lat, h, w]."""
        raw = latents.to(self.vae.dtype) / self.latents_inv_std + self.latents_mean
        return self.vae.decode(raw).sample.to(latents.dtype).clamp(-1.0, 1.0)


def _check_config(folder: Path, stored: dict, vae_class: type) -> None:
    """Check the `vae_class` (`AutoencoderKLWan`) that `folder/config.json` (`stored`) describes against the weights'
    headers, on a model built on the meta device, before diffusers allocates one: a config of
    sizes its weights do not have (base_dim 10**6) had diffusers allocate it (108 TB asked for) before it compared
    shapes, and one it cannot build (dim_mult longer than temperal_downsample) raised an IndexError."""
    path = folder / "config.json"
    _check_types(path, stored)
    tensors = index_tensors(folder)  # headers only: the weights' files, and every weight stored as floating point
    defaults = inspect.signature(vae_class.__init__).parameters
    levels = stored.get("dim_mult", defaults["dim_mult"].default)
    blocks = stored.get("num_res_blocks", defaults["num_res_blocks"].default)
    # The model holds at least a tensor per residual block of each level: bounded so, building it is quick.
    if blocks * len(levels) > len(tensors):
        raise CheckpointError(f"{path}: num_res_blocks={blocks!r} on each of dim_mult's {len(levels)} level(s); "
                              f"expected a positive integer, and at most as many blocks in all as the weights hold "
                              f"tensors ({len(tensors)})")
    try:
        with torch.device("meta"):
            vae = vae_class.from_config(stored)
    except (TypeError, ValueError, IndexError, RuntimeError) as error:
        raise CheckpointError(f"{path}: cannot build the {WAN_VAE_CLASS} from it ({error})") from None
    check_state_dict(vae, tensors, folder)
    config = vae.config
    for name in ("latents_mean", "latents_std"):
        values = getattr(config, name)  # lists of numbers (`_check_types`)
        if len(values) != config.z_dim or not all(math.isfinite(v) for v in values):
            raise CheckpointError(f"{path}: {name} must hold z_dim={config.z_dim} finite values")
    if min(config.latents_std) <= 0:
        raise CheckpointError(f"{path}: latents_std must be positive, got {config.latents_std}")
    # Each encoder stage but the last halves the frame, after the patchify; the pipeline sizes latents by the
    # config's own factors, so they must be the architecture's.
    spatial = (config.patch_size or 1) * 2 ** (len(config.dim_mult) - 1)
    temporal = 2 ** sum(config.temperal_downsample)
    if (config.scale_factor_spatial, config.scale_factor_temporal) != (spatial, temporal):
        raise CheckpointError(
            f"{path}: scale_factor_spatial {config.scale_factor_spatial} and scale_factor_temporal "
            f"{config.scale_factor_temporal}; the architecture (patch_size, dim_mult, temperal_downsample) "
            f"compresses {spatial}x in space and {temporal}x in time")


def _check_types(path: Path, stored: dict) -> None:
    """Each `AutoencoderKLWan` argument in `stored` (`path`'s fields) of the JSON type diffusers takes it as."""
    def is_int(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def is_number(value: object) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)

    def fail(name: str, expected: str) -> None:
        raise CheckpointError(f"{path}: {name}={stored[name]!r}; expected {expected}")

    for name in (*_POSITIVE_INTS, *_OPTIONAL_POSITIVE_INTS):
        optional = name in _OPTIONAL_POSITIVE_INTS
        if name in stored and not (optional and stored[name] is None) and not (is_int(stored[name])
                                                                              and stored[name] >= 1):
            fail(name, "a positive integer" + (" or null" if optional else ""))
    if "dim_mult" in stored and not (isinstance(stored["dim_mult"], list) and stored["dim_mult"]
                                     and all(is_int(v) and v >= 1 for v in stored["dim_mult"])):
        fail("dim_mult", "a list of positive integer channel multipliers, one per level")
    if "temperal_downsample" in stored and not (isinstance(stored["temperal_downsample"], list)
                                                and all(isinstance(v, bool) for v in stored["temperal_downsample"])):
        fail("temperal_downsample", "a list of true or false, one per level but the last")
    for name in _NUMBER_LISTS:
        if name in stored and not (isinstance(stored[name], list) and all(is_number(v) for v in stored[name])):
            fail(name, "a list of numbers")
    if "dropout" in stored and not (is_number(stored["dropout"]) and 0 <= stored["dropout"] < 1):
        fail("dropout", "a number in [0, 1)")
    if "is_residual" in stored and not isinstance(stored["is_residual"], bool):
        fail("is_residual", "true or false")
