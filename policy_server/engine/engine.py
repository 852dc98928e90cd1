"""`ModelEngine`: the `Engine` the transport calls, backed by one `PolicyPipeline` on one device.

One worker thread owns the model (`engine/worker.py`): control ticks go first, queued ticks of one
shape from different sessions start together as a micro-batch (`engine/batching.py`), and reasoner
calls run one prefill chunk or token at a time between ticks, forward / inverse dynamics calls one sampler step at
a time (`_SteppedCall`). A session is admitted only when every
open session's ticks still meet their budgets (`engine/admission.py`); it gets a slot, the model time
its ticks are planned in. A tick is planned against the smallest of its slot, its budget less the
time it queued, and the caller's deadline: the budget planner picks this tick's cache setting, its
deadline guard arms, SeaCache runs with the guard's force-skip hook, and the guard paces the sampler.
The finished tick feeds the cost model and the session's history, and the answer carries the full
record of why it was as fast as it was.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_for
from dataclasses import dataclass

import numpy as np
import torch

from policy_server.budget.cost_model import CallCosts, CostModel
from policy_server.budget.guard import monotonic_ms
from policy_server.budget.planner import MAX_CACHING, CacheSetting, PlannerConfig
from policy_server.budget.record import TickRecord as BudgetTickRecord
from policy_server.budget.tick import PREFILL_STAGE, PREVIEW_STAGE, TickBudget
from policy_server.cache.controller import NoCache, StepController
from policy_server.cache.sea_filter import SeaFilter
from policy_server.cache.seacache import SeaCache, SeaCacheConfig
from policy_server.engine import api
from policy_server.engine.admission import Demand, RateLimiter, assign_slots, default_rate_hz, sessions_that_fit
from policy_server.engine.batching import StackBatcher
from policy_server.engine.sessions import SessionState, SessionTable
from policy_server.engine.worker import GeneratorJob, ModelWorker, TickJob
from policy_server.limits import (
    MAX_BUDGET_MS,
    MAX_DYNAMICS_MS,
    MAX_INSTRUCTION_TOKENS,
    MAX_PROMPT_TOKENS,
)
from policy_server.pipeline.embodiments import Embodiment
from policy_server.pipeline.policy import Aborted, PolicyOutput, PolicyPipeline, PolicyRequest, PromptState
from policy_server.pipeline.reasoner import ReasonerStream

STAGES = ("encode", "prefill", "denoise", "decode")
# Ticks attend to their instruction's text K/V, so each call costs more with a longer instruction.
# Costs are learned per instruction-length group, and warmup fills each group at its longest.
INSTRUCTION_TOKEN_GROUPS = (32, MAX_INSTRUCTION_TOKENS)
_POLL_S = 0.02  # how often a waiting caller checks whether it went away
_ABANDONED_WAIT_S = 1.0  # how long a new tick waits for its session's abandoned one to stop
_CLOSE_TIMEOUT_S = 5.0
# Sampler steps of the warmup ticks that only fill costs: the first and last step are full, the rest can skip.
_SHORT_WARMUP_STEPS = 6
GRID_SAMPLES = 8  # ticks at a smaller latent grid before they are planned at its own costs


@dataclass(frozen=True)
class EngineSettings:
    """Serving knobs. `cache_threshold` / `max_consecutive_cached` define the middle of the planner's ladder
    (the published Cosmos3 default 0.25 / 2); `full_call_delay_ms` injects an artificial slowdown per full
    GEN-stack call (benchmarks and fault drills). `max_batch`: the most queued ticks of one shape that run
    together as a micro-batch (1 = one tick at a time). `max_reason_calls`: reasoner calls at once;
    `max_dynamics_calls`: forward / inverse dynamics calls at once (0: none, and admission reserves nothing for
    them)."""

    default_budget_ms: float = 120.0
    max_sessions: int = 4
    diffusion_cache: bool = True
    cache_threshold: float = 0.25
    residual_order: int = 1
    max_consecutive_cached: int = 2
    warmup_ticks: int = 4
    max_reason_tokens: int = 256
    max_reason_calls: int = 2
    max_dynamics_calls: int = 0
    full_call_delay_ms: float = 0.0
    max_batch: int = 4


def cache_ladder(threshold: float, cap: int) -> tuple[CacheSetting, ...]:
    """Least to most aggressive settings around (threshold, cap); (0.25, 2) gives the planner's default ladder."""
    return (
        CacheSetting(f"t{0.4 * threshold:.2f}-c1", 0.4 * threshold, 1),
        CacheSetting(f"t{threshold:.2f}-c1", threshold, 1),
        CacheSetting(f"t{threshold:.2f}-c{cap}", threshold, cap),
        CacheSetting(f"t{2 * threshold:.2f}-c{cap}", 2 * threshold, cap),
        CacheSetting(f"t{4 * threshold:.2f}-c{cap + 1}", 4 * threshold, cap + 1),
        MAX_CACHING,
    )


class _DelayedFull:
    """Step controller wrapper that makes every full GEN-stack call `delay_ms` slower."""

    def __init__(self, inner: StepController, delay_ms: float):
        self.inner, self.delay_s = inner, delay_ms / 1e3

    def begin(self, num_steps: int) -> None:
        self.inner.begin(num_steps)

    def run_stack(self, step, branch, sigma, noisy_vision, gen_in, full):
        def slow_full():
            time.sleep(self.delay_s)
            return full()

        return self.inner.run_stack(step=step, branch=branch, sigma=sigma, noisy_vision=noisy_vision,
                                    gen_in=gen_in, full=slow_full)

    def record(self):
        return self.inner.record()


@dataclass(frozen=True)
class _TickRequest:
    """What a queued tick carries. `instruction_tokens`: of `observation.instruction`, when it sets one.
    `deadline_ms`: from arrival, the smaller of the session budget and the caller's deadline."""

    epoch: int
    observation: api.Observation
    instruction_tokens: int
    arrived_ms: float
    deadline_ms: float
    deadline_s: float | None
    should_abort: Callable[[], bool] | None

    def gone(self) -> bool:
        """The caller's deadline passed or it went away."""
        expired = self.deadline_s is not None and time.monotonic() >= self.deadline_s
        return expired or (self.should_abort is not None and self.should_abort())

    def gone_error(self) -> api.EngineError:
        if self.deadline_s is not None and time.monotonic() >= self.deadline_s:
            return api.DeadlineExpired("the caller's deadline passed before the tick finished")
        return api.Cancelled("the caller went away")


