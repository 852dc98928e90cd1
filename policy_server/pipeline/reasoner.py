"""Reasoner text generation: autoregressive decoding over the UND (text) weights with a KV cache.

Only `embed_tokens`, the UND half of every layer, `norm` and `lm_head` run. The prompt is prefilled
in one pass, then tokens are decoded one at a time against the cache. This path never touches the
GEN pathway or the diffusion-step cache (SeaCache), which only wraps `gen_stack`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from policy_server.model.transformer import Cosmos3OmniTransformer


def _check_arguments(model: Cosmos3OmniTransformer, input_ids: torch.Tensor, max_new_tokens: int,
                     temperature: float, top_k: int | None, top_p: float | None) -> None:
    if input_ids.ndim != 1 or input_ids.numel() == 0 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be a non-empty 1-D integer tensor, got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")
    vocab = model.config.vocab_size
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids must lie in [0, {vocab}), got values in [{low}, {high}]")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")


def sample_token(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                 generator: torch.Generator) -> int:
    """Pick the next token from `logits [vocab]`.

    `temperature == 0` is greedy (argmax, ties to the lowest id). Otherwise the logits are divided by
    `temperature`, cut to the `top_k` largest, then to the smallest set whose probability reaches
    `top_p` (always keeping the most likely token), and sampled with `generator` on CPU so a seed
    gives the same tokens on any device.
    """
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float().cpu() / temperature
    if top_k is not None and top_k < logits.numel():
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def generate(model: Cosmos3OmniTransformer, input_ids: torch.Tensor, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             stop_token_ids: Iterable[int] = (), seed: int = 0) -> Iterator[int]:
    """Yield up to `max_new_tokens` generated token ids for the prompt `input_ids [N]`.

    Greedy when `temperature == 0`, else temperature / top-k / top-p sampling from a CPU generator
    seeded with `seed` (same inputs and seed give the same tokens). Generation stops after a token in
    `stop_token_ids`, which is yielded as the last item so callers can tell why it stopped. Lazily
    evaluated: the prompt is prefilled at the first `next()`.
    """
    _check_arguments(model, input_ids, max_new_tokens, temperature, top_k, top_p)
    stop = {int(t) for t in stop_token_ids}
    return _decode(model, input_ids.to(model.device), max_new_tokens, temperature, top_k, top_p, stop, seed)


def _decode(model: Cosmos3OmniTransformer, input_ids: torch.Tensor, max_new_tokens: int, temperature: float,
            top_k: int | None, top_p: float | None, stop: set[int], seed: int) -> Iterator[int]:
    if max_new_tokens == 0:
        return
    generator = torch.Generator(device="cpu").manual_seed(seed)
    # The last generated token is never fed back, so the cache needs room for prompt + new - 1.
    cache = model.new_reasoner_cache(input_ids.numel() + max_new_tokens - 1)
    # Inference mode is entered per model call, never across a `yield`: the caller's code between
    # tokens must run in its own autograd mode.
    with torch.inference_mode():
        logits = model.reasoner_forward(input_ids, cache)
    for produced in range(1, max_new_tokens + 1):
        token = sample_token(logits, temperature, top_k, top_p, generator)
        yield token
        if token in stop or produced == max_new_tokens:
            return
        with torch.inference_mode():
            logits = model.reasoner_forward(torch.tensor([token], device=input_ids.device), cache)
