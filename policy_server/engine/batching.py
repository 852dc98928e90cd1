"""Micro-batching of the GEN stack across ticks that run together, on the model worker's thread.

Each tick of a micro-batch is a generator of its own (`Tick.steps`, the pipeline's `TickSteps`) with its
own plan, SeaCache and deadline guard, exactly as it would run alone. `run_together` advances every tick
until it waits on the full GEN-stack calls of a step (or finishes), then runs every waiting call with the
same number of generated rows as one `[B, N_gen, D]` stack, each against its own text K/V, and sends each
tick its rows. Calls that share one layout object (one request shape) batch as they are; calls of different
text lengths (a step's cond and uncond branch, sessions with other instructions) batch with their text K/V
padded and masked. A tick that skips a step simply arrives later, in a later round. Only the one thread that
drives the generators touches the model.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from policy_server.model import GenInput, UndKV
from policy_server.pipeline.policy import StackCall, TickSteps

GenStack = Callable[[GenInput, UndKV], torch.Tensor]


def run_together(ticks: list[tuple[TickSteps, Future]], gen_stack: GenStack) -> None:
    """Run each `(steps, result)` to the end, its return value or exception into `result`, their full
    GEN-stack calls batched by number of generated rows. `gen_stack` is the transformer's, which accepts
    batches."""
    waiting: dict[int, StackCall] = {}

    def advance(index: int, sent: torch.Tensor | None = None, error: BaseException | None = None) -> None:
        """Run tick `index` until its next full calls (kept in `waiting`) or its end."""
        steps, result = ticks[index]
        try:
            call = steps.throw(error) if error is not None else steps.send(sent)
            while call is None:  # a step boundary: nothing to wait for
                call = steps.send(None)
            waiting[index] = call
        except StopIteration as done:
            result.set_result(done.value)
        except BaseException as failure:  # the caller gets it, the other ticks go on
            result.set_exception(failure)

    with torch.no_grad():
        for index in range(len(ticks)):
            advance(index)
        while waiting:
            groups: dict[int, list[tuple[int, StackCall]]] = {}
            for index, call in waiting.items():
                groups.setdefault(call.gen.hidden.shape[-2], []).append((index, call))
            waiting.clear()
            for group in groups.values():
                try:
                    outs = _run_group([call for _, call in group], gen_stack)
                except Exception as error:  # every tick of the group gets the failure, none hangs
                    for index, _ in group:
                        advance(index, error=error)
                    continue
                for (index, _), out in zip(group, outs, strict=True):
                    advance(index, out)


def _run_group(calls: list[StackCall], gen_stack: GenStack) -> list[torch.Tensor]:
    """Each waiting tick's output: its call alone, or its rows of one stack over all the calls' items."""
    if len(calls) == 1:
        return [gen_stack(calls[0].gen, calls[0].und_kv)]
    items = [item for call in calls for item in call.calls]
    gens, kvs = [gen for gen, _ in items], [kv for _, kv in items]
    if all(gen.layout is gens[0].layout for gen in gens):
        out = gen_stack(GenInput.stack(gens), UndKV.stack(kvs))
    else:
        out = gen_stack(GenInput.stack_varied(gens), UndKV.stack_padded(kvs))
    rows, start = [], 0
    for call in calls:
        count = len(call.calls)
        rows.append(out[start] if count == 1 else out[start:start + count])
        start += count
    return rows
