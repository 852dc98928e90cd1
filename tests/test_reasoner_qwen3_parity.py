"""Reasoner parity with `transformers.Qwen3ForCausalLM`: the UND pathway is a Qwen3 text decoder.

A tiny random Qwen3 is copied into the UND weights of our `Cosmos3OmniTransformer` (GEN weights stay
random and must not matter). In fp32 and bf16, prefill logits, the logits of every decode step and the
greedy tokens of `ReasonerStream` equal Qwen3's, and our `TextTokenizer` renders and tokenizes the chat
prompt as transformers does. Text tokens sit at the same position on all three mRoPE axes, which is
Qwen3's 1-D RoPE; the prefill also equals Qwen3-VL's text decoder (Cosmos3-Nano's UND tower) with its
interleaved mRoPE sections.

Equal means bit for bit: with transformers' sdpa attention both sides call the same torch kernels and
round every op the same way (in bf16 a logit's ulp is ~1e-2, so any tolerance would hide a rounding change).
"""

from __future__ import annotations

import math

import pytest
import torch
from cosmos3_folder import TINY_TRANSFORMER, build_text_tokenizer
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3VLTextConfig, Qwen3VLTextModel

from policy_server.benchmarks.forward import random_model
from policy_server.model import Cosmos3TransformerConfig
from policy_server.model.text_tokenizer import TextTokenizer
from policy_server.pipeline.reasoner import PREFILL_CHUNK, ReasonerStream

NEW_TOKENS = 12
MESSAGES = [{"role": "user", "content": "What is on the table? Push the red block 3 cm left."}]

# Our config at its defaults (Cosmos3-Nano's Qwen3-VL-8B eps and rope theta) except the tiny sizes.
CONFIG = Cosmos3TransformerConfig(**TINY_TRANSFORMER)
# The same decoder in the field names Qwen3Config and Qwen3VLTextConfig share.
QWEN_FIELDS = dict(
    vocab_size=CONFIG.vocab_size, hidden_size=CONFIG.hidden_size, intermediate_size=CONFIG.intermediate_size,
    num_hidden_layers=CONFIG.num_hidden_layers, num_attention_heads=CONFIG.num_attention_heads,
    num_key_value_heads=CONFIG.num_key_value_heads, head_dim=CONFIG.head_dim, hidden_act=CONFIG.hidden_act,
    rms_norm_eps=CONFIG.rms_norm_eps, attention_bias=CONFIG.attention_bias, tie_word_embeddings=False,
)

# Qwen3 parameter names -> ours, per layer (everything else keeps its name once `model.` is stripped).
_QWEN3_RENAMES = {
    "self_attn.q_proj": "self_attn.to_q", "self_attn.k_proj": "self_attn.to_k",
    "self_attn.v_proj": "self_attn.to_v", "self_attn.o_proj": "self_attn.to_out",
    "self_attn.q_norm": "self_attn.norm_q", "self_attn.k_norm": "self_attn.norm_k",
}
# Our parameters with no Qwen3 counterpart: the GEN pathway and the modality heads.
_GEN_MARKERS = ("_moe_gen", ".add_", "to_add_out", "norm_added_", "proj_in", "proj_out", "time_embedder",
                "action_")


