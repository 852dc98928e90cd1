"""Reasoner decoding: KV-cached autoregression over the UND weights, greedy and sampled."""

from __future__ import annotations

import pytest
import torch

from policy_server.benchmarks.forward import random_model
from policy_server.model import Cosmos3TransformerConfig
from policy_server.pipeline.reasoner import generate

TINY = dict(head_dim=16, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, vocab_size=300, latent_channel=8, patch_latent_dim=32,
            rope_axes_dim=[4, 2, 2], action_gen=True, action_dim=6)
CONFIGS = {
    "qwen": Cosmos3TransformerConfig(**TINY),
    "edge": Cosmos3TransformerConfig(**TINY, hidden_act="relu2", qk_norm_for_text=False,
                                     use_und_k_norm_for_gen=True, rms_norm_eps=1e-5, rope_theta=1e8),
}
PROMPT = torch.tensor([5, 17, 42, 99, 3, 250, 8, 61])


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    return random_model(CONFIGS[request.param], seed=3)


def logits_from_scratch(model, tokens: torch.Tensor) -> torch.Tensor:
    """Last-token logits recomputed with a fresh cache over the whole prefix."""
    return model.reasoner_forward(tokens, model.new_reasoner_cache(tokens.numel()))


def test_cached_decoding_matches_recomputation(model):
    with torch.no_grad():
        cache = model.new_reasoner_cache(PROMPT.numel() + 6)
        logits = model.reasoner_forward(PROMPT, cache)
        tokens = PROMPT
        for _ in range(6):
            torch.testing.assert_close(logits, logits_from_scratch(model, tokens), atol=1e-5, rtol=1e-5)
            token = torch.argmax(logits).reshape(1)
            tokens = torch.cat([tokens, token])
            logits = model.reasoner_forward(token, cache)
        torch.testing.assert_close(logits, logits_from_scratch(model, tokens), atol=1e-5, rtol=1e-5)


def test_chunked_prefill_matches_one_pass(model):
    """Several new tokens after a cached prefix (the masked path) equal one causal pass."""
    with torch.no_grad():
        one_pass = model.reasoner_forward(PROMPT, model.new_reasoner_cache(8), all_positions=True)
        cache = model.new_reasoner_cache(8)
        model.reasoner_forward(PROMPT[:3], cache)
        chunked = model.reasoner_forward(PROMPT[3:], cache, all_positions=True)
    torch.testing.assert_close(chunked, one_pass[3:], atol=1e-5, rtol=1e-5)


def test_greedy_generation_follows_the_argmax(model):
    tokens = list(generate(model, PROMPT, max_new_tokens=5))
    assert len(tokens) == 5
    prefix = PROMPT
    with torch.no_grad():
        for token in tokens:
            assert token == int(torch.argmax(logits_from_scratch(model, prefix)))
            prefix = torch.cat([prefix, torch.tensor([token])])


def test_sampling_is_reproducible_per_seed(model):
    def sample(seed):
        tokens = generate(model, PROMPT, max_new_tokens=12, temperature=1.5, top_k=200, top_p=0.99, seed=seed)
        return list(tokens)

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    greedy = list(generate(model, PROMPT, max_new_tokens=4))
    assert list(generate(model, PROMPT, max_new_tokens=4, temperature=0.8, top_k=1, seed=1)) == greedy
    assert list(generate(model, PROMPT, max_new_tokens=4, temperature=0.8, top_p=1e-6, seed=2)) == greedy


def test_stops_after_a_stop_token(model):
    greedy = list(generate(model, PROMPT, max_new_tokens=6))
    stop = greedy[2]
    stopped = list(generate(model, PROMPT, max_new_tokens=6, stop_token_ids=[stop]))
    assert stopped == greedy[: greedy.index(stop) + 1]
    assert list(generate(model, PROMPT, max_new_tokens=0)) == []


def test_reasoner_reads_only_und_weights(model):
    """Scrambling every GEN-side weight leaves the reasoner's logits unchanged."""
    gen_markers = ("_moe_gen", "add_", "norm_added", "to_add_out", "proj_in", "proj_out", "time_embedder",
                   "action_", "audio_", "k_norm_und_for_gen")
    scrambled = random_model(model.config, seed=3)
    with torch.no_grad():
        touched = 0
        for name, param in scrambled.named_parameters():
            if any(marker in name for marker in gen_markers):
                param.mul_(-3.0).add_(0.5)
                touched += 1
        assert touched > 0
        assert torch.equal(logits_from_scratch(model, PROMPT), logits_from_scratch(scrambled, PROMPT))


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(input_ids=torch.tensor([1, 300])), "input_ids"),
        (dict(input_ids=torch.tensor([[1, 2]])), "input_ids"),
    ],
)
def test_bad_arguments_are_named(model, arguments, named):
    call = dict(input_ids=PROMPT, max_new_tokens=3) | arguments
    with pytest.raises(ValueError, match=named):
        generate(model, **call)


def test_cache_overflow_is_reported(model):
    with torch.no_grad(), pytest.raises(ValueError, match="capacity"):
        model.reasoner_forward(PROMPT, model.new_reasoner_cache(PROMPT.numel() - 1))
