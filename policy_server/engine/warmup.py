"""Warmup: fill the cost model for every cost key served before health turns SERVING.

One tick per worker step, so a shutdown interrupts it within one tick. The first served embodiment's
default shape runs `warmup_ticks` full ticks per mode (uncached, maximal caching) for the latency profile
in `info()`; every other key one short tick per mode (costs are learned per call and stage, so a few
sampler steps teach them as well as all of them). Then the reasoner's steps and the pieces of dynamics calls
are timed: what a tick may find running when it arrives. With CUDA graphs or a compiled GEN stack, each shape
first runs one untimed tick per mode that captures its GEN-stack calls (and compiles what is not compiled yet: on a
CPU the stack's call patterns, which serve every shape, and the tick work of the shape's latent shape, which serves its
every chunk size; the default shape also runs two ticks as a micro-batch, whose calls batch another way), and each
session's opening captures those of its own prompt (`session_graphs`), so no live tick waits on a capture or a
compile. On a CPU one more untimed tick compiles the tick work of each latent shape no measured shape has. Last,
every step count a plan may choose gets its schedule made (`PolicyPipeline.warm_schedule`).
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import numpy as np
import torch

from policy_server.budget.cost_model import FULL, PAIR, SKIP, CallCosts, CostModel
from policy_server.budget.planner import MAX_CACHING
from policy_server.budget.tick import PREVIEW_STAGE
from policy_server.cache.controller import NoCache
from policy_server.cache.seacache import SeaCache, SeaCacheConfig
from policy_server.engine import api
from policy_server.engine.batching import run_together
from policy_server.engine.calibration import TickRunner, calibration_steps, configurations, warmup_observations
from policy_server.engine.dynamics import DynamicsCall
from policy_server.engine.served import INSTRUCTION_TOKEN_GROUPS, ServedModel
from policy_server.engine.tick import STAGES, observe_output
from policy_server.limits import MAX_INSTRUCTION_TOKENS, MAX_PROMPT_TOKENS
from policy_server.pipeline.compiled_stack import PrecompiledGenStack
from policy_server.pipeline.embodiments import Embodiment
from policy_server.pipeline.policy import PolicyOutput, PolicyRequest, TickSteps, run_steps, stepwise
from policy_server.pipeline.reasoner import ReasonerStream
from policy_server.pipeline.tick_work import CompiledTickWork

# Sampler steps of the warmup ticks that only fill costs: the first and last step are full, the rest can skip.
_SHORT_WARMUP_STEPS = 6
# Timed runs of each background call: each piece's time is the median of its runs', so one run that another process
# preempted mid-piece does not set the reserve every admission adds (a single run's longest step varied 2-3x here).
_BACKGROUND_RUNS = 3
WARMUP_CALIBRATION_OBSERVATIONS = 2  # per embodiment, when there is no quality profile
logger = logging.getLogger(__name__)


class Warmup:
    """The warmup of one engine: a generator of worker steps (`steps`), then `ready` is set. `progress` in
    [0, 1]; `profile`: the latency profile points; `error`: what made it fail, if it did. The longest reasoner
    step or dynamics piece goes to the cost model (`CostModel.background_ms`)."""

    def __init__(self, served: ServedModel):
        self.served = served
        self.ready = threading.Event()
        self.progress = 0.0
        self.profile: tuple[api.ProfilePoint, ...] = ()
        self.error: BaseException | None = None
        self._preview_ms_by_shape: dict[tuple[int, ...], float] = {}  # preview decode ms by latent shape

    def steps(self) -> Iterator[None]:
        """Fill the cost model for every cost key served, one tick per step, then time the reasoner's steps and
        the pieces of dynamics calls (what a tick may find running).
        The first served embodiment's default shape runs `warmup_ticks` full ticks per mode for the latency
        profile in `info()`; every other key one short tick per mode (costs are learned per call and stage,
        so a few sampler steps teach them as well as all of them)."""
        shapes = self._warm_shapes()
        logger.info("warming up before serving: %s", "compiling the model's work and timing its ticks (a first "
                    "start compiles for a while; torch keeps the code on disk for the next one)"
                    if self.served.compiled else "timing the model's ticks")
        profile = []
        for index, (embodiment, chunk, tokens, default) in enumerate(shapes):
            logger.info("warmup %d/%d: %s ticks of %d actions, %d instruction tokens", index + 1, len(shapes),
                        embodiment.name, chunk, tokens)
            ticks, steps = (self.served.settings.warmup_ticks, None) if default else (1, _SHORT_WARMUP_STEPS)
            points = yield from self._warm_shape(embodiment, chunk, tokens, ticks, steps, batch=default)
            if default:
                profile.extend(points)
            self.progress = (index + 1) / (len(shapes) + 1)
        if isinstance(self.served.tick_work, CompiledTickWork):
            yield from self._compile_latent_shapes(shapes)
        for num_steps in range(1, self.served.num_steps + 1):  # a plan may cut the steps to any count
            self.served.pipeline.warm_schedule(num_steps)
            yield
        self.profile = tuple(profile)
        self._interpolate_costs()
        # Soon after the ticks of the measured shapes, whose costs are the speed the live ticks' are compared with
        # from here on, to scale this timing.
        self.served.cost_model.time_background((yield from self._time_background_pieces()),
                                               [self.served.cost_key(e.name, chunk, tokens)
                                                for e, chunk, tokens, _ in shapes])
        if self.served.settings.calibrate_at_warmup and self.served.profile is None:
            self.served.profile = yield from self._calibrate()
        if self.served.graphs is not None:  # with a compiled stack, its compiles are inside the first capture
            logger.info("captured %d CUDA graphs of the GEN stack in %.0f ms", self.served.graphs.num_graphs,
                        self.served.graphs.capture_ms)
            # Kept for good, the warmup's; of those captured later, each session's three shapes (each branch alone,
            # both as one batch): beyond, the shapes used least recently go.
            self.served.graphs.max_later = 3 * self.served.settings.max_sessions
        elif isinstance(self.served.gen_stack, PrecompiledGenStack):
            stack, tick_work = self.served.gen_stack, self.served.tick_work
            logger.info("compiled the GEN stack for %d call patterns in %.0f ms, the prefill and each step's work "
                        "around the stack for %d latent shapes in %.0f ms", stack.num_patterns, stack.compile_ms,
                        tick_work.num_shapes, tick_work.compile_ms)
        self.progress = 1.0
        self.ready.set()

    def retime(self, key: tuple) -> Iterator[None]:
        """Time the ticks of cost key `key` and the background pieces again, one short tick per mode, as warmup
        times every key but the default one, and keep the lower of the two timings of each (`CostModel.adopt_lower`,
        `CostModel.lower_background`): a retiming undoes timings a busy moment inflated, and one that another
        process slows must not raise the least budget every later session is held to (live ticks raise the costs
        and the background reserve where the machine stays slower)."""
        embodiment, chunk, tokens, _ = self._all_shapes()[key]
        fresh = CostModel(self.served.cost_model.window)
        self._preview_ms_by_shape.clear()
        yield from self._warm_shape(embodiment, chunk, tokens, 1, _SHORT_WARMUP_STEPS, batch=False, cost_model=fresh)
        self.served.cost_model.adopt_lower(key, fresh)
        self.served.cost_model.lower_background((yield from self._time_background_pieces()), key, fresh)

    def _calibrate(self):
        """A bounded quality profile: `WARMUP_CALIBRATION_OBSERVATIONS` observations per embodiment over the
        coarse grid of configurations."""
        pipeline = self.served.pipeline
        observations = warmup_observations(pipeline, WARMUP_CALIBRATION_OBSERVATIONS)
        logger.warning("no quality profile for weights %s: calibrating on %d observations at warmup (bounded; run "
                       "`policy-server calibrate` for a full one)", pipeline.digest[:19], len(observations))
        configs = configurations(pipeline, self.served.settings, coarse=True)
        # Its ticks run as the live ones do: compiled where the server compiles (the graphs exist by now).
        runner = TickRunner(self.served.gen_stack, self.served.tick_work)
        profile = yield from calibration_steps(pipeline, observations, configs, source="warmup (bounded)",
                                               progress=lambda done: logger.info("warmup calibration: %.0f%%",
                                                                                 100 * done), runner=runner)
        logger.info("warmup calibration took %.1f s", profile.calibration.seconds)
        return profile

    def failed(self, error: BaseException) -> None:
        # A shutdown during warmup (the queue's ShuttingDown, or the tick it abandoned) is no failure to report.
        if not self.served.closing.is_set():
            logger.error("warmup failed", exc_info=error)
        self.error = error  # surfaced by wait_ready() and every request
        self.ready.set()

    def _warm_shapes(self) -> list[tuple[Embodiment, int, int, bool]]:
        """`(embodiment, chunk, instruction tokens, is the default shape)` to measure, the default first: each
        key at the largest chunk any served embodiment asks with it, at its longest instruction. Of the keys
        that differ only in latent frames, the fewest and the most frames and every served embodiment's default
        chunk are measured; the rest are interpolated (`_interpolate_costs`)."""
        first = next(iter(self.served.embodiments.values()))
        default_key = self.served.cost_key(first.name, first.default_chunk_size, 0)
        shapes: dict[tuple, tuple[Embodiment, int, int, bool]] = {
            default_key: (first, first.default_chunk_size, INSTRUCTION_TOKEN_GROUPS[0], True)}
        every = self._all_shapes()
        measured = {self.served.cost_key(e.name, e.default_chunk_size, tokens)
                    for e in self.served.embodiments.values() for tokens in INSTRUCTION_TOKEN_GROUPS}
        for family in {key[1:] for key in every}:
            frames = sorted(key[0] for key in every if key[1:] == family)
            measured |= {(frames[0], *family), (frames[-1], *family)}
        for key in sorted(measured - {default_key}):
            shapes[key] = every[key]
        return list(shapes.values())

    def _compile_latent_shapes(self, measured: list[tuple[Embodiment, int, int, bool]]) -> Iterator[None]:
        """One untimed tick of each latent shape of the served embodiments that no measured shape has, at the largest
        chunk making it: the tick work compiled for a latent shape serves its every chunk size and embodiment."""
        def shape(embodiment: Embodiment, chunk: int) -> tuple:
            # Embodiments alike in their costs (latent frames, a state row) share a step graph (`tick_work._shape`).
            return self.served.cost_key(embodiment.name, chunk, 0)

        done = {shape(embodiment, chunk) for embodiment, chunk, _, _ in measured}
        instruction = self.text_of(INSTRUCTION_TOKEN_GROUPS[0])
        for embodiment in self.served.embodiments.values():
            for chunk in range(embodiment.max_chunk_size, 0, -1):
                key = shape(embodiment, chunk)
                if key not in done:
                    done.add(key)
                    logger.info("warmup: compiling the step work of ticks of %d latent frames", key[0])
                    self._warmup_tick(embodiment, chunk, instruction, "uncached", 0, _SHORT_WARMUP_STEPS)
                    yield

    def _all_shapes(self) -> dict[tuple, tuple[Embodiment, int, int, bool]]:
        """Every cost key served, at the largest chunk any served embodiment asks with it."""
        shapes: dict[tuple, tuple[Embodiment, int, int, bool]] = {}
        for embodiment in self.served.embodiments.values():
            for chunk in range(1, embodiment.max_chunk_size + 1):
                for tokens in INSTRUCTION_TOKEN_GROUPS:
                    key = self.served.cost_key(embodiment.name, chunk, tokens)
                    if chunk >= shapes.get(key, (None, 0))[1]:
                        shapes[key] = (embodiment, chunk, tokens, False)
        return shapes

    def _interpolate_costs(self) -> None:
        """Costs of the keys warmup did not run, linear in latent frames between the measured keys on either
        side. A tick's cost is convex in its tokens (attention is quadratic), so the chord overestimates: such
        a key starts out cautious, and its own ticks replace the estimate as they run."""
        keys = list(self._all_shapes())
        for key in keys:
            if self.served.cost_model.is_warm(key):
                continue
            family = [k for k in keys if k[1:] == key[1:] and self.served.cost_model.is_warm(k)]
            low = max((k for k in family if k[0] < key[0]), key=lambda k: k[0])
            high = min((k for k in family if k[0] > key[0]), key=lambda k: k[0])
            calls, stages = _interpolated(self.served.cost_model.costs(low), self.served.cost_model.costs(high),
                                          (key[0] - low[0]) / (high[0] - low[0]))
            if not self.served.cost_model.samples(low)[PAIR]:  # no CFG: no pair was measured, none is made up
                calls = [(kind, ms) for kind, ms in calls if kind != PAIR]
            self.served.cost_model.observe_tick(key, calls, stages)

    def _warm_shape(self, embodiment: Embodiment, chunk: int, tokens: int, ticks: int, steps: int | None,
                    batch: bool, cost_model: CostModel | None = None):
        """Uncached ticks time the fixed stages and the calls of a step as the server runs them (both branches'
        as one batch); maximally cached ticks time skipped calls, and run the calls of their few full steps one
        by one, which is what a step with one branch skipped costs (`steps`: sampler steps per tick, None for
        the configured number). Captures and compiles come first, untimed (`batch`: also for a micro-batch).
        Yields after each tick; returns the two latency profile points. The costs go to `cost_model` (None: the
        served one)."""
        key = self.served.cost_key(embodiment.name, chunk, tokens)
        instruction = self.text_of(tokens)
        profile = []
        for mode in ("uncached", "max_caching"):
            if self.served.graphs is not None or self.served.compiled:  # they stay out of the costs
                self._warmup_tick(embodiment, chunk, instruction, mode, 0, steps)
                yield
                if batch and self.served.settings.max_batch > 1:
                    self._warmup_micro_batch(embodiment, chunk, instruction, mode, steps)
                    yield
            totals, full, skipped = [], 0, 0
            for tick in range(ticks):
                out = self._warmup_tick(embodiment, chunk, instruction, mode, tick, steps)
                stage_ms = {stage: out.timings_ms[stage] for stage in STAGES}
                stage_ms[PREVIEW_STAGE] = self._preview_ms(out.latents)
                observe_output(cost_model or self.served.cost_model, key, out, stage_ms, prefilled=True)
                if tick > 0 or ticks == 1:  # the first tick pays one-time allocation costs
                    totals.append(out.timings_ms["total"])
                full, skipped = out.cache.full_calls, out.cache.skipped_calls
                yield
            profile.append(api.ProfilePoint(label=f"{embodiment.name}/{mode}", p50_ms=float(np.median(totals)),
                                            p95_ms=float(np.percentile(totals, 95)), full_calls=full,
                                            skipped_calls=skipped))
        return profile

    def _preview_ms(self, latents: torch.Tensor) -> float:
        """What a session with preview frames adds to a tick making `latents`: their decode, timed once per
        latent shape (it depends on nothing else, and long clips take the longest of the warmup) after one
        untimed decode: the first in a process pays one-time costs, as the first tick does."""
        shape = tuple(latents.shape)
        if shape not in self._preview_ms_by_shape:
            self.served.pipeline.decode_video(latents)
            clock = self.served.clock()
            self.served.pipeline.decode_video(latents)
            self._preview_ms_by_shape[shape] = self.served.clock() - clock
        return self._preview_ms_by_shape[shape]

    def session_graphs(self, embodiment: Embodiment, chunk: int, instruction: str) -> Iterator[None]:
        """Capture the CUDA graphs of a session's GEN-stack calls (each branch alone and both as one batch),
        one sampler step per worker step."""
        for mode in ("uncached", "max_caching"):
            yield from stepwise(self._warmup_steps(embodiment, chunk, instruction, mode, 0, _SHORT_WARMUP_STEPS),
                                self.served.capturing_gen_stack)

    def _warmup_tick(self, embodiment: Embodiment, chunk: int, instruction: str, mode: str, tick: int,
                     steps: int | None) -> PolicyOutput:
        # Abandoned between two sampler steps when the engine shuts down.
        return run_steps(self._warmup_steps(embodiment, chunk, instruction, mode, tick, steps),
                         self.served.capturing_gen_stack, stop=self.served.closing.is_set)

    def _warmup_micro_batch(self, embodiment: Embodiment, chunk: int, instruction: str, mode: str,
                            steps: int | None) -> None:
        """Two warmup ticks run together as the worker runs a micro-batch: their calls go as one stack."""
        ticks = [(self._warmup_steps(embodiment, chunk, instruction, mode, tick, steps), Future()) for tick in (0, 1)]
        run_together(ticks, self.served.capturing_gen_stack)
        for _, result in ticks:
            result.result()  # a failure fails the warmup

    def _warmup_steps(self, embodiment: Embodiment, chunk: int, instruction: str, mode: str, tick: int,
                      steps: int | None) -> TickSteps:
        """An uncached or a maximally cached tick on random frames, the latter's calls one by one."""
        rng = np.random.default_rng(tick)
        images = {name: rng.integers(0, 256, (*size, 3), dtype=np.uint8)  # the advertised sizes: the ticks' shapes
                  for name, size in embodiment.frame_sizes(self.served.pipeline.config.canvas_hw).items()}
        state = np.zeros(embodiment.state_dim, np.float32) if embodiment.state_dim else None
        request = PolicyRequest(images=images, instruction=instruction, embodiment=embodiment.name, state=state,
                                chunk_size=chunk, seed=tick,
                                num_steps=None if steps is None else min(steps, self.served.pipeline.config.num_steps))
        cache = NoCache() if mode == "uncached" else _MaxCaching(
            SeaCacheConfig(threshold=MAX_CACHING.threshold, max_consecutive_cached=MAX_CACHING.cap),
            sea_filter=self.served.sea_filter)
        control = self.served.fixed_steps(request.num_steps or self.served.num_steps, cache,
                                          batch_branches=mode == "uncached")
        return self.served.pipeline.steps(request, None, control, self.served.capturing_tick_work)

    def text_of(self, tokens: int) -> str:
        """An instruction of about `tokens` tokens (at most that many)."""
        tokenizer = self.served.pipeline.tokenizer
        ids = tokenizer.tokenize("reach the red circle and then the blue square " * tokens)
        text = tokenizer.decode(ids[:tokens]).strip()
        while len(tokenizer.tokenize(text)) > tokens:
            text = text[:-1]
        return text

    def _time_background_pieces(self):
        """The longest piece (ms) of background work a tick may find running: a reasoner step or a piece of a
        dynamics call (a server without dynamics calls need not reserve for their longest piece, the frames'
        decode)."""
        reasoner_ms = yield from self._time_reasoner_steps()
        dynamics_ms = (yield from self._time_dynamics_pieces()) if self.served.settings.max_dynamics_calls else 0.0
        return max(reasoner_ms, dynamics_ms)

    def _time_reasoner_steps(self):
        """The longest step of a reasoner call at the prompt limit (ms): a prefill chunk or a token. Timed on the
        calls after the first, whose steps pay one-time costs (a GPU loads the kernels of each new shape)."""
        config = self.served.pipeline.transformer.config
        ids = torch.arange(MAX_PROMPT_TOKENS) % config.vocab_size
        runs = []
        for _ in range(1 + _BACKGROUND_RUNS):
            stream = ReasonerStream(self.served.pipeline.transformer, ids, max_new_tokens=4)

            def step(stream: ReasonerStream = stream) -> bool:
                stream.step()
                return stream.done

            runs.append((yield from self._piece_times(step)))
        return _longest_piece(runs[1:])

    def _time_dynamics_pieces(self):
        """The longest piece (ms) of a forward and an inverse dynamics call at the longest clip any served
        embodiment asks for and the longest instruction. A few sampler steps suffice: each is one piece."""
        embodiment = max(self.served.embodiments.values(), key=lambda e: e.max_chunk_size)
        chunk = embodiment.max_chunk_size
        cameras = {name: np.zeros((chunk + 1, *size, 3), np.uint8)
                   for name, size in embodiment.frame_sizes(self.served.pipeline.config.canvas_hw).items()}
        common = dict(instruction=self.text_of(MAX_INSTRUCTION_TOKENS), embodiment=embodiment.name,
                      state=np.zeros(embodiment.state_dim, np.float32) if embodiment.state_dim else None,
                      chunk_size=chunk, num_steps=min(3, self.served.pipeline.config.num_steps))
        calls = (
            (PolicyRequest(images={name: frames[0] for name, frames in cameras.items()}, mode="forward_dynamics",
                           actions=np.zeros((chunk, embodiment.raw_action_dim), np.float32), **common), True),
            (PolicyRequest(images={}, mode="inverse_dynamics", video=cameras, **common), False),
        )
        longest = 0.0
        for request, decode_frames in calls:
            on_canvas = self.served.pipeline.prepare_frames(request)  # a caller's thread does this, not the worker
            runs = []
            for _ in range(_BACKGROUND_RUNS):
                job = DynamicsCall(self.served, embodiment, request, on_canvas, decode_frames, None,
                                   self.served.clock(), end=None)  # the warmup's own job ends it
                runs.append((yield from self._piece_times(job.step)))
                job.result.result()  # a failure fails the warmup
            longest = max(longest, _longest_piece(runs))
        return longest

    def _piece_times(self, step: Callable[[], bool]):
        """The time (ms) of each piece of one background call, each a worker step: `step()` runs one and says
        whether the call has ended."""
        times, ended = [], False
        while not ended:
            started = self.served.clock()
            ended = step()
            times.append(self.served.clock() - started)
            yield
        return times