class _SteppedCall:
    """Background work (a `worker.BackgroundJob`) that runs `work(pause)` on a thread of its own, one piece
    per `step()`: a step lets the thread run until it calls `pause()` again or returns, while the model worker
    waits for it. So the work never overlaps a tick, and a tick waits for at most one piece. `result` gets
    what `work` returns or raises."""

    def __init__(self, work: Callable[[Callable[[], None]], object]):
        self._work = work
        self.result: Future = Future()
        self._resume, self._paused = threading.Semaphore(0), threading.Semaphore(0)
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def step(self) -> bool:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="dynamics")
            self._thread.start()
        else:
            self._resume.release()
        self._paused.acquire()
        return self.result.done()

    def fail(self, error: BaseException) -> None:
        """It will not be stepped again (shutdown, or its caller went away): a thread waiting in `pause()`
        raises `error` there, which ends the work without touching the model."""
        if self._thread is None:
            self.result.set_exception(error)
            return
        self._failure = error
        self._resume.release()

    def _run(self) -> None:
        try:
            self.result.set_result(self._work(self._pause))
        except BaseException as error:  # the caller gets it
            self.result.set_exception(error)
        finally:
            self._paused.release()

    def _pause(self) -> None:
        self._paused.release()
        self._resume.acquire()
        if self._failure is not None:
            raise self._failure


class _PauseEachStep:
    """Pacer of a dynamics call: hands the worker back before every sampler step, and adds up the ms the call
    waited there (the pipeline's `denoise` time includes them)."""

    def __init__(self, pause: Callable[[], float]):
        self.pause, self.paused_ms = pause, 0.0

    def pace(self, step: int, use_uncond: bool) -> tuple[bool, bool]:
        self.paused_ms += self.pause()
        return use_uncond, False


