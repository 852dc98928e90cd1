"""The GEN stack compiled whole (`Cosmos3OmniTransformer.compiled_whole_gen_stack`), compiled before live ticks need it.

A compiled graph is fixed to its call pattern: the number of items and of generated rows; text lengths are
dynamic. Compiling a pattern takes seconds, so it is done where no deadline runs: `compile` is what warmup
uses; a live tick calls the object itself, which runs a compiled pattern compiled and any other eagerly. Only
calls of one tick compile (one CFG branch, or both as one batch): a micro-batch of several ticks' calls is
already batched, and each of its sizes would be a graph more to compile at every shape.

`compile_unavailable` says whether torch.compile can run at all: it needs a compiler for the code it writes.
"""

from __future__ import annotations

import os
import shutil
import time

import torch
from torch._inductor import config as inductor_config
from torch._inductor import cpp_builder, exc

from policy_server.engine.batching import GenStack
from policy_server.model import GenInput, UndKV

MAX_COMPILED_ITEMS = 2  # a tick's calls: its CFG branches
MAX_PATTERNS = 256  # graphs of the one compiled function: far more than shapes times patterns


class CompileUnavailableError(RuntimeError):
    """The GEN stack was asked to run compiled where torch.compile cannot compile (`compile_unavailable`)."""


class PrecompiledGenStack:
    """`compiled` for the call patterns `compile` has run, `eager` (the same arithmetic) for the others.
    `compile_ms`: the time spent in `compile`, compiles and their first runs."""

    def __init__(self, compiled: GenStack, eager: GenStack):
        self.compiled = compiled
        self.eager = eager
        self.compile_ms = 0.0
        self._patterns: set[tuple] = set()

    def __call__(self, gen: GenInput, und_kv: UndKV) -> torch.Tensor:
        stack = self.compiled if _pattern(gen) in self._patterns else self.eager
        return stack(gen, und_kv)

    def compile(self, gen: GenInput, und_kv: UndKV) -> torch.Tensor:
        if gen.hidden.ndim == 3 and gen.hidden.shape[0] > MAX_COMPILED_ITEMS:
            return self.eager(gen, und_kv)
        self._patterns.add(_pattern(gen))
        start = time.perf_counter()
        # Every pattern is a graph of one function: torch's default limit (8) would stop compiling new shapes.
        with torch._dynamo.config.patch(recompile_limit=MAX_PATTERNS):
            hidden = self.compiled(gen, und_kv)
        self.compile_ms += (time.perf_counter() - start) * 1e3
        return hidden

    @property
    def num_patterns(self) -> int:
        return len(self._patterns)


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile cannot compile the GEN stack on `device`, or None when it can. Inductor compiles C++ for
    a CPU (`$CXX`, else g++); on CUDA, Triton builds its kernel launchers with a C compiler (`$CC`, else gcc or
    clang)."""
    if torch._dynamo.config.disable:
        return "torch.compile is disabled (TORCH_COMPILE_DISABLE=1)"
    if device.type == "cpu":
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


def _pattern(gen: GenInput) -> tuple:
    """What a compiled graph is fixed to: the rows' shape and dtype (items, generated rows) and whether each item
    has rotary tables of its own (a batch of text lengths) or all share one."""
    return tuple(gen.hidden.shape), gen.hidden.dtype, gen.layout.rotary.cos.ndim
