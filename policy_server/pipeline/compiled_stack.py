"""The GEN stack compiled whole on a CPU, one graph per call pattern, compiled before live ticks need it.

There an eager call spends about as long dispatching its few hundred small ops as in its matmuls, so the whole
stack, attention included, runs as one `CompiledGraph` (no guards or frame per call: 5 ms of a 20-step CFG tick
faster than `torch.compile` of the same function). A graph is fixed to its call pattern: the number of items. Each
item of a batch has its own rotary table (the CFG branches' generated rows sit after texts of different lengths); a
batch of one layout, whose items share one, goes in with it repeated, so the same graph serves it. The generated rows
and each item's text length stay dynamic, so one graph serves every request shape and instruction (as fast as a
graph fixed to the rows, and bit for bit the same). Compiling a pattern takes seconds, so it is done where no
deadline runs: warmup uses `compile`; a live tick calls the object itself, which runs a compiled pattern's graph and
any other pattern eagerly. Only calls of one tick compile (one CFG branch, or both as one batch): a micro-batch of
several ticks' calls is already batched, and each of its sizes would be a graph more to compile.

`compile_unavailable` says whether torch.compile can run at all: it needs a compiler for the code it writes.
"""

from __future__ import annotations

import os
import shutil
import sys

import torch
from torch import nn
from torch.export import Dim

from policy_server.model import Cosmos3OmniTransformer, GenInput, UndKV
from policy_server.model.rope import RotaryTables
from policy_server.pipeline.compiled_graph import MIN_DYNAMIC_SIZE, CompiledGraph, CompiledGraphs

MAX_COMPILED_ITEMS = 2  # a tick's calls: its CFG branches


class CompileUnavailableError(RuntimeError):
    """The GEN stack was asked to run compiled where torch.compile cannot compile (`compile_unavailable`)."""


class PrecompiledGenStack:
    """`transformer.gen_stack` run from the graph `compile` made for a call's pattern, eagerly for other patterns.
    `eager_calls`: the calls that ran eagerly since (patterns `compile` did not make a graph for)."""

    def __init__(self, transformer: Cosmos3OmniTransformer):
        self.transformer = transformer
        self.eager_calls = 0
        self._graphs = CompiledGraphs()

    def __call__(self, gen: GenInput, und_kv: UndKV) -> torch.Tensor:
        graph = self._graphs.get(_pattern(gen, und_kv))
        if graph is None:
            self.eager_calls += 1
            return self.transformer.gen_stack(gen, und_kv)
        return self._run(graph, *self._inputs(gen, und_kv))

    def _inputs(self, gen: GenInput, und_kv: UndKV
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """A graph's inputs: the rows, the rotary cos and sin (per item in a batch) and each item's text K/V."""
        hidden, rotary, text_kv = self.transformer.gen_stack_per_item_inputs(gen, und_kv)
        cos, sin = rotary.cos, rotary.sin
        if hidden.ndim == 3 and cos.ndim == 2:  # [N, hd] shared -> [B, N, hd]
            cos, sin = torch.stack((cos,) * hidden.shape[0]), torch.stack((sin,) * hidden.shape[0])
        return hidden, cos, sin, text_kv

    @staticmethod
    def _run(graph: CompiledGraph, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             text_kv: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return graph(hidden, cos, sin, *text_kv)[0]

    def compile(self, gen: GenInput, und_kv: UndKV) -> torch.Tensor:
        pattern = _pattern(gen, und_kv)
        if pattern is None:
            return self.transformer.gen_stack(gen, und_kv)
        hidden, cos, sin, text_kv = inputs = self._inputs(gen, und_kv)
        gen_rows = Dim("gen_rows", min=MIN_DYNAMIC_SIZE)
        hidden_rows, table_rows = {hidden.ndim - 2: gen_rows}, {cos.ndim - 2: gen_rows}
        text_rows = tuple({3: Dim(f"text_rows_{b}", min=MIN_DYNAMIC_SIZE)} for b in range(len(text_kv)))
        graph = self._graphs.compile(pattern, lambda: CompiledGraph(
            _PerItemStack(self.transformer), (hidden, cos, sin, text_kv),
            dynamic_shapes=(hidden_rows, table_rows, table_rows, text_rows)))
        return self._run(graph, *inputs)

    @property
    def num_patterns(self) -> int:
        return len(self._graphs)

    @property
    def compile_ms(self) -> float:
        return self._graphs.compile_ms


class _PerItemStack(nn.Module):
    """What export traces: `gen_stack_per_item` over plain tensors (the rotary tables as cos and sin)."""

    def __init__(self, transformer: Cosmos3OmniTransformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                text_kv: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.transformer.gen_stack_per_item(hidden, RotaryTables(cos, sin), text_kv)


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile cannot compile the GEN stack on `device`, or None when it can. Inductor compiles C++ for
    a CPU (`$CXX`, else g++); on CUDA, Triton builds its kernel launchers with a C compiler (`$CC`, else gcc or
    clang)."""
    if _compile_disabled():
        return "torch.compile is disabled (TORCH_COMPILE_DISABLE=1)"
    if device.type == "cpu":
        # Here, not at the top: importing inductor imports dynamo, seconds a process that runs eagerly need not spend.
        from torch._inductor import config as inductor_config
        from torch._inductor import cpp_builder, exc

        try:
            cpp_builder.get_cpp_compiler()
        except exc.InvalidCxxCompiler:
            tried = ", ".join(name for name in inductor_config.cpp.cxx if name)
            return f"no working C++ compiler (tried {tried}; install g++ or set CXX)"
    elif device.type == "cuda":
        cc = os.environ.get("CC", "gcc")
        if not (shutil.which(cc) or shutil.which("clang")):
            return f"no C compiler for Triton: neither {cc} nor clang is on PATH (install gcc or set CC)"
    return None


def _compile_disabled() -> bool:
    """`torch._dynamo.config.disable`, without importing dynamo where nothing has yet (it takes seconds, a third of
    an eager server's start on 2 cores): its default is TORCH_COMPILE_DISABLE's."""
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo.config.disable if dynamo is not None else os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1"


def _pattern(gen: GenInput, und_kv: UndKV) -> tuple | None:
    """What a graph is fixed to: the rows' item count (none: one call) and dtype; None for a call no graph serves:
    more items than a tick's calls, or fewer generated or text rows than `MIN_DYNAMIC_SIZE`."""
    hidden = gen.hidden
    too_many = hidden.ndim == 3 and hidden.shape[0] > MAX_COMPILED_ITEMS
    too_few = min(hidden.shape[-2], *(und_kv.lengths or (und_kv.length,))) < MIN_DYNAMIC_SIZE
    if too_many or too_few:
        return None
    return tuple(hidden.shape[:-2]), hidden.dtype
