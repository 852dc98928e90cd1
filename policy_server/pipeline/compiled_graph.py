"""`CompiledGraph`: a module's `forward` traced by `torch.export` and compiled by inductor, called with tensors.

On a CPU an eager call of this project's small models spends about as long dispatching its ops as computing, and
`torch.compile` adds its guards and frame evaluation to every call (0.25 ms a call of the embedded GEN stack). A
call of a `CompiledGraph` goes straight to inductor's kernels through its C++ wrapper. The graph is fixed to the
shapes of its example inputs but for the sizes `dynamic_shapes` names (`torch.export.export`'s argument), and
inductor's disk cache makes a restart's compiles fast.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch
from torch import nn
from torch.export.graph_signature import InputKind

MIN_DYNAMIC_SIZE = 2  # export treats sizes 0 and 1 apart: a dynamic size serves sizes from 2 up
Inputs = tuple["torch.Tensor | tuple[torch.Tensor, ...]", ...]  # tensors, or tuples of them


class CompiledGraph:
    """`module(*inputs)` compiled for inputs like `inputs`, which must be distinct tensors (export would tie
    aliases into one input). Call it with the inputs flattened in order (a tuple argument's tensors in its place);
    it returns the outputs as a list. The module's weights go in as inputs, its own tensors, so a graph holds no
    copy of them."""

    def __init__(self, module: nn.Module, inputs: Inputs, dynamic_shapes: tuple | None = None):
        import torch._inductor  # here, not at the top: it imports dynamo, seconds a process that never compiles saves

        with torch.no_grad():  # an inference graph: with grad on, inductor would compile a backward too
            program = torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes, strict=False)
            tensors = dict(module.named_parameters()) | dict(module.named_buffers()) | program.constants
            # The program's inputs are its lifted weights and constants, then the caller's (`ExportGraphSignature`).
            self.weights = [tensors[spec.target] for spec in program.graph_signature.input_specs
                            if spec.kind != InputKind.USER_INPUT]
            # The C++ wrapper calls the kernels without Python in between (measured 4% faster per uncached tick).
            self.compiled = torch._inductor.standalone_compile(
                program.graph_module, [*self.weights, *flatten(inputs)],
                options={"config_patches": {"cpp_wrapper": True}}, donate_graph_module=True)

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        return self.compiled(*self.weights, *inputs)


class CompiledGraphs:
    """Compiled graphs (or tuples of them) by key, made where no deadline runs. `get` is what a live call uses (None:
    run eagerly); `compile` makes a missing one. `compile_ms`: the time spent compiling."""

    def __init__(self):
        self.compile_ms = 0.0
        self._graphs: dict[Hashable, object] = {}

    def get(self, key: Hashable):
        return self._graphs.get(key)

    def compile(self, key: Hashable, build: Callable[[], object]):
        """The graph of `key`, `build()` when there is none yet."""
        if key not in self._graphs:
            start = time.perf_counter()
            self._graphs[key] = build()
            self.compile_ms += (time.perf_counter() - start) * 1e3
        return self._graphs[key]

    def __len__(self) -> int:
        return len(self._graphs)


def flatten(inputs: Inputs) -> list[torch.Tensor]:
    return [tensor for item in inputs for tensor in (item if isinstance(item, tuple) else (item,))]
