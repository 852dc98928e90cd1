"""Per-step forward timing: our full pass, our GEN-only pass, and diffusers' reference full pass.

This is a development benchmark. It imports diffusers lazily (a `[dev]` dependency) to time the
reference `Cosmos3OmniTransformer` at the same config and weights; nothing on the serving path
imports this module.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from policy_server.model.config import Cosmos3TransformerConfig
from policy_server.model.transformer import Cosmos3OmniTransformer

# Policy-mode defaults of the benchmark request.
DEFAULT_FPS = 10.0          # pixel frame rate, Hz (sets the fps-modulated temporal positions)
DEFAULT_TIMESTEP = 700.0    # scheduler timestep (sigma * 1000) on every noisy row
DEFAULT_DOMAIN_ID = 4       # pusht
VAE_TEMPORAL_COMPRESSION = 4


def policy_step_kwargs(config: Cosmos3TransformerConfig, n_text: int, vision_shape: tuple[int, int, int, int],
                       chunk: int, device: torch.device | str = "cpu", seed: int = 0,
                       fps: float = DEFAULT_FPS, timestep: float = DEFAULT_TIMESTEP,
                       domain_id: int = DEFAULT_DOMAIN_ID, state_rows: int = 0,
                       sound_frames: int = 0) -> dict:
    """`forward` kwargs of one policy-mode step with random text ids and latents.

    Layout `[text | vision (frame 0 clean, later frames noisy) | sound | action rows]` with Cosmos3's
    unified mRoPE (fps-modulated float positions, modality margin, spatial reset). `vision_shape` is
    the latent `(C, T, H, W)`. The action stream holds `state_rows` clean rows (current state, as
    DROID serving does) before `chunk` noisy rows; `sound_frames > 0` adds noisy sound rows (needs
    `config.sound_gen`).
    """
    generator = torch.Generator().manual_seed(seed)
    c, t, h, w = vision_shape
    p = config.latent_patch_size
    gh, gw = -(-h // p), -(-w // p)
    per_frame = gh * gw
    n_vision = t * per_frame
    offset = n_text + config.unified_3d_mrope_temporal_modality_margin
    base_ticks = config.base_fps / VAE_TEMPORAL_COMPRESSION

    text_pos = torch.arange(n_text, dtype=torch.float32).expand(3, -1)
    frame_t = torch.arange(t, dtype=torch.float32) / (fps / VAE_TEMPORAL_COMPRESSION) * base_ticks + offset
    vision_pos = torch.stack([
        frame_t.repeat_interleave(per_frame),
        torch.arange(gh, dtype=torch.float32).repeat_interleave(gw).repeat(t),
        torch.arange(gw, dtype=torch.float32).repeat(t * gh),
    ])
    n_sound = sound_frames
    n_action = state_rows + chunk
    # Action row i leads to pixel frame i + 1 - state_rows; sound frames tick at the sound latent rate.
    action_t = (torch.arange(n_action, dtype=torch.float32) + 1 - state_rows) / fps * base_ticks + offset
    sound_t = torch.arange(n_sound, dtype=torch.float32) / config.sound_latent_fps * config.base_fps + offset
    position_ids = torch.cat([
        text_pos, vision_pos,
        torch.stack([sound_t, torch.zeros(n_sound), torch.zeros(n_sound)]),
        torch.stack([action_t, torch.zeros(n_action), torch.zeros(n_action)]),
    ], dim=1)

    noisy_frames = torch.arange(1, t)
    vision_seq = torch.arange(n_text, n_text + n_vision)
    sound_seq = torch.arange(n_text + n_vision, n_text + n_vision + n_sound)
    action_seq = torch.arange(n_text + n_vision + n_sound, n_text + n_vision + n_sound + n_action)
    kwargs = dict(
        input_ids=torch.randint(0, config.vocab_size, (n_text,), generator=generator),
        text_indexes=torch.arange(n_text),
        position_ids=position_ids,
        und_len=n_text,
        sequence_length=n_text + n_vision + n_sound + n_action,
        vision_tokens=[torch.randn(1, c, t, h, w, generator=generator)],
        vision_token_shapes=[(t, gh, gw)],
        vision_sequence_indexes=vision_seq,
        vision_mse_loss_indexes=vision_seq[per_frame:],
        vision_timesteps=torch.full((len(noisy_frames) * per_frame,), timestep),
        vision_noisy_frame_indexes=[noisy_frames],
        return_dict=False,
    )
    if n_sound:
        kwargs.update(
            sound_tokens=[torch.randn(config.sound_dim, n_sound, generator=generator)],
            sound_token_shapes=[(n_sound, 1, 1)],
            sound_sequence_indexes=sound_seq,
            sound_mse_loss_indexes=sound_seq,
            sound_timesteps=torch.full((n_sound,), timestep),
            sound_noisy_frame_indexes=[torch.arange(n_sound)],
        )
    if config.action_gen:
        noisy_rows = torch.arange(state_rows, n_action)
        kwargs.update(
            action_tokens=[torch.randn(n_action, config.action_dim, generator=generator)],
            action_token_shapes=[(n_action, 1, 1)],
            action_sequence_indexes=action_seq,
            action_mse_loss_indexes=action_seq[noisy_rows],
            action_timesteps=torch.full((chunk,), timestep),
            action_noisy_frame_indexes=[noisy_rows],
            action_domain_ids=[torch.tensor([domain_id])],
        )
    return {k: _to(v, device) for k, v in kwargs.items()}


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    return value


def random_model(config: Cosmos3TransformerConfig, seed: int = 0) -> Cosmos3OmniTransformer:
    """A model with every weight drawn at random, norm scales and modality embeddings included.

    Matrices get std `1/sqrt(hidden_size)` (embedding tables std 1), norm scales `1 + 0.1 N(0, 1)`,
    biases and modality embeddings `0.1 N(0, 1)`, so activations stay O(1) through the stack and
    any mis-wired weight shows in the outputs.
    """
    generator = torch.Generator().manual_seed(seed)
    model = Cosmos3OmniTransformer(config).eval()
    matrix_std = config.hidden_size**-0.5
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name == "embed_tokens.weight":
                param.copy_(noise)
            elif param.ndim > 1 or name.endswith("fc.weight"):
                param.copy_(noise * matrix_std)
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)
    return model


def reference_model(model: Cosmos3OmniTransformer):
    """diffusers' `Cosmos3OmniTransformer` with the same config, weights and device (dev dependency).

    The reference is built in fp32 (its default); time `model` in fp32 for a like-for-like figure.
    """
    from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer as Reference

    reference = Reference(**dataclasses.asdict(model.config))
    reference.load_state_dict(model.state_dict(), strict=True)
    return reference.to(device=model.device).eval()


def measure_forward(config: Cosmos3TransformerConfig, n_text: int = 40,
                    vision_shape: tuple[int, int, int, int] = (16, 3, 8, 8), chunk: int = 8,
                    repeats: int = 50, device: torch.device | str = "cpu", warmup: int = 5,
                    seed: int = 0) -> dict:
    """Median ms of one denoising-step call, three ways, timed interleaved in one run.

    - `full_ms`: our `forward` (both pathways, diffusers-equivalent);
    - `gen_only_ms`: `embed_gen` + `gen_stack` + `heads` against UND K/V prefilled once, with the
      GEN layout (rows, rotary tables) built once per request (what the sampler runs every step);
    - `reference_full_ms`: diffusers' `Cosmos3OmniTransformer.forward` at the same weights.
    `ratio_gen_only_vs_reference` is `reference_full_ms / gen_only_ms` (the GEN-only speed-up).
    """
    device = torch.device(device)
    model = random_model(config, seed).to(device)
    reference = reference_model(model)
    kwargs = policy_step_kwargs(config, n_text, vision_shape, chunk, device=device, seed=seed)
    und_len = kwargs["und_len"]

    with torch.inference_mode():
        und_kv = model.prefill_und(kwargs["input_ids"], kwargs["position_ids"][:, :und_len])
        layout = model.gen_layout(**kwargs)

        def gen_only():
            gen = model.embed_gen(**kwargs, layout=layout)
            return model.heads(model.gen_stack(gen, und_kv), gen)

        calls = {"full_ms": lambda: model(**kwargs), "gen_only_ms": gen_only,
                 "reference_full_ms": lambda: reference(**kwargs)}
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for repeat in range(warmup + repeats):
            for name, call in calls.items():
                elapsed = _time_ms(call, device)
                if repeat >= warmup:
                    samples[name].append(elapsed)

    result = {name: statistics.median(values) for name, values in samples.items()}
    result["ratio_gen_only_vs_reference"] = result["reference_full_ms"] / result["gen_only_ms"]
    result["text_tokens"] = n_text
    result["gen_tokens"] = kwargs["sequence_length"] - und_len
    return result


def _time_ms(call, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1000.0


def embedded_like_config() -> Cosmos3TransformerConfig:
    """A config shaped like the embedded model: D=128, F=384, 4 layers, 4 heads, 2 KV heads, hd 32."""
    return Cosmos3TransformerConfig(
        head_dim=32, hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=4, vocab_size=512, latent_channel=16, patch_latent_dim=64, rope_axes_dim=[6, 5, 5],
        action_gen=True, action_dim=16,
    )


if __name__ == "__main__":
    import json

    print(json.dumps(measure_forward(embedded_like_config()), indent=2))
