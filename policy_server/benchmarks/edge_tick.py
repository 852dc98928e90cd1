"""One Cosmos3 Edge-size policy tick on a device, with random weights: ms per GEN call, MFU, what fits a budget.

    python -m policy_server.benchmarks.edge_tick --device cuda --dtype bf16 --out runs/gpu/edge_tick.json

The Edge backbone's shapes (../shared/reference/cosmos3.md: 28 layers, D 2048, 16 heads, 8 KV heads, hd 128,
relu² MLP of 9216) at one 256x256 canvas, a 32-action chunk (9 latent frames of 16x16 after the Wan2.2 VAE's
16x spatial and 4x temporal compression) and a 200-token prompt. Timed, interleaved: one GEN call (embed, the
GEN stack, heads) of one branch, and of both CFG branches as one batch (what an uncached step runs), plus the
UND prefill; on CUDA the two calls again with the GEN stack replayed from a CUDA graph (`pipeline/cuda_graphs.py`),
whose difference from the eager call is the launch overhead it removes; with `--compile`, with the stack compiled
(`Cosmos3OmniTransformer.compiled_gen_stack`), eager and graphed. MFU counts the matmul and attention FLOPs of a
call against the device's dense bf16 peak. The uncached tick and the most uncached steps that fit `--budget-ms`
follow from the calls as the server runs them (compiled and graphed on CUDA, where measured); the VAE's encode
and decode are not in them: the random-weight check has no VAE.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from policy_server.benchmarks.forward import interleaved_medians, policy_step_kwargs, random_model
from policy_server.model.boundary import GenInput, UndKV
from policy_server.model.config import Cosmos3TransformerConfig
from policy_server.pipeline.cuda_graphs import GraphedGenStack

# Dense bf16 peaks (TFLOP/s) by device name, from the vendors' data sheets (SXM parts; without sparsity).
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "RTX 4090": 165.0}


def edge_config() -> Cosmos3TransformerConfig:
    """The Cosmos3 Edge (Nemotron 2B) transformer config of ../shared/reference/cosmos3.md."""
    return Cosmos3TransformerConfig(
        num_hidden_layers=28, hidden_size=2048, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=9216, hidden_act="relu2", vocab_size=131072, rms_norm_eps=1e-5, rope_theta=1e8,
        rope_axes_dim=[24, 20, 20], qk_norm_for_text=False, use_und_k_norm_for_gen=True, latent_channel=48,
        patch_latent_dim=192, action_gen=True, action_dim=64,
    )


def gen_call_flops(config: Cosmos3TransformerConfig, gen_tokens: int, text_tokens: int) -> tuple[float, float]:
    """`(matmul, attention)` FLOPs of one GEN-stack call (one branch): the projections and the MLP, then the
    scores and the weighted values of every GEN query over the text and GEN keys."""
    d, hd = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    mlp_matrices = 2 if config.hidden_act == "relu2" else 3
    per_token = 2 * d * (q + 2 * kv) + 2 * q * d + 2 * mlp_matrices * d * config.intermediate_size
    attention = 4 * gen_tokens * (gen_tokens + text_tokens) * q
    return config.num_hidden_layers * gen_tokens * per_token, config.num_hidden_layers * attention


def measure(config: Cosmos3TransformerConfig, device: torch.device, dtype: torch.dtype, text_tokens: int,
            vision_shape: tuple[int, int, int, int], chunk: int, repeats: int, warmup: int = 3,
            compiled: bool = False) -> dict:
    """Median ms of the prefill, one branch's GEN call and both branches' as one batch, eager and (on CUDA) with
    the GEN stack from a CUDA graph, interleaved; with `compiled`, also with the layers compiled (and graphed on
    CUDA), and the compile's seconds."""
    model = random_model(config, device=device).to(dtype)
    model.time_embedder.float()  # as Cosmos3 keeps it, whatever the load dtype
    kwargs = policy_step_kwargs(config, text_tokens, vision_shape, chunk, device=device)
    und_len = kwargs["und_len"]
    with torch.inference_mode():
        ids, positions = kwargs["input_ids"], kwargs["position_ids"][:, :und_len]
        und_kv = model.prefill_und(ids, positions)
        layout = model.gen_layout(**kwargs)
        pair_kv = UndKV.stack([und_kv, und_kv])

        def call(stack):
            gen = model.embed_gen(**kwargs, layout=layout)
            return model.heads(stack(gen, und_kv), gen)

        def pair(stack):
            gen = model.embed_gen(**kwargs, layout=layout)
            out = stack(GenInput.stack([gen, gen]), pair_kv)
            return [model.heads(out[b], gen) for b in range(2)]

        timed = {"prefill_ms": lambda: model.prefill_und(ids, positions), "gen_call_ms": lambda: call(model.gen_stack),
                 "cfg_pair_call_ms": lambda: pair(model.gen_stack)}
        if device.type == "cuda":
            graphs = GraphedGenStack(model.gen_stack)
            timed.update(gen_call_graphed_ms=lambda: call(graphs.capture),
                         cfg_pair_call_graphed_ms=lambda: pair(graphs.capture))
        if compiled:
            started = time.perf_counter()
            compiled_stack = model.compiled_gen_stack()
            call(compiled_stack), pair(compiled_stack)
            compile_s = time.perf_counter() - started
            timed.update(gen_call_compiled_ms=lambda: call(compiled_stack),
                         cfg_pair_call_compiled_ms=lambda: pair(compiled_stack))
            if device.type == "cuda":
                compiled_graphs = GraphedGenStack(compiled_stack)
                timed.update(gen_call_compiled_graphed_ms=lambda: call(compiled_graphs.capture),
                             cfg_pair_call_compiled_graphed_ms=lambda: pair(compiled_graphs.capture))
        result = interleaved_medians(timed, device, repeats, warmup)
        if compiled:
            result["compile_s"] = compile_s
    result["gen_tokens"] = kwargs["sequence_length"] - und_len
    result["text_tokens"] = und_len
    return result


