"""`policy-server bench`: latency and action quality per cache/budget setting, as JSON + PNG plots.

    policy-server bench --out bench.json --ticks 500

Every configuration sees the same observations (expert trajectories of the built-in task `--env` on
held-out seeds) with the same seed, hence the same initial noise, tick by tick and interleaved, so
machine drift cancels and errors compare like with like:

- `uncached`                  the pipeline without caching (the quality reference);
- `seacache_default`          SeaCache 0.25 / order 1 / cap 2 on every step, no deadline;
- `max_caching`               SeaCache at its most aggressive (full calls only where forced), no deadline;
- `budget_<ms>`               the controller: the engine planning each tick on the quality profile's frontier
                              (`--quality-profile`: by default the one the server would use, beside the
                              checkpoint or in the cache; without one, calibrated here on the shipped
                              observations first);
- `ladder_<ms>`               the engine's ladder planner at that budget (no profile), for comparison;
- `guarded_<family>_<ms>`     each family's best configuration by the profile's prediction at that budget,
                              under the same in-tick guard: `fewer_steps` (uncached), `seacache` (the published
                              default), `fewer_steps_seacache`;
- `<family>_<ms>`             the same configurations without the guard;
- `budget_<ms>_slowdown`      the controller at the tightest budget run, with an extra delay per full GEN-stack call
                              from the halfway tick;
- `budget_<ms>_eager`         when the engines run the GEN stack compiled (the server's default), the controller
                              on the eager stack (`--no-compile-gen-stack`): what the compile buys at each budget.

Budgets default to 35% .. 100% of the uncached tick's median over 16 ticks before the run (six points). A budget
an engine's admission refuses, below the best achievable latency on this machine, runs nothing: the report lists it
under `infeasible_budgets` with that latency and the plots mark it; the first engine's admission is asked before any
other engine starts. With every budget refused, the bench writes nothing and exits 2. The report's `sweep`
compares, per budget run, the controller with the guarded families that hold 1% misses and with the best unguarded
configuration whose p50 fits (and with the eager controller), and says whether issue 14's targets hold there.
With `--closed-loop N` every configuration a robot could run (all but the unguarded families and the eager
controller) also drives N held-out episodes of `--env` (the same seeds for all) and reports
`success_rate`, `collision_rate` (episodes ended on ReachEither's blocker) and `episode_steps` (mean control
steps per episode). The default task is the
one the shipped model is fine-tuned for, ReachEitherTimed: it fails a sampler that averages its two modes or
drives slowly (on Reach every configuration of the shipped model succeeds). Its observations are
ReachEither's, the calibration set's task, so the controller is measured on the traffic its profile was
calibrated for. `closed_loop` then checks issue 14's closed-loop targets against uncached, maximal caching and
the controller at half the uncached latency.

Latency is the pipeline's end-to-end time for the fixed configurations (their text K/V reused, as a
session's) and the engine's (queue included) for the engines' ones. The README's "Simulation rollouts and
benchmarks" says what the JSON holds.

The bench lives on the robot side because it drives the built-in task and its expert; `policy-server
bench` finds it through the `policy_server.commands` entry point. What it measures with, it owns: each
budget engine runs a bench pipeline over the loaded weights that keeps the latest tick's output and, in the
slowdown run's engine, adds the delay before each full GEN-stack call. Every configuration runs the GEN stack as
the engines serve it (compiled, as the server's default; `--no-compile-gen-stack`: eagerly), the uncached reference
included.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import resource
import statistics
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
import torch
from tqdm import tqdm

from policy_server.benchmarks.forward import measure_forward, reference_unavailable
from policy_server.budget.cost_model import FULL, PAIR, SKIP
from policy_server.budget.guard import LATE_FALLBACKS
from policy_server.budget.planner import MAX_CACHING
from policy_server.budget.profile import ProfileError, ProfilePoint, QualityProfile
from policy_server.budget.tick import PREFILL_STAGE, PREVIEW_STAGE
from policy_server.cache.seacache import SeaCache, SeaCacheConfig
from policy_server.config import DTYPES, check_dtype
from policy_server.engine import api
from policy_server.engine.calibration import (
    DEFAULT_OBSERVATIONS,
    action_rel_l2,
    calibrate,
    configurations,
    fixed_control,
    observations_source,
    resolve_profile,
    warmup_observations,
)
from policy_server.engine.engine import DeviceUnavailable, EngineSettings, ModelEngine, resolve_device, resolve_dtype
from policy_server.engine.tick import step_calls
from policy_server.limits import MAX_BUDGET_MS, MAX_FRAME_SIDE
from policy_server.output_file import output_file
from policy_server.pipeline.compiled_stack import PrecompiledGenStack, compile_unavailable
from policy_server.pipeline.cuda_graphs import GraphedGenStack
from policy_server.pipeline.embodiments import Embodiment
from policy_server.pipeline.policy import (
    CheckpointLoadError,
    PolicyOutput,
    PolicyPipeline,
    PolicyRequest,
    TickSteps,
    run_steps,
)
from policy_server.pipeline.tick_work import CompiledTickWork, TickWork
from robots.envs import ENV_IDS, HELDOUT_SEED_OFFSET, REACH_EITHER_TIMED_ID, REACH_ID
from robots.expert import expert_observations
from robots.rollout import RolloutError, RolloutStopped, TickStats, check_execute, run_episodes

SCHEMA = 1
SCALE_TICKS = 16  # uncached ticks whose median latency the budget fractions scale on


@dataclass
class ConfigRun:
    """Per-tick measurements of one configuration."""

    name: str
    budget_ms: float | None = None
    family: str | None = None  # controller, controller_eager, ladder, fewer_steps, seacache, fewer_steps_seacache
    guarded: bool | None = None
    point: ProfilePoint | None = None  # a fixed configuration's profile point
    latency_ms: list[float] = field(default_factory=list)
    expected_error: list[float] = field(default_factory=list)
    full: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    forced: list[int] = field(default_factory=list)
    cut: list[bool] = field(default_factory=list)  # the guard forced a skip or gave up part of the tick
    rel_l2: list[float] = field(default_factory=list)
    psnr_db: list[float] = field(default_factory=list)
    settings: dict[str, int] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)  # ticks per fallback kind, e.g. "late_finish_at_step"

    def add_tick_record(self, tick: api.TickRecord) -> None:
        self.settings[tick.setting] = self.settings.get(tick.setting, 0) + 1
        if "expected_error" in tick.knobs:
            self.expected_error.append(tick.knobs["expected_error"])
        for kind in set(tick.fallback_kinds):
            self.fallbacks[kind] = self.fallbacks.get(kind, 0) + 1

    def add(self, latency_ms: float, out: PolicyOutput, reference: PolicyOutput | None,
            late_fallbacks: tuple[str, ...] = ()) -> None:
        """One tick; `late_fallbacks`: what its guard gave up during it (`DeadlineGuard.late_fallbacks`)."""
        self.latency_ms.append(latency_ms)
        self.full.append(out.cache.full_calls)
        self.skipped.append(out.cache.skipped_calls)
        self.forced.append(out.cache.forced_skips)
        self.cut.append(out.cache.forced_skips > 0 or bool(late_fallbacks))
        if reference is not None:
            self.rel_l2.append(action_rel_l2(out.actions, reference.actions))
            self.psnr_db.append(latent_psnr_db(out.latents, reference.latents))

    def summary(self) -> dict:
        latency = np.asarray(self.latency_ms)
        summary = {
            "name": self.name,
            "p50_ms": float(np.percentile(latency, 50)),
            "p99_ms": float(np.percentile(latency, 99)),
            "mean_ms": float(latency.mean()),
            "ticks": len(latency),
            "full_calls": float(np.mean(self.full)),
            "skipped_calls": float(np.mean(self.skipped)),
            "forced_skips": float(np.mean(self.forced)),
            "cut_rate": float(np.mean(self.cut)),
            "action_rel_l2": float(np.mean(self.rel_l2)) if self.rel_l2 else 0.0,
            # Where a guarded configuration loses quality: the ticks its guard cut against those it did not.
            "action_rel_l2_cut": _mean_where(self.rel_l2, self.cut, True),
            "action_rel_l2_uncut": _mean_where(self.rel_l2, self.cut, False),
            "action_rel_l2_p90": float(np.percentile(self.rel_l2, 90)) if self.rel_l2 else 0.0,
            "latent_psnr_db": _finite_mean(self.psnr_db) if self.psnr_db else None,
            "budget_ms": self.budget_ms,
            "miss_rate": float(np.mean(latency > self.budget_ms)) if self.budget_ms is not None else None,
            "utilisation": float(np.percentile(latency, 50) / self.budget_ms) if self.budget_ms else None,
            "family": self.family,
            "guarded": self.guarded,
        }
        if self.point is not None:  # its calibrated error is that of uncut ticks: the guard's cuts err more
            summary.update(point=self.point.config.name, point_error=self.point.error)
        elif self.expected_error:
            summary["expected_error"] = float(np.mean(self.expected_error))
        if self.settings:
            summary["cache_settings"] = dict(sorted(self.settings.items(), key=lambda kv: -kv[1]))
            summary["fallback_ticks"] = dict(sorted(self.fallbacks.items()))
        return summary


def latent_psnr_db(latents: torch.Tensor, reference: torch.Tensor) -> float:
    """PSNR of the generated (noisy) latent frames against the reference, peak = the reference's range."""
    generated, target = latents[:, 1:].float(), reference[:, 1:].float()
    mse = float((generated - target).pow(2).mean())
    peak = float(target.max() - target.min())
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