class ModelEngine:
    """Thread-safe `Engine` over a `PolicyPipeline`. Call `start()` to warm up."""

    def __init__(self, pipeline: PolicyPipeline, settings: EngineSettings | None = None,
                 clock: Callable[[], float] = monotonic_ms):
        self.pipeline = pipeline
        self.settings = settings or EngineSettings()
        self.clock = clock
        self.sessions = SessionTable(self.settings.max_sessions)
        self.cost_model = CostModel()
        planner = PlannerConfig(ladder=cache_ladder(self.settings.cache_threshold,
                                                    self.settings.max_consecutive_cached))
        self.budget = TickBudget(self.cost_model, planner, clock=clock, post_stages=("decode", PREVIEW_STAGE))
        self.full_call_delay_ms = self.settings.full_call_delay_ms
        self._sea_filter = SeaFilter()
        self._worker = ModelWorker(self._tick, lambda size: StackBatcher(pipeline.transformer.gen_stack, size),
                                   self.settings.max_batch)
        self._embodiments = {name: pipeline.embodiments.get(name) for name in pipeline.served_embodiments}
        self._admission = threading.Lock()  # held while slots are assigned, so two opens cannot both fit
        self._reason_calls = threading.Semaphore(self.settings.max_reason_calls)
        self._dynamics_calls = threading.Semaphore(self.settings.max_dynamics_calls)
        canvas_h, canvas_w = pipeline.config.canvas_hw
        m = pipeline.vae.spatial_compression
        self._full_grid = (canvas_h // m, canvas_w // m)  # the largest latent grid: what admission plans for
        self._preview_costs: dict[tuple[int, ...], float] = {}  # warmup: preview decode ms by latent shape
        self._closing = threading.Event()
        self._ready = threading.Event()
        self._warm_progress = 0.0
        self._warmup_error: BaseException | None = None
        self._profile: tuple[api.ProfilePoint, ...] = ()
        # The longest reasoner step or dynamics piece: what a tick may find running when it arrives.
        self._blocking_ms = 0.0
        # The pipeline output of the latest tick (generated latents, step records), for benchmarks.
        self.last_output: PolicyOutput | None = None

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Warm up in the background; `ready()` turns True when the cost model is filled."""
        self._worker.submit(GeneratorJob(self._warmup(), self._warmup_failed))

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        if not self._ready.wait(timeout_s):
            return False
        if self._warmup_error is not None:
            raise RuntimeError("warmup failed") from self._warmup_error
        return True

    def close(self) -> bool:
        """Abandon the running tick (or warmup tick) within one step, fail everything queued, stop the worker.
        Returns whether the worker stopped within `_CLOSE_TIMEOUT_S` (a device call may hold it longer)."""
        self._closing.set()
        return self._worker.close(_CLOSE_TIMEOUT_S)

    def ready(self) -> bool:
        return self._ready.is_set() and self._warmup_error is None

    def stats(self) -> api.EngineStats:
        return api.EngineStats(sessions=len(self.sessions), queue_depth=self._worker.queue_depth,
                               warmup_progress=self._warm_progress)

    def info(self) -> api.ServerInfo:
        config = self.pipeline.config
        # The pipeline floors frames to multiples of the VAE's spatial compression: a side needs at least that.
        min_side = self.pipeline.vae.spatial_compression
        return api.ServerInfo(
            model_name=config.name,
            embodiments=tuple(e.to_spec(config.canvas_hw, min_side, self.pipeline.normalizers(e).state)
                              for e in self._embodiments.values()),
            default_budget_ms=self.settings.default_budget_ms,
            max_sessions=self.settings.max_sessions,
            model_digest=self.pipeline.digest,
            device=str(self.pipeline.device),
            max_reason_tokens=self.settings.max_reason_tokens,
            max_instruction_tokens=MAX_INSTRUCTION_TOKENS,
            max_prompt_tokens=MAX_PROMPT_TOKENS,
            warmup_profile=self._profile,
            num_steps=config.num_steps,
            diffusion_cache=self.settings.diffusion_cache,
            max_dynamics_calls=self.settings.max_dynamics_calls,
        )

    # ------------------------------------------------------------------------------ admission

    def capacity(self, budget_ms: float | None = None, rate_hz: float | None = None) -> tuple[api.Capacity, ...]:
        if not self.ready():
            return ()
        budget = self.settings.default_budget_ms if budget_ms is None else budget_ms
        with self._admission:
            sessions = self.sessions.all()
            out = []
            for embodiment in self._embodiments.values():
                chunk = embodiment.default_chunk_size
                rate = default_rate_hz(embodiment.fps, chunk) if rate_hz is None else rate_hz
                demand = self._demand(embodiment.name, chunk, budget, rate)
                limit = self.settings.max_sessions
                out.append(api.Capacity(
                    embodiment=embodiment.name, chunk_size=chunk, budget_ms=budget, rate_hz=rate,
                    sessions_alone=sessions_that_fit([], demand, self._blocking_ms, limit),
                    sessions_more=sessions_that_fit([s.demand for s in sessions], demand, self._blocking_ms,
                                                    limit - len(sessions)),
                ))
        return tuple(out)

    def open_session(self, embodiment: str, instruction: str, budget_ms: float | None = None,
                     chunk_size: int | None = None, seed: int | None = None, rate_hz: float | None = None,
                     actions_per_chunk: int | None = None, preview: bool = False) -> api.SessionHandle:
        self._require_ready()
        if embodiment not in self._embodiments:
            raise api.UnknownEmbodiment(embodiment, tuple(self._embodiments))
        spec = self._embodiments[embodiment]
        chunk = spec.default_chunk_size if chunk_size is None else chunk_size
        executed = chunk if actions_per_chunk is None else actions_per_chunk
        if not 1 <= executed <= chunk:
            raise api.InvalidArgument("actions_per_chunk", f"1..{chunk} (the chunk size)", str(executed),
                                      reason="BAD_VALUE")
        rate = default_rate_hz(spec.fps, executed) if rate_hz is None else rate_hz
        budget = self.settings.default_budget_ms if budget_ms is None else budget_ms
        key = self.cost_key(embodiment, chunk, self._instruction_tokens(instruction, "instruction"))
        demand = self._demand(embodiment, chunk, budget, rate, preview)
        if demand.floor_ms > budget:
            raise api.BudgetInfeasible(budget, demand.floor_ms)
        with self._admission:
            self._admit([*[s.demand for s in self.sessions.all()], demand], demand)
            session = self.sessions.open(embodiment=embodiment, instruction=instruction, budget_ms=budget,
                                         chunk_size=chunk, seed=0 if seed is None else seed, cost_key=key,
                                         demand=demand, limiter=RateLimiter(rate, time.monotonic()), preview=preview)
            self._assign_slots()
        return session.handle()

    def session(self, session_id: str) -> api.SessionHandle:
        return self.sessions.get(session_id).handle()

    def reset_session(self, session_id: str) -> api.SessionHandle:
        return self.sessions.reset(session_id).handle()

    def close_session(self, session_id: str) -> None:
        with self._admission:
            self.sessions.close(session_id)
            self._assign_slots()

    def set_budget(self, session_id: str, budget_ms: float) -> api.SessionHandle:
        session = self.sessions.get(session_id)
        old = session.demand
        demand = Demand(budget_ms, old.rate_hz, old.floor_ms, old.ceiling_ms)
        if demand.floor_ms > budget_ms:
            raise api.BudgetInfeasible(budget_ms, demand.floor_ms)
        with self._admission:
            others = [s.demand for s in self.sessions.all() if s is not session]
            self._admit([*others, demand], demand)
            session.demand, session.budget_ms = demand, budget_ms
            self._assign_slots()
        return session.handle()

    def _demand(self, embodiment: str, chunk: int, budget_ms: float, rate_hz: float, preview: bool = False) -> Demand:
        """A session's claim on the worker: its cheapest tick (the planner's floor) and its uncached tick, at
        the longest instruction it may send (an observation may change the instruction at any tick), with the
        decode of its predicted frames when it asked for them."""
        key = self.cost_key(embodiment, chunk, MAX_INSTRUCTION_TOKENS)
        steps, passes = self.pipeline.config.num_steps, self._passes()
        ceiling = self.budget.plan(key, MAX_BUDGET_MS, steps, passes, None, prefill=True, preview=preview).predicted_ms
        floor = ceiling
        if self._budget_controlled():
            floor = self.budget.plan(key, 1e-3, steps, passes, None, prefill=True, preview=preview).predicted_ms
        return Demand(budget_ms, rate_hz, floor, ceiling)

    def _admit(self, demands: list[Demand], new: Demand) -> None:
        """Raise Overloaded unless every demand (``new`` among them) can be met (under ``_admission``)."""
        if assign_slots(demands, self._blocking_ms) is not None:
            return
        others = [d for d in demands if d is not new]
        alone = sessions_that_fit([], new, self._blocking_ms, self.settings.max_sessions)
        queue_ms = self._blocking_ms + sum(d.floor_ms for d in demands)
        load = sum(d.rate_hz * d.floor_ms for d in demands) / 1e3
        raise api.Overloaded(
            f"the server cannot take this session: with the {len(others)} open session(s), a tick could wait "
            f"{queue_ms:.0f} ms against the tightest budget of {min(d.budget_ms for d in demands):g} ms, and "
            f"the declared rates would claim {load:.0%} of the model; no session like this one fits beside them, "
            f"{alone} would on an idle server (a larger budget or a lower rate_hz fits more)", sessions_fit=alone)

    def _assign_slots(self) -> None:
        sessions = self.sessions.all()
        slots = assign_slots([s.demand for s in sessions], self._blocking_ms)
        for session, slot in zip(sessions, slots, strict=True):
            session.slot_ms = slot

    # ------------------------------------------------------------------------------ ticks

    def act(self, session_id: str, epoch: int, observation: api.Observation, deadline_s: float | None = None,
            should_abort: Callable[[], bool] | None = None) -> api.ActResult:
        self._require_ready()
        session = self.sessions.get(session_id)
        if epoch != session.epoch:
            raise api.StaleEpoch(session_id, session.epoch, epoch)
        tokens = self._instruction_tokens(observation.instruction, "observation.instruction") \
            if observation.instruction else 0
        deadline_ms = session.budget_ms
        if deadline_s is not None:
            deadline_ms = min(deadline_ms, (deadline_s - time.monotonic()) * 1e3)
        request = _TickRequest(epoch, observation, tokens, self.clock(), deadline_ms, deadline_s, should_abort)
        prior = session.in_flight
        if prior is not None and prior.payload.gone():  # it stops within one step: wait instead of refusing
            wait_for([prior.result], timeout=_ABANDONED_WAIT_S)
        with session.lock:
            if session.in_flight is not None and not session.in_flight.result.done():
                raise api.SessionBusy(session_id)
            wait_s = session.limiter.take(time.monotonic())
            if wait_s > 0:
                raise api.RateExceeded(session_id, session.limiter.rate_hz, session.limiter.measured_hz,
                                       wait_s * 1e3)
            job = TickJob(session, (session.embodiment, session.chunk_size), request)
            session.in_flight = job
        self._worker.submit(job)
        while True:
            try:
                return job.result.result(timeout=_POLL_S)
            except FutureTimeout:
                if request.gone() and self._worker.withdraw(job):
                    error = request.gone_error()
                    job.result.set_exception(error)
                    raise error from None

    def _tick(self, job: TickJob, batcher: StackBatcher | None) -> api.ActResult:
        """One control tick, on the worker; `batcher`: the micro-batch's GEN-stack rendezvous, if any."""
        session, request = job.session, job.payload
        observation = request.observation
        if request.epoch != session.epoch:  # reset while queued
            raise api.StaleEpoch(session.session_id, session.epoch, request.epoch)
        if request.gone():
            raise request.gone_error()
        started_ms = self.clock()
        left_ms = request.deadline_ms - (started_ms - request.arrived_ms)
        if observation.instruction and observation.instruction != session.instruction:
            session.instruction = observation.instruction
            session.cost_key = self.cost_key(session.embodiment, session.chunk_size, request.instruction_tokens)
        embodiment = self._embodiments[session.embodiment]
        steps, passes = self.pipeline.config.num_steps, self._passes()
        canvas_hw = self.pipeline.canvas_for(embodiment, observation.images)
        prefill = not self._prompt_ready(session, embodiment, passes, canvas_hw)
        unused = {stage for stage, used in ((PREFILL_STAGE, prefill), (PREVIEW_STAGE, session.preview)) if not used}
        learn_key, key = self._grid_keys(session.cost_key, self.pipeline.latent_grid(embodiment, observation.images),
                                         unused)

        plan = guard = None
        if self._budget_controlled():
            # A slot that holds the uncached tick is no cap: rounding must not turn caching on.
            slot_ms = session.slot_ms if session.slot_ms < session.demand.ceiling_ms else left_ms
            plan_ms = max(min(left_ms, slot_ms), 1e-3)
            plan = self.budget.plan(key, plan_ms, steps, passes, session.history, prefill=prefill,
                                    preview=session.preview)
            guard = self.budget.arm(plan, key, started_ms)
            controller: StepController = SeaCache(
                SeaCacheConfig(threshold=plan.thresholds, residual_order=self.settings.residual_order,
                               max_consecutive_cached=plan.cap),
                force_skip=guard.force_skip, on_decision=guard.on_decision, sea_filter=self._sea_filter,
            )
            steps, cfg_steps = plan.num_steps, plan.cfg_steps
        else:
            controller = NoCache()
            cfg_steps = steps if passes == 2 else 0
        if self.full_call_delay_ms > 0:
            controller = _DelayedFull(controller, self.full_call_delay_ms)

        prefill_ms = self._prefill(session, embodiment, passes, canvas_hw) if prefill else 0.0
        pipeline_request = PolicyRequest(
            images=observation.images, instruction=session.instruction, embodiment=session.embodiment,
            state=observation.state, chunk_size=session.chunk_size, num_steps=steps,
            seed=session.seed + session.ticks, cfg_steps=cfg_steps,
        )

        def abort() -> bool:
            return self._closing.is_set() or request.gone()

        try:
            out = self.pipeline(pipeline_request, prompt=session.prompt, controller=controller, should_abort=abort,
                                pacer=guard, stack=None if batcher is None else batcher.run)
        except Aborted:
            if self._closing.is_set():
                raise api.ShuttingDown() from None
            raise request.gone_error() from None
        session.ticks += 1
        self.last_output = out

        actions = out.actions
        if not np.all(np.isfinite(actions)):
            raise api.NonFiniteOutput("the model produced NaN or Inf actions; nothing is sent to the robot")
        clipped = int(np.count_nonzero(embodiment.out_of_limits(actions)))
        actions = embodiment.clip_to_limits(actions)

        stage_ms = {stage: out.timings_ms[stage] for stage in STAGES}
        stage_ms["prefill"] += prefill_ms
        stage_ms["queue"] = started_ms - request.arrived_ms
        frames = None
        if session.preview:  # inside the tick: the plan reserved this stage, the guard kept time for it
            clock = self.clock()
            frames = self.pipeline.decode_video(out.latents)
            stage_ms[PREVIEW_STAGE] = self.clock() - clock
        total_ms = self.clock() - request.arrived_ms
        batch_size = 1 if batcher is None else batcher.participants
        tick = self._record(session, plan, guard, out, stage_ms, total_ms, request.deadline_ms, clipped, learn_key,
                            batch_size, prefill)
        return api.ActResult(actions=actions.astype(np.float32), first_step_index=observation.step_index,
                             tick=tick, preview_frames=frames)

    def _prompt_ready(self, session: SessionState, embodiment: Embodiment, passes: int,
                      canvas_hw: tuple[int, int]) -> bool:
        key = self.pipeline.prompt_key(session.instruction, embodiment, session.chunk_size, passes == 2, canvas_hw)
        return session.prompt is not None and session.prompt.key == key

    def _prefill(self, session: SessionState, embodiment: Embodiment, passes: int, canvas_hw: tuple[int, int]) -> float:
        """Prefill the text K/V of the session's instruction for frames on `canvas_hw`; returns the ms spent."""
        started = self.clock()
        session.prompt = self.pipeline.encode_prompt(session.instruction, embodiment, session.chunk_size,
                                                     passes == 2, canvas_hw)
        return self.clock() - started

    def _grid_keys(self, key: tuple, grid: tuple[int, int], unused: set[str]) -> tuple[tuple, tuple]:
        """`(the key a tick's costs teach, the key it is planned with)` for frames making latent `grid` under the
        full-grid cost key `key`, for a tick that skips the `unused` stages. A smaller grid has costs of its own;
        until its calls have been seen `GRID_SAMPLES` times, and every stage the tick runs at least once, the
        tick is planned at the full grid's, the most it can cost."""
        if grid == self._full_grid:
            return key, key
        grid_key = (*key, grid)
        seen = self.cost_model.samples(grid_key)
        stages = set(self.cost_model.samples(key)) - {"full", "skip"} - unused
        known = seen["full"] >= GRID_SAMPLES and stages <= set(seen)
        return grid_key, grid_key if known else key

    def _record(self, session: SessionState, plan, guard, out: PolicyOutput, stage_ms: dict[str, float],
                total_ms: float, deadline_ms: float, clipped: int, key: Hashable, batch_size: int,
                prefilled: bool) -> api.TickRecord:
        """The tick's record; `total_ms` and `deadline_ms` both count from the tick's arrival; its costs teach
        `key`. A tick that ran in a micro-batch does not teach the cost model single-tick costs."""
        cache = out.cache
        sequences = {branch: cache.sequence(branch) for branch in cache.branches}
        knobs = {"num_steps": float(len(out.steps)), "clipped_actions": float(clipped),
                 "batch_size": float(batch_size), "slot_ms": session.slot_ms}
        learn_costs = batch_size == 1
        if plan is None:
            if learn_costs:
                self._observe_output(key, out, stage_ms, prefilled)
            return api.TickRecord(
                budget_ms=session.budget_ms, deadline_ms=deadline_ms, actual_ms={**stage_ms, "total": total_ms},
                knobs=knobs, full_calls=cache.full_calls, skipped_calls=cache.skipped_calls,
                deadline_met=total_ms <= deadline_ms,
                setting="uncacheable" if self.settings.diffusion_cache else "disabled",
                sequences=sequences, branches=cache.counts_dict(),
            )
        stages = {k: v for k, v in stage_ms.items() if k != "queue"}
        record: BudgetTickRecord = self.budget.finish(key, plan, guard, session.history, cache.counts_dict(),
                                                      stages, actual_ms=total_ms, sequences=sequences,
                                                      learn_costs=learn_costs, prefilled=prefilled)
        knobs.update(cap=float(plan.cap), cfg_steps=float(plan.cfg_steps),
                     threshold=max(plan.thresholds, default=0.0), expected_full_calls=float(plan.expected_full_calls))
        return api.TickRecord(
            budget_ms=session.budget_ms,
            deadline_ms=deadline_ms,
            predicted_ms={**plan.predicted_stage_ms, "total": plan.predicted_ms},
            actual_ms={**stage_ms, "total": total_ms},
            knobs=knobs,
            full_calls=record.full_calls,
            skipped_calls=record.skipped_calls,
            forced_skips=cache.forced_skips,
            fail_open=cache.fail_opens,
            fallbacks=record.fallbacks,
            deadline_met=total_ms <= deadline_ms,
            setting=plan.setting,
            thresholds=tuple(plan.thresholds),
            branches=cache.counts_dict(),
            sequences=sequences,
            feasible=plan.feasible,
            best_achievable_ms=plan.best_achievable_ms,
        )

    def _observe_output(self, key: Hashable, out: PolicyOutput, stage_ms: dict[str, float], prefilled: bool) -> None:
        """Feed a tick run without the guard (warmup, cache disabled) to the cost model."""
        calls = [(d.full, out.steps[d.step].ms[d.branch]) for d in out.cache.decisions]
        stages = ("encode", "prefill", "decode", PREVIEW_STAGE) if prefilled else ("encode", "decode", PREVIEW_STAGE)
        self.cost_model.observe_tick(key, calls, {stage: stage_ms[stage] for stage in stages if stage in stage_ms})

    def _budget_controlled(self) -> bool:
        """Whether ticks are planned and guarded: the cache is on and the step count leaves steps between
        the always-full first and last ones (with 1 or 2 steps nothing can be skipped)."""
        return self.settings.diffusion_cache and self.pipeline.config.num_steps > 2

    def _passes(self) -> int:
        return 2 if self.pipeline.config.guidance != 1.0 else 1

    def cost_key(self, embodiment: str, chunk: int, instruction_tokens: int) -> tuple[int, bool, int]:
        """What a tick's costs depend on: the video's latent frames, whether a state row comes with the actions,
        and the instruction-length group. Embodiments alike in these share costs."""
        group = next(bound for bound in INSTRUCTION_TOKEN_GROUPS if instruction_tokens <= bound)
        return self.pipeline.num_latent_frames(chunk), self._embodiments[embodiment].state_dim > 0, group

    def _instruction_tokens(self, text: str, field: str) -> int:
        """Token count of an instruction; InvalidArgument over the limit."""
        count = len(self.pipeline.tokenizer.tokenize(text))
        if count > MAX_INSTRUCTION_TOKENS:
            raise api.InvalidArgument(field, f"at most {MAX_INSTRUCTION_TOKENS} tokens", f"{count} tokens",
                                      reason="TOO_LONG")
        return count

    def _require_ready(self) -> None:
        if self._closing.is_set():
            raise api.ShuttingDown()
        if self._warmup_error is not None:
            raise RuntimeError("the engine failed to warm up") from self._warmup_error
        if not self._ready.is_set():
            raise api.WarmingUp(progress=self._warm_progress)

    # ------------------------------------------------------------------------------ warmup

    def _warmup(self) -> Iterator[None]:
        """Fill the cost model for every cost key served, one tick per step, then time the reasoner's steps and
        the pieces of dynamics calls (what a tick may find running).
        The first served embodiment's default shape runs `warmup_ticks` full ticks per mode for the latency
        profile in `info()`; every other key one short tick per mode (costs are learned per call and stage,
        so a few sampler steps teach them as well as all of them)."""
        shapes = self._warm_shapes()
        profile = []
        for index, (embodiment, chunk, tokens, default) in enumerate(shapes):
            ticks, steps = (self.settings.warmup_ticks, None) if default else (1, _SHORT_WARMUP_STEPS)
            points = yield from self._warm_shape(embodiment, chunk, tokens, ticks, steps)
            if default:
                profile.extend(points)
            self._warm_progress = (index + 1) / (len(shapes) + 1)
        self._profile = tuple(profile)
        self._interpolate_costs()
        reasoner_ms = yield from self._time_reasoner_steps()
        # A server without dynamics calls need not reserve for their longest piece (the frames' decode).
        dynamics_ms = (yield from self._time_dynamics_pieces()) if self.settings.max_dynamics_calls else 0.0
        self._blocking_ms = max(reasoner_ms, dynamics_ms)
        self._warm_progress = 1.0
        self._ready.set()

    def _warmup_failed(self, error: BaseException) -> None:
        self._warmup_error = error  # surfaced by wait_ready() and every request
        self._ready.set()

    def _warm_shapes(self) -> list[tuple[Embodiment, int, int, bool]]:
        """`(embodiment, chunk, instruction tokens, is the default shape)` to measure, the default first: each
        key at the largest chunk any served embodiment asks with it, at its longest instruction. Of the keys
        that differ only in latent frames, the fewest and the most frames and every served embodiment's default
        chunk are measured; the rest are interpolated (`_interpolate_costs`)."""
        first = next(iter(self._embodiments.values()))
        default_key = self.cost_key(first.name, first.default_chunk_size, 0)
        shapes: dict[tuple, tuple[Embodiment, int, int, bool]] = {
            default_key: (first, first.default_chunk_size, INSTRUCTION_TOKEN_GROUPS[0], True)}
        every = self._all_shapes()
        measured = {self.cost_key(e.name, e.default_chunk_size, tokens)
                    for e in self._embodiments.values() for tokens in INSTRUCTION_TOKEN_GROUPS}
        for family in {key[1:] for key in every}:
            frames = sorted(key[0] for key in every if key[1:] == family)
            measured |= {(frames[0], *family), (frames[-1], *family)}
        for key in sorted(measured - {default_key}):
            shapes[key] = every[key]
        return list(shapes.values())

    def _all_shapes(self) -> dict[tuple, tuple[Embodiment, int, int, bool]]:
        """Every cost key served, at the largest chunk any served embodiment asks with it."""
        shapes: dict[tuple, tuple[Embodiment, int, int, bool]] = {}
        for embodiment in self._embodiments.values():
            for chunk in range(1, embodiment.max_chunk_size + 1):
                for tokens in INSTRUCTION_TOKEN_GROUPS:
                    key = self.cost_key(embodiment.name, chunk, tokens)
                    if chunk >= shapes.get(key, (None, 0))[1]:
                        shapes[key] = (embodiment, chunk, tokens, False)
        return shapes

    def _interpolate_costs(self) -> None:
        """Costs of the keys warmup did not run, linear in latent frames between the measured keys on either
        side. A tick's cost is convex in its tokens (attention is quadratic), so the chord overestimates: such
        a key starts out cautious, and its own ticks replace the estimate as they run."""
        keys = list(self._all_shapes())
        for key in keys:
            if self.cost_model.is_warm(key):
                continue
            family = [k for k in keys if k[1:] == key[1:] and self.cost_model.is_warm(k)]
            low = max((k for k in family if k[0] < key[0]), key=lambda k: k[0])
            high = min((k for k in family if k[0] > key[0]), key=lambda k: k[0])
            full, skip, stages = _interpolated(self.cost_model.costs(low), self.cost_model.costs(high),
                                               (key[0] - low[0]) / (high[0] - low[0]))
            self.cost_model.observe_tick(key, [(True, full), (False, skip)], stages)

    def _warm_shape(self, embodiment: Embodiment, chunk: int, tokens: int, ticks: int, steps: int | None):
        """Uncached ticks time full calls and the fixed stages, maximally cached ticks time skipped calls
        (`steps`: sampler steps per tick, None for the configured number). Yields after each tick; returns the
        two latency profile points."""
        key = self.cost_key(embodiment.name, chunk, tokens)
        instruction = self._text_of(tokens)
        profile = []
        for mode in ("uncached", "max_caching"):
            totals, full, skipped = [], 0, 0
            for tick in range(ticks):
                out = self._warmup_tick(embodiment, chunk, instruction, mode, tick, steps)
                stage_ms = {stage: out.timings_ms[stage] for stage in STAGES}
                stage_ms[PREVIEW_STAGE] = self._preview_ms(out.latents)
                self._observe_output(key, out, stage_ms, prefilled=True)
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
        latent shape (it depends on nothing else, and long clips take the longest of the warmup)."""
        shape = tuple(latents.shape)
        if shape not in self._preview_costs:
            clock = self.clock()
            self.pipeline.decode_video(latents)
            self._preview_costs[shape] = self.clock() - clock
        return self._preview_costs[shape]

    def _warmup_tick(self, embodiment: Embodiment, chunk: int, instruction: str, mode: str, tick: int,
                     steps: int | None) -> PolicyOutput:
        height, width = self.pipeline.config.canvas_hw
        rng = np.random.default_rng(tick)
        images = {name: rng.integers(0, 256, (height, width // len(embodiment.cameras), 3), dtype=np.uint8)
                  for name in embodiment.cameras}
        state = np.zeros(embodiment.state_dim, np.float32) if embodiment.state_dim else None
        request = PolicyRequest(images=images, instruction=instruction, embodiment=embodiment.name, state=state,
                                chunk_size=chunk, seed=tick,
                                num_steps=None if steps is None else min(steps, self.pipeline.config.num_steps))
        controller = NoCache() if mode == "uncached" else SeaCache(
            SeaCacheConfig(threshold=MAX_CACHING.threshold, max_consecutive_cached=MAX_CACHING.cap),
            sea_filter=self._sea_filter)
        return self.pipeline(request, controller=controller, should_abort=self._closing.is_set)

    def _text_of(self, tokens: int) -> str:
        """An instruction of about `tokens` tokens (at most that many)."""
        tokenizer = self.pipeline.tokenizer
        ids = tokenizer.tokenize("reach the red circle and then the blue square " * tokens)
        text = tokenizer.decode(ids[:tokens]).strip()
        while len(tokenizer.tokenize(text)) > tokens:
            text = text[:-1]
        return text

    def _time_reasoner_steps(self):
        """The longest step of a reasoner call at the prompt limit (ms): a prefill chunk or a token."""
        config = self.pipeline.transformer.config
        ids = torch.arange(MAX_PROMPT_TOKENS) % config.vocab_size
        stream = ReasonerStream(self.pipeline.transformer, ids, max_new_tokens=4)
        longest = 0.0
        while not stream.done:
            started = self.clock()
            stream.step()
            longest = max(longest, self.clock() - started)
            yield
        return longest

    def _time_dynamics_pieces(self):
        """The longest piece (ms) of a forward and an inverse dynamics call at the longest clip any served
        embodiment asks for and the longest instruction. A few sampler steps suffice: each is one piece."""
        embodiment = max(self._embodiments.values(), key=lambda e: e.max_chunk_size)
        chunk = embodiment.max_chunk_size
        height, width = self.pipeline.config.canvas_hw
        frames = np.zeros((chunk + 1, height, width // len(embodiment.cameras), 3), np.uint8)
        cameras = {name: frames for name in embodiment.cameras}
        video = np.concatenate(list(cameras.values()), axis=2)
        common = dict(instruction=self._text_of(MAX_INSTRUCTION_TOKENS), embodiment=embodiment.name,
                      state=np.zeros(embodiment.state_dim, np.float32) if embodiment.state_dim else None,
                      chunk_size=chunk, num_steps=min(3, self.pipeline.config.num_steps))
        calls = (
            (PolicyRequest(images={name: frames[0] for name in cameras}, mode="forward_dynamics",
                           actions=np.zeros((chunk, embodiment.raw_action_dim), np.float32), **common), True),
            (PolicyRequest(images={}, mode="inverse_dynamics", video=video, **common), False),
        )
        canvas_hw = self.pipeline.canvas_for(embodiment, {name: frames[0] for name in cameras})
        longest = 0.0
        for request, decode_frames in calls:
            job = _SteppedCall(self._dynamics_work(embodiment, request, canvas_hw, decode_frames, None, self.clock()))
            finished = False
            while not finished:
                started = self.clock()
                finished = job.step()
                longest = max(longest, self.clock() - started)
                yield
            job.result.result()  # a failure fails the warmup
        return longest

    # ------------------------------------------------------------------------------ forward / inverse dynamics

    def forward_dynamics(self, session_id: str, epoch: int, observation: api.Observation, actions: np.ndarray,
                         seed: int | None = None, deadline_s: float | None = None,
                         should_abort: Callable[[], bool] | None = None) -> api.PredictedVideo:
        session, embodiment, instruction = self._dynamics_session(session_id, epoch, observation.instruction,
                                                                  "observation.instruction")
        request = PolicyRequest(images=observation.images, instruction=instruction, embodiment=session.embodiment,
                                state=observation.state, mode="forward_dynamics", chunk_size=session.chunk_size,
                                seed=session.seed if seed is None else seed, actions=actions)
        canvas_hw = self.pipeline.canvas_for(embodiment, observation.images)
        out, frames, tick = self._run_dynamics(session, embodiment, request, canvas_hw, True, deadline_s, should_abort)
        return api.PredictedVideo(frames=frames, latents_shape=tuple(out.latents.shape), tick=tick)

    def inverse_dynamics(self, session_id: str, epoch: int, clip: api.VideoClip, seed: int | None = None,
                         deadline_s: float | None = None,
                         should_abort: Callable[[], bool] | None = None) -> api.ActResult:
        session, embodiment, instruction = self._dynamics_session(session_id, epoch, clip.instruction, "instruction")
        cameras = [clip.frames[name] for name in embodiment.cameras]
        # Side by side, frame by frame, as a tick sees its cameras.
        video = np.concatenate(cameras, axis=2) if len(cameras) > 1 else cameras[0]
        request = PolicyRequest(images={}, instruction=instruction, embodiment=session.embodiment, state=clip.state,
                                mode="inverse_dynamics", chunk_size=session.chunk_size,
                                seed=session.seed if seed is None else seed, video=video)
        canvas_hw = self.pipeline.canvas_for(embodiment, {name: clip.frames[name][0] for name in embodiment.cameras})
        out, _, tick = self._run_dynamics(session, embodiment, request, canvas_hw, False, deadline_s, should_abort)
        if not np.all(np.isfinite(out.actions)):
            raise api.NonFiniteOutput("the model produced NaN or Inf actions")
        clipped = int(np.count_nonzero(embodiment.out_of_limits(out.actions)))
        tick = dataclasses.replace(tick, knobs={**tick.knobs, "clipped_actions": float(clipped)})
        return api.ActResult(actions=embodiment.clip_to_limits(out.actions).astype(np.float32),
                             first_step_index=clip.step_index, tick=tick)

    def _dynamics_session(self, session_id: str, epoch: int, instruction: str,
                          field: str) -> tuple[SessionState, Embodiment, str]:
        """The session a dynamics call runs on, its embodiment, and the call's instruction (else the session's)."""
        self._require_ready()
        session = self.sessions.get(session_id)
        if epoch != session.epoch:
            raise api.StaleEpoch(session_id, session.epoch, epoch)
        if instruction:
            self._instruction_tokens(instruction, field)
        return session, self._embodiments[session.embodiment], instruction or session.instruction

    def _run_dynamics(self, session: SessionState, embodiment: Embodiment, request: PolicyRequest,
                      canvas_hw: tuple[int, int], decode_frames: bool, deadline_s: float | None,
                      should_abort: Callable[[], bool] | None,
                      ) -> tuple[PolicyOutput, np.ndarray | None, api.TickRecord]:
        """Run a dynamics request uncached at the configured step count, as background work between ticks (at most
        `max_dynamics_calls` at once), within the caller's deadline and `MAX_DYNAMICS_MS`. Returns the pipeline
        output, the decoded frames (`decode_frames`) and the record."""
        arrived_ms = self.clock()
        bound_s = time.monotonic() + MAX_DYNAMICS_MS / 1e3
        deadline_s = bound_s if deadline_s is None else min(deadline_s, bound_s)
        deadline_ms = (deadline_s - time.monotonic()) * 1e3
        if not self.settings.max_dynamics_calls:
            raise api.DynamicsOff()
        if not self._dynamics_calls.acquire(blocking=False):  # released when the call ends, however it ends
            raise api.TooManyDynamicsCalls(self.settings.max_dynamics_calls)
        job = _SteppedCall(self._dynamics_work(embodiment, request, canvas_hw, decode_frames, session.prompt,
                                               arrived_ms))
        job.result.add_done_callback(lambda _: self._dynamics_calls.release())
        try:
            self._worker.submit(job)
        except api.ShuttingDown as error:
            job.fail(error)
            raise

        def stopped() -> api.EngineError | None:
            if self._closing.is_set():
                return api.ShuttingDown()
            if time.monotonic() >= deadline_s:
                return api.DeadlineExpired(f"the call's deadline passed (the caller's, or the server's bound of "
                                           f"{MAX_DYNAMICS_MS / 1e3:g} s)")
            if should_abort is not None and should_abort():
                return api.Cancelled("the caller went away")
            return None

        while True:
            try:
                out, frames, stage_ms = job.result.result(timeout=_POLL_S)
                break
            except FutureTimeout:
                # Ticks go first, so the call may wait long between pieces: it ends between two of them.
                if (reason := stopped()) is not None and self._worker.withdraw(job):
                    job.fail(reason)
        total_ms = self.clock() - arrived_ms
        cache = out.cache
        tick = api.TickRecord(
            budget_ms=MAX_DYNAMICS_MS, deadline_ms=deadline_ms, actual_ms={**stage_ms, "total": total_ms},
            knobs={"num_steps": float(len(out.steps)), "batch_size": 1.0}, full_calls=cache.full_calls,
            skipped_calls=cache.skipped_calls, fail_open=cache.fail_opens, deadline_met=total_ms <= deadline_ms,
            setting="none", branches=cache.counts_dict(),
            sequences={branch: cache.sequence(branch) for branch in cache.branches},
        )
        return out, frames, tick

    def _dynamics_work(self, embodiment: Embodiment, request: PolicyRequest, canvas_hw: tuple[int, int],
                       decode_frames: bool, prompt: PromptState | None, arrived_ms: float):
        """The `_SteppedCall` work of one dynamics call. Its pieces: the prefill (unless `prompt`, the
        session's text K/V, fits), the encode, each sampler step, the frames' decode. The work returns the
        pipeline output, the frames (or None) and the ms per stage, the waits since `arrived_ms` before and
        between its pieces as "queue"."""
        cfg = self._passes() == 2

        def work(pause: Callable[[], None]):
            def wait() -> float:
                clock = self.clock()
                pause()
                return self.clock() - clock

            stage_ms = {"queue": self.clock() - arrived_ms, "prefill": 0.0}
            key = self.pipeline.prompt_key(request.instruction, embodiment, request.chunk_size, cfg, canvas_hw)
            text = prompt
            if text is None or text.key != key:
                clock = self.clock()
                text = self.pipeline.encode_prompt(request.instruction, embodiment, request.chunk_size, cfg, canvas_hw)
                stage_ms["prefill"] = self.clock() - clock
                stage_ms["queue"] += wait()
            pacer = _PauseEachStep(wait)
            out = self.pipeline(request, prompt=text, pacer=pacer)
            stage_ms.update(encode=out.timings_ms["encode"], denoise=out.timings_ms["denoise"] - pacer.paused_ms,
                            decode=out.timings_ms["decode"])
            stage_ms["prefill"] += out.timings_ms["prefill"]
            stage_ms["queue"] += pacer.paused_ms
            frames = None
            if decode_frames:
                stage_ms["queue"] += wait()
                clock = self.clock()
                frames = self.pipeline.decode_video(out.latents)
                stage_ms["video_decode"] = self.clock() - clock
            return out, frames, stage_ms

        return work

    # ------------------------------------------------------------------------------ reasoner

    def reason(self, prompt: str, max_new_tokens: int, temperature: float = 0.0, seed: int | None = None,
               should_abort: Callable[[], bool] | None = None, deadline_s: float | None = None) -> Iterator[str]:
        """Autoregressive text over the UND weights with a KV cache; never touches the diffusion cache."""
        self._require_ready()
        tokenizer = self.pipeline.tokenizer
        count = len(tokenizer.tokenize(prompt))
        if count > MAX_PROMPT_TOKENS:
            raise api.InvalidArgument("prompt", f"at most {MAX_PROMPT_TOKENS} tokens", f"{count} tokens",
                                      reason="TOO_LONG")
        ids = torch.tensor(tokenizer.tokenize(tokenizer.apply_chat_template([{"role": "user", "content": prompt}])),
                           dtype=torch.long)
        stops = {tokenizer.eos_token_id, *tokenizer.special_token_ids.values()}
        stream = ReasonerStream(self.pipeline.transformer, ids, min(max_new_tokens, self.settings.max_reason_tokens),
                                temperature=temperature, stop_token_ids=stops, seed=seed or 0)
        if not self._reason_calls.acquire(blocking=False):  # released by finish(), whatever ends the call
            raise api.TooManyReasonCalls(self.settings.max_reason_calls)
        pieces: queue.Queue = queue.Queue()
        done = object()

        def stopped() -> api.EngineError | None:
            """Why the call must end now, if it must."""
            if self._closing.is_set():
                return api.ShuttingDown()
            if deadline_s is not None and time.monotonic() >= deadline_s:
                return api.DeadlineExpired("the caller's deadline passed during reasoning")
            if should_abort is not None and should_abort():
                return api.Cancelled("the caller went away")
            return None

        def steps() -> Iterator[None]:
            produced: list[int] = []
            emitted = ""
            while not stream.done:
                if (reason := stopped()) is not None:
                    raise reason
                token = stream.step()
                if token is not None and token not in stops:
                    produced.append(token)
                    decoded = tokenizer.decode(produced)
                    if len(decoded) > len(emitted) and not decoded.endswith("\ufffd"):
                        pieces.put(decoded[len(emitted):])
                        emitted = decoded
                yield
            finish(done)

        def finish(last: object) -> None:
            pieces.put(last)
            self._reason_calls.release()

        job = GeneratorJob(steps(), finish)
        try:
            self._worker.submit(job)
        except api.ShuttingDown:
            self._reason_calls.release()
            raise

        def stream_pieces() -> Iterator[str]:
            # Ticks go first, so a busy worker may not step this job for a long time: the caller's deadline
            # and departure are also watched here, and end the job between two of its steps.
            while True:
                try:
                    item = pieces.get(timeout=_POLL_S)
                except queue.Empty:
                    if (reason := stopped()) is not None and self._worker.withdraw(job):
                        job.fail(reason)
                    continue
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item

        return stream_pieces()


def _interpolated(low: CallCosts, high: CallCosts, weight: float) -> tuple[float, float, dict[str, float]]:
    """`(full ms, skip ms, stage ms)` a `weight` of the way from `low`'s costs to `high`'s."""
    def lerp(a: float, b: float) -> float:
        return a + weight * (b - a)

    stages = {stage: lerp(ms, high.fixed_ms[stage]) for stage, ms in low.fixed_ms.items() if stage in high.fixed_ms}
    return lerp(low.full_ms, high.full_ms), lerp(low.skip_ms, high.skip_ms), stages


def settings_from_config(config) -> EngineSettings:
    """EngineSettings from the CLI's `ServerConfig`."""
    return EngineSettings(
        default_budget_ms=config.latency_budget_ms,
        max_sessions=config.max_sessions,
        max_batch=config.max_batch,
        max_dynamics_calls=config.max_dynamics_calls,
        diffusion_cache=config.diffusion_cache,
        cache_threshold=config.diffusion_cache_thresh,
        residual_order=config.diffusion_cache_residual_order,
        max_consecutive_cached=config.diffusion_cache_max_consecutive,
    )


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """A `--dtype` name (`config.DTYPES`) on a resolved device: auto is bf16 on CUDA, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return _DTYPES[name]
