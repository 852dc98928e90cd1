"""Reasoner text generation: autoregressive decoding over the UND (text) weights with a KV cache.

Only `embed_tokens`, the UND half of every layer, `norm` and `lm_head` run. The prompt is prefilled
in chunks of `PREFILL_CHUNK` tokens, then tokens are decoded one at a time against the cache.
`ReasonerStream.step()` does one of these pieces of work at a time, so that a caller can stop between
any two (a deadline, a cancelled call) and run other work in between (the engine's control ticks).
This path never touches the GEN pathway or the diffusion-step cache (SeaCache), which only wraps
`gen_stack`.
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
    # In float64 (a float32 temperature of 1e-300 is 0), shifted by the maximum: a tiny temperature then
    # sends the others to -inf and keeps the maximum at 0, never inf - inf.
    logits = logits.double().cpu()
    logits = (logits - logits.max()) / temperature
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


PREFILL_CHUNK = 32  # prompt tokens per prefill step


class ReasonerStream:
    """Generation for one prompt `input_ids [N]`, one piece of work per `step()`.

    Greedy when `temperature == 0`, else temperature / top-k / top-p sampling from a CPU generator
    seeded with `seed` (same inputs and seed give the same tokens). Generation stops after
    `max_new_tokens` tokens or a token in `stop_token_ids` (which is still returned, so callers can
    tell why it stopped).
    """

    def __init__(self, model: Cosmos3OmniTransformer, input_ids: torch.Tensor, max_new_tokens: int,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 stop_token_ids: Iterable[int] = (), seed: int = 0) -> None:
        _check_arguments(model, input_ids, max_new_tokens, temperature, top_k, top_p)
        self._model = model
        self._prompt = input_ids.to(model.device)
        self._sampling = (temperature, top_k, top_p)
        self._stop = {int(t) for t in stop_token_ids}
        self._left = max_new_tokens
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        # The last generated token is never fed back, so the cache needs room for prompt + new - 1.
        self._cache = model.new_reasoner_cache(self._prompt.numel() + max(max_new_tokens - 1, 0))
        self._logits: torch.Tensor | None = None  # of the last token fed, once the prompt is in
        self.done = max_new_tokens == 0

    def step(self) -> int | None:
        """Prefill the next chunk of the prompt (returns None), or decode one token (returns it)."""
        # Inference mode per model call, never across steps: the caller's code in between runs in its own mode.
        with torch.inference_mode():
            filled = self._cache.length
            if filled < self._prompt.numel():
                logits = self._model.reasoner_forward(self._prompt[filled: filled + PREFILL_CHUNK], self._cache)
                if self._cache.length == self._prompt.numel():
                    self._logits = logits
                return None
            token = sample_token(self._logits, *self._sampling, self._generator)
            self._left -= 1
            self.done = token in self._stop or self._left == 0
            if not self.done:
                self._logits = self._model.reasoner_forward(
                    torch.tensor([token], device=self._prompt.device), self._cache)
            return token


def generate(model: Cosmos3OmniTransformer, input_ids: torch.Tensor, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             stop_token_ids: Iterable[int] = (), seed: int = 0) -> Iterator[int]:
    """Yield up to `max_new_tokens` generated token ids for the prompt `input_ids [N]` (see
    `ReasonerStream`). Arguments are checked at the call; the prompt is prefilled at the first `next()`."""
    stream = ReasonerStream(model, input_ids, max_new_tokens, temperature, top_k, top_p, stop_token_ids, seed)
    return _tokens(stream)


def _tokens(stream: ReasonerStream) -> Iterator[int]:
    while not stream.done:
        token = stream.step()
        if token is not None:
            yield token