def _mean_where(values: list[float], flags: list[bool], flag: bool) -> float | None:
    chosen = [v for v, f in zip(values, flags, strict=True) if f == flag]
    return float(np.mean(chosen)) if chosen else None


def _finite_mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else None  # None: identical to the reference on every tick


FAMILIES = ("fewer_steps", "seacache", "fewer_steps_seacache")
# Fixed, without a deadline; compared with the controller as unguarded configurations are. The uncached reference
# is not: every error is measured against it, and at the 100% budget its own p50 meets the budget by construction.
REFERENCE_CONFIGS = ("seacache_default", "max_caching")


def _is_published(config) -> bool:
    return (config.threshold, config.cap, config.residual_order) == (0.25, 2, 1)


def family_members(points: tuple[ProfilePoint, ...], steps: int, cfg: bool) -> dict[str, list[ProfilePoint]]:
    """The profile's points of each fixed family (the uncond pass on every step when `cfg`): fewer steps than the
    default, uncached; the published SeaCache default (0.25, order 1, cap 2) at the default steps; fewer steps with
    it."""
    full_cfg = [p for p in points if p.config.cfg_steps == (p.config.num_steps if cfg else 0)]
    return {
        "fewer_steps": [p for p in full_cfg if p.config.threshold == 0 and p.config.num_steps < steps],
        "seacache": [p for p in full_cfg if _is_published(p.config) and p.config.num_steps == steps],
        "fewer_steps_seacache": [p for p in full_cfg if _is_published(p.config) and p.config.num_steps < steps],
    }


def best_fitting(points: list[ProfilePoint], costs, budget_ms: float) -> ProfilePoint:
    """The least calibrated error whose latency fits `budget_ms` by the controller's rule (`plan_on_frontier`)
    before a session has run anything: at the calibration set's 90th-percentile counts; else the cheapest."""
    fitting = [p for p in points if p.predicted_p90_ms(costs) <= budget_ms]
    if fitting:
        return min(fitting, key=lambda p: p.error)
    return min(points, key=lambda p: p.predicted_p90_ms(costs))


class FixedConfig:
    """One fixed tick configuration over the served pipeline, its text K/V reused as a session reuses them:
    under the in-tick guard (`guarded`: planned as a one-point frontier, so the guard paces it and forces
    skips exactly as it does the controller's ticks, with the controller's costs) or without a deadline."""

    def __init__(self, served, point: ProfilePoint, guarded: bool = False):
        self.served, self.point, self.guarded = served, point, guarded
        self.prompt = None

    def __call__(self, request: PolicyRequest, budget_ms: float | None
                 ) -> tuple[float, PolicyOutput, tuple[str, ...]]:
        """One tick: its latency (ms), output and what the guard gave up during it (late fallbacks)."""
        served, pipeline, config = self.served, self.served.pipeline, self.point.config
        embodiment = served.embodiments[request.embodiment]
        chunk = embodiment.default_chunk_size
        started = served.clock()
        canvas = pipeline.canvas_for(embodiment, request.images)
        prefill = not served.prompt_fits(self.prompt, request.instruction, embodiment, chunk, canvas)
        if self.guarded:
            key = served.cost_key(embodiment.name, chunk, served.instruction_tokens(request.instruction, "bench"))
            plan = served.budget.plan(key, budget_ms, config.num_steps, served.passes, None, prefill=prefill,
                                      frontier=(self.point,))
            cache = SeaCache(SeaCacheConfig(threshold=plan.thresholds, residual_order=config.residual_order,
                                            max_consecutive_cached=plan.cap), sea_filter=served.sea_filter)
            control = served.budget.guarded_steps(plan, key, started, cache, plan.deadline_ms)
        else:
            control = fixed_control(pipeline, config, served.sea_filter)
        self.prompt, _ = served.prompt(request.instruction, embodiment, chunk, canvas, self.prompt)
        out = run_steps(pipeline.steps(PolicyRequest(**{**request.__dict__, "num_steps": config.num_steps}),
                                       self.prompt, control), served.gen_stack)
        return served.clock() - started, out, control.guard.late_fallbacks if self.guarded else ()


def paired_difference(errors: Sequence[float], baseline: Sequence[float], resamples: int = 2000) -> dict:
    """Mean per-tick difference `errors - baseline` (the same ticks, seeds and noise) and its 95% bootstrap
    interval over ticks. A few ticks where one side flips the sampler's mode carry much of a mean error, so a
    gap narrower than this interval is not one the run can tell apart."""
    diff = np.asarray(errors, dtype=float) - np.asarray(baseline, dtype=float)
    picks = np.random.default_rng(0).integers(0, len(diff), size=(resamples, len(diff)))
    low, high = np.percentile(diff[picks].mean(axis=1), [2.5, 97.5])
    return {"mean": float(diff.mean()), "ci95": [float(low), float(high)]}


