"""`run_together`: the ticks of a micro-batch, driven on one thread, their full GEN-stack calls batched.

The calls are real ones of a small random model: a step's cond + uncond pair (text lengths 11 and 7, one
input), single calls sharing the cond layout, and a call with more generated rows that cannot join them.
"""

from concurrent.futures import Future

import pytest
import torch

from policy_server.benchmarks.forward import policy_step_kwargs, random_model
from policy_server.engine.batching import run_together
from policy_server.model import GenInput, UndKV
from policy_server.pipeline.policy import StackCall
from tests.test_model_kv_reuse import CONFIGS, TOLERANCE


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIGS[sorted(CONFIGS)[0]], seed=5)


def _branch(model, n_text, seed, height=5):
    kwargs = policy_step_kwargs(model.config, n_text=n_text, vision_shape=(8, 3, height, 6), chunk=4, seed=seed,
                                state_rows=1)
    und_kv = model.prefill_und(kwargs["input_ids"], kwargs["position_ids"][:, : kwargs["und_len"]])
    return model.embed_gen(**kwargs), und_kv


def _single(gen, und_kv):
    return StackCall(gen, und_kv, ((gen, und_kv),))


def _pair(first, second):
    gen = GenInput.stack_varied([first[0], second[0]])
    return StackCall(gen, UndKV.stack_padded([first[1], second[1]]), (first, second))


class RecordingStack:
    """The model's `gen_stack`, recording each call's `[B, N_gen]`; or failing every call."""

    def __init__(self, model, fail=False):
        self.model, self.fail, self.shapes = model, fail, []

    def __call__(self, gen, und_kv):
        self.shapes.append(tuple(gen.hidden.shape[:-1]))
        if self.fail:
            raise RuntimeError("stack failed")
        return self.model.gen_stack(gen, und_kv)


def _tick(calls, boundaries=1):
    """A tick that waits on each of `calls` in order, with `boundaries` step boundaries before each; returns
    the outputs it was sent."""
    outputs = []
    for call in calls:
        for _ in range(boundaries):
            yield None
        outputs.append((yield call))
    return outputs


def _run_all(work, stack):
    results = [Future() for _ in work]
    run_together([(steps, result) for steps, result in zip(work, results, strict=True)], stack)
    return results


def test_calls_with_one_row_count_run_as_one_batch_and_each_tick_gets_its_rows(model):
    with torch.no_grad():
        cond, uncond = _branch(model, 11, seed=1), _branch(model, 7, seed=2)
        other = _branch(model, 11, seed=3)
        shared = (GenInput(other[0].hidden, cond[0].layout), other[1])  # cond's shape: one layout object
        taller = _branch(model, 9, seed=4, height=8)  # more generated rows: runs apart
        calls = [_pair(cond, uncond), _single(*shared), _single(*taller)]
        stack = RecordingStack(model)
        results = _run_all([_tick([call]) for call in calls], stack)
        n_gen, n_taller = cond[0].hidden.shape[0], taller[0].hidden.shape[0]
        assert sorted(stack.shapes) == sorted([(3, n_gen), (n_taller,)])
        (pair_out,), (shared_out,), (taller_out,) = (r.result() for r in results)
        assert pair_out.shape == (2, n_gen, model.config.hidden_size)
        for out, (gen, kv) in [(pair_out[0], cond), (pair_out[1], uncond), (shared_out, shared),
                               (taller_out, taller)]:
            assert (out - model.gen_stack(gen, kv)).abs().max().item() <= TOLERANCE


def test_calls_sharing_one_layout_batch_without_padding(model):
    with torch.no_grad():
        first, other = _branch(model, 9, seed=5), _branch(model, 9, seed=6)
        second = (GenInput(other[0].hidden, first[0].layout), other[1])
        stack = RecordingStack(model)
        results = _run_all([_tick([_single(*first)]), _tick([_single(*second)])], stack)
        assert stack.shapes == [(2, first[0].hidden.shape[0])]
        for result, (gen, kv) in zip(results, (first, second), strict=True):
            assert torch.equal(result.result()[0], model.gen_stack(GenInput.stack([gen, gen]),
                                                                   UndKV.stack([kv, kv]))[0])


def test_a_tick_that_finishes_early_or_skips_does_not_stall_the_others(model):
    with torch.no_grad():
        call = _single(*_branch(model, 9, seed=7))
        stack = RecordingStack(model)
        results = _run_all([_tick([call] * 3, boundaries=2), _tick([call]), _tick([])], stack)
    assert [len(r.result()) for r in results] == [3, 1, 0]
    n_gen = call.gen.hidden.shape[0]
    assert stack.shapes == [(2, n_gen), (n_gen,), (n_gen,)]


def test_a_failing_stack_reaches_every_tick_of_its_batch_and_no_other(model):
    with torch.no_grad():
        call = _single(*_branch(model, 9, seed=8))
        results = _run_all([_tick([call]), _tick([call]), _tick([])], RecordingStack(model, fail=True))
    for result in results[:2]:
        with pytest.raises(RuntimeError, match="stack failed"):
            result.result()
    assert results[2].result() == []


def test_a_tick_that_raises_ends_alone(model):
    def broken():
        yield None
        raise ValueError("bad tick")

    with torch.no_grad():
        call = _single(*_branch(model, 9, seed=9))
        results = _run_all([broken(), _tick([call])], RecordingStack(model))
    with pytest.raises(ValueError, match="bad tick"):
        results[0].result()
    assert len(results[1].result()) == 1
