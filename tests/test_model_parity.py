"""Numerical parity with diffusers' `Cosmos3OmniTransformer` 0.42.1 (the test-only reference).

Random tiny configs of both backbones are built in diffusers, saved with `save_pretrained`, loaded
with our loader, and run on policy-mode inputs laid out the way diffusers' Cosmos3 pipeline packs them
(clean first latent frame, noisy future frames, a clean state row plus noisy action rows with a
domain id, odd latent H/W, fps-modulated float mRoPE positions).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer as Reference

from policy_server.benchmarks.forward import random_model
from policy_server.model import (
    Cosmos3OmniTransformerOutput,
    Cosmos3TransformerConfig,
    load_transformer,
    save_transformer,
)

TOLERANCE = 1e-5

TINY = dict(head_dim=16, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, vocab_size=300, latent_channel=8, patch_latent_dim=32,
            rope_axes_dim=[4, 2, 2], action_gen=True, action_dim=6)
BACKBONES = {
    # Qwen3-VL style (Nano/Super): SwiGLU, RMSNorm, text q/k norm; with the sound heads of Nano.
    "qwen": TINY | dict(sound_gen=True, sound_dim=8),
    # Nemotron style (Edge): relu², fp32-upcast RMSNorm, no text q/k norm, k_norm_und_for_gen.
    "edge": TINY | dict(hidden_act="relu2", qk_norm_for_text=False, use_und_k_norm_for_gen=True,
                        rms_norm_eps=1e-5, rope_theta=1e8),
}


@pytest.fixture(scope="module", params=sorted(BACKBONES))
def models(request, tmp_path_factory):
    """(diffusers reference, ours loaded from the reference's `save_pretrained` directory)."""
    fields = BACKBONES[request.param]
    reference = Reference(**fields).eval()
    reference.load_state_dict(random_model(Cosmos3TransformerConfig(**fields), seed=1).state_dict())
    directory = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(directory)
    return reference, load_transformer(directory)


def text_positions(count: int) -> torch.Tensor:
    """Diffusers' `get_3d_mrope_ids_text_tokens(count, 0, use_float_positions=True)`."""
    return torch.arange(count, dtype=torch.float32).unsqueeze(0).expand(3, -1)


def grid_positions(t: int, h: int, w: int, offset: float, fps: float, tcf: int, base_tcf: int,
                   start_frame: int = 0, base_fps: float = 24.0) -> torch.Tensor:
    """Diffusers' `get_3d_mrope_ids_vae_tokens` with fps modulation and spatial reset."""
    frames = torch.arange(t, dtype=torch.float32) + start_frame
    frames = frames / (fps / tcf) * (base_fps / base_tcf) + offset
    return torch.stack([
        frames.view(-1, 1).expand(-1, h * w).flatten(),
        torch.arange(h).view(1, -1, 1).expand(t, -1, w).flatten().float(),
        torch.arange(w).view(1, 1, -1).expand(t, h, -1).flatten().float(),
    ])


def policy_inputs(config: Cosmos3TransformerConfig, seed: int = 0, timestep: float = 723.0,
                  domain_id: int = 5, n_text: int = 7, latent_thw=(3, 5, 7), chunk: int = 4,
                  mode: str = "policy") -> dict:
    """Action-mode forward kwargs, packed like diffusers' `Cosmos3OmniPipeline` (plus one clean state row).

    `mode`: "policy" (frame 0 clean; actions noisy), "forward_dynamics" (frame 0 and all actions
    clean) or "inverse_dynamics" (all frames clean; actions noisy).
    """
    g = torch.Generator().manual_seed(seed)
    t, h, w = latent_thw
    gh, gw = (h + 1) // 2, (w + 1) // 2
    per_frame, fps = gh * gw, 10.0
    n_vision, n_sound, n_action = t * per_frame, (6 if config.sound_gen else 0), chunk + 1
    offset = n_text + config.unified_3d_mrope_temporal_modality_margin
    positions = [text_positions(n_text), grid_positions(t, gh, gw, offset, fps, tcf=4, base_tcf=4)]
    if n_sound:
        positions.append(grid_positions(n_sound, 1, 1, offset, config.sound_latent_fps, tcf=1, base_tcf=1))
    positions.append(grid_positions(n_action, 1, 1, offset, fps, tcf=1, base_tcf=4, start_frame=0))
    noisy_frames = torch.arange(t if mode == "inverse_dynamics" else 1, t)
    vision_seq = torch.arange(n_text, n_text + n_vision)
    kwargs = dict(
        input_ids=torch.randint(0, config.vocab_size, (n_text,), generator=g),
        text_indexes=torch.arange(n_text),
        position_ids=torch.cat(positions, dim=1),
        und_len=n_text,
        sequence_length=n_text + n_vision + n_sound + n_action,
        vision_tokens=[torch.randn(1, config.latent_channel, t, h, w, generator=g)],
        vision_token_shapes=[(t, gh, gw)],
        vision_sequence_indexes=vision_seq,
        vision_mse_loss_indexes=vision_seq[per_frame:] if len(noisy_frames) else vision_seq[:0],
        vision_timesteps=torch.full((len(noisy_frames) * per_frame,), timestep),
        vision_noisy_frame_indexes=[noisy_frames],
    )
    start = n_text + n_vision
    if n_sound:
        sound_seq = torch.arange(start, start + n_sound)
        kwargs.update(sound_tokens=[torch.randn(config.sound_dim, n_sound, generator=g)],
                      sound_token_shapes=[(n_sound, 1, 1)], sound_sequence_indexes=sound_seq,
                      sound_mse_loss_indexes=sound_seq, sound_timesteps=torch.full((n_sound,), timestep),
                      sound_noisy_frame_indexes=[torch.arange(n_sound)])
        start += n_sound
    action_seq = torch.arange(start, start + n_action)
    # Row 0 is the current robot state, given as conditioning; forward dynamics gives every action.
    noisy_rows = torch.arange(n_action if mode == "forward_dynamics" else 1, n_action)
    kwargs.update(action_tokens=[torch.randn(n_action, config.action_dim, generator=g)],
                  action_token_shapes=[(n_action, 1, 1)], action_sequence_indexes=action_seq,
                  action_mse_loss_indexes=action_seq[noisy_rows],
                  action_timesteps=torch.full((len(noisy_rows),), timestep),
                  action_noisy_frame_indexes=[noisy_rows],
                  action_domain_ids=[torch.tensor([domain_id])])
    return kwargs


def assert_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.shape == reference.shape and ours.dtype == reference.dtype
    error = (ours - reference).abs().max().item()
    assert error <= TOLERANCE, f"max |ours - diffusers| = {error:.3g} > {TOLERANCE}"


@pytest.mark.parametrize("timestep", [998.0, 723.0, 12.0])
def test_policy_step_matches_diffusers(models, timestep):
    reference, ours = models
    kwargs = policy_inputs(ours.config, timestep=timestep)
    with torch.no_grad():
        ref_vision, ref_sound, ref_action = reference(**kwargs, return_dict=False)
        vision, sound, action = ours(**kwargs, return_dict=False)
    assert_close(vision[0], ref_vision[0])
    assert_close(action[0], ref_action[0])
    if ours.config.sound_gen:
        assert_close(sound[0], ref_sound[0])
    else:
        assert sound is None and ref_sound is None
    # Clean conditioning (latent frame 0, the state row) gets zero velocity; noisy rows do not.
    assert vision[0].shape == (1, ours.config.latent_channel, 3, 5, 7)
    assert torch.all(vision[0][:, :, 0] == 0) and vision[0][:, :, 1:].abs().amax() > 0
    assert torch.all(action[0][0] == 0) and action[0][1:].abs().amax() > 0


def test_every_domain_matches_and_domains_differ(models):
    reference, ours = models
    outputs = []
    for domain_id in (0, 8, 31):
        kwargs = policy_inputs(ours.config, domain_id=domain_id)
        with torch.no_grad():
            _, _, ref_action = reference(**kwargs, return_dict=False)
            _, _, action = ours(**kwargs, return_dict=False)
        assert_close(action[0], ref_action[0])
        outputs.append(action[0])
    assert not torch.allclose(outputs[0], outputs[1]) and not torch.allclose(outputs[1], outputs[2])


def test_return_dict_matches_tuple(models):
    _, ours = models
    kwargs = policy_inputs(ours.config, seed=3)
    with torch.no_grad():
        as_tuple = ours(**kwargs, return_dict=False)
        as_output = ours(**kwargs)
    assert isinstance(as_output, Cosmos3OmniTransformerOutput)
    assert torch.equal(as_output.sample[0], as_tuple[0][0])
    assert torch.equal(as_output.action[0], as_tuple[2][0])


def test_bf16_load_keeps_time_embedder_fp32_and_tracks_fp32(models, tmp_path):
    reference, ours = models
    reference.save_pretrained(tmp_path)
    low = load_transformer(tmp_path, dtype=torch.bfloat16)
    assert low.time_embedder.linear_1.weight.dtype == torch.float32
    assert low.proj_in.weight.dtype == low.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    kwargs = policy_inputs(ours.config)
    with torch.no_grad():
        vision, _, action = low(**kwargs, return_dict=False)
        vision32, _, action32 = ours(**kwargs, return_dict=False)
    assert vision[0].dtype == torch.bfloat16
    for low_out, full_out in ((vision[0], vision32[0]), (action[0], action32[0])):
        relative = (low_out.float() - full_out).norm() / full_out.norm()
        assert relative < 0.05, f"bf16 output drifts {relative:.3f} from fp32"


# Relative output error against diffusers at the same load dtype (measured: 8e-3, 1e-3, 6e-7).
LOW_PRECISION_TOLERANCE = {torch.bfloat16: 0.02, torch.float16: 4e-3, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_bf16_checkpoint_keeps_time_embedder_fp32_at_every_load_dtype(tmp_path, dtype):
    """bf16 storage, time embedder included: it loads fp32 whatever `dtype` (None leaves the stack bf16), and
    its fp32 embedding reaches the stack cast to the stack dtype, as in diffusers loaded at that dtype."""
    save_transformer(random_model(Cosmos3TransformerConfig(**BACKBONES["qwen"]), seed=1).to(torch.bfloat16), tmp_path)
    stack = dtype or torch.bfloat16
    ours = load_transformer(tmp_path, dtype=dtype)
    reference = Reference.from_pretrained(tmp_path, torch_dtype=stack).eval()
    for name, param in ours.named_parameters():
        assert param.dtype == (torch.float32 if name.startswith("time_embedder.") else stack), name
        assert torch.equal(param, reference.get_parameter(name)), name
    timesteps = torch.tensor([998.0, 723.0, 12.0])
    features = reference.time_proj(timesteps * ours.config.timestep_scale)
    torch.testing.assert_close(ours.timestep_embedding(timesteps),
                               reference.time_embedder(features.float()).to(stack))
    kwargs = policy_inputs(ours.config)
    for name in ("vision_tokens", "sound_tokens", "action_tokens"):  # diffusers takes latents in its dtype
        kwargs[name] = [tokens.to(stack) for tokens in kwargs[name]]
    with torch.no_grad():
        vision, _, action = ours(**kwargs, return_dict=False)
        ref_vision, _, ref_action = reference(**kwargs, return_dict=False)
    for out, ref in ((vision[0], ref_vision[0]), (action[0], ref_action[0])):
        assert out.dtype == ref.dtype == stack
        relative = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert relative < LOW_PRECISION_TOLERANCE[stack], f"{relative:.3g} from diffusers at {stack}"


def test_config_round_trips_through_diffusers(models):
    reference, ours = models
    ours_fields = dataclasses.asdict(ours.config)
    for name, value in ours_fields.items():
        assert reference.config[name] == value, name


@pytest.mark.parametrize("mode", ["forward_dynamics", "inverse_dynamics"])
def test_dynamics_modes_match_diffusers(models, mode):
    reference, ours = models
    kwargs = policy_inputs(ours.config, mode=mode)
    with torch.no_grad():
        ref_vision, _, ref_action = reference(**kwargs, return_dict=False)
        vision, _, action = ours(**kwargs, return_dict=False)
    assert_close(vision[0], ref_vision[0])
    assert_close(action[0], ref_action[0])
    predicted = action[0] if mode == "inverse_dynamics" else vision[0]
    assert predicted.abs().amax() > 0


def test_integer_positions_match_diffusers(models):
    """Without fps modulation the pipeline passes integer position ids."""
    reference, ours = models
    kwargs = policy_inputs(ours.config)
    kwargs["position_ids"] = kwargs["position_ids"].round().long()
    with torch.no_grad():
        ref_vision, _, ref_action = reference(**kwargs, return_dict=False)
        vision, _, action = ours(**kwargs, return_dict=False)
    assert_close(vision[0], ref_vision[0])
    assert_close(action[0], ref_action[0])