def sweep(summaries: list[dict], budgets: list[float], uncached_ms: float,
          tick_errors: Mapping[str, Sequence[float]]) -> list[dict]:
    """Per budget: the controller against the guarded families (those holding 1% misses) and against the
    unguarded configurations whose p50 fits, and whether issue 14's targets hold there. `tick_errors`: each
    configuration's per-tick action errors, for the paired differences."""
    rows = []
    for b in budgets:
        at = [s for s in summaries if s["budget_ms"] == b and not s["name"].endswith("_slowdown")]
        controller = next(s for s in at if s["family"] == "controller")
        eager = next((s for s in at if s["family"] == "controller_eager"), None)
        guarded = [s for s in at if s["guarded"] and s["family"] in FAMILIES]
        holding = [s for s in guarded if s["miss_rate"] <= 0.01]
        unguarded = [s for s in summaries if s["guarded"] is False or s["name"] in REFERENCE_CONFIGS]
        fitting = [s for s in unguarded if s["p50_ms"] <= b]
        best_guarded = min(holding, key=lambda s: s["action_rel_l2"], default=None)
        best_unguarded = min(fitting, key=lambda s: s["action_rel_l2"], default=None)
        err = controller["action_rel_l2"]
        rows.append({
            "budget_ms": b,
            "fraction": b / uncached_ms,
            "controller": {k: controller[k] for k in ("name", "action_rel_l2", "miss_rate", "p50_ms", "p99_ms",
                                                       "utilisation")},
            "best_guarded": None if best_guarded is None else {k: best_guarded[k] for k in ("name", "action_rel_l2")},
            "best_unguarded_fitting": None if best_unguarded is None else {
                k: best_unguarded[k] for k in ("name", "action_rel_l2", "p50_ms")},
            "eager_controller": None if eager is None else {
                k: eager[k] for k in ("name", "action_rel_l2", "miss_rate", "p50_ms", "p99_ms")},
            # controller minus each: a negative mean is the controller's lead
            "paired_difference": {other["name"]: paired_difference(tick_errors[controller["name"]],
                                                                   tick_errors[other["name"]])
                                  for other in (best_guarded, best_unguarded, eager) if other is not None},
            "targets": {
                "miss_rate_at_most_1pct": controller["miss_rate"] <= 0.01,
                "p99_within_budget": controller["p99_ms"] <= b,
                "beats_guarded_holding_1pct": all(err <= s["action_rel_l2"] for s in holding),
                "beats_best_unguarded_fitting": best_unguarded is None or err <= best_unguarded["action_rel_l2"],
            },
        })
    return rows


class BenchPipeline(PolicyPipeline):
    """A budget engine's own pipeline: the loaded pipeline's parts (the same weights, not a copy) that keeps
    the output of the latest tick the engine runs through it, which the bench compares with the uncached
    reference. The bench drives each engine one call at a time, so `last` is that call's tick. `slowdown_ms`:
    a delay its ticks add before each full GEN-stack call (one call, batched or not), as if the call were slower."""

    last: PolicyOutput | None = None
    slowdown_ms = 0.0

    @classmethod
    def over(cls, pipeline: PolicyPipeline) -> BenchPipeline:
        return cls(pipeline.transformer, pipeline.vae, pipeline.tokenizer, pipeline.embodiments, pipeline.config,
                   pipeline.served_embodiments, pipeline.digest)

    def steps(self, *args, **kwargs) -> TickSteps:
        steps = super().steps(*args, **kwargs)
        try:  # `yield from steps`, sleeping before each full call handed out
            call = next(steps)
            while True:
                if call is not None and self.slowdown_ms:
                    time.sleep(self.slowdown_ms / 1e3)
                try:
                    sent = yield call
                except BaseException as error:  # passed on, as `yield from` does
                    call = steps.throw(error)
                else:
                    call = steps.send(sent)
        except StopIteration as done:
            self.last = done.value
            return self.last
        finally:
            steps.close()


class _FixedPolicy:
    """`robots.rollout` policy protocol over one fixed configuration, at `budget_ms` (None: no deadline)."""

    def __init__(self, fixed: FixedConfig, embodiment: str, budget_ms: float | None):
        self.fixed, self.embodiment, self.budget_ms = fixed, embodiment, budget_ms

    def open(self, instruction: str, seed: int, preview: bool, request_id: str):
        return {"instruction": instruction, "seed": seed, "ticks": 0}

    def act(self, session: dict, obs: dict, step: int, want_video: bool = False, committed: np.ndarray | None = None):
        request = PolicyRequest(images={"image": obs["image"]}, instruction=session["instruction"],
                                embodiment=self.embodiment, state=obs["state"], seed=session["seed"] + session["ticks"],
                                committed_actions=committed)
        session["ticks"] += 1
        latency_ms, out, _ = self.fixed(request, self.budget_ms)
        budget_ms = math.inf if self.budget_ms is None else self.budget_ms
        stats = TickStats(latency_ms, budget_ms, latency_ms <= budget_ms, out.cache.full_calls,
                          out.cache.skipped_calls, out.cache.forced_skips, self.fixed.point.config.name)
        return out.actions, stats, None

    def close(self, session) -> None:
        pass


class _EnginePolicy:
    """`robots.rollout` policy protocol over an engine session at a fixed budget."""

    def __init__(self, engine: ModelEngine, embodiment: str, budget_ms: float):
        self.engine, self.embodiment, self.budget_ms = engine, embodiment, budget_ms

    def open(self, instruction: str, seed: int, preview: bool, request_id: str):
        return self.engine.open_session(self.embodiment, instruction, budget_ms=self.budget_ms, seed=seed,
                                        rate_hz=0.0, request_id=request_id)

    def act(self, session, obs: dict, step: int, want_video: bool = False, committed: np.ndarray | None = None):
        result = self.engine.act(session.session_id, session.epoch, api.Observation(
            images={"image": obs["image"]}, state=obs["state"], step_index=step, committed_actions=committed))
        return result.actions, TickStats.of(result.tick), None

    def close(self, session) -> None:
        self.engine.close_session(session.session_id)


def closed_loop(policies: dict, episodes: int, execute: int, env_id: str) -> dict[str, dict[str, float]]:
    """Per config, over the same held-out episodes of `env_id` (seed indices 0..N-1): its policy's success rate, the
    share of episodes that ended on the blocker (ReachEither; the rest of the failures ran out of time) and the
    mean control steps per episode (a slower policy takes more)."""
    outcomes = {}
    for name, policy in tqdm(policies.items(), desc="closed loop", unit="config"):
        try:
            results = run_episodes(policy, env_id, range(episodes), num_envs=1, execute=execute)
        except RolloutStopped as stopped:  # a configuration's rates are of all its episodes or none
            raise stopped.cause from None
        outcomes[name] = {"success_rate": float(np.mean([r.success for r in results])),
                          "collision_rate": float(np.mean([r.collided for r in results])),
                          "episode_steps": float(np.mean([r.steps for r in results]))}
    return outcomes


def closed_loop_summary(summaries: list[dict], budgets: list[float], uncached_ms: float,
                        args: argparse.Namespace) -> dict:
    """Issue 14's closed-loop targets: uncached succeeds at least 90%, maximal caching (about 30% of the uncached
    latency) loses at least 10 points, the controller at the budget nearest half the uncached latency stays
    within 3 points of uncached."""
    by_name = {s["name"]: s for s in summaries}
    half = min(budgets, key=lambda b: abs(b / uncached_ms - 0.5))
    uncached, maximal = by_name["uncached"]["success_rate"], by_name["max_caching"]["success_rate"]
    controller = by_name[f"budget_{half:g}"]
    compared = {"uncached": by_name["uncached"], "max_caching": by_name["max_caching"], "controller": controller}
    return {
        "env_id": args.env,
        "episodes": args.closed_loop,
        "execute": args.execute,
        "uncached": uncached,
        "max_caching": maximal,
        "max_caching_latency_fraction": by_name["max_caching"]["p50_ms"] / uncached_ms,
        "controller": {"name": controller["name"], "fraction": half / uncached_ms,
                       "success_rate": controller["success_rate"]},
        **{metric: {name: summary[metric] for name, summary in compared.items()}
           for metric in ("collision_rate", "episode_steps")},
        "targets": {
            "uncached_at_least_90pct": uncached >= 0.9,
            "max_caching_loses_10_points": maximal <= uncached - 0.10,
            "controller_within_3_points": controller["success_rate"] >= uncached - 0.03,
        },
    }


