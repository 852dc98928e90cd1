"""Offline builder of a tiny random `diffusers.Cosmos3OmniPipeline` folder, and a diffusers policy call on it.

Test helper (not a test module). `build_tiny_cosmos3_folder` writes exactly what
`Cosmos3OmniPipeline.save_pretrained` writes for a real Cosmos3 checkpoint:

    model_index.json          _class_name Cosmos3OmniPipeline + the three pipeline flags
    transformer/              Cosmos3OmniTransformer config.json + diffusion_pytorch_model.safetensors
    vae/                      AutoencoderKLWan (Wan2.2 layout: 2x2 patchify, 16x spatial, 4x temporal, residual)
    text_tokenizer/           Qwen2TokenizerFast (byte-level BPE built in code) + chat_template.jinja
    scheduler/                UniPCMultistepScheduler with Karras flow sigmas (sigma_max 200, sigma_min 0.147)

Everything is built in code from a seed; nothing is downloaded. `diffusers_policy_call` loads such a folder with
`Cosmos3OmniPipeline.from_pretrained` and runs one policy-mode call on CPU; it is the reference future parity tests
compare the server against.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

# Tiny transformer: same kind of config as tests/test_model_parity.py (Qwen backbone, action pathway), with a
# wider action head so that 10-D (bridge/droid/fractal/umi) and 20-D (dual arm) embodiments fit as well as pusht.
TINY_TRANSFORMER = dict(
    head_dim=16, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
    num_hidden_layers=2, vocab_size=300, latent_channel=8, latent_patch_size=2, patch_latent_dim=32,
    rope_axes_dim=[4, 2, 2], action_gen=True, action_dim=32, num_embodiment_domains=32,
)

# Tiny Wan2.2-style VAE: Wan2.2 (TI2V-5B) ships base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1,2,4,4],
# num_res_blocks=2, is_residual=True, patch_size=2, in/out_channels=12 (3 RGB x 2x2 patchify),
# scale_factor_spatial=16 (8x conv x 2x patchify), scale_factor_temporal=4, temperal_downsample=[False,True,True].
TINY_VAE = dict(
    base_dim=8, decoder_base_dim=8, z_dim=TINY_TRANSFORMER["latent_channel"], dim_mult=[1, 2, 2, 2],
    num_res_blocks=1, attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0, is_residual=True,
    in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
)

# Scheduler as the Cosmos3 diffusers converter ships it (docs/reference cosmos3.md §5): a Karras-sigma UniPC over
# flow sigmas that approximates the native shift-5 schedule. In the Karras branch `flow_shift` is not applied.
SCHEDULER = dict(
    num_train_timesteps=1000, solver_order=2, prediction_type="flow_prediction", use_flow_sigmas=True,
    use_karras_sigmas=True, sigma_max=200.0, sigma_min=0.147, flow_shift=1.0, final_sigmas_type="zero",
)

PIPELINE_FLAGS = dict(enable_safety_checker=False, default_use_system_prompt=True, use_native_flow_schedule=False)

# Every token the pipeline (or a Qwen3-VL chat template) looks up by name.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_text_tokenizer():
    """Qwen2-style byte-level BPE: 256 byte tokens, a few merges, the Qwen special tokens, a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    # A handful of merges so that the tokenizer is a real BPE (common pieces of the action JSON caption).
    merges = [("t", "h"), ("th", "e"), ("i", "s"), ("e", "r"), ("i", "n"), ("o", "n"), ("a", "n"), ("r", "e"),
              ("\u0120", "t"), ("\u0120t", "h"), ("\u0120th", "e"), ("\u0120", "a"), ("\"", ":")]
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    model = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    fast = Qwen2TokenizerFast(
        tokenizer_object=tokenizer, unk_token=None, bos_token=None, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    if len(fast) > TINY_TRANSFORMER["vocab_size"]:
        raise AssertionError(f"tokenizer has {len(fast)} ids, transformer vocab is {TINY_TRANSFORMER['vocab_size']}")
    return fast


def _randomize_transformer(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter with seeded, well-scaled random values (diffusers' default init zeroes some heads)."""
    g = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                value = 1.0 + 0.1 * noise
            elif name.endswith("bias") or name.endswith("bias.weight") or "modality_embed" in name:
                value = 0.1 * noise
            elif name == "action_proj_in.fc.weight":
                value = noise / model.config.action_dim ** 0.5
            elif name == "action_proj_out.fc.weight":
                value = noise / hidden ** 0.5
            elif name == "embed_tokens.weight":
                value = noise
            elif param.ndim == 2:
                value = noise / param.shape[1] ** 0.5
            else:
                value = 0.1 * noise
            param.copy_(value.to(param.dtype))


def build_tiny_cosmos3_folder(path: Path, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Build a tiny random `Cosmos3OmniPipeline` fully offline and `save_pretrained` it into `path`;
    `max_shard_size` (e.g. "100KB") shards the weights as the published checkpoints are."""
    from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, Cosmos3OmniTransformer, UniPCMultistepScheduler

    path = Path(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = Cosmos3OmniTransformer(**TINY_TRANSFORMER).eval()
        _randomize_transformer(transformer, seed)
        g = torch.Generator().manual_seed(seed + 1)
        z_dim = TINY_VAE["z_dim"]
        latents_mean = (0.2 * torch.randn(z_dim, generator=g)).tolist()
        latents_std = (0.5 + torch.rand(z_dim, generator=g)).tolist()
        vae = AutoencoderKLWan(**TINY_VAE, latents_mean=latents_mean, latents_std=latents_std).eval()
    scheduler = UniPCMultistepScheduler(**SCHEDULER)
    pipe = Cosmos3OmniPipeline(
        transformer=transformer, text_tokenizer=build_text_tokenizer(), vae=vae, scheduler=scheduler,
        **PIPELINE_FLAGS,
    )
    sharding = {"max_shard_size": max_shard_size} if max_shard_size else {}
    pipe.save_pretrained(path, safe_serialization=True, **sharding)
    return path


class PolicyResult(NamedTuple):
    actions: np.ndarray | None  # [chunk, raw_action_dim] float32, model space, as diffusers returns it (not in FD)
    latents: np.ndarray | None  # [1, z, T_lat, h, w] final denoised, normalised video latents (output_type="latent")


def _to_pil(image_uint8_hwc: Any):
    """uint8 HWC numpy -> PIL. diffusers' VideoProcessor mishandles uint8 numpy (no /255), so hand it PIL."""
    from PIL import Image

    array = np.asarray(image_uint8_hwc)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
        raise ValueError(f"expected a uint8 HxWx3 image, got {array.dtype} {array.shape}")
    return Image.fromarray(array, mode="RGB")


_PIPELINES: dict[str, Any] = {}


def load_pipeline(folder: Path, cache: bool = True):
    """`Cosmos3OmniPipeline.from_pretrained(folder)` on CPU in float32 (cached per folder)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers import Cosmos3OmniPipeline

    key = str(Path(folder).resolve())
    if cache and key in _PIPELINES:
        return _PIPELINES[key]
    pipe = Cosmos3OmniPipeline.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    pipe.to("cpu")
    pipe.set_progress_bar_config(disable=True)
    if cache:
        _PIPELINES[key] = pipe
    return pipe


def diffusers_policy_call(folder: Path, image_uint8_hwc: np.ndarray, instruction: str, embodiment: str,
                          chunk_size: int, num_steps: int, seed: int, **extra: Any) -> PolicyResult:
    """One diffusers policy-mode call: image + instruction + embodiment + chunk -> actions (and video latents).

    `extra` may hold `resolution_tier` (default 256 here, diffusers' default is 480), `view_point`, `fps`,
    `guidance_scale` (default 1.0 here, i.e. no CFG as the Cosmos3 policy servers run; diffusers' default is 6.0),
    `negative_prompt`, `latents`, `action_latents`, `use_system_prompt`, `output_type` (default "latent"), `cache`,
    and any other `Cosmos3OmniPipeline.__call__` keyword.
    """
    return diffusers_action_call(folder, "policy", image_uint8_hwc[None], instruction, embodiment, chunk_size,
                                 num_steps, seed, **extra)


def diffusers_action_call(folder: Path, mode: str, frames_uint8_thwc: np.ndarray, instruction: str, embodiment: str,
                          chunk_size: int, num_steps: int, seed: int, raw_actions: np.ndarray | None = None,
                          **extra: Any) -> PolicyResult:
    """One diffusers action-mode call. `frames_uint8_thwc` [T, H, W, 3]: policy and forward_dynamics condition on
    frame 0 (passed as `image`), inverse_dynamics on the whole video; `raw_actions` [chunk, raw_dim] drive
    forward_dynamics. `extra` as for `diffusers_policy_call`, plus `pipe`: an already loaded pipeline to call."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition

    cache = extra.pop("cache", True)
    pipe = extra.pop("pipe", None) or load_pipeline(folder, cache=cache)
    frames = [_to_pil(frame) for frame in frames_uint8_thwc]
    action = CosmosActionCondition(
        mode=mode, chunk_size=chunk_size, domain_name=embodiment,
        resolution_tier=extra.pop("resolution_tier", 256),
        image=frames[0] if mode != "inverse_dynamics" else None,
        video=frames if mode == "inverse_dynamics" else None,
        raw_actions=None if raw_actions is None else torch.from_numpy(np.asarray(raw_actions, np.float32)),
        view_point=extra.pop("view_point", "ego_view"),
    )
    extra.setdefault("guidance_scale", 1.0)
    extra.setdefault("output_type", "latent")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        out = pipe(prompt=instruction, action=action, num_inference_steps=num_steps, generator=generator,
                   enable_safety_check=False, **extra)
    actions = out.action[0].float().numpy() if out.action is not None else None
    latents = out.video.float().cpu().numpy() if extra["output_type"] == "latent" else None
    return PolicyResult(actions=actions, latents=latents)