def fitting_steps(prefill_ms: float, step_ms: float, budget_ms: float) -> int:
    """The most uncached sampler steps of `step_ms` each that fit in `budget_ms` after the prefill."""
    return max(0, int((budget_ms - prefill_ms) // step_ms))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m policy_server.benchmarks.edge_tick", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="torch device (cuda)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="weight dtype (bf16)")
    parser.add_argument("--text-tokens", type=int, default=200, help="instruction tokens prefilled (200)")
    parser.add_argument("--chunk", type=int, default=32, help="actions per chunk (latent frames 1 + chunk / 4)")
    parser.add_argument("--canvas", type=int, default=256, help="canvas side in pixels (latent side canvas / 16)")
    parser.add_argument("--steps", type=int, default=20, help="sampler steps of the uncached tick")
    parser.add_argument("--budget-ms", type=float, default=120.0,
                        help="the tick budget the report fits uncached steps in, ms (120)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per figure, interleaved (20)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help=f"dense peak of --dtype (default: by device name, {BF16_PEAK_TFLOPS})")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than Edge's 28 (a quick try)")
    parser.add_argument("--compile", action="store_true",
                        help="also time the GEN stack with its layers compiled by torch.compile (graphed on CUDA)")
    parser.add_argument("--out", type=Path, default=None, help="JSON report (default: stdout only)")
    args = parser.parse_args(argv)
    if args.chunk < 4 or args.chunk % 4 or args.canvas < 32 or args.canvas % 32:
        parser.error("--chunk must be a multiple of 4 and --canvas a multiple of 32 (the VAE and the patch)")
    if min(args.text_tokens, args.steps, args.repeats, 1 if args.layers is None else args.layers) < 1 \
            or not args.budget_ms > 0:
        parser.error("--text-tokens, --steps, --repeats and --layers must be at least 1 and --budget-ms above 0")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("edge_tick: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    config = edge_config()
    if args.layers is not None:
        config = dataclasses.replace(config, num_hidden_layers=args.layers)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    side = args.canvas // 16
    result = measure(config, device, dtype, args.text_tokens, (config.latent_channel, 1 + args.chunk // 4, side, side),
                     args.chunk, args.repeats, compiled=args.compile)
    flops = sum(gen_call_flops(config, result["gen_tokens"], result["text_tokens"]))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_tflops or next((tflops for key, tflops in BF16_PEAK_TFLOPS.items() if key in name), None)
    # The calls as the server runs them: compiled and from CUDA graphs where measured (its CUDA default).
    served = next(variant for variant in ("_compiled_graphed", "_graphed", "")
                  if f"gen_call{variant}_ms" in result)
    call_ms, pair_ms = result[f"gen_call{served}_ms"], result[f"cfg_pair_call{served}_ms"]

    def mfu(call_flops: float, ms: float) -> float | None:
        return None if peak is None else call_flops / (ms / 1e3) / (peak * 1e12)

    tick_ms = result["prefill_ms"] + args.steps * pair_ms
    report = {
        "device": name, "dtype": args.dtype, "layers": config.num_hidden_layers, **result,
        "gen_call_tflop": flops / 1e12,
        "peak_tflops": peak,
        **{f"mfu_gen_call{variant}": mfu(flops, result[f"gen_call{variant}_ms"])
           for variant in ("", "_graphed", "_compiled", "_compiled_graphed") if f"gen_call{variant}_ms" in result},
        **{f"mfu_cfg_pair_call{variant}": mfu(2 * flops, result[f"cfg_pair_call{variant}_ms"])
           for variant in ("", "_graphed", "_compiled", "_compiled_graphed") if f"gen_call{variant}_ms" in result},
        "served_calls": served.lstrip("_") or "eager",
        "uncached_tick_ms": tick_ms,  # with the prefill: the first tick of an instruction
        "uncached_tick_reused_prompt_ms": args.steps * pair_ms,  # a session's later ticks reuse the text K/V
        "budget_ms": args.budget_ms,
        "uncached_fits_budget": tick_ms <= args.budget_ms,
        # A CFG step runs both branches as one batch; without CFG, one call.
        "uncached_cfg_steps_in_budget": fitting_steps(result["prefill_ms"], pair_ms, args.budget_ms),
        "uncached_cfg_steps_in_budget_reused_prompt": fitting_steps(0.0, pair_ms, args.budget_ms),
        "uncached_steps_in_budget_without_cfg": fitting_steps(result["prefill_ms"], call_ms, args.budget_ms),
    }
    if "gen_call_graphed_ms" in result:  # what launching each kernel from Python costs a call
        report.update(launch_overhead_gen_call_ms=result["gen_call_ms"] - result["gen_call_graphed_ms"],
                      launch_overhead_cfg_pair_call_ms=result["cfg_pair_call_ms"] - result["cfg_pair_call_graphed_ms"])
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
