"""A tick's model work besides the GEN stack: `TickWork` runs it eagerly, `CompiledTickWork` from graphs.

The work: the text prefill of a new prompt (`prefill`), the embedding of the first step's generated rows (`embed`)
and, after each sampler step's GEN-stack calls, the rest of the step (`advance`): decode the velocity (the CFG
combination and the heads, vision and actions in fp32, flat as the sampler state is), take the sampler step, set the
conditioning back and embed the next step's rows (none after the final step). A step the deadline guard makes the last
decodes its velocity and jumps to the clean estimate (`finish`).

On a CPU these ops cost more to dispatch than to compute, the more so right after a GEN-stack call has filled the caches
with its own work. `CompiledTickWork` runs each piece as one `CompiledGraph`: the prefill with the text length dynamic,
and per latent shape the guided step (the first step's embedding, once a tick, runs eagerly). A step of the cond branch
alone (a plan may drop the uncond pass) runs the guided graph with the cond output as the uncond one too, which guides
by exactly nothing (`uncond + g * (cond - uncond)` is `cond` bit for bit), so one step graph per latent shape serves
both. These read the layout's GEN-local rows alone, which the text length does not move, and take the rows that depend
on the action rows as inputs, their counts dynamic (`_ActionRows`): so a latent shape's graphs serve every instruction,
chunk size and count of history actions, and every embodiment (`_shape`). A step graph holds the UniPC update of the
sampler's order in its widest form (`schedulers.widest_update`), which gives every step's update bit for bit, so one
graph serves every step; its x0 prediction is also the clean estimate a finishing step jumps to. Compiling takes
seconds, so it is done where no deadline runs, by the object `compiling()` returns (warmup's); the object itself runs
eagerly what it has no graph for (an Euler sampler's steps among them).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn
from torch.export import Dim

from policy_server.model import Cosmos3OmniTransformer, GenInput, UndKV
from policy_server.model.gen_layout import GenLayout
from policy_server.model.layers import DomainIds
from policy_server.pipeline.compiled_graph import MIN_DYNAMIC_SIZE, CompiledGraph, CompiledGraphs
from policy_server.pipeline.packing import RequestShape
from policy_server.pipeline.schedulers import FlowSampler, UniCoefficients, UniPCSampler, unipc_update, widest_update

if TYPE_CHECKING:
    from policy_server.pipeline.policy import DenoiseState


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
                 guidance: float | torch.Tensor = 1.0) -> torch.Tensor:
        """The velocity decoded from the cond branch's GEN stack output `[N_gen, D]`, pushed away from the uncond
        branch's by `guidance` when that is given: fp32 and flat like the sampler state, zero on clean frames and
        rows. The heads are affine, so guiding what they decode guides the velocities, with one decode, not two."""
        out = cond if uncond is None else uncond + guidance * (cond - uncond)
        vision, _, actions = self.transformer.heads(out, GenInput(out, layout))
        return torch.cat((vision[0][0].float().flatten(), actions[0].float().flatten()))

    def advance(self, layout: GenLayout, cond: torch.Tensor, uncond: torch.Tensor | None, guidance: float,
                sampler: FlowSampler, state: DenoiseState, time_embedding: torch.Tensor | None) -> torch.Tensor | None:
        """The rest of a sampler step after its GEN-stack calls, whose outputs `velocity` decodes: step `sampler`,
        advance `state` and return the next step's generated rows, embedded with its `time_embedding` (None after
        the final step, which has no next step). All of it eagerly, in a subclass too."""
        sample = sampler.step(TickWork.velocity(self, layout, cond, uncond, guidance), state.sample)
        state.advance(sample, sampler.sigmas[sampler.step_index])  # the sampler is at the next step now
        return None if time_embedding is None else TickWork.embed(self, layout, state.sample, time_embedding)

    def finish(self, layout: GenLayout, cond: torch.Tensor, uncond: torch.Tensor | None, guidance: float,
               sampler: FlowSampler, state: DenoiseState) -> None:
        """End the tick at this step, out of time: jump `state` to the clean estimate, x0 = x_t - sigma * v for
        flow matching."""
        velocity = TickWork.velocity(self, layout, cond, uncond, guidance)
        state.advance(state.sample - sampler.sigmas[sampler.step_index] * velocity, 0.0)


class CompiledTickWork(TickWork):
    """A tick's work from the graphs compiled for it, eagerly where there is none. `eager_calls`: the prefills,
    sampler steps and finishes that ran eagerly (no graph yet, or none for their request shape or sampler). The first
    step's embedding always runs eagerly: it runs once a tick, and a graph of its own would save less there than its
    compile costs each latent shape at warmup."""

    def __init__(self, transformer: Cosmos3OmniTransformer):
        super().__init__(transformer)
        self.eager_calls = 0
        self._prefill = CompiledGraphs()  # one graph: text lengths are dynamic
        self._steps = CompiledGraphs()  # `_Step` graphs by `_step_key`

    @property
    def num_shapes(self) -> int:
        """Latent shapes with a step graph (one each for the sampler's UniPC order)."""
        return len(self._steps)

    @property
    def compile_ms(self) -> float:
        return self._prefill.compile_ms + self._steps.compile_ms

    def prefill(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> UndKV:
        graph = self._prefill.get(())
        if graph is None or input_ids.shape[0] < MIN_DYNAMIC_SIZE:
            self.eager_calls += 1
            return super().prefill(input_ids, position_ids)
        tensors = graph(input_ids, position_ids)
        layers = self.transformer.config.num_hidden_layers
        return UndKV(tensors[:layers], tensors[layers:])

    def advance(self, layout: GenLayout, cond: torch.Tensor, uncond: torch.Tensor | None, guidance: float,
                sampler: FlowSampler, state: DenoiseState, time_embedding: torch.Tensor | None) -> torch.Tensor | None:
        graph = self._steps.get(_step_key(layout, sampler))
        if graph is None:
            self.eager_calls += 1
            return super().advance(layout, cond, uncond, guidance, sampler, state, time_embedding)
        _, state.sample, hidden = self._step(graph, layout, cond, uncond, guidance, sampler, state, time_embedding)
        return None if time_embedding is None else hidden  # the graph set the conditioning back

    def finish(self, layout: GenLayout, cond: torch.Tensor, uncond: torch.Tensor | None, guidance: float,
               sampler: FlowSampler, state: DenoiseState) -> None:
        graph = self._steps.get(_step_key(layout, sampler))
        if graph is None:
            self.eager_calls += 1
            return super().finish(layout, cond, uncond, guidance, sampler, state)
        # The step's x0 prediction is the clean estimate (`unipc_update`); the rest of its work goes unused.
        x0, _, _ = self._step(graph, layout, cond, uncond, guidance, sampler, state, None)
        state.advance(x0, 0.0)

    def _step(self, graph: CompiledGraph, layout: GenLayout, cond: torch.Tensor, uncond: torch.Tensor | None,
              guidance: float, sampler: UniPCSampler, state: DenoiseState, time_embedding: torch.Tensor | None
              ) -> list[torch.Tensor]:
        """Step `sampler` by a `_Step` graph: the x0 prediction, the next sample (its conditioning set back) and
        that sample's rows, embedded with `time_embedding`. The cond branch alone goes in as both branches."""
        branches = (cond, cond if uncond is None else uncond, _scalar(guidance, cond.device))
        # Without a next step the graph embeds rows too, which nothing reads: from any time embedding (one graph
        # serves every step; a call's embedding costs less than a second graph's compile).
        next_time = _time_embedding_like(self.transformer, cond.device) if time_embedding is None else time_embedding
        given = state.given_at(sampler.sigmas[sampler.step_index + 1])

        def update(sample, sigma, history, last_sample, corrector, predictor):
            scalars, states = _widest(sampler.solver_order, sample, sigma, history, last_sample, corrector, predictor)
            x0, corrected, predicted, hidden = graph(sample, scalars, *states, state.given, given, next_time,
                                                     *_ActionRows.of(layout), *branches)
            return x0, corrected, x0, predicted, hidden

        return sampler.step_with(update, state.sample)

    def compiling(self) -> TickWork:
        """This tick work, compiling first the graphs it lacks for what it is asked."""
        return _Compiling(self)


class _Compiling(TickWork):
    """`CompiledTickWork` that compiles the graphs it lacks, traced on the tensors it is given, before it runs
    them."""

    def __init__(self, compiled: CompiledTickWork):
        super().__init__(compiled.transformer)
        self.compiled = compiled

    def prefill(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> UndKV:
        if input_ids.shape[0] >= MIN_DYNAMIC_SIZE:
            text_rows = Dim("text_rows", min=MIN_DYNAMIC_SIZE)
            self.compiled._prefill.compile((), lambda: CompiledGraph(
                _Prefill(self.transformer), (input_ids, position_ids), dynamic_shapes=({0: text_rows}, {1: text_rows})))
        return self.compiled.prefill(input_ids, position_ids)

    def advance(self, layout: GenLayout, cond: torch.Tensor, uncond: torch.Tensor | None, guidance: float,
                sampler: FlowSampler, state: DenoiseState, time_embedding: torch.Tensor | None) -> torch.Tensor | None:
        self._compile_step(layout, cond, sampler, state)
        return self.compiled.advance(layout, cond, uncond, guidance, sampler, state, time_embedding)

    def finish(self, layout: GenLayout, cond: torch.Tensor, uncond: torch.Tensor | None, guidance: float,
               sampler: FlowSampler, state: DenoiseState) -> None:
        self._compile_step(layout, cond, sampler, state)
        self.compiled.finish(layout, cond, uncond, guidance, sampler, state)

    def _compile_step(self, layout: GenLayout, cond: torch.Tensor, sampler: FlowSampler, state: DenoiseState) -> None:
        """The step graph of this latent shape (none for an Euler sampler)."""
        key = _step_key(layout, sampler)
        if key is not None and _traceable(layout.key):
            self.compiled._steps.compile(key, lambda: self._step_graph(layout, cond, sampler.solver_order, state))

    def _step_graph(self, layout: GenLayout, cond: torch.Tensor, order: int, state: DenoiseState) -> CompiledGraph:
        """A latent shape's guided step for a UniPC sampler of `order`, traced on distinct examples of the step's
        tensors."""
        zeros = torch.zeros_like
        # Any step's update in the widest form has the shapes of all of them: an uncorrected first step's will do.
        scalars, states = _widest(order, state.sample, 1.0, (), None, None, UniCoefficients(1.0, 0.0, 0.0, (), ()))
        guidance = torch.zeros((), device=cond.device)
        time_embedding = _time_embedding_like(self.transformer, cond.device)
        inputs = (zeros(state.sample), zeros(scalars), tuple(zeros(tensor) for tensor in states), zeros(state.given),
                  zeros(state.clean), time_embedding, _ActionRows.example(layout), zeros(cond), zeros(cond), guidance)
        dims = ("flat", None, tuple("flat" for _ in states), "flat", "flat", None, "action_rows", "gen", "gen", None)
        return CompiledGraph(_Step(TickWork(self.transformer), layout, order), inputs,
                             _dynamic_shapes(self.transformer, layout, dims))


class _Prefill(nn.Module):
    """What export traces for `TickWork.prefill`: the layers' keys, then their values."""

    def __init__(self, transformer: Cosmos3OmniTransformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        und_kv = self.transformer.prefill_und(input_ids, position_ids)
        return (*und_kv.keys, *und_kv.values)


class _Step(nn.Module):
    """What export traces for `CompiledTickWork.advance` of one latent shape and UniPC order: the guided decode, the
    update in its widest form (`_widest`; its scalars, each a 0-dim fp32 tensor in the arithmetic as the eager update's
    Python floats are in fp32), `DenoiseState.advance`'s restore (of `given_values`, its `given_at` the next noise
    level) and the next embedding. Returns the x0 prediction, the corrected sample, the next sample and its embedded
    rows."""

    def __init__(self, work: TickWork, layout: GenLayout, order: int):
        super().__init__()
        self.work, self.layout, self.order = work, layout, order

    def forward(self, sample: torch.Tensor, scalars: torch.Tensor, states: tuple[torch.Tensor, ...],
                given: torch.Tensor, given_values: torch.Tensor, time_embedding: torch.Tensor,
                action_rows: tuple[torch.Tensor, ...], cond: torch.Tensor, uncond: torch.Tensor,
                guidance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        layout = _ActionRows(*action_rows).laid_out(self.layout)
        velocity = self.work.velocity(layout, cond, uncond, guidance)
        values = iter(scalars)
        corrector = _coefficients(self.order, self.order, values)
        predictor = _coefficients(self.order, self.order - 1, values)
        x0, corrected, predicted = unipc_update(velocity, sample, next(values), states[:-1], states[-1], corrector,
                                                predictor)
        sample = torch.where(given, given_values, predicted)
        return x0, corrected, sample, self.work.embed(layout, sample, time_embedding)


class _ActionRows(NamedTuple):
    """The tensors of a layout whose sizes follow its action rows (one action item, as a policy packs): `R` rows
    (history, state, chunk) and the chunk's `K` noisy ones. A graph takes them as inputs, so that one serves every
    `R` and `K` of a latent shape (`_dynamic_shapes`)."""

    rows: torch.Tensor             # [R] GEN-local rows of the action tokens
    noisy: torch.Tensor            # [K] the noisy ones, as indexes into the action rows
    noisy_rows: torch.Tensor       # [K] GEN-local rows of the noisy ones
    readout_rows: torch.Tensor     # [K] rows the action head reads
    row_domains: torch.Tensor      # [R] embodiment domain of each action row
    readout_domains: torch.Tensor  # [K] ... of each read row
    time_rows: torch.Tensor        # [noisy vision rows + K] rows that get the time embedding

    @classmethod
    def of(cls, layout: GenLayout) -> _ActionRows:
        action = layout.action
        return cls(action.rows, action.noisy_frame_indexes[0], action.noisy_rows, action.readout_rows,
                   layout.action_row_domains.rows, layout.action_readout_domains.rows, layout.time_rows)

    @classmethod
    def example(cls, layout: GenLayout) -> tuple[torch.Tensor, ...]:
        """Copies of `of(layout)`, as a graph's example input: distinct tensors, in a plain tuple."""
        return tuple(tensor.clone() for tensor in cls.of(layout))

    def laid_out(self, layout: GenLayout) -> GenLayout:
        """`layout` (of the same latent shape) with these action rows, its sizes taken from these tensors (so
        symbolic in a trace)."""
        action = replace(layout.action, rows=self.rows, token_shapes=[(self.rows.shape[0], 1, 1)],
                         noisy_frame_indexes=[self.noisy], noisy_rows=self.noisy_rows, readout_rows=self.readout_rows)
        return replace(layout, num_gen=layout.num_gen - layout.action.rows.shape[0] + self.rows.shape[0],
                       action=action, time_rows=self.time_rows,
                       action_row_domains=DomainIds(self.row_domains, layout.action_row_domains.distinct),
                       action_readout_domains=DomainIds(self.readout_domains, layout.action_readout_domains.distinct))


def _widest(order: int, sample: torch.Tensor, sigma: float, history: tuple[torch.Tensor, ...],
            last_sample: torch.Tensor | None, corrector: UniCoefficients | None, predictor: UniCoefficients
            ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A UniPC update in the widest form of `order` as `_Step` takes it: its scalars as one fp32 tensor (the
    corrector's, the predictor's, sigma), and its tensors (the earlier predictions, then the sample the corrector
    starts from)."""
    history, last_sample, corrector, predictor = widest_update(order, sample, history, last_sample, corrector,
                                                               predictor)
    return _scalars(sigma, corrector, predictor, sample.device), (*history, last_sample)


@functools.lru_cache(maxsize=4096)  # a schedule's steps repeat every tick
def _scalars(sigma: float, corrector: UniCoefficients, predictor: UniCoefficients,
             device: torch.device) -> torch.Tensor:
    values = [value for coef in (corrector, predictor)
              for value in (coef.x_scale, coef.m0_scale, coef.res_scale, *coef.rks, *coef.rhos)]
    return torch.tensor([*values, sigma], dtype=torch.float32, device=device)


def _time_embedding_like(transformer: Cosmos3OmniTransformer, device: torch.device) -> torch.Tensor:
    """A time embedding `[1, D]` of zeros: a step graph's example, and what the final step's graph embeds rows
    with that no step reads."""
    return torch.zeros((1, transformer.config.hidden_size), dtype=transformer.dtype, device=device)


@functools.lru_cache(maxsize=64)  # a handful of guidance scales
def _scalar(value: float, device: torch.device) -> torch.Tensor:
    """`value` as a 0-dim fp32 tensor: in fp32, as the eager product takes a Python float."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def _coefficients(order: int, num_rhos: int, values) -> UniCoefficients:
    """UniPC coefficients of `order` (`order - 1` rks, `num_rhos` rhos) taken in turn from `values` (0-dim
    tensors)."""
    return UniCoefficients(next(values), next(values), next(values), tuple(next(values) for _ in range(order - 1)),
                           tuple(next(values) for _ in range(num_rhos)))


def _split(transformer: Cosmos3OmniTransformer, layout: GenLayout, sample: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a flat sampler state: vision latents `[C, T_lat, h, w]` and action rows `[R, action_dim]`."""
    (frames, height, width), = layout.vision_latent_shapes
    vision = sample[: transformer.config.latent_channel * frames * height * width]
    return (vision.view(-1, frames, height, width),
            sample[vision.numel():].view(-1, transformer.config.action_dim))


def _action_counts(shape: RequestShape) -> tuple[int, int]:
    """A request shape's action rows `R` and its noisy ones `K` (`_ActionRows`)."""
    action = shape.action
    return action.num_rows, action.num_rows - len(action.clean_rows)


def _dynamic(shape: RequestShape) -> bool:
    """Whether a request shape's graphs take its action rows' counts as dynamic: where it has 2 rows or more and
    reads 1 or more. Else (forward dynamics reads none) its graphs are its own."""
    rows, noisy = _action_counts(shape)
    return rows >= MIN_DYNAMIC_SIZE and noisy >= 1


def _traceable(shape: RequestShape) -> bool:
    """Whether export can trace a request shape's graphs on it: it fixes a dynamic count it is shown at 1, so a
    latent shape's graphs are traced on a chunk of 2 actions or more (and serve one of 1)."""
    return not _dynamic(shape) or _action_counts(shape)[1] >= MIN_DYNAMIC_SIZE


@functools.lru_cache(maxsize=256)  # asked every sampler step; a server sees a handful of request shapes
def _shape(shape: RequestShape) -> RequestShape:
    """What a request shape's graphs are fixed to: the shape but for the text length, the embodiment (its domain's
    weights are looked up from the rows' domain ids, and its fps moves only the rotary positions, which the step
    work does not read) and, where dynamic, the action rows."""
    shape = replace(shape, und_len=0, fps=0.0)
    if shape.action is not None:
        shape = replace(shape, action=replace(shape.action, domain_id=0))
    if _dynamic(shape):
        shape = replace(shape, action=replace(shape.action, chunk_size=0, num_prefix=0, clean_rows=()))
    return shape


def _dynamic_shapes(transformer: Cosmos3OmniTransformer, layout: GenLayout, dims: tuple) -> tuple | None:
    """`torch.export`'s `dynamic_shapes` of a graph of `layout` whose inputs' first dimensions `dims` names: "flat"
    (a flat sampler state), "gen" (generated rows), "action_rows" (an `_ActionRows`), None (fixed), or a tuple of
    these for a tuple input. None where the layout's action rows are fixed."""
    if not _dynamic(layout.key):
        return None
    rows, noisy = Dim("action_rows", min=MIN_DYNAMIC_SIZE), Dim("noisy_action_rows", min=1)
    example = _ActionRows.of(layout)
    (frames, height, width), = layout.vision_latent_shapes
    vision = transformer.config.latent_channel * frames * height * width
    timed_vision = example.time_rows.shape[0] - example.readout_rows.shape[0]  # none without noisy vision
    sizes = {
        "flat": {0: transformer.config.action_dim * rows + vision},
        "gen": {0: rows + (layout.num_gen - example.rows.shape[0])},
        "action_rows": tuple({0: size} for size in (rows, noisy, noisy, noisy, rows, noisy,
                                                    noisy + timed_vision if timed_vision else noisy)),
        None: None,
    }

    def spec(dim):
        return tuple(spec(each) for each in dim) if isinstance(dim, tuple) else sizes[dim]

    return spec(dims)


def _step_key(layout: GenLayout, sampler: FlowSampler) -> tuple | None:
    """What a step graph is fixed to: the request shape and the UniPC order; None for a sampler no graph serves
    (Euler)."""
    if not isinstance(sampler, UniPCSampler):
        return None
    return _shape(layout.key), sampler.solver_order