class _Engines:
    """The engines a bench run starts, each closed once: by the run where it is done with them, else as the run ends,
    whatever ends it (a refusal other than BudgetInfeasible, Overloaded say, any error, Ctrl-C). Left open, each kept
    its worker and idle-sweep threads and its share of the device to the process's end: an in-process caller's for
    good."""

    def __init__(self) -> None:
        self.open: list[ModelEngine] = []

    def start(self, engine: ModelEngine) -> ModelEngine:
        """`engine` started and warm (one whose warmup fails is closed as the run ends, as the others)."""
        self.open.append(engine)
        engine.start()
        engine.wait_ready()
        return engine

    def close(self, engines: Sequence[ModelEngine]) -> None:
        for engine in list(engines):
            self.open.remove(engine)
            engine.close()

    def __enter__(self) -> _Engines:
        return self

    def __exit__(self, *exc) -> None:
        self.close(self.open)


def run(args: argparse.Namespace) -> dict:
    """The bench's report; every engine it started is closed when it returns or raises."""
    with _Engines() as engines:
        return _run(args, engines)


def _run(args: argparse.Namespace, live: _Engines) -> dict:
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    pipeline = PolicyPipeline.from_pretrained(args.checkpoint, device=device, dtype=resolve_dtype(args.dtype, device))
    name = args.embodiment or pipeline.served_embodiments[0]
    if name not in pipeline.served_embodiments:
        raise BenchError(f"--embodiment {name!r} is not served; expected one of {pipeline.served_embodiments}")
    smallest = pipeline.vae.spatial_compression
    if args.frame_size is not None and not all(smallest <= side <= MAX_FRAME_SIDE for side in args.frame_size):
        raise BenchError(f"--frame-size {args.frame_size[0]}x{args.frame_size[1]}: sides from {smallest} to "
                         f"{MAX_FRAME_SIDE} px, as the server takes")
    embodiment = pipeline.embodiments.get(name)
    if args.closed_loop and (embodiment.raw_action_dim, embodiment.state_dim) != (2, 2):
        raise BenchError(f"--closed-loop drives the built-in Reach task (2-D velocity actions, 2-D position state); "
                         f"embodiment {embodiment.name!r} has {embodiment.raw_action_dim}-D actions and "
                         f"{embodiment.state_dim}-D state")
    if args.closed_loop:
        check_execute(args.execute, 0, embodiment.default_chunk_size)
    if embodiment.state_dim not in (0, 2):
        raise BenchError(f"the bench feeds the Reach task's 2-D state; embodiment {embodiment.name!r} takes "
                         f"{embodiment.state_dim}-D state (choose another with --embodiment)")
    steps = pipeline.config.num_steps
    if args.compile_gen_stack and (unavailable := compile_unavailable(pipeline.device)):
        raise BenchError(f"--compile-gen-stack: {unavailable}")

    # One engine per budgeted config: each session has the worker to itself, as one robot would, and the
    # slowdown run's engine must learn the slowdown on its own. Each runs its own bench pipeline over the
    # shared weights, which keeps the engine's latest output (its latents) for the comparison.
    settings = EngineSettings(warmup_ticks=args.warmup, max_sessions=8, compile_gen_stack=args.compile_gen_stack)

    try:  # where the server would find it (`--quality-profile auto`), or the file named
        profile, _ = resolve_profile(args.quality_profile, pipeline.folder, pipeline.digest, [name], pipeline.config)
    except ProfileError as error:
        raise BenchError(str(error)) from error

    def started_engine(quality_profile: QualityProfile | None = None, **changes) -> tuple[ModelEngine, BenchPipeline]:
        own = BenchPipeline.over(pipeline)
        return live.start(ModelEngine(own, dataclasses.replace(settings, quality_profile=quality_profile,
                                                               **changes))), own

    if profile is None:  # the shipped ReachEither set; for another embodiment its frames on that one's cameras
        calibration_set = [o for o in warmup_observations(pipeline, args.calibration_observations)
                           if o.embodiment == embodiment.name]
        source = observations_source(DEFAULT_OBSERVATIONS) + ("" if embodiment.name == "pusht"
                                                              else " (resized, zero state)")
        why = "--quality-profile off" if args.quality_profile == "off" else \
            "no quality profile of these weights beside the checkpoint or in the cache"
        print(f"policy-server bench: {why}: calibrating on {len(calibration_set)} observations of {source}",
              file=sys.stderr)
        profile = calibrate(pipeline, calibration_set, configurations(pipeline, settings), source=source)
        profile.save(args.out.with_name(args.out.stem + "_profile.json"))
    points = profile.embodiments[embodiment.name]

    started = time.perf_counter()
    engine, engine_pipeline = started_engine(profile)
    warmup = warmup_summary(engine, time.perf_counter() - started)
    observations = [model_inputs(obs, embodiment, args.frame_size)
                    for obs in expert_observations(args.ticks, HELDOUT_SEED_OFFSET + args.seed * 10_000,
                                                         env_id=args.env)]

    def uncached(request: PolicyRequest) -> PolicyOutput:  # through the GEN stack the engines serve
        return run_steps(pipeline.steps(request, None, pipeline.fixed_steps(steps, pipeline.config.guidance)),
                         engine.served.gen_stack)

    # Budgets scale on the uncached tick's median over more ticks than one engine's warmup, which a slow moment
    # can carry (session 20: a warmup p50 of 152.8 ms against 126.2 ms over the run's own 300 uncached ticks).
    scale_ticks = [uncached(request_of(obs, embodiment, tick))
                   for tick, obs in enumerate((observations * SCALE_TICKS)[:SCALE_TICKS])]
    uncached_scale_ms = statistics.median(out.timings_ms["total"] for out in scale_ticks)
    # Tightest first, each once: the slowdown run is at the tightest every engine admits (and a budget given twice
    # would run two engines under one name).
    budgets = sorted(set(args.budgets_ms or [round(f * uncached_scale_ms, 1) for f in args.budget_fractions]))
    slowdown_ms = args.slowdown_ms
    if slowdown_ms is None:  # half an uncached step (embed, the branches' GEN stack as one call, heads)
        slowdown_ms = round(0.5 * statistics.median(step.ms for step in scale_ticks[0].steps), 2)

    cfg = pipeline.config.guidance != 1.0
    default = next(p for p in points if p.config == profile.default)
    maximal = [p for p in points if p.config.threshold == MAX_CACHING.threshold and p.config.cap == MAX_CACHING.cap
               and p.config.num_steps == steps and p.config.cfg_steps == default.config.cfg_steps]
    if not maximal:
        raise BenchError(f"the quality profile has no maximal-caching point ({MAX_CACHING.threshold:g} / cap "
                         f"{MAX_CACHING.cap} at {steps} steps); recalibrate it with `policy-server calibrate`")
    runs = {"uncached": ConfigRun("uncached"), "seacache_default": ConfigRun("seacache_default", family="seacache"),
            "max_caching": ConfigRun("max_caching", family="seacache")}
    fixed = {"seacache_default": FixedConfig(engine.served, family_members(points, steps, cfg)["seacache"][0]),
             "max_caching": FixedConfig(engine.served, maximal[0])}
    sessions = {}  # config name -> (engine, its bench pipeline, session)
    engines = [engine]
    infeasible: list[dict] = []  # the budgets an engine's admission refused, tightest first

    def refused(b: float, name: str, refusal: api.BudgetInfeasible) -> None:
        budgets.remove(b)
        infeasible.append({"budget_ms": b, "fraction": b / uncached_scale_ms, "refused_by": name,
                           "best_achievable_ms": refusal.best_achievable_ms, "message": refusal.message})
        print(f"policy-server bench: {name}: {refusal.message}; budget {b:g} ms skipped", file=sys.stderr)

    # The first engine's admission first, as a server's: a budget it refuses starts no engine (a user's run refused
    # at its tightest budget spent two minutes, much of them on the warmups of engines started for it).
    for b in list(budgets):
        try:
            engine.close_session(engine.open_session(embodiment.name, "warm up", budget_ms=b, seed=0,
                                                     rate_hz=0.0).session_id)
        except api.BudgetInfeasible as refusal:
            refused(b, f"budget_{b:g}", refusal)
    tokens = engine.served.instruction_tokens(observations[0]["instruction"], "instruction")
    key = engine.served.cost_key(embodiment.name, embodiment.default_chunk_size, tokens)
    slow = None  # (budget, name, engine, pipeline, session): the controller at the tightest budget all engines admit
    for b in list(budgets):
        # Every engine that runs at `b` must admit it, else the budget is reported infeasible and runs nothing (the
        # configurations at a budget are compared with each other, tick by tick): each session opens before the
        # next engine starts, so a refusal stops the warmups.
        arms, started = [], []  # (name, family, engine, its pipeline, session); the engines started for `b`
        # The first budget to run takes the first engine (whose warmup the report gives) for its controller: None.
        kinds = [(f"budget_{b:g}", "controller", None if slow is None else {"quality_profile": profile}),
                 (f"ladder_{b:g}", "ladder", {})]
        if engine.served.compiled:
            kinds.append((f"budget_{b:g}_eager", "controller_eager",
                          {"quality_profile": profile, "compile_gen_stack": False}))
        if slow is None:
            kinds.append((f"budget_{b:g}_slowdown", "controller", {"quality_profile": profile}))
        try:
            for name, family, changes in kinds:
                if changes is None:
                    owner, own = engine, engine_pipeline
                else:
                    owner, own = started_engine(**changes)
                    started.append(owner)
                arms.append((name, family, owner, own, owner.open_session(embodiment.name, "warm up", budget_ms=b,
                                                                          seed=0, rate_hz=0.0)))
        except api.BudgetInfeasible as refusal:
            refused(b, name, refusal)
            for _, _, owner, _, session in arms:
                owner.close_session(session.session_id)
            live.close(started)  # before the next budget's engines start
            continue
        engines += started
        for name, family, owner, own, session in arms:
            if name.endswith("_slowdown"):
                slow = (b, name, owner, own, session)
                continue
            runs[name] = ConfigRun(name, budget_ms=b, family=family, guarded=True)
            sessions[name] = (owner, own, session)
        controller = arms[0][2]
        # Each family's best configuration by the profile's prediction at the costs the guard holds a tick to,
        # under its guard and without it.
        costs = controller.served.cost_model.costs(key).without(PREFILL_STAGE).without(PREVIEW_STAGE)
        costs = costs.cautious(controller.served.budget.config.cost_margin_devs)
        for family, members in family_members(points, steps, cfg).items():
            if not members:  # the profile has no such point (e.g. no fewer steps than a 3-step default)
                continue
            point = best_fitting(members, costs, b)
            for guarded in (True, False):
                name = f"{'guarded_' if guarded else ''}{family}_{b:g}"
                runs[name] = ConfigRun(name, budget_ms=b, family=family, guarded=guarded, point=point)
                fixed[name] = FixedConfig(controller.served, point, guarded)
    infeasible.sort(key=lambda entry: entry["budget_ms"])
    if slow is None:  # no report rather than one without a budget: a bench.json of an earlier run stays as it was
        best_ms = math.ceil(max(entry["best_achievable_ms"] for entry in infeasible) * 10) / 10
        fraction = math.ceil(best_ms / uncached_scale_ms * 100) / 100
        given = ", ".join(f"{entry['budget_ms']:g}" for entry in infeasible)
        raise BenchError(
            f"no budget is feasible on this machine: every budget ({given} ms) is "
            f"below the best achievable latency (up to {best_ms:.1f} ms; uncached p50 {uncached_scale_ms:.1f} ms); "
            f"choose --budgets-ms of at least {best_ms:.1f}" + (f" or --budget-fractions of at least {fraction:g}"
                                                                if fraction <= 1 else ""))
    slow_budget, slow_name, slow_engine, slow_pipeline, slow_session = slow
    runs[slow_name] = ConfigRun(slow_name, budget_ms=slow_budget, family="controller", guarded=True)
    sessions[slow_name] = (slow_engine, slow_pipeline, slow_session)

    latent_shape = None
    order = list(runs)
    for tick, obs in enumerate(tqdm(observations, desc="bench", unit="tick")):
        request = request_of(obs, embodiment, tick)
        slow_pipeline.slowdown_ms = slowdown_ms if tick >= args.ticks // 2 else 0.0
        reference = uncached(request)
        latent_shape = tuple(reference.latents.shape)
        runs["uncached"].add(reference.timings_ms["total"], reference, reference)
        rotation = order[tick % len(order):] + order[: tick % len(order)]  # interleave: no config always first
        for name in rotation:
            run_ = runs[name]
            if name == "uncached":
                continue
            if name in fixed:
                latency_ms, out, late = fixed[name](request, run_.budget_ms)
                run_.add(latency_ms, out, reference, late)
            else:
                owner, own, session = sessions[name]
                result = owner.act(session.session_id, session.epoch, api.Observation(
                    images=obs["images"], state=obs["state"], instruction=obs["instruction"], step_index=tick))
                late = tuple(kind for kind in result.tick.fallback_kinds if kind in LATE_FALLBACKS)
                run_.add(result.tick.actual_ms["total"], own.last, reference, late)
                run_.add_tick_record(result.tick)

    summaries = [runs[name].summary() for name in order]
    for owner, _, session in sessions.values():
        owner.close_session(session.session_id)
    closed = None
    if args.closed_loop:  # every configuration a robot could run: the fixed ones without a deadline or guarded
        slow_pipeline.slowdown_ms = slowdown_ms  # the slowdown run's episodes run slowed throughout
        policies = {"uncached": _FixedPolicy(FixedConfig(engine.served, default), embodiment.name, None)}
        for name in runs:
            if name in fixed and runs[name].guarded is not False:
                policies[name] = _FixedPolicy(fixed[name], embodiment.name, runs[name].budget_ms)
            elif name in sessions and runs[name].family != "controller_eager":  # compared open loop only
                owner = sessions[name][0]
                policies[name] = _EnginePolicy(owner, embodiment.name, runs[name].budget_ms)
        outcomes = closed_loop(policies, args.closed_loop, args.execute, args.env)
        for summary in summaries:
            outcome = outcomes.get(summary["name"], {"success_rate": None, "collision_rate": None,
                                                     "episode_steps": None})
            summary.update(outcome, episodes=args.closed_loop if summary["name"] in outcomes else 0)
        closed = closed_loop_summary(summaries, budgets, uncached_scale_ms, args)

    live.close(engines)  # the figures below are measured without them
    memory = peak_memory(pipeline.device)  # before `forward_summary` builds diffusers' reference model beside ours
    report = {
        "schema": SCHEMA,
        "machine": {
            "device": str(pipeline.device),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if pipeline.device.type == "cuda" else None,
            "cpu": platform.processor() or platform.machine(),
            **memory,
        },
        "model": model_summary(pipeline, embodiment, observations[0], latent_shape),
        "forward": forward_summary(pipeline, embodiment, latent_shape, args),
        "tick_profile": tick_profile(pipeline, embodiment, observations[0], args.profile_ticks, args.compile_gen_stack),
        "warmup": warmup,
        "env_id": args.env,  # the task whose observations every configuration ran (and the closed loop's)
        "uncached_p50_before_run_ms": uncached_scale_ms,  # what the budget fractions scale on
        # Budgets an engine's admission refused (below its best achievable latency); they ran nothing.
        "infeasible_budgets": infeasible,
        "slowdown": {"config": slow_name, "extra_ms_per_full_call": slowdown_ms, "from_tick": args.ticks // 2},
        "configs": summaries,
        "sweep": sweep(summaries, budgets, uncached_scale_ms, {name: run_.rel_l2 for name, run_ in runs.items()}),
        "closed_loop": closed,
    }
    return report


SAMPLE_INSTRUCTION = "reach the red circle"  # for token counts only


def warmup_summary(engine: ModelEngine, seconds: float) -> dict:
    """The bench's first engine's warmup: `seconds` from its start until ready (what a server spends after loading
    the weights before health turns SERVING), and what it compiled on the way (a first start's figures when the
    inductor cache, `TORCHINDUCTOR_CACHE_DIR`, starts empty): on a CPU the GEN stack's call patterns and the tick
    work's latent shapes, on CUDA the GEN stack's CUDA graphs; None when it compiled nothing."""
    served = engine.served
    compiled = None
    if served.graphs is not None:
        compiled = {"cuda_graphs": served.graphs.num_graphs, "capture_ms": served.graphs.capture_ms}
    elif isinstance(served.gen_stack, PrecompiledGenStack):
        compiled = {"gen_stack_patterns": served.gen_stack.num_patterns,
                    "gen_stack_compile_ms": served.gen_stack.compile_ms,
                    "tick_work_latent_shapes": served.tick_work.num_shapes,
                    "tick_work_compile_ms": served.tick_work.compile_ms}
    return {"seconds": seconds, "compiled": compiled}


def peak_memory(device: torch.device) -> dict:
    """Peak memory of this process so far, MiB: host RSS (`ru_maxrss`, KiB on Linux), and on CUDA the
    caching allocator's peak allocated (`peak_cuda_mb`) and reserved (`peak_cuda_reserved_mb`) on `device`."""
    cuda = device.type == "cuda"
    return {
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_cuda_mb": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
        "peak_cuda_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20 if cuda else None,
    }


def model_inputs(obs: dict, embodiment: Embodiment, frame_hw: tuple[int, int] | None) -> dict:
    """A Reach observation as the embodiment's request inputs: its frame (resized to `frame_hw`, a camera's
    native size, when given) for every camera side by side, its state when the embodiment takes one."""
    image = obs["image"]
    if frame_hw is not None:  # each camera's: a two-camera robot sends two of them
        image = cv2.resize(image, (frame_hw[1], frame_hw[0]), interpolation=cv2.INTER_LINEAR)
    return {"images": {camera: image for camera in embodiment.cameras}, "instruction": obs["instruction"],
            "state": obs["state"] if embodiment.state_dim else None}


def request_of(inputs: dict, embodiment: Embodiment, seed: int = 0) -> PolicyRequest:
    """A tick of `model_inputs`' `inputs`, its noise drawn from `seed`."""
    return PolicyRequest(images=inputs["images"], instruction=inputs["instruction"], embodiment=embodiment.name,
                         state=inputs["state"], seed=seed)


def model_summary(pipeline: PolicyPipeline, embodiment: Embodiment, inputs: dict,
                  latent_shape: tuple[int, ...]) -> dict:
    """The served model and the shapes of one tick: the frames, the canvas they go on, the video latents
    `[C, T, h, w]` and the token counts."""
    config = pipeline.config
    chunk = embodiment.default_chunk_size
    canvas_hw = pipeline.canvas_for(embodiment, inputs["images"])
    prompt = pipeline.encode_prompt(SAMPLE_INSTRUCTION, embodiment, chunk, cfg=False, canvas_hw=canvas_hw)
    _, frames, h, w = latent_shape
    p = pipeline.transformer.config.latent_patch_size
    first = inputs["images"][embodiment.cameras[0]]
    return {
        "name": config.name,
        "params": sum(t.numel() for t in pipeline.transformer.parameters()),
        "dtype": str(pipeline.transformer.dtype).removeprefix("torch."),  # the stack's; the time embedder is fp32
        "param_bytes": sum(t.numel() * t.element_size() for t in pipeline.transformer.parameters()),
        "vae": type(pipeline.vae).__name__,
        "steps": config.num_steps,
        "sampler": config.sampler,
        "sigma_schedule": config.sigma_schedule,
        "shift": config.shift,
        "cfg": config.guidance != 1.0,
        "guidance": config.guidance,
        "embodiment": embodiment.name,
        "chunk_size": chunk,
        "action_dim": pipeline.transformer.config.action_dim,
        "frame_hw": [first.shape[0], sum(inputs["images"][c].shape[1] for c in embodiment.cameras)],
        "canvas_hw": list(canvas_hw),
        "latent_shape": list(latent_shape),
        "text_tokens": len(prompt.input_ids["cond"]),
        "gen_tokens": frames * math.ceil(h / p) * math.ceil(w / p) + chunk + _state_rows(embodiment),
    }


def forward_summary(pipeline: PolicyPipeline, embodiment: Embodiment, latent_shape: tuple[int, ...],
                    args: argparse.Namespace) -> dict:
    """Per-step call times of the served transformer's config: full, GEN-only and the diffusers reference (None
    with --no-reference, and so is the ratio to it: the rest is measured)."""
    chunk = embodiment.default_chunk_size
    prompt = pipeline.encode_prompt(SAMPLE_INSTRUCTION, embodiment, chunk, cfg=False,
                                    canvas_hw=pipeline.config.canvas_hw)
    return measure_forward(pipeline.transformer.config, n_text=len(prompt.input_ids["cond"]),
                           vision_shape=latent_shape, chunk=chunk, repeats=args.forward_repeats,
                           device=pipeline.device, state_rows=_state_rows(embodiment), reference=args.reference)


def _state_rows(embodiment: Embodiment) -> int:
    """The clean state rows before the chunk in a tick's action stream."""
    return 1 if embodiment.state_dim else 0


# Profiler ops that are the model's arithmetic: matmuls and the attention kernel (by backend).
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})
ATTENTION_OPS = frozenset({"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_flash_attention_forward",
                           "aten::_efficient_attention_forward", "aten::_scaled_dot_product_cudnn_attention",
                           "aten::_scaled_dot_product_attention_math"})


