"""`run_together`: the ticks of a micro-batch, driven on one thread, their full GEN-stack calls batched."""

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from policy_server.engine.batching import run_together
from policy_server.model import GenInput, UndKV
from policy_server.pipeline.policy import StackCall

# Calls group by `layout.key`; `GenInput.stack` then needs the one layout object per key.
LAYOUT_A, LAYOUT_B = SimpleNamespace(key="a"), SimpleNamespace(key="b")


def _call(layout, value):
    kv = torch.full((2, 3, 4), float(value))
    return StackCall(GenInput(torch.full((5, 8), float(value)), layout), UndKV([kv], [kv]))


class RecordingStack:
    def __init__(self, fail=False):
        self.shapes, self.fail = [], fail

    def __call__(self, gen, und_kv):
        self.shapes.append(tuple(gen.hidden.shape))
        if self.fail:
            raise RuntimeError("stack failed")
        return gen.hidden + und_kv.keys[0].flatten(-3).sum(-1)[..., None, None]  # row b + sum of K/V b


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


def test_calls_sharing_a_layout_run_as_one_batch_and_each_tick_gets_its_row():
    stack = RecordingStack()
    results = _run_all([_tick([_call(LAYOUT_A, 1)]), _tick([_call(LAYOUT_A, 2)]), _tick([_call(LAYOUT_B, 3)])], stack)
    assert sorted(stack.shapes) == [(2, 5, 8), (5, 8)]  # one batch of two, one alone
    for value, result in zip((1, 2, 3), results, strict=True):
        (out,) = result.result()
        assert torch.equal(out, torch.full((5, 8), value + 24.0 * value))  # its own rows and its own K/V


def test_a_tick_that_finishes_early_or_skips_does_not_stall_the_others():
    stack = RecordingStack()
    results = _run_all([_tick([_call(LAYOUT_A, 1)] * 3, boundaries=2), _tick([_call(LAYOUT_A, 2)]), _tick([])],
                       stack)
    assert [len(r.result()) for r in results] == [3, 1, 0]
    assert stack.shapes == [(2, 5, 8), (5, 8), (5, 8)]


def test_a_failing_stack_reaches_every_tick_of_its_batch_and_no_other():
    stack = RecordingStack(fail=True)
    results = _run_all([_tick([_call(LAYOUT_A, 1)]), _tick([_call(LAYOUT_A, 2)]), _tick([])], stack)
    for result in results[:2]:
        with pytest.raises(RuntimeError, match="stack failed"):
            result.result()
    assert results[2].result() == []


def test_a_tick_that_raises_ends_alone():
    def broken():
        yield None
        raise ValueError("bad tick")

    results = _run_all([broken(), _tick([_call(LAYOUT_A, 1)])], RecordingStack())
    with pytest.raises(ValueError, match="bad tick"):
        results[0].result()
    assert len(results[1].result()) == 1
