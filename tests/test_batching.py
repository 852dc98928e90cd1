"""`StackBatcher`: the rendezvous that runs the full GEN-stack calls of concurrent ticks as batches."""

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from policy_server.engine.batching import StackBatcher
from policy_server.model import GenInput, UndKV

# The batcher groups calls by `layout.key`; `GenInput.stack` then needs the one layout object per key.
LAYOUT_A, LAYOUT_B = SimpleNamespace(key="a"), SimpleNamespace(key="b")


def _call(layout, value):
    kv = torch.full((2, 3, 4), float(value))
    return GenInput(torch.full((5, 8), float(value)), layout), UndKV([kv], [kv])


class RecordingStack:
    def __init__(self, fail=False):
        self.shapes, self.fail = [], fail

    def __call__(self, gen, und_kv):
        self.shapes.append(tuple(gen.hidden.shape))
        if self.fail:
            raise RuntimeError("stack failed")
        return gen.hidden + und_kv.keys[0].flatten(-3).sum(-1)[..., None, None]  # row b + sum of K/V b


def _run_all(batcher, work):
    """Each item of `work` is a list of calls one tick makes in order; returns each tick's outputs."""
    def tick(calls):
        try:
            return [batcher.run(*call) for call in calls]
        finally:
            batcher.leave()

    with ThreadPoolExecutor(len(work)) as pool:
        return [f.result() for f in [pool.submit(tick, calls) for calls in work]]


def test_calls_sharing_a_layout_run_as_one_batch_and_each_tick_gets_its_row():
    stack = RecordingStack()
    batcher = StackBatcher(stack, participants=3)
    outputs = _run_all(batcher, [[_call(LAYOUT_A, 1)], [_call(LAYOUT_A, 2)], [_call(LAYOUT_B, 3)]])
    assert sorted(stack.shapes) == [(2, 5, 8), (5, 8)]  # one batch of two, one alone
    for value, (out,) in zip((1, 2, 3), outputs, strict=True):
        assert torch.equal(out, torch.full((5, 8), value + 24.0 * value))  # its own rows and its own K/V


def test_a_tick_that_finishes_early_or_skips_does_not_stall_the_others():
    stack = RecordingStack()
    batcher = StackBatcher(stack, participants=3)
    outputs = _run_all(batcher, [[_call(LAYOUT_A, 1)] * 3, [_call(LAYOUT_A, 2)], []])
    assert [len(o) for o in outputs] == [3, 1, 0]
    assert stack.shapes == [(2, 5, 8), (5, 8), (5, 8)]


def test_a_failing_stack_reaches_every_tick_of_its_batch():
    batcher = StackBatcher(RecordingStack(fail=True), participants=2)
    errors = []

    def tick(value):
        try:
            batcher.run(*_call(LAYOUT_A, value))
        except RuntimeError as error:
            errors.append(str(error))
        finally:
            batcher.leave()

    threads = [threading.Thread(target=tick, args=(v,)) for v in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert errors == ["stack failed", "stack failed"]


def test_needs_a_participant():
    with pytest.raises(ValueError, match="participants"):
        StackBatcher(RecordingStack(), participants=0)