def tick_profile(pipeline: PolicyPipeline, embodiment: Embodiment, inputs: dict, ticks: int,
                 compile_gen_stack: bool | None = None) -> dict | None:
    """Where an uncached tick's time goes (ms per tick): its wall time (median, without the profiler), the
    matmul and attention time the torch profiler attributes to it (self time, mean over `ticks` profiled ticks, one
    after each round of timed ticks), their ratio (1.0: nothing but arithmetic) and the ops per tick; the same tick
    with each step's CFG branches run one by one (the path before batched CFG, interleaved tick by tick); and what
    one call costs (median over the steps: embed, stack or extrapolation, heads, sampler update): full alone, both
    branches' as one batch, skipped (a maximally cached tick's). On CUDA, `graphed` has the same wall time and
    calls with the GEN stack replayed from CUDA graphs, interleaved with the eager ticks (what a call saves,
    `*_saved_ms`, is the launch overhead the graphs remove), and `compiled_graphed` with the stack compiled and
    graphed, as the server runs it there; on a CPU, `compiled` with the stack compiled whole, as the server runs it
    there by default, with its call patterns and compile time (variants that compile are left out where
    torch.compile cannot, `compile_unavailable`, and with `compile_gen_stack` False, as the flag). Each variant's
    `wall_vs_arithmetic` divides its wall time by the eager tick's matmul and attention time: it runs the same
    matmuls and attention."""
    if ticks == 0:
        return None
    from torch.profiler import ProfilerActivity, profile

    request = request_of(inputs, embodiment)
    steps, guidance = pipeline.config.num_steps, pipeline.config.guidance

    cuda = pipeline.device.type == "cuda"
    transformer = pipeline.transformer
    variants = {"graphed": GraphedGenStack(transformer.gen_stack)} if cuda else {}
    if compile_gen_stack is False:
        pass  # asked for: nothing compiles
    elif unavailable := compile_unavailable(pipeline.device):
        print(f"policy-server bench: the tick profile has no compiled variant: {unavailable}", file=sys.stderr)
    elif cuda:
        variants["compiled_graphed"] = GraphedGenStack(transformer.compiled_gen_stack())
    else:
        variants["compiled"] = PrecompiledGenStack(transformer)
    warming = {name: stack.capture if cuda else stack.compile for name, stack in variants.items()}
    # The compiled CPU variant runs the prefill and the step's work around the stack compiled too, as the server.
    tick_work = {name: CompiledTickWork(transformer) if name == "compiled" else None for name in variants}
    warming_work = {name: work and work.compiling() for name, work in tick_work.items()}

    def tick(cache=None, batch_branches: bool = True, stack=pipeline.transformer.gen_stack,
             work: TickWork | None = None) -> PolicyOutput:
        control = pipeline.fixed_steps(steps, guidance, cache, batch_branches)
        return run_steps(pipeline.steps(request, None, control, work), stack)

    def max_caching() -> SeaCache:
        return SeaCache(SeaCacheConfig(threshold=MAX_CACHING.threshold, max_consecutive_cached=MAX_CACHING.cap))

    tick(), tick(batch_branches=False)  # allocations and layouts of this shape are made outside the figures
    for name, warm in warming.items():  # and the graphs' captures and compiles
        tick(stack=warm, work=warming_work[name])
        tick(max_caching(), batch_branches=False, stack=warm, work=warming_work[name])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    op_us, op_counts = Counter(), Counter()  # self time and calls by op, summed over the profiled ticks
    walls, walls_one_by_one, calls = [], [], []
    variant_walls, variant_calls = {name: [] for name in variants}, {name: [] for name in variants}
    for _ in range(ticks):  # every figure's ticks interleaved, so that a machine that drifts moves them all alike
        for out, one_by_one in ((tick(), False), (tick(batch_branches=False), True),
                                (tick(max_caching(), batch_branches=False), None)):
            calls += step_calls(out.steps)
            if one_by_one is not None:
                (walls_one_by_one if one_by_one else walls).append(out.timings_ms["total"])
        for name, stack in variants.items():
            out = tick(stack=stack, work=tick_work[name])
            variant_walls[name].append(out.timings_ms["total"])
            variant_calls[name] += step_calls(out.steps) + step_calls(tick(max_caching(), False, stack,
                                                                           tick_work[name]).steps)
        with profile(activities=activities) as profiler:
            tick()
        for e in profiler.key_averages():
            op_us[e.key] += e.self_device_time_total if cuda else e.self_cpu_time_total
            op_counts[e.key] += e.count

    def op_ms(names: frozenset[str]) -> float:
        return sum(us for key, us in op_us.items() if key in names) / 1e3 / ticks

    def call_ms(kind: str, timed: list[tuple[str, float]] = calls) -> float | None:
        """None for a kind the ticks made no call of (no batched pair without CFG)."""
        samples = [ms for k, ms in timed if k == kind]
        return statistics.median(samples) if samples else None

    def saved_ms(kind: str, variant: str) -> float | None:
        eager, faster = call_ms(kind), call_ms(kind, variant_calls[variant])
        return None if eager is None or faster is None else eager - faster

    wall_ms, matmul_ms, attention_ms = statistics.median(walls), op_ms(MATMUL_OPS), op_ms(ATTENTION_OPS)
    return {
        "wall_ms": wall_ms,
        "matmul_ms": matmul_ms,
        "attention_ms": attention_ms,
        "wall_vs_arithmetic": wall_ms / (matmul_ms + attention_ms),
        "ops_per_tick": sum(count for key, count in op_counts.items() if key.startswith("aten::")) / ticks,
        "wall_branches_one_by_one_ms": statistics.median(walls_one_by_one),
        "full_call_ms": call_ms(FULL),
        "batched_cfg_call_ms": call_ms(PAIR),
        "skipped_call_ms": call_ms(SKIP),
        **{name: None if name not in variants else {
            "wall_ms": statistics.median(variant_walls[name]),
            "wall_vs_arithmetic": statistics.median(variant_walls[name]) / (matmul_ms + attention_ms),
            "full_call_ms": call_ms(FULL, variant_calls[name]),
            "batched_cfg_call_ms": call_ms(PAIR, variant_calls[name]),
            "skipped_call_ms": call_ms(SKIP, variant_calls[name]),
            "full_call_saved_ms": saved_ms(FULL, name),
            "batched_cfg_call_saved_ms": saved_ms(PAIR, name),
            **({"graphs": variants[name].num_graphs, "capture_ms": variants[name].capture_ms}  # compiles included
               if cuda else {"patterns": variants[name].num_patterns, "compile_ms": variants[name].compile_ms,
                             "tick_work_shapes": tick_work[name].num_shapes,
                             "tick_work_compile_ms": tick_work[name].compile_ms}),
        } for name in ("graphed", "compiled_graphed", "compiled")},
        "ticks": ticks,
    }


