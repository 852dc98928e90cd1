"""Calibration: measure a checkpoint's quality profile by running observations through tick configurations.

    profile = calibrate(pipeline, load_observations(path), configurations(pipeline, settings))

Every configuration (`budget.profile.TickConfig`: sampler steps x CFG schedule x SeaCache setting) runs every
observation with the same seed as the uncached default does, so the initial noise is the same and the action
error (rel-L2, physical units) measures only what the levers change. Each point keeps the mean error, its
90th percentile and the mean calls a tick made: full alone, pairs (both branches full, one batch) and skipped.
The planner chooses on their frontier (`budget.profile.frontier`). Then each frontier point runs again as the
planner would plan it to fit, under the in-tick guard, on a clock that advances by the call costs measured in
the first pass slowed by 1 / `CUT_FRACTIONS`: the error of the refreshes the guard skips on a slow tick, free
of this machine's own timing noise (`budget.profile.Cut`).

Observation files are safetensors (no pickle): tensors `images.<camera>` uint8 `[M, H, W, 3]` (one per
camera of the embodiment) and optionally `state` float32 `[M, state_dim]`; metadata `embodiment` (a served
name) and `instructions` (a JSON list of M strings). `save_observations` writes one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save

from policy_server.budget.cost_model import SKIP, CallCosts, CostModel
from policy_server.budget.guard import DeadlineGuard
from policy_server.budget.planner import plan_on_frontier
from policy_server.budget.profile import (
    PROFILE_FILE,
    Calibration,
    Cut,
    ProfileError,
    ProfilePoint,
    QualityProfile,
    TickConfig,
    frontier,
)
from policy_server.budget.tick import GuardedSteps
from policy_server.cache.controller import NoCache
from policy_server.cache.sea_filter import SeaFilter
from policy_server.cache.seacache import SeaCache, SeaCacheConfig
from policy_server.config import DTYPES, PROFILE_CACHE_ENV, ladder_settings_overridden
from policy_server.engine import api
from policy_server.engine.batching import GenStack
from policy_server.engine.served import EngineSettings, cache_ladder, instruction_tokens
from policy_server.engine.tick import step_calls
from policy_server.limits import MAX_FRAME_SIDE
from policy_server.output_file import output_file
from policy_server.pipeline.hub import is_hub_id
from policy_server.pipeline.policy import (
    CheckpointLoadError,
    Condition,
    FixedSteps,
    PolicyOutput,
    PolicyPipeline,
    PolicyRequest,
    PromptState,
    StepControl,
    default_model_path,
    run_steps,
)
from policy_server.pipeline.policy_config import PolicyConfig
from policy_server.pipeline.tick_work import TickWork
from policy_server.specs import too_wide_beside

logger = logging.getLogger(__name__)

MIN_STEPS = 2  # fewest sampler steps a calibration tries, unless the checkpoint has fewer
# Sampler steps tried, as fractions of the default (then floored at `min_steps`); a coarse grid, for the
# bounded calibration at warmup, tries fewer of them, two CFG schedules and three cache settings.
STEP_FRACTIONS = (1.0, 0.75, 0.6, 0.5, 0.4, 0.3, 0.2)
COARSE_STEP_FRACTIONS = (1.0, 0.6, 0.4, 0.2)
# Of the ladder, counted from its end (a cap of 1 makes it a rung shorter): the published default's, the loosest
# threshold, maximal caching.
COARSE_RUNGS = (-4, -2, -1)
# The embedded model's calibration set: expert observations of the built-in ReachEither task, whose start frames
# have two modes (robots/calibration_set.py).
DEFAULT_OBSERVATIONS = Path(__file__).resolve().parent.parent / "assets" / "calibration" / "reach_either.safetensors"
MAX_OBSERVATIONS = 1024
# A frontier point's step loop is also measured with these fractions of the time its calls take (calls 1.05,
# 1.11, 1.25, 1.67 and 2.5 times slower than expected). The first two because a cut's error is not linear in its
# depth: one forced skip past the cap of an aggressive cache costs it much of what a 20% cut does.
CUT_FRACTIONS = (0.95, 0.9, 0.8, 0.6, 0.4)


class CalibrationError(ValueError):
    """Observations that cannot calibrate this checkpoint; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Observation:
    """One calibration observation: the embodiment's cameras (uint8 RGB `[H, W, 3]`), state, instruction."""

    embodiment: str
    images: dict[str, np.ndarray]
    state: np.ndarray | None
    instruction: str


