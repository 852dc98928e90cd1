"""Batched CFG at the model boundary: inputs whose layouts differ only in text length run as one GEN stack.

The cond and uncond branches of a step share their generated rows (N_gen) but not their prompts, so the
batch pads the text K/V (`UndKV.stack_padded`), has each item attend to its own text rows and rotates
each item's rows at its own positions (`GenInput.stack_varied`).
"""

from __future__ import annotations

import pytest
import torch

from policy_server.benchmarks.forward import policy_step_kwargs, random_model
from policy_server.model import GenInput, UndKV
from policy_server.model.boundary import PaddedGenLayouts
from tests.test_model_kv_reuse import CONFIGS, TOLERANCE


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    return random_model(CONFIGS[request.param], seed=3)


def branch(model, n_text: int, seed: int, timestep: float = 600.0):
    """One CFG branch's `(GenInput, UndKV)`: same vision/action shapes for every `n_text`."""
    sound = 5 if model.config.sound_gen else 0
    kwargs = policy_step_kwargs(model.config, n_text=n_text, vision_shape=(8, 3, 5, 6), chunk=4, seed=seed,
                                timestep=timestep, state_rows=1, sound_frames=sound)
    und_len = kwargs["und_len"]
    und_kv = model.prefill_und(kwargs["input_ids"], kwargs["position_ids"][:, :und_len])
    return model.embed_gen(**kwargs), und_kv


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("lengths", [(11, 7), (7, 11), (5, 13, 9)])
def test_varied_text_lengths_batch_equals_each_alone(model, lengths):
    with torch.no_grad():
        branches = [branch(model, n, seed=40 + i) for i, n in enumerate(lengths)]
        gens, kvs = zip(*branches, strict=True)
        assert len({g.und_len for g in gens}) == len(lengths) and len({g.hidden.shape for g in gens}) == 1
        alone = [model.gen_stack(g, kv) for g, kv in branches]
        batched = model.gen_stack(GenInput.stack_varied(list(gens)), UndKV.stack_padded(list(kvs)))
        assert batched.shape == (len(lengths), *alone[0].shape)
        for row, (gen, single) in enumerate(zip(gens, alone, strict=True)):
            assert max_error(batched[row], single) <= TOLERANCE
            # Row b decodes with item b's own layout.
            for mine, theirs in zip(model.heads(batched[row], gen), model.heads(single, gen), strict=True):
                for a, b in zip(mine or [], theirs or [], strict=True):
                    assert max_error(a, b) <= TOLERANCE


def test_equal_lengths_match_the_shared_layout_batch(model):
    """With one text length nothing is padded: the varied batch equals `GenInput.stack` + `UndKV.stack`."""
    with torch.no_grad():
        (first, kv1), (second, kv2) = branch(model, 9, seed=50), branch(model, 9, seed=51, timestep=200.0)
        shared = GenInput(second.hidden, first.layout)  # same request shape, so one layout serves both
        stacked = model.gen_stack(GenInput.stack([first, shared]), UndKV.stack([kv1, kv2]))
        varied = model.gen_stack(GenInput.stack_varied([first, second]), UndKV.stack_padded([kv1, kv2]))
    assert GenInput.stack_varied([first, second]).ragged_und_lens is None
    assert max_error(stacked, varied) <= TOLERANCE


def test_padded_layouts_reused_across_steps(model):
    with torch.no_grad():
        (cond, cond_kv), (uncond, uncond_kv) = branch(model, 11, seed=60), branch(model, 7, seed=61)
        layouts = PaddedGenLayouts.build([cond.layout, uncond.layout])
        n_gen = cond.hidden.shape[0]
        assert layouts.ragged_und_lens == (cond.und_len, uncond.und_len) == (11, 7)
        assert layouts.rotary.cos.shape == (2, n_gen, model.config.head_dim)
        kv = UndKV.stack_padded([cond_kv, uncond_kv])
        first = model.gen_stack(GenInput.stack_varied([cond, uncond], layouts), kv)
        again = model.gen_stack(GenInput.stack_varied([cond, uncond], layouts), kv)
        assert torch.equal(first, again)
        with pytest.raises(ValueError, match="layouts must be built"):
            GenInput.stack_varied([uncond, cond], layouts)


def test_mismatched_padding_is_rejected(model):
    with torch.no_grad():
        (cond, cond_kv), (uncond, uncond_kv) = branch(model, 11, seed=70), branch(model, 7, seed=71)
        varied = GenInput.stack_varied([cond, uncond])
        with pytest.raises(ValueError, match="each item's text rows"):  # K/V in the other order
            model.gen_stack(varied, UndKV.stack_padded([uncond_kv, cond_kv]))
        with pytest.raises(ValueError, match="each item's text rows"):  # unpadded K/V of the longer prompt
            model.gen_stack(varied, UndKV.stack([cond_kv, cond_kv]))
        with pytest.raises(ValueError, match="each item's text rows"):  # padded K/V, one shared layout
            model.gen_stack(GenInput.stack([cond, cond]), UndKV.stack_padded([cond_kv, uncond_kv]))
        other = branch(model, 7, seed=72)[0]
        other_shape = policy_step_kwargs(model.config, n_text=7, vision_shape=(8, 3, 8, 6), chunk=4, state_rows=1,
                                         sound_frames=5 if model.config.sound_gen else 0)
        with pytest.raises(ValueError, match="one N_gen"):
            GenInput.stack_varied([other, model.embed_gen(**other_shape)])