def qwen3_to_und(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`Qwen3ForCausalLM.state_dict()` -> the UND keys of our (diffusers-flat) state dict.

    `model.embed_tokens/norm/layers.*` lose the `model.` prefix, attention projections and q/k norms get
    diffusers' names (`q_proj` -> `to_q`, `q_norm` -> `norm_q`, ...); MLP, layer norms and `lm_head` keep theirs.
    """
    out = {}
    for key, value in state.items():
        key = key.removeprefix("model.")
        for old, new in _QWEN3_RENAMES.items():
            key = key.replace(f".{old}.", f".{new}.")
        out[key] = value
    return out


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Well-scaled random weights (HF's init, std 0.02 and unit norms, gives near-flat logits and argmax ties)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "embed_tokens" in name:
                param.copy_(noise)
            elif param.ndim == 2:
                param.copy_(noise / param.shape[1] ** 0.5)
            else:
                param.copy_(1.0 + 0.1 * noise)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=str)
def models(request, tmp_path_factory):
    """(Qwen3 reference, our transformer holding its weights as the UND pathway), both in one dtype."""
    qwen = Qwen3ForCausalLM(Qwen3Config(**QWEN_FIELDS, rope_theta=CONFIG.rope_theta))
    randomize(qwen, seed=5)
    ours = random_model(CONFIG, seed=6)
    loaded = ours.load_state_dict(qwen3_to_und(qwen.state_dict()), strict=False)
    assert loaded.unexpected_keys == []
    assert loaded.missing_keys and all(any(m in key for m in _GEN_MARKERS) for key in loaded.missing_keys)
    # Loaded in the dtype as a checkpoint is (`.to(bf16)` would also round Qwen3's fp32 RoPE frequencies).
    folder = tmp_path_factory.mktemp("qwen3")
    qwen.save_pretrained(folder)
    qwen = Qwen3ForCausalLM.from_pretrained(folder, dtype=request.param, attn_implementation="sdpa").eval()
    qwen.generation_config.eos_token_id = None  # generate exactly NEW_TOKENS tokens
    qwen.generation_config.pad_token_id = 0
    return qwen, ours.to(request.param)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(transformers' tokenizer of the tiny Cosmos3 folder, ours loaded from its `save_pretrained` folder)."""
    reference = build_text_tokenizer()
    folder = tmp_path_factory.mktemp("text_tokenizer")
    reference.save_pretrained(folder)
    return reference, TextTokenizer.from_dir(folder)


@pytest.fixture(scope="module")
def prompt(tokenizers) -> torch.Tensor:
    """The chat prompt `Engine.reason` builds: template with the assistant turn opened, tokenized."""
    _, ours = tokenizers
    ids = torch.tensor(ours.tokenize(ours.apply_chat_template(MESSAGES, add_generation_prompt=True)))
    assert ids.numel() > PREFILL_CHUNK  # the stream prefills in more than one chunk
    return ids


@pytest.mark.parametrize("messages", [
    MESSAGES,
    [{"role": "system", "content": "You are a robot."}, {"role": "user", "content": "héllo <|im_end|> wörld\n"}],
])
def test_chat_template_ids_equal_transformers(tokenizers, messages):
    reference, ours = tokenizers
    expected = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                             return_dict=True).input_ids
    assert ours.tokenize(ours.apply_chat_template(messages, add_generation_prompt=True)) == expected


def test_prefill_logits_equal_qwen3(models, prompt):
    qwen, ours = models
    with torch.no_grad():
        expected = qwen(prompt[None]).logits[0]
        logits = ours.reasoner_forward(prompt, ours.new_reasoner_cache(prompt.numel()), all_positions=True)
    torch.testing.assert_close(logits, expected, atol=0, rtol=0)


def test_prefill_logits_equal_qwen3_vl_text(prompt):
    rope = {"rope_type": "default", "rope_theta": CONFIG.rope_theta, "mrope_section": CONFIG.rope_axes_dim,
            "mrope_interleaved": True}
    text = Qwen3VLTextModel(Qwen3VLTextConfig(**QWEN_FIELDS, rope_parameters=rope, attn_implementation="sdpa"))
    lm_head = torch.nn.Linear(CONFIG.hidden_size, CONFIG.vocab_size, bias=False)
    randomize(text, seed=7)
    randomize(lm_head, seed=8)
    ours = random_model(CONFIG, seed=6)
    state = {f"model.{key}": value for key, value in text.state_dict().items()} | {"lm_head.weight": lm_head.weight}
    assert ours.load_state_dict(qwen3_to_und(state), strict=False).unexpected_keys == []
    with torch.no_grad():
        expected = lm_head(text.eval()(input_ids=prompt[None]).last_hidden_state)[0]
        logits = ours.reasoner_forward(prompt, ours.new_reasoner_cache(prompt.numel()), all_positions=True)
    torch.testing.assert_close(logits, expected, atol=0, rtol=0)