def save_observations(path: Path, observations: Sequence[Observation]) -> None:
    """Write `observations` (one embodiment, the same cameras and sizes) in the calibration file format."""
    first = observations[0]
    tensors = {f"images.{camera}": np.stack([o.images[camera] for o in observations]) for camera in first.images}
    if first.state is not None:
        tensors["state"] = np.stack([o.state for o in observations]).astype(np.float32)
    metadata = {"embodiment": first.embodiment, "instructions": json.dumps([o.instruction for o in observations])}
    path.parent.mkdir(parents=True, exist_ok=True)
    _save_sorted(path, tensors, metadata)


def _save_sorted(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """`safetensors.numpy.save_file` with the metadata's keys sorted, so that the same observations give the same
    bytes (a rebuilt set keeps the digest its quality profile names, `observations_source`): safetensors writes them
    in the order of a Rust HashMap, which changes from one call to the next (safetensors issue 584)."""
    data = save(tensors, metadata=metadata)
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the format's padding: the tensors start 8-byte aligned
    with path.open("wb") as file:
        file.write(len(text).to_bytes(8, "little") + text)
        file.write(memoryview(data)[8 + size:])


def load_observations(path: Path, pipeline: PolicyPipeline, served: bool = True) -> list[Observation]:
    """The observations of a calibration file, checked against what `pipeline` serves (`served`; else against
    its embodiment registry)."""
    if path.is_dir():  # safetensors would say "No such device"
        raise CalibrationError(f"{path}: a folder; expected a calibration observations file (safetensors)")
    try:
        with safe_open(str(path), framework="np") as file:
            metadata = file.metadata() or {}
            tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 (not a dict)
    except (OSError, SafetensorError) as error:
        raise CalibrationError(f"{path}: not a calibration observations file (safetensors): {error}") from error
    embodiment = metadata.get("embodiment")
    known = pipeline.served_embodiments if served else pipeline.embodiments.names()
    if embodiment not in known:
        raise CalibrationError(f"{path}: metadata embodiment {embodiment!r}; expected one of {sorted(known)}")
    try:
        instructions = json.loads(metadata.get("instructions", "null"))
    except json.JSONDecodeError as error:
        raise CalibrationError(f"{path}: metadata instructions: {error}") from error
    spec = pipeline.embodiments.get(embodiment)
    cameras = {name: tensors.get(f"images.{name}") for name in spec.cameras}
    count = len(instructions) if isinstance(instructions, list) else -1
    if not 1 <= count <= MAX_OBSERVATIONS or not all(isinstance(text, str) and text.strip() for text in instructions):
        raise CalibrationError(f"{path}: metadata instructions must be a JSON list of 1 to {MAX_OBSERVATIONS} "
                               "non-empty strings")
    for name, images in cameras.items():
        if images is None or images.dtype != np.uint8 or images.ndim != 4 or images.shape[0] != count \
                or images.shape[-1] != 3:
            got = "missing" if images is None else f"{images.dtype} {list(images.shape)}"
            per = f", one frame per instruction (the metadata's instructions hold {count})" \
                if images is not None and images.ndim == 4 and images.shape[0] != count else ""
            raise CalibrationError(f"{path}: images.{name} is {got}; expected uint8 [{count}, H, W, 3]{per}")
        smallest = pipeline.vae.spatial_compression
        if not all(smallest <= side <= MAX_FRAME_SIDE for side in images.shape[1:3]):
            raise CalibrationError(f"{path}: images.{name} are {images.shape[1]}x{images.shape[2]}; expected sides "
                                   f"of {smallest} to {MAX_FRAME_SIDE} px, as the server takes")
    sizes = {name: images.shape[1:3] for name, images in cameras.items()}
    too_wide = too_wide_beside(sizes, dict.fromkeys(sizes, MAX_FRAME_SIDE))  # the bound the server keeps
    if too_wide is not None:
        name, tallest, scaled = too_wide
        raise CalibrationError(f"{path}: images.{name} are {sizes[name][0]}x{sizes[name][1]}, {scaled} px wide once "
                               f"scaled to the height of images.{tallest} ({sizes[tallest][0]} px) to sit beside them; "
                               f"expected at most {MAX_FRAME_SIDE} px, as the server takes")
    state = tensors.get("state")
    if spec.state_dim and (state is None or state.shape != (count, spec.state_dim) or state.dtype.kind != "f"):
        got = "missing" if state is None else f"{state.dtype} {list(state.shape)}"
        raise CalibrationError(f"{path}: state is {got}; {embodiment} expects float32 [{count}, {spec.state_dim}]")
    if spec.state_dim and not np.isfinite(state).all():
        raise CalibrationError(f"{path}: state holds NaN or infinite values; expected finite ones")
    # What the server would refuse, so that a profile is measured on observations it serves.
    for i, text in enumerate(instructions):
        try:
            instruction_tokens(pipeline.tokenizer, text, f"instructions[{i}]")
        except api.InvalidArgument as error:
            raise CalibrationError(f"{path}: {error}, which the server refuses") from None
    accepted = spec.state_range(pipeline.normalizers(spec)) if served else None  # a registry's may have no stats
    if accepted is not None:
        low, high = (bound.astype(np.float32).astype(np.float64) for bound in accepted)  # as the server compares
        outside = np.argwhere((state < low) | (state > high))
        if len(outside):
            i, channel = (int(k) for k in outside[0])
            raise CalibrationError(f"{path}: state[{i}] holds {state[i, channel]} at index {channel}; expected values "
                                   f"within the accepted state range [{low.tolist()}, {high.tolist()}], as the server "
                                   "takes")
    return [Observation(embodiment, {name: images[i] for name, images in cameras.items()},
                        state[i].astype(np.float32) if spec.state_dim else None, instructions[i])
            for i in range(count)]


def observations_source(path: Path) -> str:
    """How a profile names the observations file at `path`: its file name and content digest, which identify it on
    any machine (a profile is shared, and `GetServerInfo` shows its source to every client), not the path it had on
    the machine that calibrated."""
    with path.open("rb") as file:
        return f"{path.name} (sha256:{hashlib.file_digest(file, 'sha256').hexdigest()})"


def _template_embodiment() -> str:
    """The embodiment of the embedded simulator's observations (`DEFAULT_OBSERVATIONS`)."""
    with safe_open(str(DEFAULT_OBSERVATIONS), framework="np") as file:
        return file.metadata()["embodiment"]


def warmup_observations(pipeline: PolicyPipeline, count: int,
                        embodiments: Sequence[str] | None = None) -> list[Observation]:
    """`count` observations per served embodiment (or per one of `embodiments`) for a bounded calibration at
    warmup: the embedded set's for its embodiment; for the others its frames resized to each of the embodiment's
    cameras at its advertised size (`Embodiment.frame_sizes`), a zero state and its instructions (synthetic, which
    the profile's source says)."""
    template = load_observations(DEFAULT_OBSERVATIONS, pipeline, served=False)[:count]
    observations = []
    for name in pipeline.served_embodiments if embodiments is None else embodiments:
        spec = pipeline.embodiments.get(name)
        if name == template[0].embodiment:
            observations += template
            continue
        sizes = spec.frame_sizes(pipeline.config.canvas_hw)  # the advertised ones, which ticks will send
        observations += [Observation(name, {c: cv2.resize(next(iter(o.images.values())), (w, h))
                                            for c, (h, w) in sizes.items()},
                                     np.zeros(spec.state_dim, np.float32) if spec.state_dim else None, o.instruction)
                         for o in template]
    return observations


def configurations(pipeline: PolicyPipeline, settings: EngineSettings, min_steps: int = MIN_STEPS,
                   residual_orders: Sequence[int] | None = None, coarse: bool = False) -> list[TickConfig]:
    """The joint space calibrated: sampler steps from the default down to `min_steps` (or to the default, when
    it has fewer: a calibration measures no tick slower than the checkpoint's own); with guidance, the
    uncond pass on all guided steps, the first half, or the first only; no cache, or each rung of the
    planner's ladder (when a tick has steps to skip), at each residual order (default: the configured one).
    `coarse`: about a fifth of it (`COARSE_STEP_FRACTIONS`, all or the first guided step, `COARSE_RUNGS`)."""
    default_steps, cfg = pipeline.config.num_steps, pipeline.config.guidance != 1.0
    orders = tuple(residual_orders or (settings.residual_order,))
    ladder = cache_ladder(settings.cache_threshold, settings.max_consecutive_cached)
    if coarse:
        ladder = tuple(ladder[i] for i in COARSE_RUNGS)
    configs = []
    fractions = COARSE_STEP_FRACTIONS if coarse else STEP_FRACTIONS
    floor = min(min_steps, default_steps)
    for steps in sorted({max(floor, round(default_steps * f)) for f in fractions}, reverse=True):
        schedules = {steps, 1} if coarse else {steps, math.ceil(steps / 2), 1}
        for cfg_steps in sorted(schedules if cfg else {0}, reverse=True):
            configs.append(TickConfig(num_steps=steps, cfg_steps=cfg_steps, threshold=0.0, cap=0,
                                      residual_order=orders[0]))
            if settings.diffusion_cache and steps > 2:
                configs += [TickConfig(num_steps=steps, cfg_steps=cfg_steps, threshold=float(rung.threshold),
                                       cap=rung.cap, residual_order=order) for rung in ladder for order in orders]
    return configs


def action_rel_l2(actions: np.ndarray, reference: np.ndarray) -> float:
    """||a - a_ref|| / ||a_ref|| over the whole chunk."""
    return float(np.linalg.norm(actions - reference) / max(np.linalg.norm(reference), 1e-12))


def fixed_control(pipeline: PolicyPipeline, config: TickConfig, sea_filter: SeaFilter) -> FixedSteps:
    """The step control of a tick at `config` without a deadline; `sea_filter` is shared across ticks, as the
    server shares its own, so that its gains are computed once per schedule and not on every tick."""
    window = pipeline.guided_steps(config.num_steps) if config.cfg_steps else range(0)
    guided = range(window.start, max(window.start, min(window.stop, config.cfg_steps)))
    cache = NoCache() if config.threshold == 0 else SeaCache(SeaCacheConfig(
        threshold=config.threshold, max_consecutive_cached=config.cap, residual_order=config.residual_order),
        sea_filter=sea_filter)
    return FixedSteps(config.num_steps, guided, cache)


@dataclass(frozen=True)
class TickRunner:
    """How calibration runs a tick's model work: the GEN stack's calls and the rest (`TickWork`). Eagerly by
    default; the server's warmup calibrates with what its ticks run (compiled where it compiles)."""

    gen_stack: GenStack
    work: TickWork

    @classmethod
    def eager(cls, pipeline: PolicyPipeline) -> TickRunner:
        return cls(pipeline.transformer.gen_stack, pipeline.tick_work)


@dataclass(frozen=True)
class CalibrationTick:
    """An observation's request and what every configuration's tick of it shares, made once: its frames
    encoded and its text K/V prefilled (the configurations differ only in the denoising)."""

    request: PolicyRequest
    condition: Condition
    prompt: PromptState
    runner: TickRunner

    @classmethod
    def of(cls, pipeline: PolicyPipeline, observation: Observation, seed: int, runner: TickRunner
           ) -> CalibrationTick:
        request = PolicyRequest(images=observation.images, instruction=observation.instruction,
                                embodiment=observation.embodiment, state=observation.state, seed=seed)
        pipeline.validate(request)
        condition = pipeline.encode_condition(pipeline.prepare_frames(request))
        return cls(request, condition, pipeline.prompt_for(request, condition[1], runner.work), runner)

    def run(self, pipeline: PolicyPipeline, num_steps: int, control: StepControl) -> PolicyOutput:
        """The tick at `num_steps` sampler steps under the step `control`."""
        request = PolicyRequest(**{**self.request.__dict__, "num_steps": num_steps})
        return run_steps(pipeline.steps(request, self.prompt, control, self.runner.work, condition=self.condition),
                         self.runner.gen_stack)


def run_config(pipeline: PolicyPipeline, tick: CalibrationTick, config: TickConfig,
               sea_filter: SeaFilter) -> PolicyOutput:
    """`tick` at `config`, without a deadline."""
    return tick.run(pipeline, config.num_steps, fixed_control(pipeline, config, sea_filter))


class _SimulatedClock:
    """Monotonic ms that advance only when told."""

    def __init__(self) -> None:
        self.now_ms = 0.0

    def __call__(self) -> float:
        return self.now_ms


class SimulatedGuardedSteps(GuardedSteps):
    """A guarded step loop whose guard reads a clock that each call advances by `costs` times `slowdown` (c_skip
    for a skipped call, c_full alone, c_pair for a step's two full calls as one batch): the guard, expecting
    `costs` (their medians, no margin), cuts the tick as it would on a machine that runs that much slower."""

    def __init__(self, plan, costs: CallCosts, cache: SeaCache, slowdown: float) -> None:
        self.clock, self.costs, self.slowdown = _SimulatedClock(), costs, slowdown
        super().__init__(plan, DeadlineGuard(plan, costs, plan.deadline_ms, clock=self.clock, cost_margin_devs=0.0),
                         cache)

    def estimate(self, step, branch, sigma, noisy_vision, gen_in) -> torch.Tensor | None:
        out = super().estimate(step, branch, sigma, noisy_vision, gen_in)
        if out is not None:
            self.clock.now_ms += self.slowdown * self.costs.skip_ms
        return out

    def ran(self, outs) -> None:
        ms = self.costs.pair_ms if len(outs) == 2 else len(outs) * self.costs.full_ms
        self.clock.now_ms += self.slowdown * ms
        super().ran(outs)


def run_cut(pipeline: PolicyPipeline, tick: CalibrationTick, point: ProfilePoint, fraction: float,
            costs: CallCosts, sea_filter: SeaFilter) -> PolicyOutput:
    """`tick` at `point` planned to fit at `costs` (as the planner plans it before a session has run it), whose
    calls run `1 / fraction` times slower."""
    config = point.config
    plan = plan_on_frontier(point.predicted_p90_ms(costs), (point,), costs, guided=pipeline.guided_steps)
    cache = SeaCache(SeaCacheConfig(threshold=plan.thresholds, residual_order=config.residual_order,
                                    max_consecutive_cached=plan.cap), sea_filter=sea_filter)
    return tick.run(pipeline, config.num_steps, SimulatedGuardedSteps(plan, costs, cache, 1.0 / fraction))


def call_counts(out: PolicyOutput) -> tuple[int, int, int]:
    """`(full calls alone, pairs, skipped calls)` of one tick."""
    alone = pairs = skipped = 0
    for step in out.steps:
        if step.batched:
            pairs += 1
        else:
            alone += len(step.full)
        skipped += len(step.branches) - len(step.full)
    return alone, pairs, skipped


def calibrate(pipeline: PolicyPipeline, observations: Sequence[Observation], configs: Sequence[TickConfig],
              source: str, progress: Callable[[float], None] | None = None,
              runner: TickRunner | None = None) -> QualityProfile:
    """The quality profile of `pipeline` on `observations` over `configs` (see the module docstring), its ticks
    run by `runner` (default: eagerly)."""
    steps = calibration_steps(pipeline, observations, configs, source, progress, runner)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def calibration_steps(pipeline: PolicyPipeline, observations: Sequence[Observation], configs: Sequence[TickConfig],
                      source: str, progress: Callable[[float], None] | None = None,
                      runner: TickRunner | None = None):
    """`calibrate` as a generator that yields after each tick it runs (the engine's warmup runs it one tick
    per worker step) and returns the profile."""
    started = time.perf_counter()
    runner = runner or TickRunner.eager(pipeline)
    default = default_config(pipeline.config, configs[0].residual_order)
    measured: dict[str, dict[TickConfig, list[tuple[float, int, int, int]]]] = {}
    cost_model = CostModel(window=len(observations) * len(configs))  # keyed by embodiment; every tick counts
    references = []
    sea_filter = SeaFilter()
    for index, observation in enumerate(observations):
        # Made again for the second pass: the text K/V of every observation would be too large to keep.
        tick = CalibrationTick.of(pipeline, observation, index, runner)
        references.append(run_config(pipeline, tick, default, sea_filter).actions)
        yield
        for config in configs:
            out = run_config(pipeline, tick, config, sea_filter)
            runs = measured.setdefault(observation.embodiment, {}).setdefault(config, [])
            runs.append((action_rel_l2(out.actions, references[-1]), *call_counts(out)))
            cost_model.observe_tick(observation.embodiment, step_calls(out.steps))
            yield
        if progress is not None:
            progress((index + 1) / len(observations) / 2)
    embodiments = {embodiment: [point_of(config, runs) for config, runs in by_config.items()]
                   for embodiment, by_config in measured.items()}
    # Slow ticks: each frontier point that has calls to cut, at the costs this machine ran them at, slowed.
    # Their medians (the guard holds the simulated tick to them); none without a skipped call: nothing was cached.
    costs = {embodiment: cost_model.costs(embodiment) if cost_model.samples(embodiment)[SKIP] else None
             for embodiment in embodiments}
    cut_errors: dict[tuple[str, TickConfig], dict[float, list[float]]] = {}
    for index, observation in enumerate(observations):
        embodiment = observation.embodiment
        if costs[embodiment] is None:
            continue
        tick = CalibrationTick.of(pipeline, observation, index, runner)
        for point in frontier(embodiments[embodiment]):
            if point.config.num_steps <= 2:
                continue  # the first and last steps always run full: nothing to cut
            for fraction in CUT_FRACTIONS:
                out = run_cut(pipeline, tick, point, fraction, costs[embodiment], sea_filter)
                errors = cut_errors.setdefault((embodiment, point.config), {}).setdefault(fraction, [])
                errors.append(action_rel_l2(out.actions, references[index]))
                yield
        if progress is not None:
            progress(0.5 + (index + 1) / len(observations) / 2)
    profile_points = {
        embodiment: tuple(point.model_copy(update={"cuts": tuple(
            Cut(fraction=fraction, error=float(np.mean(errors)))
            for fraction, errors in cut_errors.get((embodiment, point.config), {}).items())}) for point in points)
        for embodiment, points in embodiments.items()}
    return QualityProfile(digest=pipeline.digest, default=default, embodiments=profile_points,
                          calibration=Calibration(observations=len(observations), source=source,
                                                  seconds=time.perf_counter() - started))


def point_of(config: TickConfig, runs: Sequence[tuple[float, int, int, int]]) -> ProfilePoint:
    """`config`'s profile point from its `(error, full calls alone, pairs, skipped calls)` per observation."""
    errors, alone, pairs, skipped = (np.array(column, dtype=float) for column in zip(*runs, strict=True))
    return ProfilePoint(config=config, error=float(errors.mean()), error_p90=float(np.percentile(errors, 90)),
                        full_calls=float(alone.mean()), pairs=float(pairs.mean()), skipped_calls=float(skipped.mean()),
                        full_calls_p90=float(np.percentile(alone, 90)), pairs_p90=float(np.percentile(pairs, 90)))


def cache_dir() -> Path:
    """Where profiles of checkpoints that cannot hold their own go: `$POLICY_SERVER_CACHE`, else
    `$XDG_CACHE_HOME/policy-server` (default `~/.cache/policy-server`)."""
    if os.environ.get(PROFILE_CACHE_ENV):
        return Path(os.environ[PROFILE_CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec: an empty or relative value is ignored (relative, it would be under the working folder).
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "policy-server"


def profile_locations(checkpoint: Path | None, digest: str) -> list[Path]:
    """Where the profile of these weights is looked for, in order: beside the checkpoint (the embedded model's
    ships in the package), then the cache."""
    cached = cache_dir() / "profiles" / f"{digest.removeprefix('sha256:')}.json"
    return [(default_model_path() if checkpoint is None else checkpoint) / PROFILE_FILE, cached]


def default_config(sampler: PolicyConfig, residual_order: int) -> TickConfig:
    """The checkpoint's own tick: all its sampler steps, guided on each when it guides, uncached. A profile's
    errors are measured against it."""
    return TickConfig(num_steps=sampler.num_steps, cfg_steps=sampler.num_steps if sampler.guidance != 1.0 else 0,
                      threshold=0.0, cap=0, residual_order=residual_order)


def resolve_profile(setting: str, checkpoint: Path | None, digest: str, served: Sequence[str],
                    sampler: PolicyConfig, ladder_settings: Sequence[str] = ()) -> tuple[QualityProfile | None, bool]:
    """`(profile, calibrate at warmup)` for the server's `quality_profile` setting: "off", "auto" (the first
    of `profile_locations` that exists; none: calibrate at warmup) or a profile file. `ProfileError` when the
    profile found cannot be used: not of these weights, its default (the reference every error is measured
    against) not the checkpoint's `sampler` steps and guidance, or without one of the `served` embodiments; or when
    the server was given `ladder_settings`, which the profile's configurations would override."""
    if setting == "off":
        return None, False
    path = Path(setting) if setting != "auto" else next(
        (path for path in profile_locations(checkpoint, digest) if path.is_file()), None)
    if path is None:
        return None, True
    if ladder_settings:
        raise ProfileError(ladder_settings_overridden(list(ladder_settings), path))
    profile = QualityProfile.load(path, digest)
    have, want = profile.default, default_config(sampler, profile.default.residual_order)
    if (have.num_steps, have.cfg_steps) != (want.num_steps, want.cfg_steps):
        raise ProfileError(f"{path}: its default configuration has {have.num_steps} sampler steps, {have.cfg_steps} "
                           f"of them guided; the checkpoint's {want.num_steps}, {want.cfg_steps} guided; recalibrate "
                           "with `policy-server calibrate`, or plan on the cache ladder with --quality-profile off")
    missing = [name for name in served if name not in profile.embodiments]
    if missing:
        raise ProfileError(f"{path}: no configurations for {', '.join(missing)} (it has "
                           f"{', '.join(profile.embodiments) or 'none'}); calibrate the served embodiments with "
                           "`policy-server calibrate`, or plan on the cache ladder with --quality-profile off")
    logger.info("planning ticks on the quality profile %s (%s)", path, profile.calibration.describe())
    return profile, False


def main(argv: list[str] | None = None) -> int:
    """`policy-server calibrate`: measure a checkpoint's quality profile and write it where the server finds it."""
    # Imported here: engine.engine imports the warmup, which imports this module.
    from policy_server.engine.engine import DeviceUnavailable, resolve_device, resolve_dtype

    parser = argparse.ArgumentParser(prog="policy-server calibrate", description=main.__doc__)
    parser.add_argument("--checkpoint", help="checkpoint folder or Hugging Face Hub id (default: the embedded model)")
    parser.add_argument("--observations", type=Path, nargs="+", default=[],
                        help="calibration observations, safetensors files, one embodiment each (the README's "
                             "quality-profile section gives the format); a served embodiment without any is "
                             "calibrated on the embedded simulator's set, its frames resized to its cameras")
    parser.add_argument("--out", type=output_file,
                        help="profile file (default: quality_profile.json beside --checkpoint, else the cache "
                             "directory, where `--quality-profile auto` looks)")
    parser.add_argument("--max-observations", type=int, default=MAX_OBSERVATIONS,
                        help=f"use at most this many per embodiment ({MAX_OBSERVATIONS}, as many as a file holds)")
    parser.add_argument("--min-steps", type=int,
                        help=f"fewest sampler steps tried ({MIN_STEPS}, or the checkpoint's when fewer)")
    parser.add_argument("--residual-orders", default=None,
                        help="SeaCache residual orders tried, comma-separated (default: the server's, 1)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (auto)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="weight dtype (auto)")
    args = parser.parse_args(argv)
    for flag, value in (("--max-observations", args.max_observations), ("--min-steps", args.min_steps)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    orders = None
    if args.residual_orders is not None:
        orders = [int(o) for o in args.residual_orders.split(",") if o.strip().isdigit()]
        if len(orders) != len(args.residual_orders.split(",")) or not set(orders) <= {0, 1, 2}:
            parser.error(f"--residual-orders {args.residual_orders!r}: expected comma-separated orders 0, 1 or 2")
    try:
        device = resolve_device(args.device)
    except DeviceUnavailable as error:
        parser.error(str(error))
    if device == "cpu":
        torch.set_num_threads(1)  # as the server runs it: the profile's costs and errors are the server's
    try:
        pipeline = PolicyPipeline.from_pretrained(args.checkpoint, device=device,
                                                  dtype=resolve_dtype(args.dtype, device))
        by_embodiment: dict[str, list[Observation]] = {}
        for path in args.observations:
            for observation in load_observations(path, pipeline):
                by_embodiment.setdefault(observation.embodiment, []).append(observation)
        missing = [name for name in pipeline.served_embodiments if name not in by_embodiment]
        # A profile must cover every served embodiment, or the server refuses it: the others as the warmup does.
        for observation in warmup_observations(pipeline, args.max_observations, missing) if missing else []:
            by_embodiment.setdefault(observation.embodiment, []).append(observation)
        observations = [o for group in by_embodiment.values() for o in group[: args.max_observations]]
    except (CheckpointLoadError, CalibrationError) as error:
        print(f"policy-server calibrate: {error}", file=sys.stderr)
        return 2
    if synthetic := [name for name in missing if name != _template_embodiment()]:
        print(f"no observations of {', '.join(synthetic)}: calibrating on the embedded simulator's frames resized to "
              "their cameras and a zero state (pass --observations of their own scenes for a profile of them)")
    if args.min_steps is not None and args.min_steps > pipeline.config.num_steps:
        parser.error(f"--min-steps {args.min_steps}: above the checkpoint's {pipeline.config.num_steps} sampler steps")
    out = args.out  # checked now: the profile is written after the calibration, which may take an hour
    if out is None:  # beside a checkpoint folder of the user's that can hold it, else in the cache
        beside = args.checkpoint is not None and not is_hub_id(args.checkpoint) and os.access(pipeline.folder, os.W_OK)
        out = profile_locations(pipeline.folder, pipeline.digest)[0 if beside else 1]
        try:
            output_file(str(out))
        except argparse.ArgumentTypeError as error:
            print(f"policy-server calibrate: {error} (the cache directory: ${PROFILE_CACHE_ENV}, else "
                  "$XDG_CACHE_HOME/policy-server); pass --out FILE", file=sys.stderr)
            return 2
    configs = configurations(pipeline, EngineSettings(), args.min_steps or MIN_STEPS, orders)
    print(f"calibrating {len(configs)} configurations on {len(observations)} observations", flush=True)
    # The embedded set by file name and digest, as a file given is (and as the bench names it): two profiles say
    # whether they were measured on the same data. An embodiment calibrated on its frames resized says so.
    embedded = observations_source(DEFAULT_OBSERVATIONS)
    source = ", ".join([*map(observations_source, args.observations),
                        *(f"{name}: {embedded} (resized, zero state)" if name in synthetic else embedded
                          for name in missing)])
    profile = calibrate(pipeline, observations, configs, source=source,
                        progress=lambda done: print(f"  {done:.0%}", flush=True))
    replaced = out.is_file()
    try:
        profile.save(out)
    except OSError as error:
        print(f"policy-server calibrate: cannot write {out}: {error.strerror or error}"
              f"{'; the profile there is unchanged' if replaced else ''}", file=sys.stderr)
        return 1
    for embodiment, points in profile.embodiments.items():
        print(f"{embodiment}: {len(frontier(points))} configurations on the frontier of {len(points)}")
    print(f"{'replaced' if replaced else 'wrote'} {out} ({profile.calibration.seconds:.0f} s)")
    found = next((path for path in profile_locations(pipeline.folder, pipeline.digest) if path.is_file()), None)
    if found is None or found.resolve() != out.resolve():
        where = f"finds {found} first" if found else "looks beside the checkpoint and in the cache, not there"
        print(f"`--quality-profile auto` {where}; serve this one with --quality-profile {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