def _longest_piece(runs: list[list[float]]) -> float:
    """The longest piece (ms) of runs of the same pieces of work, each piece's time the median of its runs'."""
    return max(statistics.median(times) for times in zip(*runs, strict=True))


class _MaxCaching(SeaCache):
    """The most caching a tick may see: SeaCache's gate, and where the gate cannot measure (no noisy vision: a chunk
    inside the conditioning frame's latent frame) the skips the deadline guard would force. So a skipped call is
    timed for every shape; until one has been, the cost model prices a skip as a full call, and the guard of a
    tight tick of such a shape, seeing no cheaper rest, would give up its CFG and its last steps instead."""

    def estimate(self, step, branch, sigma, noisy_vision, gen_in) -> torch.Tensor | None:
        gate = self.gate(step, branch, sigma, noisy_vision)
        return self.skip(gate, gen_in, force_skip=gate.full_reason == "no_noisy_vision")


def _interpolated(low: CallCosts, high: CallCosts,
                  weight: float) -> tuple[list[tuple[str, float]], dict[str, float]]:
    """The calls `(kind, ms)` and stages (ms) a `weight` of the way from `low`'s costs to `high`'s."""
    def lerp(a: float, b: float) -> float:
        return a + weight * (b - a)

    stages = {stage: lerp(ms, high.fixed_ms[stage]) for stage, ms in low.fixed_ms.items() if stage in high.fixed_ms}
    calls = [(FULL, lerp(low.full_ms, high.full_ms)), (SKIP, lerp(low.skip_ms, high.skip_ms)),
             (PAIR, lerp(low.pair_ms, high.pair_ms))]
    return calls, stages
