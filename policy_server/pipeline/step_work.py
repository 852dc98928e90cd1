"""What a sampler step computes around the GEN stack: `StepWork` eagerly, `CompiledStepWork` from graphs.

Each step embeds its generated rows from the sampler state (`embed`) and decodes the velocity from the GEN stack's
output (`velocity`: the heads, vision and actions in fp32, flattened as the state is). On a CPU these few dozen
small ops cost more to dispatch than to compute; `CompiledStepWork` runs each as one `CompiledGraph` per request
shape (3 ms of the embedded model's 20-step CFG tick, the same outputs bit for bit). Both graphs read the layout's
GEN-local rows alone, which do not depend on the text, so a shape's graphs serve every instruction. Compiling
takes seconds, so it is done where no deadline runs: by the object `compiling()` returns (warmup's); the object
itself runs a shape it has no graphs for eagerly.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from torch import nn

from policy_server.model import Cosmos3OmniTransformer, GenInput
from policy_server.model.gen_layout import GenLayout
from policy_server.pipeline.compiled_graph import CompiledGraph


class StepWork:
    """The step's work run eagerly through `transformer`."""

    def __init__(self, transformer: Cosmos3OmniTransformer):
        self.transformer = transformer

    def embed(self, layout: GenLayout, sample: torch.Tensor, time_embedding: torch.Tensor) -> torch.Tensor:
        """The generated rows `[N_gen, D]` of sampler state `sample` (fp32, flat: vision latents then action rows)
        laid out by `layout`, the noisy rows given `time_embedding` `[1, D]`."""
        vision, actions = _split(self.transformer, layout, sample)
        dtype = self.transformer.dtype
        return self.transformer.embed_gen(layout=layout, time_embedding=time_embedding,
                                          vision_tokens=[vision.to(dtype).unsqueeze(0)],
                                          action_tokens=[actions.to(dtype)]).hidden

    def velocity(self, layout: GenLayout, stack_out: torch.Tensor) -> torch.Tensor:
        """The velocity decoded from a GEN stack output `[N_gen, D]` by the heads, fp32 and flat like the sampler
        state, zero on clean frames and rows."""
        vision, _, actions = self.transformer.heads(stack_out, GenInput(stack_out, layout))
        return torch.cat((vision[0][0].float().flatten(), actions[0].float().flatten()))


class CompiledStepWork(StepWork):
    """The step's work from the graphs compiled for its request shape, eagerly for other shapes. `compile_ms`: the
    time spent compiling; `eager_steps`: the steps that ran eagerly (shapes without graphs)."""

    def __init__(self, transformer: Cosmos3OmniTransformer):
        super().__init__(transformer)
        self.compile_ms = 0.0
        self.eager_steps = 0
        self._graphs: dict[object, tuple[CompiledGraph, CompiledGraph]] = {}  # by shape: embed, velocity

    def embed(self, layout: GenLayout, sample: torch.Tensor, time_embedding: torch.Tensor) -> torch.Tensor:
        graphs = self._graphs.get(_shape(layout))
        if graphs is None:
            self.eager_steps += 1
            return super().embed(layout, sample, time_embedding)
        return graphs[0](sample, time_embedding)[0]

    def velocity(self, layout: GenLayout, stack_out: torch.Tensor) -> torch.Tensor:
        graphs = self._graphs.get(_shape(layout))
        if graphs is None:
            return super().velocity(layout, stack_out)
        return graphs[1](stack_out)[0]

    def compiling(self) -> StepWork:
        """This step work, compiling the graphs of a shape it meets first."""
        return _Compiling(self)

    @property
    def num_shapes(self) -> int:
        return len(self._graphs)

    def compile(self, layout: GenLayout) -> None:
        if _shape(layout) in self._graphs:
            return
        start = time.perf_counter()
        transformer = self.transformer
        vision, actions = transformer.config.latent_channel, transformer.config.action_dim
        (frames, height, width), = layout.vision_latent_shapes
        (rows, _, _), = layout.action.token_shapes
        sample = torch.zeros(vision * frames * height * width + rows * actions, device=transformer.device)
        time_embedding = torch.zeros((1, transformer.config.hidden_size), dtype=transformer.dtype,
                                     device=transformer.device)
        stack_out = torch.zeros((layout.num_gen, transformer.config.hidden_size), dtype=transformer.dtype,
                                device=transformer.device)
        eager = StepWork(transformer)
        self._graphs[_shape(layout)] = (CompiledGraph(_Embed(eager, layout), (sample, time_embedding)),
                                        CompiledGraph(_Velocity(eager, layout), (stack_out,)))
        self.compile_ms += (time.perf_counter() - start) * 1e3


class _Compiling(StepWork):
    def __init__(self, compiled: CompiledStepWork):
        super().__init__(compiled.transformer)
        self.compiled = compiled

    def embed(self, layout: GenLayout, sample: torch.Tensor, time_embedding: torch.Tensor) -> torch.Tensor:
        self.compiled.compile(layout)
        return self.compiled.embed(layout, sample, time_embedding)

    def velocity(self, layout: GenLayout, stack_out: torch.Tensor) -> torch.Tensor:
        self.compiled.compile(layout)
        return self.compiled.velocity(layout, stack_out)


class _Embed(nn.Module):
    """What export traces for `StepWork.embed` of one layout."""

    def __init__(self, work: StepWork, layout: GenLayout):
        super().__init__()
        self.work, self.layout = work, layout

    def forward(self, sample: torch.Tensor, time_embedding: torch.Tensor) -> torch.Tensor:
        return self.work.embed(self.layout, sample, time_embedding)


class _Velocity(nn.Module):
    """What export traces for `StepWork.velocity` of one layout."""

    def __init__(self, work: StepWork, layout: GenLayout):
        super().__init__()
        self.work, self.layout = work, layout

    def forward(self, stack_out: torch.Tensor) -> torch.Tensor:
        return self.work.velocity(self.layout, stack_out)


def _split(transformer: Cosmos3OmniTransformer, layout: GenLayout, sample: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a flat sampler state: vision latents `[C, T_lat, h, w]` and action rows `[R, action_dim]`."""
    (frames, height, width), = layout.vision_latent_shapes
    vision = sample[: transformer.config.latent_channel * frames * height * width]
    return (vision.view(-1, frames, height, width),
            sample[vision.numel():].view(-1, transformer.config.action_dim))


def _shape(layout: GenLayout):
    """What a layout's graphs are fixed to: its request shape but for the text length (`RequestShape`)."""
    return replace(layout.key, und_len=0)
