"""A tick's model work besides the GEN stack: `TickWork` runs it eagerly, `CompiledTickWork` from graphs.

The work: the text prefill of a new prompt (`prefill`), and each sampler step's embedding of its generated rows
(`embed`), decode of the velocity from the GEN stack's outputs (`velocity`: the CFG combination, the heads,
vision and actions in fp32, flattened as the sampler state is) and UniPC update (`unipc_update`). On a CPU these
ops cost more to dispatch than to compute; `CompiledTickWork` runs each as one `CompiledGraph`: the prefill with
the text length dynamic, the UniPC update per step structure (orders of its corrector and predictor) with the
state's size dynamic, and per request shape the embedding and the decode (of one branch, and of two guided),
which read the layout's GEN-local rows alone (they do not depend on the text), so a shape's graphs serve every
instruction. Compiling takes seconds, so it is done where no deadline runs, by the object `compiling()` returns
(warmup's); the object itself runs eagerly what it has no graph for.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from torch import nn
from torch.export import Dim

from policy_server.model import Cosmos3OmniTransformer, GenInput, UndKV
from policy_server.model.gen_layout import GenLayout
from policy_server.pipeline.compiled_graph import MIN_DYNAMIC_SIZE, CompiledGraph, CompiledGraphs
from policy_server.pipeline.schedulers import UniCoefficients, unipc_update


class TickWork:
    """A tick's work besides the GEN stack, run eagerly through `transformer`."""

    def __init__(self, transformer: Cosmos3OmniTransformer):
        self.transformer = transformer

    def prefill(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> UndKV:
        """The text K/V of token ids `[N]` at mRoPE positions `[3, N]` (`Cosmos3OmniTransformer.prefill_und`)."""
        return self.transformer.prefill_und(input_ids, position_ids)

    def embed(self, layout: GenLayout, sample: torch.Tensor, time_embedding: torch.Tensor) -> torch.Tensor:
        """The generated rows `[N_gen, D]` of sampler state `sample` (fp32, flat: vision latents then action rows)
        laid out by `layout`, the noisy rows given `time_embedding` `[1, D]`."""
        vision, actions = _split(self.transformer, layout, sample)
        dtype = self.transformer.dtype
        return self.transformer.embed_gen(layout=layout, time_embedding=time_embedding,
                                          vision_tokens=[vision.to(dtype).unsqueeze(0)],
                                          action_tokens=[actions.to(dtype)]).hidden

    def velocity(self, layout: GenLayout, cond: torch.Tensor, uncond: torch.Tensor | None = None,
                 guidance: float = 1.0) -> torch.Tensor:
        """The velocity decoded from the cond branch's GEN stack output `[N_gen, D]`, pushed away from the uncond
        branch's by `guidance` when that is given: fp32 and flat like the sampler state, zero on clean frames and
        rows. The heads are affine, so guiding what they decode guides the velocities, with one decode, not two."""
        out = cond if uncond is None else uncond + guidance * (cond - uncond)
        vision, _, actions = self.transformer.heads(out, GenInput(out, layout))
        return torch.cat((vision[0][0].float().flatten(), actions[0].float().flatten()))

    def unipc_update(self, velocity: torch.Tensor, sample: torch.Tensor, sigma: float,
                     history: tuple[torch.Tensor, ...], last_sample: torch.Tensor | None,
                     corrector: UniCoefficients | None, predictor: UniCoefficients
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One UniPC step's tensors (`schedulers.unipc_update`)."""
        return unipc_update(velocity, sample, sigma, history, last_sample, corrector, predictor)


class CompiledTickWork(TickWork):
    """A tick's work from the graphs compiled for it, eagerly where there is none. `eager_calls`: the prefills and
    sampler steps that ran eagerly (no graph yet, or a request shape without graphs)."""

    def __init__(self, transformer: Cosmos3OmniTransformer):
        super().__init__(transformer)
        self.eager_calls = 0
        self._prefill = CompiledGraphs()  # one graph: text lengths are dynamic
        self._updates = CompiledGraphs()  # by step structure (`_update_structure`)
        self._shapes = CompiledGraphs()  # by request shape: the embedding, the one-branch and the guided decode

    @property
    def num_shapes(self) -> int:
        return len(self._shapes)

    @property
    def compile_ms(self) -> float:
        return self._prefill.compile_ms + self._updates.compile_ms + self._shapes.compile_ms

    def prefill(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> UndKV:
        graph = self._prefill.get(())
        if graph is None or input_ids.shape[0] < MIN_DYNAMIC_SIZE:
            self.eager_calls += 1
            return super().prefill(input_ids, position_ids)
        tensors = graph(input_ids, position_ids)
        layers = self.transformer.config.num_hidden_layers
        return UndKV(tensors[:layers], tensors[layers:])

    def embed(self, layout: GenLayout, sample: torch.Tensor, time_embedding: torch.Tensor) -> torch.Tensor:
        graphs = self._shapes.get(_shape(layout))
        if graphs is None:
            self.eager_calls += 1
            return super().embed(layout, sample, time_embedding)
        return graphs[0](sample, time_embedding)[0]

    def velocity(self, layout: GenLayout, cond: torch.Tensor, uncond: torch.Tensor | None = None,
                 guidance: float = 1.0) -> torch.Tensor:
        graphs = self._shapes.get(_shape(layout))
        if graphs is None:
            return super().velocity(layout, cond, uncond, guidance)
        if uncond is None:
            return graphs[1](cond)[0]
        # The scale as the eager product takes a Python float: in fp32.
        return graphs[2](cond, uncond, torch.tensor(guidance, dtype=torch.float32, device=cond.device))[0]

    def unipc_update(self, velocity: torch.Tensor, sample: torch.Tensor, sigma: float,
                     history: tuple[torch.Tensor, ...], last_sample: torch.Tensor | None,
                     corrector: UniCoefficients | None, predictor: UniCoefficients
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        graph = self._updates.get(_update_structure(sample, history, corrector, predictor))
        if graph is None:
            return super().unipc_update(velocity, sample, sigma, history, last_sample, corrector, predictor)
        x0, corrected, predicted = graph(velocity, sample, _update_scalars(sigma, corrector, predictor, sample.device),
                                         *history, *(() if last_sample is None else (last_sample,)))
        return x0, corrected, predicted

    def compiling(self) -> TickWork:
        """This tick work, compiling first the graphs it lacks for what it is asked."""
        return _Compiling(self)


class _Compiling(TickWork):
    """`CompiledTickWork` that compiles the graphs it lacks before it runs them. A step embeds before it decodes, so
    the embedding compiles the step's request shape, from the step's own tensors."""

    def __init__(self, compiled: CompiledTickWork):
        super().__init__(compiled.transformer)
        self.compiled = compiled

    def prefill(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> UndKV:
        if input_ids.shape[0] >= MIN_DYNAMIC_SIZE:
            text_rows = Dim("text_rows", min=MIN_DYNAMIC_SIZE)
            self.compiled._prefill.compile((), lambda: CompiledGraph(
                _Prefill(self.transformer), (input_ids, position_ids), dynamic_shapes=({0: text_rows}, {1: text_rows})))
        return self.compiled.prefill(input_ids, position_ids)

    def embed(self, layout: GenLayout, sample: torch.Tensor, time_embedding: torch.Tensor) -> torch.Tensor:
        self.compiled._shapes.compile(_shape(layout), lambda: self._shape_graphs(layout, sample, time_embedding))
        return self.compiled.embed(layout, sample, time_embedding)

    def velocity(self, layout: GenLayout, cond: torch.Tensor, uncond: torch.Tensor | None = None,
                 guidance: float = 1.0) -> torch.Tensor:
        return self.compiled.velocity(layout, cond, uncond, guidance)

    def unipc_update(self, velocity: torch.Tensor, sample: torch.Tensor, sigma: float,
                     history: tuple[torch.Tensor, ...], last_sample: torch.Tensor | None,
                     corrector: UniCoefficients | None, predictor: UniCoefficients
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        structure = _update_structure(sample, history, corrector, predictor)
        if structure is not None:
            self.compiled._updates.compile(structure, lambda: self._update_graph(sample, history, corrector,
                                                                                 predictor))
        return self.compiled.unipc_update(velocity, sample, sigma, history, last_sample, corrector, predictor)

    def _shape_graphs(self, layout: GenLayout, sample: torch.Tensor, time_embedding: torch.Tensor
                      ) -> tuple[CompiledGraph, CompiledGraph, CompiledGraph]:
        """A request shape's embedding, one-branch decode and guided decode, traced on distinct examples."""
        eager = TickWork(self.transformer)
        stack_out = torch.zeros((layout.num_gen, self.transformer.config.hidden_size), dtype=self.transformer.dtype,
                                device=sample.device)
        return (CompiledGraph(_Embed(eager, layout), (torch.zeros_like(sample), torch.zeros_like(time_embedding))),
                CompiledGraph(_Velocity(eager, layout), (stack_out,)),
                CompiledGraph(_Velocity(eager, layout), (stack_out, torch.zeros_like(stack_out),
                                                         torch.zeros((), device=sample.device))))

    @staticmethod
    def _update_graph(sample: torch.Tensor, history: tuple[torch.Tensor, ...], corrector: UniCoefficients | None,
                      predictor: UniCoefficients) -> CompiledGraph:
        """The UniPC update of one step structure, the state's size dynamic."""
        size = Dim("size", min=MIN_DYNAMIC_SIZE)
        states = [torch.zeros_like(sample) for _ in range(2 + len(history) + (corrector is not None))]
        return CompiledGraph(_UniPCUpdate(corrector, predictor),
                             (states[0], states[1], _update_scalars(1.0, corrector, predictor, sample.device),
                              tuple(states[2:])),
                             dynamic_shapes=({0: size}, {0: size}, None, tuple({0: size} for _ in states[2:])))


class _Prefill(nn.Module):
    """What export traces for `TickWork.prefill`: the layers' keys, then their values."""

    def __init__(self, transformer: Cosmos3OmniTransformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        und_kv = self.transformer.prefill_und(input_ids, position_ids)
        return (*und_kv.keys, *und_kv.values)


class _Embed(nn.Module):
    """What export traces for `TickWork.embed` of one layout."""

    def __init__(self, work: TickWork, layout: GenLayout):
        super().__init__()
        self.work, self.layout = work, layout

    def forward(self, sample: torch.Tensor, time_embedding: torch.Tensor) -> torch.Tensor:
        return self.work.embed(self.layout, sample, time_embedding)


class _Velocity(nn.Module):
    """What export traces for `TickWork.velocity` of one layout."""

    def __init__(self, work: TickWork, layout: GenLayout):
        super().__init__()
        self.work, self.layout = work, layout

    def forward(self, cond: torch.Tensor, uncond: torch.Tensor | None = None,
                guidance: torch.Tensor | float = 1.0) -> torch.Tensor:
        return self.work.velocity(self.layout, cond, uncond, guidance)


class _UniPCUpdate(nn.Module):
    """What export traces for `unipc_update` of one step structure: its scalars go in as one fp32 tensor
    (`_update_scalars`), each a 0-dim tensor in the arithmetic, as the eager update's Python floats are in fp32."""

    def __init__(self, corrector: UniCoefficients | None, predictor: UniCoefficients):
        super().__init__()
        self.corrector, self.predictor = corrector, predictor

    def forward(self, velocity: torch.Tensor, sample: torch.Tensor, scalars: torch.Tensor,
                states: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        values = iter(scalars)
        corrector = None if self.corrector is None else _scalar_coefficients(self.corrector, values)
        predictor = _scalar_coefficients(self.predictor, values)
        sigma = next(values)
        history, last_sample = (states[:-1], states[-1]) if corrector is not None else (states, None)
        return unipc_update(velocity, sample, sigma, history, last_sample, corrector, predictor)


def _update_structure(sample: torch.Tensor, history: tuple[torch.Tensor, ...], corrector: UniCoefficients | None,
                      predictor: UniCoefficients) -> tuple | None:
    """What an update's graph is fixed to: the number of earlier predictions and the corrector's and predictor's
    orders; None for an update no graph serves (a state not flat, or smaller than `MIN_DYNAMIC_SIZE`)."""
    if sample.ndim != 1 or sample.shape[0] < MIN_DYNAMIC_SIZE:
        return None
    return len(history), None if corrector is None else len(corrector.rks), len(predictor.rks), sample.dtype


@functools.lru_cache(maxsize=4096)  # a schedule's steps repeat every tick
def _update_scalars(sigma: float, corrector: UniCoefficients | None, predictor: UniCoefficients,
                    device: torch.device) -> torch.Tensor:
    """An update's scalars in the order `_UniPCUpdate` reads them: the corrector's, the predictor's, sigma."""
    values = [] if corrector is None else _coefficient_values(corrector)
    return torch.tensor([*values, *_coefficient_values(predictor), sigma], dtype=torch.float32, device=device)


def _coefficient_values(coef: UniCoefficients) -> list[float]:
    return [coef.x_scale, coef.m0_scale, coef.res_scale, *coef.rks, *coef.rhos]


def _scalar_coefficients(coef: UniCoefficients, values) -> UniCoefficients:
    """`coef` with its values taken in turn from `values` (0-dim tensors)."""
    return UniCoefficients(next(values), next(values), next(values), tuple(next(values) for _ in coef.rks),
                           tuple(next(values) for _ in coef.rhos))


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