@pytest.fixture(scope="module")
def qwen_greedy(models, prompt):
    """`Qwen3ForCausalLM.generate(do_sample=False)`: new tokens, raw logits `[NEW_TOKENS, vocab]` before each."""
    qwen, _ = models
    out = qwen.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], do_sample=False,
                        max_new_tokens=NEW_TOKENS, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, prompt.numel():].tolist(), torch.cat(out.logits)


def greedy_stream(model, prompt: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
    """`ReasonerStream` greedy: its tokens and the logits of every `reasoner_forward` it ran."""
    forward, seen, tokens = model.reasoner_forward, [], []

    def recording(*args):
        seen.append(forward(*args))
        return seen[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model, "reasoner_forward", recording)
        stream = ReasonerStream(model, prompt, max_new_tokens=NEW_TOKENS)
        while not stream.done:
            if (token := stream.step()) is not None:
                tokens.append(token)
    return tokens, seen


@pytest.fixture(scope="module")
def stream_greedy(models, prompt):
    return greedy_stream(models[1], prompt)


def test_greedy_tokens_equal_qwen3_generate(qwen_greedy, stream_greedy):
    expected, _ = qwen_greedy
    assert len(set(expected)) > 1  # not a degenerate repeat of one token
    assert stream_greedy[0] == expected


def test_decode_step_logits_equal_qwen3(prompt, qwen_greedy, stream_greedy):
    """The logits after the whole prompt and after each fed-back token (the last token is never fed back)."""
    _, expected = qwen_greedy
    _, seen = stream_greedy
    chunks = math.ceil(prompt.numel() / PREFILL_CHUNK)
    assert len(seen) == chunks + NEW_TOKENS - 1
    # generate returns the logits upcast to fp32, which is exact.
    torch.testing.assert_close(torch.stack(seen[chunks - 1:]).float(), expected, atol=0, rtol=0)


def test_reason_on_a_diffusers_folder_uses_its_und_weights_lm_head_and_chat_template(tmp_path_factory):
    """A `Cosmos3OmniPipeline` folder served as is: its UND weights and `lm_head`, read back into a Qwen3, and
    its own tokenizer with its chat template (through transformers) give the tokens `Engine.reason` decodes and
    the logits of every step, bit for bit."""
    from cosmos3_folder import build_tiny_cosmos3_folder
    from transformers import AutoTokenizer

    from policy_server.pipeline.policy import PolicyPipeline

    folder = build_tiny_cosmos3_folder(tmp_path_factory.mktemp("cosmos3") / "pipe", seed=3)
    pipe = PolicyPipeline.from_pretrained(folder)
    und_to_qwen3 = {new: old for old, new in _QWEN3_RENAMES.items()}
    state = {}
    for key, value in pipe.transformer.state_dict().items():
        if any(marker in key for marker in _GEN_MARKERS):
            continue
        for new, old in und_to_qwen3.items():
            key = key.replace(f".{new}.", f".{old}.")
        state[key if key == "lm_head.weight" else f"model.{key}"] = value
    qwen = Qwen3ForCausalLM(Qwen3Config(**QWEN_FIELDS, rope_theta=CONFIG.rope_theta)).eval()
    qwen.load_state_dict(state, strict=True)

    reference_tokenizer = AutoTokenizer.from_pretrained(folder / "text_tokenizer")
    expected_prompt = reference_tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                                              return_dict=True).input_ids
    tokenizer = pipe.tokenizer
    prompt = torch.tensor(tokenizer.tokenize(tokenizer.apply_chat_template(MESSAGES)))
    assert prompt.tolist() == expected_prompt
    with torch.no_grad():
        expected = qwen.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], do_sample=False,
                                 max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
    tokens, seen = greedy_stream(pipe.transformer, prompt)
    assert tokens == expected.sequences[0, prompt.numel():].tolist() and len(set(tokens)) > 1
    chunks = math.ceil(prompt.numel() / PREFILL_CHUNK)
    torch.testing.assert_close(torch.stack(seen[chunks - 1:]).float(), torch.cat(expected.logits), atol=0, rtol=0)
