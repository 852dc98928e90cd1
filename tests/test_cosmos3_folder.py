"""The tiny offline `Cosmos3OmniPipeline` folder (tests/cosmos3_folder.py) and diffusers' policy call on it."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from cosmos3_folder import (
    SPECIAL_TOKENS,
    TINY_TRANSFORMER,
    build_tiny_cosmos3_folder,
    diffusers_policy_call,
    load_pipeline,
)
from safetensors.torch import load_file

PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"}


@pytest.fixture(scope="module", autouse=True)
def offline():
    """No hub access: HF offline mode, and any socket connection fails loudly."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        mp.setattr(socket.socket, "connect", refuse)
        mp.setattr(socket, "create_connection", refuse)
        yield


@pytest.fixture(scope="module")
def folder(tmp_path_factory, offline) -> Path:
    return build_tiny_cosmos3_folder(tmp_path_factory.mktemp("cosmos3") / "pipe", seed=0)


def image(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_folder_has_the_diffusers_layout(folder):
    index = read_json(folder / "model_index.json")
    assert index["_class_name"] == "Cosmos3OmniPipeline"
    assert index["enable_safety_checker"] is False
    assert index["default_use_system_prompt"] is True
    assert index["use_native_flow_schedule"] is False
    assert index["transformer"] == ["diffusers", "Cosmos3OmniTransformer"]
    assert index["vae"] == ["diffusers", "AutoencoderKLWan"]
    assert index["scheduler"] == ["diffusers", "UniPCMultistepScheduler"]
    assert index["text_tokenizer"][0] == "transformers" and "Qwen2Tokenizer" in index["text_tokenizer"][1]
    assert index["safety_checker"] == [None, None] and index["sound_tokenizer"] == [None, None]

    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert not [f for f in files if Path(f).suffix in PICKLE_SUFFIXES], files
    assert {Path(f).parts[0] for f in files} == {"model_index.json", "transformer", "vae", "text_tokenizer",
                                                 "scheduler"}

    transformer_files = {f.split("/", 1)[1] for f in files if f.startswith("transformer/")}
    weights = sorted(f for f in transformer_files if f.endswith(".safetensors"))
    assert "config.json" in transformer_files and weights
    if len(weights) > 1:  # sharded: the index must name exactly the shards
        shard_index = read_json(folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json")
        assert sorted(set(shard_index["weight_map"].values())) == weights
    config = read_json(folder / "transformer" / "config.json")
    assert config["_class_name"] == "Cosmos3OmniTransformer"
    assert config["action_gen"] is True and config["action_dim"] == TINY_TRANSFORMER["action_dim"]
    assert config["patch_latent_dim"] == config["latent_patch_size"] ** 2 * config["latent_channel"]
    state = {}
    for name in weights:
        state |= load_file(folder / "transformer" / name)
    assert state["embed_tokens.weight"].shape == (config["vocab_size"], config["hidden_size"])
    assert state["action_proj_out.fc.weight"].shape == (32, config["hidden_size"] * config["action_dim"])
    assert state["action_proj_out.fc.weight"].std() > 0.01  # randomised, not diffusers' init

    vae = read_json(folder / "vae" / "config.json")
    assert vae["_class_name"] == "AutoencoderKLWan"
    assert (vae["is_residual"], vae["patch_size"], vae["scale_factor_spatial"], vae["scale_factor_temporal"]) == (
        True, 2, 16, 4)
    assert vae["in_channels"] == vae["out_channels"] == 12 and len(vae["dim_mult"]) == 4
    assert vae["z_dim"] == config["latent_channel"]
    assert len(vae["latents_mean"]) == len(vae["latents_std"]) == vae["z_dim"]
    assert min(vae["latents_std"]) > 0 and len(set(vae["latents_mean"])) == vae["z_dim"]
    assert (folder / "vae" / "diffusion_pytorch_model.safetensors").is_file()

    template = (folder / "text_tokenizer" / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template and "add_generation_prompt" in template
    assert (folder / "text_tokenizer" / "tokenizer.json").is_file()

    scheduler = read_json(folder / "scheduler" / "scheduler_config.json")
    assert scheduler["_class_name"] == "UniPCMultistepScheduler"
    assert scheduler["use_karras_sigmas"] is True and scheduler["use_flow_sigmas"] is True
    assert scheduler["prediction_type"] == "flow_prediction"
    assert (scheduler["sigma_max"], scheduler["sigma_min"]) == (200.0, 0.147)


def test_loaded_components(folder):
    pipe = load_pipeline(folder)
    tokenizer = pipe.text_tokenizer
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    assert len(set(ids.values())) == len(SPECIAL_TOKENS)
    assert max(ids.values()) < len(tokenizer) <= pipe.transformer.config.vocab_size
    assert pipe.llm_special_tokens == {"start_of_generation": ids["<|vision_start|>"],
                                       "eos_token_id": ids["<|im_end|>"]}
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": "push the T."}], tokenize=True,
                                            add_generation_prompt=True, return_dict=True).input_ids
    assert encoded[0] == ids["<|im_start|>"] and ids["<|im_end|>"] in encoded
    assert tokenizer.decode(encoded) == "<|im_start|>user\npush the T.<|im_end|>\n<|im_start|>assistant\n"
    assert pipe.transformer.dtype == torch.float32 and pipe.safety_checker is None
    assert pipe.vae_scale_factor_spatial == 16 and pipe.vae_scale_factor_temporal == 4
    pipe.scheduler.set_timesteps(4)
    # Karras over sigma in [0.147, 200], mapped to flow sigmas s/(1+s); timesteps are int64 (truncated) s*1000.
    ramp = np.linspace(0, 1, 4)
    karras = (200 ** (1 / 7) + ramp * (0.147 ** (1 / 7) - 200 ** (1 / 7))) ** 7
    np.testing.assert_allclose(pipe.scheduler.sigmas[:-1].numpy(), karras / (1 + karras), rtol=1e-6)
    assert pipe.scheduler.timesteps.tolist() == [995, 973, 798, 128] and float(pipe.scheduler.sigmas[-1]) == 0


@pytest.mark.parametrize("embodiment,raw_dim,size,chunk", [
    ("pusht", 2, (64, 64), 4),
    ("pusht", 2, (50, 70), 4),
    ("bridge_orig_lerobot", 10, (64, 64), 8),
    ("robomind-franka-dual", 20, (50, 70), 5),
])
def test_policy_call_returns_actions(folder, embodiment, raw_dim, size, chunk):
    result = diffusers_policy_call(folder, image(*size), "push the T onto the target", embodiment,
                                   chunk_size=chunk, num_steps=3, seed=0)
    assert result.actions.shape == (chunk, raw_dim) and result.actions.dtype == np.float32
    assert np.isfinite(result.actions).all() and np.abs(result.actions).max() > 1e-3
    # Latents: content crop of the padded canvas; a non-multiple-of-16 image is first floored to a multiple of 16.
    latent_t = (chunk + 1 - 1) // 4 + 1
    h, w = (size[0] // 16 * 16) // 16, (size[1] // 16 * 16) // 16
    assert result.latents.shape == (1, TINY_TRANSFORMER["latent_channel"], latent_t, h, w)
    assert np.isfinite(result.latents).all()


def test_policy_call_is_deterministic(folder):
    frame = image(64, 64, seed=1)
    first = diffusers_policy_call(folder, frame, "push the T", "pusht", chunk_size=4, num_steps=3, seed=7)
    again = diffusers_policy_call(folder, frame, "push the T", "pusht", chunk_size=4, num_steps=3, seed=7,
                                  cache=False)
    other = diffusers_policy_call(folder, frame, "push the T", "pusht", chunk_size=4, num_steps=3, seed=8)
    np.testing.assert_array_equal(first.actions, again.actions)
    np.testing.assert_array_equal(first.latents, again.latents)
    assert not np.allclose(first.actions, other.actions)


def test_conditioning_reaches_the_actions(folder):
    """Instruction, image and embodiment all change the actions for the same initial noise (seed)."""
    frame = image(64, 64, seed=2)
    base = diffusers_policy_call(folder, frame, "push the T", "bridge_orig_lerobot", 4, 3, seed=0).actions
    text = diffusers_policy_call(folder, frame, "move it left", "bridge_orig_lerobot", 4, 3, seed=0).actions
    pixels = diffusers_policy_call(folder, image(64, 64, seed=3), "push the T", "bridge_orig_lerobot", 4, 3,
                                   seed=0).actions
    domain = diffusers_policy_call(folder, frame, "push the T", "fractal", 4, 3, seed=0).actions  # also 10-D
    for changed in (text, pixels, domain):
        assert changed.shape == base.shape and np.abs(changed - base).max() > 1e-4


def test_explicit_initial_noise_matches_the_generator_draw(folder):
    """Noise is drawn vision first, then actions, from one generator; passing it in reproduces the call."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition
    from PIL import Image

    pipe = load_pipeline(folder)
    frame, chunk = image(50, 70, seed=4), 4
    action = CosmosActionCondition(mode="policy", chunk_size=chunk, domain_name="pusht", resolution_tier=256,
                                   image=Image.fromarray(frame))
    prepared = pipe.prepare_latents(num_frames=chunk + 1, fps=24.0, generator=torch.Generator().manual_seed(5),
                                    device="cpu", dtype=torch.float32, action=action)
    latents, action_latents, vision_mask, image_size = prepared[0], prepared[2], prepared[5], prepared[9]
    assert vision_mask.flatten().tolist() == [1.0, 0.0]
    assert image_size.tolist() == [256.0, 320.0, 48.0, 64.0]  # canvas (256 tier, ratio 0.8), content 48x64

    g = torch.Generator().manual_seed(5)
    vision_noise = torch.randn(latents.shape, generator=g)
    action_noise = torch.randn(action_latents.shape, generator=g)
    assert action_latents.shape == (chunk, TINY_TRANSFORMER["action_dim"])
    torch.testing.assert_close(latents[:, :, 1:], vision_noise[:, :, 1:], rtol=0, atol=0)
    torch.testing.assert_close(action_latents[:, :2], action_noise[:, :2], rtol=0, atol=0)
    assert not action_latents[:, 2:].any()  # padded action channels start at zero
    # Frame 0 is the clean latent: the padded canvas (one frame suffices, the VAE is causal) encoded, then cropped.
    canvas, size, _, _ = pipe._prepare_action_video_conditioning([Image.fromarray(frame)], 256, 1, "cpu",
                                                                 torch.float32)
    with torch.no_grad():
        clean = pipe._remove_action_video_padding_from_latent(pipe._encode_video(canvas), size)
    torch.testing.assert_close(latents[:, :, :1], clean, rtol=1e-5, atol=1e-5)

    by_seed = diffusers_policy_call(folder, frame, "push the T", "pusht", chunk, 3, seed=5)
    passed = diffusers_policy_call(folder, frame, "push the T", "pusht", chunk, 3, seed=999,
                                   latents=latents, action_latents=action_latents)
    np.testing.assert_array_equal(by_seed.actions, passed.actions)
    np.testing.assert_array_equal(by_seed.latents, passed.latents)


def test_unsupported_embodiments_are_rejected(folder):
    with pytest.raises(ValueError, match="exceeds the model's trained action_dim"):
        diffusers_policy_call(folder, image(64, 64), "wave", "hand_pose", 4, 2, seed=0)  # 57-D > 32
    with pytest.raises(ValueError, match="no canonical action"):
        diffusers_policy_call(folder, image(64, 64), "pick", "libero", 4, 2, seed=0)


def test_build_is_seeded(tmp_path):
    a = build_tiny_cosmos3_folder(tmp_path / "a", seed=0)
    b = build_tiny_cosmos3_folder(tmp_path / "b", seed=0)
    c = build_tiny_cosmos3_folder(tmp_path / "c", seed=1)
    for part in ("transformer", "vae"):
        name = f"{part}/diffusion_pytorch_model.safetensors"
        sa, sb, sc = (load_file(x / name) for x in (a, b, c))
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    assert read_json(a / "vae/config.json") == read_json(b / "vae/config.json") != read_json(c / "vae/config.json")
    assert os.listdir(a / "text_tokenizer") and (a / "text_tokenizer/tokenizer.json").read_text() == (
        c / "text_tokenizer/tokenizer.json").read_text()


def test_our_sampler_from_the_folders_scheduler_config_walks_the_same_schedule(folder):
    from policy_server.pipeline.policy_config import PolicyConfig
    from policy_server.pipeline.schedulers import make_sampler, scheduler_settings

    config = PolicyConfig(**scheduler_settings(folder / "scheduler" / "scheduler_config.json"))
    pipe = load_pipeline(folder)
    for steps in (4, 35):
        pipe.scheduler.set_timesteps(steps)
        sampler = make_sampler(config.sampler, steps, config.shift, solver_order=config.solver_order,
                               karras=config.karras)
        assert sampler.timesteps == pipe.scheduler.timesteps.tolist()
        assert np.array_equal(np.array(sampler.sigmas, np.float32), pipe.scheduler.sigmas.numpy())
