"""Micro-batching of the GEN stack across ticks that run together, on the model worker's thread.

Each tick of a micro-batch is a generator of its own (`Tick.steps`, the pipeline's `TickSteps`) with its
own plan, SeaCache and deadline guard, exactly as it would run alone. `run_together` advances every tick
until it waits on a full GEN-stack call (or finishes), then runs the waiting calls whose layouts share a
`GenLayout.key` (the request shape, text length included; the pipeline keeps one layout object per key) as
one `[B, N_gen, D]` stack and sends each tick its row. Calls of different shapes (e.g. cond and uncond
branches of different text lengths) run as separate stacks in the same round. A tick that skips a step simply
arrives later, in a later round. Only the one thread that drives the generators touches the model.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import Future

import torch

from policy_server.model import GenInput, UndKV
from policy_server.pipeline.policy import StackCall, TickSteps

GenStack = Callable[[GenInput, UndKV], torch.Tensor]


def run_together(ticks: list[tuple[TickSteps, Future]], gen_stack: GenStack) -> None:
    """Run each `(steps, result)` to the end, its return value or exception into `result`, their full
    GEN-stack calls batched by layout key. `gen_stack` is the transformer's, which accepts batches."""
    waiting: dict[int, StackCall] = {}

    def advance(index: int, sent: torch.Tensor | None = None, error: BaseException | None = None) -> None:
        """Run tick `index` until its next full call (kept in `waiting`) or its end."""
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
            groups: dict[Hashable, list[tuple[int, StackCall]]] = {}
            for index, call in waiting.items():
                groups.setdefault(call.gen.layout.key, []).append((index, call))
            waiting.clear()
            for group in groups.values():
                try:
                    if len(group) == 1:
                        rows = [gen_stack(group[0][1].gen, group[0][1].und_kv)]
                    else:
                        out = gen_stack(GenInput.stack([c.gen for _, c in group]),
                                        UndKV.stack([c.und_kv for _, c in group]))
                        rows = [out[row] for row in range(len(group))]
                except Exception as error:  # every tick of the group gets the failure, none hangs
                    for index, _ in group:
                        advance(index, error=error)
                    continue
                for (index, _), row in zip(group, rows, strict=True):
                    advance(index, row)
