"""Per-step forward timing: our full pass, our GEN-only pass, and diffusers' reference full pass.

This is a development benchmark. It imports diffusers lazily (a `[dev]` dependency) to time the
reference `Cosmos3OmniTransformer` at the same config and weights; nothing on the serving path
imports this module.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from policy_server.model.config import Cosmos3TransformerConfig
from policy_server.model.transformer import Cosmos3OmniTransformer
from policy_server.pipeline.packing import ActionLayout, pack_request

# Policy-mode defaults of the benchmark request.
DEFAULT_FPS = 10.0          # pixel frame rate, Hz (sets the fps-modulated temporal positions)
DEFAULT_TIMESTEP = 700.0    # scheduler timestep (sigma * 1000) on every noisy row
DEFAULT_DOMAIN_ID = 4       # pusht


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
    action = ActionLayout(chunk, state_rows, tuple(range(state_rows)), domain_id) if config.action_gen else None
    input_ids = torch.randint(0, config.vocab_size, (n_text,), generator=generator).tolist()
    seq = pack_request(config, input_ids, vision_shape, clean_frames=[0], fps=fps, action=action, device=device,
                       sound_frames=sound_frames)
    vision = torch.randn(vision_shape, generator=generator)
    actions = torch.randn(action.num_rows, config.action_dim, generator=generator) if action else None
    sound = torch.randn(config.sound_dim, sound_frames, generator=generator) if sound_frames else None
    kwargs = seq.model_kwargs(vision.to(device), None if actions is None else actions.to(device), timestep,
                              None if sound is None else sound.to(device))
    return {**kwargs, "return_dict": False}


def random_model(config: Cosmos3TransformerConfig, seed: int = 0,
                 device: torch.device | str = "cpu") -> Cosmos3OmniTransformer:
    """A model with every weight drawn at random, norm scales and modality embeddings included.

    Matrices get std `1/sqrt(hidden_size)` (embedding tables std 1), norm scales `1 + 0.1 N(0, 1)`,
    biases and modality embeddings `0.1 N(0, 1)`, so activations stay O(1) through the stack and
    any mis-wired weight shows in the outputs. Built and drawn on `device` (a seed draws other weights on a
    GPU than on the CPU; an Edge-size model takes minutes to draw on a CPU).
    """
    generator = torch.Generator(device).manual_seed(seed)
    with torch.device(device):
        model = Cosmos3OmniTransformer(config).eval()
    matrix_std = config.hidden_size**-0.5
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, device=device)
            if name == "embed_tokens.weight":
                param.copy_(noise)
            elif param.ndim > 1 or name.endswith("fc.weight"):
                param.copy_(noise * matrix_std)
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)
    return model


def _reference_class():
    """diffusers' `Cosmos3OmniTransformer` (ImportError without the [dev] or [cosmos3] extra)."""
    from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer

    return Cosmos3OmniTransformer


def reference_unavailable() -> str | None:
    """Why diffusers' reference transformer cannot be built here (diffusers >= 0.42.1, the [dev] or [cosmos3]
    extra, is not installed), or None when it can: checked before a bench that ends by timing it starts."""
    try:
        _reference_class()
    except ImportError as error:
        return f"diffusers' Cosmos3OmniTransformer cannot be imported ({error})"
    return None


def reference_model(model: Cosmos3OmniTransformer):
    """diffusers' `Cosmos3OmniTransformer` with the same config, weights and device (dev dependency).

    The reference is built in fp32 (its default); time `model` in fp32 for a like-for-like figure.
    """
    reference = _reference_class()(**dataclasses.asdict(model.config))
    reference.load_state_dict(model.state_dict(), strict=True)
    return reference.to(device=model.device).eval()


def measure_forward(config: Cosmos3TransformerConfig, n_text: int = 40,
                    vision_shape: tuple[int, int, int, int] = (16, 3, 8, 8), chunk: int = 8,
                    repeats: int = 50, device: torch.device | str = "cpu", warmup: int = 5,
                    seed: int = 0, state_rows: int = 0, reference: bool = True) -> dict:
    """Median ms of one denoising-step call, three ways, timed interleaved in one run.

    - `full_ms`: our `forward` (both pathways, diffusers-equivalent);
    - `gen_only_ms`: `embed_gen` + `gen_stack` + `heads` against UND K/V prefilled once, with the
      GEN layout (rows, rotary tables) built once per request (what the sampler runs every step);
    - `reference_full_ms`: diffusers' `Cosmos3OmniTransformer.forward` at the same weights (None without
      `reference`: not built, so that no diffusers is needed).
    `ratio_gen_only_vs_reference` is `reference_full_ms / gen_only_ms` (the GEN-only speed-up; None without
    `reference`). `state_rows`: the clean state rows before the chunk (1 for an embodiment with state, as its ticks
    carry).
    """
    device = torch.device(device)
    model = random_model(config, seed).to(device)
    kwargs = policy_step_kwargs(config, n_text, vision_shape, chunk, device=device, seed=seed, state_rows=state_rows)
    und_len = kwargs["und_len"]

    with torch.inference_mode():
        und_kv = model.prefill_und(kwargs["input_ids"], kwargs["position_ids"][:, :und_len])
        layout = model.gen_layout(**kwargs)

        def gen_only():
            gen = model.embed_gen(**kwargs, layout=layout)
            return model.heads(model.gen_stack(gen, und_kv), gen)

        calls = {"full_ms": lambda: model(**kwargs), "gen_only_ms": gen_only}
        if reference:
            diffusers_model = reference_model(model)
            calls["reference_full_ms"] = lambda: diffusers_model(**kwargs)
        result = interleaved_medians(calls, device, repeats, warmup)
    result.setdefault("reference_full_ms", None)
    result["ratio_gen_only_vs_reference"] = result["reference_full_ms"] / result["gen_only_ms"] if reference else None
    result["text_tokens"] = n_text
    result["gen_tokens"] = kwargs["sequence_length"] - und_len
    return result


def interleaved_medians(calls: dict[str, Callable[[], object]], device: torch.device, repeats: int,
                        warmup: int) -> dict[str, float]:
    """Median ms of each call, timed one after the other round by round (so drift hits them alike), after
    `warmup` untimed rounds."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for repeat in range(warmup + repeats):
        for name, call in calls.items():
            elapsed = _time_ms(call, device)
            if repeat >= warmup:
                samples[name].append(elapsed)
    return {name: statistics.median(values) for name, values in samples.items()}


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