def plot(report: dict, out: Path) -> list[Path]:
    """Latency distribution per config, and action error against latency; each infeasible budget with the best
    achievable latency its refusal gave."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs, infeasible = report["configs"], report["infeasible_budgets"]
    paths = []
    rows = len(configs) + len(infeasible)
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.2 * rows))  # a label's height per bar: none overlap
    names = [c["name"] for c in configs]
    ax.barh(names, [c["p99_ms"] for c in configs], color="#c7d6ea", label="p99")
    ax.barh(names, [c["p50_ms"] for c in configs], color="#3b6ea8", label="p50")
    for c in configs:
        if c["budget_ms"] is not None and c["name"].startswith("budget_"):
            ax.plot([c["budget_ms"]] * 2, [names.index(c["name"]) - 0.4, names.index(c["name"]) + 0.4], "r-")
    for row, entry in enumerate(infeasible, start=len(configs)):  # no ticks ran: its budget and the best achievable
        ax.plot([entry["budget_ms"]] * 2, [row - 0.4, row + 0.4], "r-")
        ax.plot([entry["best_achievable_ms"]], [row], "kx", label="best achievable (infeasible)" if
                row == len(configs) else None)
    ax.set_yticks(range(rows), names + [f"budget_{e['budget_ms']:g}: infeasible" for e in infeasible])
    ax.margins(y=0.01)
    ax.set_xlabel("tick latency (ms); red: budget")
    ax.set_title(f"{report['model']['name']} on {report['machine']['device']}: latency per config")
    ax.legend(loc="lower right")
    fig.tight_layout()
    paths.append(out.with_name(out.stem + "_latency.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    styles = {"controller": ("k", "-", 2.5), "controller_eager": ("#9467bd", "-", 1.2),
              "ladder": ("#888888", "-", 1.2), "fewer_steps": ("#d62728", "-", 1.2),
              "seacache": ("#1f77b4", "-", 1.2), "fewer_steps_seacache": ("#2ca02c", "-", 1.2)}
    for family, (color, _, width) in styles.items():
        for guarded in (True, False):
            line = sorted((c for c in configs if c["family"] == family and (c["guarded"] is not False) == guarded
                           and not c["name"].endswith("_slowdown") and c["budget_ms"] is not None),
                          key=lambda c: c["budget_ms"])
            if not line:
                continue
            label = family + ("" if guarded else " (no guard)")
            ax.plot([c["p50_ms"] for c in line], [c["action_rel_l2"] for c in line], color=color, lw=width,
                    ls="-" if guarded else "--", marker="o", ms=4, label=label)
            missing = [c for c in line if c["miss_rate"] > 0.01]
            ax.scatter([c["p50_ms"] for c in missing], [c["action_rel_l2"] for c in missing], s=90,
                       facecolors="none", edgecolors=color)
    for c in configs:
        if c["budget_ms"] is None:
            ax.scatter(c["p50_ms"], c["action_rel_l2"], marker="s", color="#444444")
            ax.annotate(c["name"], (c["p50_ms"], c["action_rel_l2"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
    for entry in infeasible:  # a budget nothing ran at: where it lies on the latency axis
        ax.axvline(entry["budget_ms"], color="r", ls=":", lw=1)
        ax.text(entry["budget_ms"], 0.98, f"budget {entry['budget_ms']:g} ms: infeasible "
                f"(best {entry['best_achievable_ms']:.1f} ms)", transform=ax.get_xaxis_transform(), rotation=90,
                ha="right", va="top", fontsize=7, color="r")
    ax.set_xlabel("p50 tick latency (ms)")
    ax.set_ylabel("action rel. L2 error vs uncached")
    ax.set_title("action error against latency, one point per budget (circled: misses > 1%)")
    ax.set_yscale("symlog", linthresh=0.01)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out.with_name(out.stem + "_error_vs_latency.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="policy-server bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=output_file, default="bench.json",
                        help="JSON path; PNGs go beside it (bench.json)")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="the embedded layout or a diffusers Cosmos3OmniPipeline folder, or a Hugging Face Hub "
                             "id (default: embedded)")
    parser.add_argument("--embodiment", default=None, help="embodiment to drive (default: the first served)")
    parser.add_argument("--frame-size", type=_frame_size, default=None, metavar="HxW",
                        help="resize the task's 64x64 frames to a camera's native size, e.g. 480x640")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (cpu)")
    parser.add_argument("--dtype", default="auto",
                        help=f"weight dtype: {', '.join(DTYPES)} (auto: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--compile-gen-stack", action=argparse.BooleanOptionalAction, default=None,
                        help="the engines' GEN stack compiled, as the server's flag (default: as the server: "
                             "wherever torch can compile); --no-compile-gen-stack compiles nothing, the tick "
                             "profile's compiled variants included")
    parser.add_argument("--ticks", type=int, default=500, help="ticks every configuration runs (500)")
    parser.add_argument("--warmup", type=int, default=4, help="warmup ticks per engine and cache mode (4)")
    budgets = parser.add_mutually_exclusive_group()
    budgets.add_argument("--budgets-ms", type=float, nargs="+", default=None,
                         help="per-tick budgets to run, ms (default: --budget-fractions of the uncached latency)")
    # The tightest must lie above the cheapest tick plus the longest background piece an engine may wait for, with
    # room: 0.3 of the uncached tick was refused on this CPU.
    budgets.add_argument("--budget-fractions", type=float, nargs="+", default=[0.35, 0.4, 0.5, 0.6, 0.75, 1.0],
                         help="budgets as fractions of the uncached p50 measured before the run (0.35 .. 1.0, "
                              "six points)")
    parser.add_argument("--slowdown-ms", type=float, default=None,
                        help="extra ms per full call from the halfway tick (default: half a full call)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1)")
    parser.add_argument("--seed", type=int, default=0, help="which held-out scenes the ticks see (0)")
    parser.add_argument("--profile-ticks", type=int, default=20,
                        help="uncached ticks profiled for `tick_profile` (wall vs matmul + attention; 20); 0: skip")
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                        help="time diffusers' reference forward (on; needs the [dev] extra)")
    parser.add_argument("--forward-repeats", type=int, default=50, help="timed calls per figure of `forward` (50)")
    parser.add_argument("--closed-loop", type=int, default=0, metavar="N",
                        help="also run N held-out episodes per config; report success_rate, collision_rate and "
                             "episode_steps")
    parser.add_argument("--env", default=REACH_EITHER_TIMED_ID, choices=ENV_IDS,
                        help="the task whose held-out expert observations feed every configuration, and whose "
                             f"episodes the closed loop runs (default {REACH_EITHER_TIMED_ID}, the shipped "
                             f"model's; {REACH_ID} for a Reach-only checkpoint)")
    parser.add_argument("--execute", type=int, default=4, help="closed loop: actions executed per chunk (4)")
    parser.add_argument("--quality-profile", default="auto",
                        help="the controller's profile (`policy-server calibrate`): a file, or auto (default): "
                             "where the server finds it, beside the checkpoint or in the cache, else calibrate "
                             "first; off: calibrate first even when a profile is stored")
    parser.add_argument("--calibration-observations", type=int, default=16,
                        help="without a quality profile: observations of the shipped set to calibrate on (16)")
    args = parser.parse_args(argv)
    try:
        check_dtype(args.dtype)
    except ValueError as error:  # one line, like the server's own flags
        parser.exit(2, f"{parser.prog}: --dtype: {error}\n")
    for flag, value, least in (("--ticks", args.ticks, 2), ("--warmup", args.warmup, 2),
                               ("--calibration-observations", args.calibration_observations, 1),
                               ("--closed-loop", args.closed_loop, 0), ("--execute", args.execute, 1),
                               ("--profile-ticks", args.profile_ticks, 0),
                               ("--forward-repeats", args.forward_repeats, 1), ("--threads", args.threads, 1)):
        if value < least:
            parser.error(f"{flag} must be at least {least}, got {value}")
    for fraction in args.budget_fractions:
        if not 0 < fraction <= 1:
            parser.error(f"--budget-fractions must lie in (0, 1], budgets up to the uncached latency; got {fraction}")
    for budget in args.budgets_ms or ():
        if not 0 < budget <= MAX_BUDGET_MS:
            parser.error(f"--budgets-ms must lie in (0, {MAX_BUDGET_MS:g}], got {budget}")
    if args.seed < 0:  # seeds below HELDOUT_SEED_OFFSET are the demonstrations' scenes
        parser.error(f"--seed must be >= 0 (held-out scenes), got {args.seed}")
    if args.slowdown_ms is not None and not 0 <= args.slowdown_ms < math.inf:
        parser.error(f"--slowdown-ms must be >= 0, got {args.slowdown_ms}")
    try:
        resolve_device(args.device)
    except DeviceUnavailable as error:
        parser.error(str(error))
    if args.reference and (unavailable := reference_unavailable()):  # timed last: know now, not after the run
        parser.error(f"--reference: {unavailable}; install the [dev] extra (pip install -e '.[dev]') or pass "
                     "--no-reference")
    return args


class BenchError(ValueError):
    """Options the bench cannot run with; the message says which and why."""


def _frame_size(text: str) -> tuple[int, int]:
    height, _, width = text.lower().partition("x")
    if not (height.isdigit() and width.isdigit() and int(height) > 0 and int(width) > 0):
        raise argparse.ArgumentTypeError(f"expected HxW in pixels, e.g. 480x640, got {text!r}")
    return int(height), int(width)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except (api.BudgetInfeasible, api.Overloaded) as refused:  # a budget below what this machine can serve
        print(f"policy-server bench: {refused.message}; choose larger --budget-fractions or --budgets-ms",
              file=sys.stderr)
        return 2
    except (BenchError, CheckpointLoadError, RolloutError) as error:
        print(f"policy-server bench: {error}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    paths = plot(report, args.out)
    print(json.dumps({"out": str(args.out), "plots": [str(p) for p in paths],
                      "configs": {c["name"]: {k: c[k] for k in ("p50_ms", "p99_ms", "action_rel_l2", "miss_rate")}
                                  for c in report["configs"]},
                      "infeasible_budgets": {f"{e['budget_ms']:g}": {"best_achievable_ms": e["best_achievable_ms"]}
                                             for e in report["infeasible_budgets"]}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
