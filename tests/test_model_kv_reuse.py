"""Exact text K/V reuse: `prefill_und` once, then `embed_gen` + `gen_stack` + `heads` every step."""

from __future__ import annotations

import pytest
import torch

from policy_server.benchmarks.forward import policy_step_kwargs, random_model
from policy_server.model import Cosmos3TransformerConfig, GenInput, UndKV

TOLERANCE = 1e-5

TINY = dict(head_dim=16, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=3, vocab_size=300, latent_channel=8, patch_latent_dim=32,
            rope_axes_dim=[4, 2, 2], action_gen=True, action_dim=6)
CONFIGS = {
    "qwen": Cosmos3TransformerConfig(**TINY, sound_gen=True, sound_dim=8),
    "edge": Cosmos3TransformerConfig(**TINY, hidden_act="relu2", qk_norm_for_text=False,
                                     use_und_k_norm_for_gen=True, rms_norm_eps=1e-5, rope_theta=1e8),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    return random_model(CONFIGS[request.param], seed=2)


def step_kwargs(model, seed=0, timestep=700.0):
    sound = 5 if model.config.sound_gen else 0
    return policy_step_kwargs(model.config, n_text=9, vision_shape=(8, 3, 5, 6), chunk=4, seed=seed,
                              timestep=timestep, state_rows=1, sound_frames=sound)


def split_call(model, kwargs, und_kv=None, **embed_options):
    und_len = kwargs["und_len"]
    if und_kv is None:
        und_kv = model.prefill_und(kwargs["input_ids"], kwargs["position_ids"][:, :und_len])
    gen = model.embed_gen(**kwargs, **embed_options)
    return model.heads(model.gen_stack(gen, und_kv), gen)


def assert_outputs_close(split, full):
    for split_items, full_items in zip(split, full, strict=True):
        if full_items is None:
            assert split_items is None
            continue
        for a, b in zip(split_items, full_items, strict=True):
            error = (a - b).abs().max().item()
            assert error <= TOLERANCE, f"split path differs from forward by {error:.3g}"


def test_prefill_then_gen_stack_equals_forward(model):
    kwargs = step_kwargs(model)
    with torch.no_grad():
        assert_outputs_close(split_call(model, kwargs), model(**kwargs))


def test_one_prefill_serves_every_step(model):
    """The cached K/V do not depend on the step: reuse them across timesteps and noisy latents."""
    base = step_kwargs(model)
    with torch.no_grad():
        und_kv = model.prefill_und(base["input_ids"], base["position_ids"][:, : base["und_len"]])
        for step, timestep in enumerate((999.0, 500.0, 3.0)):
            kwargs = step_kwargs(model, seed=10 + step, timestep=timestep)
            kwargs["input_ids"] = base["input_ids"]  # same prompt, new latents and noise level
            assert_outputs_close(split_call(model, kwargs, und_kv), model(**kwargs))


def test_layout_built_once_serves_every_step(model):
    kwargs = step_kwargs(model)
    with torch.no_grad():
        layout = model.gen_layout(**kwargs)
        for step, timestep in enumerate((950.0, 20.0)):
            step_args = step_kwargs(model, seed=20 + step, timestep=timestep)
            plain, reused = split_call(model, step_args), split_call(model, step_args, layout=layout)
            assert torch.equal(plain[0][0], reused[0][0]) and torch.equal(plain[2][0], reused[2][0])


def test_batched_gen_stack_equals_one_request_at_a_time(model):
    """Requests sharing a layout run as one `[B, N_gen, D]` batch (micro-batching, training)."""
    base = step_kwargs(model)
    with torch.no_grad():
        layout = model.gen_layout(**base)
        prompts, gens, single = [], [], []
        for item, timestep in enumerate((900.0, 400.0, 50.0)):
            kwargs = step_kwargs(model, seed=30 + item, timestep=timestep)  # own prompt, latents and noise level
            prompts.append(model.prefill_und(kwargs["input_ids"], kwargs["position_ids"][:, : kwargs["und_len"]]))
            gens.append(model.embed_gen(**kwargs, layout=layout))
            single.append(model.gen_stack(gens[-1], prompts[-1]))
        batched = model.gen_stack(GenInput.stack(gens), UndKV.stack(prompts))
    assert batched.shape == (3, *single[0].shape)
    for row, alone in enumerate(single):
        assert (batched[row] - alone).abs().max().item() <= TOLERANCE


def test_batch_needs_one_layout_and_matching_kv(model):
    kwargs = step_kwargs(model)
    with torch.no_grad():
        und_kv = model.prefill_und(kwargs["input_ids"], kwargs["position_ids"][:, : kwargs["und_len"]])
        first, second = model.embed_gen(**kwargs), model.embed_gen(**kwargs)
        with pytest.raises(ValueError, match="same GenLayout"):
            GenInput.stack([first, second])
        with pytest.raises(ValueError, match="same B"):
            model.gen_stack(GenInput.stack([first, first]), UndKV.stack([und_kv] * 3))


def test_cached_keys_are_what_gen_queries_read(model):
    """UndKV keys are post norm+RoPE; on Edge the `k_norm_und_for_gen` version, unlike the causal keys."""
    kwargs = step_kwargs(model)
    und_len = kwargs["und_len"]
    with torch.no_grad():
        und_kv = model.prefill_und(kwargs["input_ids"], kwargs["position_ids"][:, :und_len])
        cache = model.new_reasoner_cache(und_len)
        model.reasoner_forward(kwargs["input_ids"], cache)  # fills the causal-path keys, same positions
    assert isinstance(und_kv, UndKV) and und_kv.num_layers == model.config.num_hidden_layers
    assert und_kv.keys[0].shape == (model.config.num_key_value_heads, und_len, model.config.head_dim)
    for layer in range(und_kv.num_layers):
        torch.testing.assert_close(und_kv.values[layer], cache.values[layer][:, :und_len])
        same_keys = torch.allclose(und_kv.keys[layer], cache.keys[layer][:, :und_len], atol=1e-6)
        assert same_keys == (not model.config.has_und_k_norm_for_gen)


def test_gen_input_layout(model):
    kwargs = step_kwargs(model)
    with torch.no_grad():
        gen = model.embed_gen(**kwargs)
    n_gen = kwargs["sequence_length"] - kwargs["und_len"]
    assert isinstance(gen, GenInput) and gen.und_len == kwargs["und_len"]
    assert gen.hidden.shape == (n_gen, model.config.hidden_size)
    assert gen.layout.rotary.cos.shape == gen.layout.rotary.sin.shape == (n_gen, model.config.head_dim)
    layout = gen.layout
    assert torch.equal(layout.vision.readout_rows, kwargs["vision_mse_loss_indexes"] - kwargs["und_len"])
    assert torch.equal(layout.action.readout_rows, kwargs["action_mse_loss_indexes"] - kwargs["und_len"])
    assert torch.equal(layout.vision.rows, kwargs["vision_sequence_indexes"] - kwargs["und_len"])


def test_time_embedding_only_on_noisy_rows(model):
    """Changing the timestep moves noisy rows' embeddings and leaves clean rows (frame 0, state row) alone."""
    with torch.no_grad():
        early = model.embed_gen(**step_kwargs(model, timestep=900.0))
        late = model.embed_gen(**step_kwargs(model, timestep=100.0))
    moved = (early.hidden - late.hidden).abs().amax(dim=1) > 0
    kwargs = step_kwargs(model)
    und_len = kwargs["und_len"]
    clean = torch.ones_like(moved)
    clean[kwargs["vision_mse_loss_indexes"] - und_len] = False
    clean[kwargs["action_mse_loss_indexes"] - und_len] = False
    if model.config.sound_gen:
        clean[kwargs["sound_mse_loss_indexes"] - und_len] = False
    assert torch.equal(moved, ~clean)


def test_same_inputs_and_seed_are_bit_identical(model):
    config = model.config
    twin = random_model(config, seed=2)
    kwargs, again = step_kwargs(model, seed=4), step_kwargs(model, seed=4)
    with torch.no_grad():
        first, second = model(**kwargs), twin(**again)
        split_first, split_second = split_call(model, kwargs), split_call(twin, again)
    for a, b in ((first, second), (split_first, split_second)):
        assert torch.equal(a[0][0], b[0][0]) and torch.equal(a[2][0], b[2][0])


def test_gen_stack_rejects_kv_of_another_prompt(model):
    kwargs = step_kwargs(model)
    with torch.no_grad():
        shorter = kwargs["und_len"] - 2
        other = model.prefill_und(kwargs["input_ids"][:shorter], kwargs["position_ids"][:, :shorter])
        gen = model.embed_gen(**kwargs)
        with pytest.raises(ValueError, match="und_len"):
            model.gen_stack(gen, other)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda kw: kw.update(vision_timesteps=kw["vision_timesteps"][:-1]), "vision_timesteps"),
        (lambda kw: kw.update(vision_mse_loss_indexes=kw["vision_mse_loss_indexes"] - 20),
         "vision_mse_loss_indexes"),
        (lambda kw: kw.update(vision_tokens=[kw["vision_tokens"][0][:, :3]]), "vision latent"),
        (lambda kw: kw.update(vision_token_shapes=[(3, 2, 2)]), "vision_token_shapes"),
        (lambda kw: kw.update(action_domain_ids=[torch.tensor([40])]), "domain ids"),
        (lambda kw: kw.update(position_ids=kw["position_ids"][:, :-1]), "position_ids"),
        (lambda kw: kw.update(vision_timestep=kw["vision_timesteps"]), "vision_timestep"),
    ],
)
def test_embed_gen_names_bad_inputs(model, change, named):
    kwargs = step_kwargs(model)
    change(kwargs)
    with torch.no_grad(), pytest.raises(ValueError, match=named):
        model.embed_gen(**kwargs)


def test_reused_layout_rejects_latents_of_another_shape(model):
    layout = model.gen_layout(**step_kwargs(model))
    other = policy_step_kwargs(model.config, n_text=9, vision_shape=(8, 3, 6, 6), chunk=4, state_rows=1,
                               sound_frames=5 if model.config.sound_gen else 0)
    with torch.no_grad(), pytest.raises(ValueError, match="vision latent"):
        model.embed_gen(**other, layout=layout)
