"""Micro-batching of the GEN stack across ticks that run together.

The engine runs each tick of a micro-batch on its own thread, with its own plan, SeaCache and deadline
guard, exactly as it would run alone. Only the full GEN-stack calls meet here: `StackBatcher.run` blocks
until every tick still running is either waiting in `run` or finished, then runs the waiting calls whose
layouts share a `GenLayout.key` (the request shape, text length included; the pipeline keeps one layout
object per key) as one `[B, N_gen, D]` stack and hands each tick its row. Calls of different shapes (e.g.
cond and uncond branches of different text lengths) run as separate batches in the same round. A tick that
skips a step simply arrives later, in a later round.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from policy_server.model import GenInput, UndKV


@dataclass
class _Call:
    gen: GenInput
    und_kv: UndKV
    output: torch.Tensor | None = None
    error: BaseException | None = None


class StackBatcher:
    """Rendezvous for the full GEN-stack calls of `participants` concurrently running ticks.

    Each tick passes `run` as the pipeline's `stack` and calls `leave` when it ends (in a `finally`),
    or the others would wait for it forever. `gen_stack`: the transformer's, which accepts batches.
    """

    def __init__(self, gen_stack: Callable[[GenInput, UndKV], torch.Tensor], participants: int):
        if participants < 1:
            raise ValueError(f"participants must be >= 1, got {participants}")
        self._gen_stack = gen_stack
        self.participants = participants
        self._running = participants
        self._waiting: list[_Call] = []
        self._changed = threading.Condition()

    def run(self, gen: GenInput, und_kv: UndKV) -> torch.Tensor:
        """The GEN stack output `[N_gen, D]` of this tick's call, computed in a batch with the others."""
        call = _Call(gen, und_kv)
        with self._changed:
            self._waiting.append(call)
            self._fire_if_all_waiting()
            while call.output is None and call.error is None:
                self._changed.wait()
        if call.error is not None:
            raise call.error
        return call.output

    def leave(self) -> None:
        """This tick has finished (or failed): stop waiting for it."""
        with self._changed:
            self._running -= 1
            self._fire_if_all_waiting()

    def _fire_if_all_waiting(self) -> None:
        # Runs under the lock: every other tick is blocked in `run`, so nobody else could make progress.
        if not self._waiting or len(self._waiting) < self._running:
            return
        calls, self._waiting = self._waiting, []
        groups: dict[Hashable, list[_Call]] = {}
        for call in calls:
            groups.setdefault(call.gen.layout.key, []).append(call)
        for group in groups.values():
            try:
                if len(group) == 1:
                    group[0].output = self._gen_stack(group[0].gen, group[0].und_kv)
                else:
                    out = self._gen_stack(GenInput.stack([c.gen for c in group]),
                                          UndKV.stack([c.und_kv for c in group]))
                    for row, call in enumerate(group):
                        call.output = out[row]
            except Exception as error:  # every tick of the group gets the failure, none hangs
                for call in group:
                    call.error = error
        self._changed.notify_all()
