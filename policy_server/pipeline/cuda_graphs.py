"""The GEN stack replayed from CUDA graphs: one graph per input shape, captured before live ticks need it.

On a GPU a GEN-stack call is hundreds of small kernels, and launching them from Python costs more than
running them for a small model. A CUDA graph launches them all at once. A graph is fixed to the shapes and
memory it was captured with, so each one owns static input buffers: a call copies its rows, rotary tables
and text K/V in, replays, and returns a copy of the output (a later replay overwrites the graph's own).

Capture runs the stack twice (once to warm the libraries outside the graph, once captured), so it is done
where no deadline runs: `capture` is what warmup and a session's opening use; a live tick calls the object
itself, which replays a captured shape and runs any other shape eagerly (a micro-batch of several sessions,
a text length no session opened with). All graphs share one memory pool: they never run at the same time.
A server running for days sees many instruction lengths: it keeps the warmup's graphs (micro-batches among them, which
nothing else captures) and, of those captured later, the `max_later` shapes used last.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from policy_server.model import GenInput, UndKV
from policy_server.model.rope import RotaryTables


@dataclass(frozen=True)
class _Graph:
    """One captured GEN stack: `inputs` are what `gen_stack` read at capture, `out` what it wrote."""

    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    out: torch.Tensor

    def run(self, gen: GenInput, und_kv: UndKV) -> torch.Tensor:
        torch._foreach_copy_(self.inputs, _tensors(gen, und_kv))  # one multi-tensor copy, not one per layer
        self.graph.replay()
        return self.out.clone()


class GraphedGenStack:
    """A GEN stack (`transformer.gen_stack`) with CUDA graphs: call it as the stack (replays a captured shape,
    runs any other eagerly), or `capture` to replay a shape, capturing it first when it is new. `max_later`: how
    many shapes captured after the warmup it keeps, those used last (None while warming up: the warmup's are kept for
    good; each graph holds its static inputs on the device, text K/V of every layer included). `capture_ms`: time
    spent capturing so far."""

    def __init__(self, gen_stack: Callable[[GenInput, UndKV], torch.Tensor]):
        self.gen_stack = gen_stack
        self.capture_ms = 0.0
        self.max_later: int | None = None
        self._warmup_graphs: dict[tuple, _Graph] = {}
        self._later_graphs: OrderedDict[tuple, _Graph] = OrderedDict()  # the shape used last at the end
        self._pool = torch.cuda.graph_pool_handle()

    def __call__(self, gen: GenInput, und_kv: UndKV) -> torch.Tensor:
        graph = self._find(_shape_key(gen, und_kv))
        return self.gen_stack(gen, und_kv) if graph is None else graph.run(gen, und_kv)

    def capture(self, gen: GenInput, und_kv: UndKV) -> torch.Tensor:
        key = _shape_key(gen, und_kv)
        graph = self._find(key)
        if graph is None:
            started = time.perf_counter()
            graph = self._capture(gen, und_kv)
            self.capture_ms += (time.perf_counter() - started) * 1e3
            if self.max_later is None:
                self._warmup_graphs[key] = graph
            else:
                self._later_graphs[key] = graph
                if len(self._later_graphs) > self.max_later:
                    self._later_graphs.popitem(last=False)
        return graph.run(gen, und_kv)

    @property
    def num_graphs(self) -> int:
        return len(self._warmup_graphs) + len(self._later_graphs)

    def _find(self, key: tuple) -> _Graph | None:
        graph = self._warmup_graphs.get(key)
        if graph is None and (graph := self._later_graphs.get(key)) is not None:
            self._later_graphs.move_to_end(key)
        return graph

    def _capture(self, gen: GenInput, und_kv: UndKV) -> _Graph:
        rotary = gen.layout.rotary
        static_gen = GenInput(gen.hidden.clone(), dataclasses.replace(
            gen.layout, rotary=RotaryTables(rotary.cos.clone(), rotary.sin.clone())))
        static_kv = UndKV([k.clone() for k in und_kv.keys], [v.clone() for v in und_kv.values], und_kv.lengths)
        # cuBLAS handles and attention workspaces are made on a first run, which a capture must not contain.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.gen_stack(static_gen, static_kv)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.gen_stack(static_gen, static_kv)
        return _Graph(graph, _tensors(static_gen, static_kv), out)


def _tensors(gen: GenInput, und_kv: UndKV) -> list[torch.Tensor]:
    """Every tensor a GEN-stack call reads, in a fixed order."""
    return [gen.hidden, *gen.layout.rotary.tensors(), *und_kv.keys, *und_kv.values]


def _shape_key(gen: GenInput, und_kv: UndKV) -> tuple:
    """What a captured graph is fixed to: the shapes and dtype of its inputs and how its text rows are padded."""
    return (tuple(gen.hidden.shape), gen.hidden.dtype, tuple(gen.layout.rotary.cos.shape),
            tuple(und_kv.keys[0].shape), und_kv.lengths, gen.und_lens)
