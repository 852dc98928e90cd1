"""`ModelEngine`: the `Engine` the transport calls, backed by one `PolicyPipeline` on one device.

One worker thread owns the model; requests queue in front of it, and queued ticks of one shape from
different sessions start together as a micro-batch (`engine/batching.py`). A control tick is planned
against the smaller of the session's budget and the caller's deadline, counting the time it waited in
the queue: the budget planner picks this tick's cache setting, its deadline guard arms, SeaCache runs
with the guard's force-skip hook, and the guard paces the sampler (drops the uncond pass or ends the
loop early when a stall leaves no other way to the deadline). The finished tick feeds the cost model
and the session's history, and the answer carries the full record of why it was as fast as it was.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from policy_server.budget.cost_model import CostModel
from policy_server.budget.guard import monotonic_ms
from policy_server.budget.planner import MAX_CACHING, CacheSetting, PlannerConfig
from policy_server.budget.record import TickRecord as BudgetTickRecord
from policy_server.budget.tick import TickBudget
from policy_server.cache.controller import NoCache, StepController
from policy_server.cache.sea_filter import SeaFilter
from policy_server.cache.seacache import SeaCache, SeaCacheConfig
from policy_server.engine import api
from policy_server.engine.batching import StackBatcher
from policy_server.engine.sessions import Session, SessionTable
from policy_server.pipeline.embodiments import Embodiment
from policy_server.pipeline.policy import Aborted, PolicyOutput, PolicyPipeline, PolicyRequest
from policy_server.pipeline.reasoner import generate

STAGES = ("encode", "prefill", "denoise", "decode")


@dataclass(frozen=True)
class EngineSettings:
    """Serving knobs. `cache_threshold` / `max_consecutive_cached` define the middle of the planner's ladder
    (the published Cosmos3 default 0.25 / 2); `full_call_delay_ms` injects an artificial slowdown per full
    GEN-stack call (benchmarks and fault drills). `max_batch`: the most queued ticks of one shape that run
    together as a micro-batch (1 = one tick at a time)."""

    default_budget_ms: float = 120.0
    max_sessions: int = 4
    diffusion_cache: bool = True
    cache_threshold: float = 0.25
    residual_order: int = 1
    max_consecutive_cached: int = 2
    warmup_ticks: int = 4
    max_reason_tokens: int = 256
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


@dataclass
class _TickJob:
    """A queued control tick and the future its caller waits on."""

    session: Session
    epoch: int
    observation: api.Observation
    arrived_ms: float
    deadline_s: float | None
    should_abort: Callable[[], bool] | None
    result: Future = field(default_factory=Future)

    @property
    def shape(self) -> tuple[str, int]:
        return self.session.embodiment, self.session.chunk_size


class ModelEngine:
    """Thread-safe `Engine` over a `PolicyPipeline`. Call `start()` to load the worker and warm up."""

    def __init__(self, pipeline: PolicyPipeline, settings: EngineSettings | None = None,
                 clock: Callable[[], float] = monotonic_ms):
        self.pipeline = pipeline
        self.settings = settings or EngineSettings()
        self.clock = clock
        self.sessions = SessionTable(self.settings.max_sessions)
        self.cost_model = CostModel()
        planner = PlannerConfig(ladder=cache_ladder(self.settings.cache_threshold,
                                                    self.settings.max_consecutive_cached))
        self.budget = TickBudget(self.cost_model, planner, clock=clock, post_stages=("decode",))
        self.full_call_delay_ms = self.settings.full_call_delay_ms
        self._sea_filter = SeaFilter()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-worker")
        # Ticks of a micro-batch run on these threads while the worker waits for them.
        self._batch_threads = ThreadPoolExecutor(max_workers=self.settings.max_batch, thread_name_prefix="tick")
        self._inbox: list[_TickJob] = []  # queued ticks, oldest first; guarded by _queued_lock
        self._queued = 0
        self._queued_lock = threading.Lock()
        self._ready = threading.Event()
        self._warm_progress = 0.0
        self._warmup_error: BaseException | None = None
        self._profile: tuple[api.ProfilePoint, ...] = ()
        self._embodiments = {name: pipeline.embodiments.get(name) for name in pipeline.served_embodiments}
        # The pipeline output of the latest tick (generated latents, step records), for benchmarks.
        self.last_output: PolicyOutput | None = None

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Warm up in the background; `ready()` turns True when the cost model is filled."""
        self._worker.submit(self._warmup)

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        if not self._ready.wait(timeout_s):
            return False
        if self._warmup_error is not None:
            raise RuntimeError("warmup failed") from self._warmup_error
        return True

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
        self._batch_threads.shutdown(wait=True)
        with self._queued_lock:
            left, self._inbox = self._inbox, []
        for job in left:  # their worker calls were cancelled: answer the callers instead of leaving them waiting
            job.result.set_exception(api.Cancelled("the engine shut down before this tick ran"))

    def ready(self) -> bool:
        return self._ready.is_set() and self._warmup_error is None

    def stats(self) -> api.EngineStats:
        return api.EngineStats(sessions=len(self.sessions), queue_depth=self._queued,
                               warmup_progress=self._warm_progress)

    def info(self) -> api.ServerInfo:
        config = self.pipeline.config
        return api.ServerInfo(
            model_name=config.name,
            embodiments=tuple(self._spec(e) for e in self._embodiments.values()),
            default_budget_ms=self.settings.default_budget_ms,
            max_sessions=self.settings.max_sessions,
            device=str(self.pipeline.device),
            max_reason_tokens=self.settings.max_reason_tokens,
            warmup_profile=self._profile,
            num_steps=config.num_steps,
            diffusion_cache=self.settings.diffusion_cache,
        )

    def _spec(self, embodiment: Embodiment) -> api.EmbodimentSpec:
        height, width = self.pipeline.config.canvas_hw
        cameras = tuple(api.CameraSpec(name, height, width // len(embodiment.cameras))
                        for name in embodiment.cameras)
        return api.EmbodimentSpec(
            name=embodiment.name,
            cameras=cameras,
            state_dim=embodiment.state_dim,
            action=api.ActionSpec(
                dim=embodiment.raw_action_dim, names=tuple(embodiment.action_names),
                units=",".join(embodiment.action_units),
                low=tuple(embodiment.action_low or ()), high=tuple(embodiment.action_high or ()),
            ),
            default_chunk_size=embodiment.default_chunk_size,
            max_chunk_size=embodiment.max_chunk_size,
            control_hz=embodiment.fps,
        )

    # ------------------------------------------------------------------------------ sessions

    def open_session(self, embodiment: str, instruction: str, budget_ms: float | None = None,
                     chunk_size: int | None = None, seed: int | None = None) -> api.SessionHandle:
        self._require_ready()
        if embodiment not in self._embodiments:
            raise api.UnknownEmbodiment(embodiment, tuple(self._embodiments))
        spec = self._embodiments[embodiment]
        chunk = spec.default_chunk_size if chunk_size is None else chunk_size
        budget = self.settings.default_budget_ms if budget_ms is None else budget_ms
        spec.check_chunk_size(chunk)
        if self._budget_controlled() and not self.cost_model.is_warm(self._cost_key(embodiment, chunk)):
            self._submit(self._warm_shape, spec, chunk)  # a chunk size warmup did not cover
        self._check_feasible(embodiment, chunk, budget)
        session = self.sessions.open(embodiment=embodiment, instruction=instruction, budget_ms=budget,
                                     chunk_size=chunk, seed=0 if seed is None else seed)
        return session.handle()

    def session(self, session_id: str) -> api.SessionHandle:
        return self.sessions.get(session_id).handle()

    def reset_session(self, session_id: str) -> api.SessionHandle:
        return self.sessions.reset(session_id).handle()

    def close_session(self, session_id: str) -> None:
        self.sessions.close(session_id)

    def set_budget(self, session_id: str, budget_ms: float) -> api.SessionHandle:
        session = self.sessions.get(session_id)
        self._check_feasible(session.embodiment, session.chunk_size, budget_ms)
        session.budget_ms = budget_ms
        return session.handle()

    def _check_feasible(self, embodiment: str, chunk: int, budget_ms: float) -> None:
        """Reject a budget that even maximal caching plus every fallback is predicted to miss."""
        if not self._budget_controlled():
            return
        key = self._cost_key(embodiment, chunk)
        plan = self.budget.plan(key, budget_ms, self.pipeline.config.num_steps, self._passes(), None)
        if not plan.fits:
            raise api.BudgetInfeasible(budget_ms, plan.predicted_ms)

    # ------------------------------------------------------------------------------ ticks

    def act(self, session_id: str, epoch: int, observation: api.Observation, deadline_s: float | None = None,
            should_abort: Callable[[], bool] | None = None) -> api.ActResult:
        self._require_ready()
        session = self.sessions.get(session_id)
        if epoch != session.epoch:
            raise api.StaleEpoch(session_id, session.epoch, epoch)
        job = _TickJob(session, epoch, observation, self.clock(), deadline_s, should_abort)
        with self._queued_lock:
            self._queued += 1
            self._inbox.append(job)
        job.result.add_done_callback(self._dequeue)
        self._worker.submit(self._run_queued_ticks)
        return job.result.result()

    def _run_queued_ticks(self) -> None:
        """On the worker: run the oldest queued tick, with up to `max_batch - 1` other queued ticks of the same
        shape from other sessions as one micro-batch. (Each `act` queues one call of this; ticks an
        earlier call already took leave it nothing to do.)"""
        with self._queued_lock:
            if not self._inbox:
                return
            batch = [self._inbox.pop(0)]
            for job in list(self._inbox):
                if len(batch) == self.settings.max_batch:
                    break
                if job.shape == batch[0].shape and all(job.session is not b.session for b in batch):
                    batch.append(job)
                    self._inbox.remove(job)
        if len(batch) == 1:
            _settle(batch[0].result, self._tick, batch[0])
            return
        batcher = StackBatcher(self.pipeline.transformer.gen_stack, len(batch))

        def run_in_batch(job: _TickJob) -> None:
            try:
                _settle(job.result, self._tick, job, batcher)
            finally:
                batcher.leave()

        for finished in [self._batch_threads.submit(run_in_batch, job) for job in batch]:
            finished.result()

    def _submit(self, fn, *args):
        """Run `fn(*args)` on the model worker and wait for its result."""
        return self._enqueue(fn, *args).result()

    def _enqueue(self, fn, *args) -> Future:
        """Queue `fn(*args)` on the model worker; the queue depth counts it until it finishes."""
        with self._queued_lock:
            self._queued += 1
        future = self._worker.submit(fn, *args)
        future.add_done_callback(self._dequeue)
        return future

    def _dequeue(self, _: Future) -> None:
        with self._queued_lock:
            self._queued -= 1

    def _tick(self, job: _TickJob, batcher: StackBatcher | None = None) -> api.ActResult:
        """One control tick; `batcher`: the micro-batch's GEN-stack rendezvous when it runs with others."""
        session, epoch, observation = job.session, job.epoch, job.observation
        arrived_ms, deadline_s, should_abort = job.arrived_ms, job.deadline_s, job.should_abort
        if epoch != session.epoch:  # reset while queued
            raise api.StaleEpoch(session.session_id, session.epoch, epoch)
        started_ms = self.clock()
        left_ms = session.budget_ms - (started_ms - arrived_ms)
        if deadline_s is not None:
            caller_left_ms = (deadline_s - time.monotonic()) * 1e3
            if caller_left_ms <= 0:
                raise api.DeadlineExpired("the caller's deadline passed while the request was queued")
            left_ms = min(left_ms, caller_left_ms)
        if observation.instruction:
            session.instruction = observation.instruction
        embodiment = self._embodiments[session.embodiment]
        key = self._cost_key(session.embodiment, session.chunk_size)
        steps, passes = self.pipeline.config.num_steps, self._passes()

        plan = guard = None
        if self._budget_controlled():
            plan = self.budget.plan(key, max(left_ms, 1e-3), steps, passes, session.history)
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

        prefill_ms = self._ensure_prompt(session, embodiment, passes)
        request = PolicyRequest(
            images=observation.images, instruction=session.instruction, embodiment=session.embodiment,
            state=observation.state, chunk_size=session.chunk_size, num_steps=steps,
            seed=session.seed + session.ticks, cfg_steps=cfg_steps,
        )

        def abort() -> bool:
            expired = deadline_s is not None and time.monotonic() >= deadline_s
            return expired or (should_abort is not None and should_abort())

        try:
            out = self.pipeline(request, prompt=session.prompt, controller=controller, should_abort=abort,
                                pacer=guard, stack=None if batcher is None else batcher.run)
        except Aborted as stop:
            if deadline_s is not None and time.monotonic() >= deadline_s:
                raise api.DeadlineExpired(f"the caller's deadline passed: {stop}") from None
            raise api.Cancelled(f"the caller went away: {stop}") from None
        session.ticks += 1
        self.last_output = out

        actions = out.actions
        if not np.all(np.isfinite(actions)):
            raise api.NonFiniteOutput("the model produced NaN or Inf actions; nothing is sent to the robot")
        clipped = int(np.count_nonzero(embodiment.out_of_limits(actions)))
        actions = embodiment.clip_to_limits(actions)

        stage_ms = {stage: out.timings_ms[stage] for stage in STAGES}
        stage_ms["prefill"] += prefill_ms
        stage_ms["queue"] = started_ms - arrived_ms
        total_ms = self.clock() - arrived_ms
        batch_size = 1 if batcher is None else batcher.participants
        tick = self._record(session, plan, guard, out, stage_ms, total_ms, left_ms, clipped, key, batch_size)
        return api.ActResult(actions=actions.astype(np.float32), first_step_index=observation.step_index,
                             tick=tick)

    def _ensure_prompt(self, session: Session, embodiment: Embodiment, passes: int) -> float:
        """Prefill the instruction's text K/V unless the session already holds it; returns the ms spent."""
        key = self.pipeline.prompt_key(session.instruction, embodiment, session.chunk_size, passes == 2)
        if session.prompt is not None and session.prompt.key == key:
            return 0.0
        started = self.clock()
        session.prompt = self.pipeline.encode_prompt(session.instruction, embodiment, session.chunk_size,
                                                     passes == 2)
        return self.clock() - started

    def _record(self, session: Session, plan, guard, out: PolicyOutput, stage_ms: dict[str, float],
                total_ms: float, left_ms: float, clipped: int, key: Hashable, batch_size: int) -> api.TickRecord:
        """The tick's record; a tick that ran in a micro-batch does not teach the cost model single-tick costs."""
        cache = out.cache
        sequences = {branch: cache.sequence(branch) for branch in cache.branches}
        knobs = {"num_steps": float(len(out.steps)), "clipped_actions": float(clipped),
                 "batch_size": float(batch_size)}
        learn_costs = batch_size == 1
        if plan is None:
            if learn_costs:
                self._observe_output(key, out, stage_ms)
            return api.TickRecord(
                budget_ms=session.budget_ms, deadline_ms=left_ms, actual_ms={**stage_ms, "total": total_ms},
                knobs=knobs, full_calls=cache.full_calls, skipped_calls=cache.skipped_calls,
                deadline_met=total_ms <= left_ms,
                setting="uncacheable" if self.settings.diffusion_cache else "disabled",
                sequences=sequences, branches=cache.counts_dict(),
            )
        stages = {k: v for k, v in stage_ms.items() if k != "queue"}
        record: BudgetTickRecord = self.budget.finish(key, plan, guard, session.history, cache.counts_dict(),
                                                      stages, actual_ms=total_ms, sequences=sequences,
                                                      learn_costs=learn_costs)
        knobs.update(cap=float(plan.cap), cfg_steps=float(plan.cfg_steps),
                     threshold=max(plan.thresholds, default=0.0), expected_full_calls=float(plan.expected_full_calls))
        return api.TickRecord(
            budget_ms=session.budget_ms,
            deadline_ms=left_ms,
            predicted_ms={**plan.predicted_stage_ms, "total": plan.predicted_ms},
            actual_ms={**stage_ms, "total": total_ms},
            knobs=knobs,
            full_calls=record.full_calls,
            skipped_calls=record.skipped_calls,
            forced_skips=cache.forced_skips,
            fail_open=cache.fail_opens,
            fallbacks=record.fallbacks,
            deadline_met=total_ms <= left_ms,
            setting=plan.setting,
            thresholds=tuple(plan.thresholds),
            branches=cache.counts_dict(),
            sequences=sequences,
            feasible=plan.feasible,
            best_achievable_ms=plan.best_achievable_ms,
        )

    def _observe_output(self, key: Hashable, out: PolicyOutput, stage_ms: dict[str, float]) -> None:
        """Feed a tick run without the guard (warmup, cache disabled) to the cost model."""
        calls = [(d.full, out.steps[d.step].ms[d.branch]) for d in out.cache.decisions]
        self.cost_model.observe_calls(key, calls)
        for stage in ("encode", "prefill", "decode"):
            self.cost_model.observe_stage(key, stage, stage_ms[stage])

    def _budget_controlled(self) -> bool:
        """Whether ticks are planned and guarded: the cache is on and the step count leaves steps between
        the always-full first and last ones (with 1 or 2 steps nothing can be skipped)."""
        return self.settings.diffusion_cache and self.pipeline.config.num_steps > 2

    def _passes(self) -> int:
        return 2 if self.pipeline.config.guidance != 1.0 else 1

    @staticmethod
    def _cost_key(embodiment: str, chunk: int) -> tuple[str, int]:
        return (embodiment, chunk)

    def _require_ready(self) -> None:
        if self._warmup_error is not None:
            raise RuntimeError("the engine failed to warm up") from self._warmup_error
        if not self._ready.is_set():
            raise api.WarmingUp(progress=self._warm_progress)

    # ------------------------------------------------------------------------------ warmup

    def _warmup(self) -> None:
        """Warm every served embodiment at its default chunk size; publish the latency profile in `info()`."""
        try:
            embodiments = list(self._embodiments.values())
            profile = []
            for index, embodiment in enumerate(embodiments):
                profile.extend(self._warm_shape(embodiment, embodiment.default_chunk_size))
                self._warm_progress = (index + 1) / len(embodiments)
            self._profile = tuple(profile)
        except BaseException as error:  # surfaced by wait_ready() and every request
            self._warmup_error = error
        finally:
            self._ready.set()

    def _warm_shape(self, embodiment: Embodiment, chunk: int) -> list[api.ProfilePoint]:
        """Fill the cost model for one request shape: uncached ticks time full calls and the fixed stages,
        maximally cached ticks time skipped calls. Returns the two latency profile points."""
        key = self._cost_key(embodiment.name, chunk)
        profile = []
        for mode in ("uncached", "max_caching"):
            totals, full, skipped = [], 0, 0
            for tick in range(self.settings.warmup_ticks):
                out = self._warmup_tick(embodiment, chunk, mode, tick)
                self._observe_output(key, out, {stage: out.timings_ms[stage] for stage in STAGES})
                if tick > 0 or self.settings.warmup_ticks == 1:  # the first tick pays one-time allocation costs
                    totals.append(out.timings_ms["total"])
                full, skipped = out.cache.full_calls, out.cache.skipped_calls
            profile.append(api.ProfilePoint(label=f"{embodiment.name}/{mode}", p50_ms=float(np.median(totals)),
                                            p95_ms=float(np.percentile(totals, 95)), full_calls=full,
                                            skipped_calls=skipped))
        return profile

    def _warmup_tick(self, embodiment: Embodiment, chunk: int, mode: str, tick: int) -> PolicyOutput:
        height, width = self.pipeline.config.canvas_hw
        rng = np.random.default_rng(tick)
        images = {name: rng.integers(0, 256, (height, width // len(embodiment.cameras), 3), dtype=np.uint8)
                  for name in embodiment.cameras}
        state = np.zeros(embodiment.state_dim, np.float32) if embodiment.state_dim else None
        request = PolicyRequest(images=images, instruction="warm up", embodiment=embodiment.name, state=state,
                                chunk_size=chunk, seed=tick)
        controller = NoCache() if mode == "uncached" else SeaCache(
            SeaCacheConfig(threshold=MAX_CACHING.threshold, max_consecutive_cached=MAX_CACHING.cap),
            sea_filter=self._sea_filter)
        return self.pipeline(request, controller=controller)

    # ------------------------------------------------------------------------------ reasoner

    def reason(self, prompt: str, max_new_tokens: int, temperature: float = 0.0, seed: int | None = None,
               should_abort: Callable[[], bool] | None = None) -> Iterator[str]:
        """Autoregressive text over the UND weights with a KV cache; never touches the diffusion cache."""
        self._require_ready()
        limit = min(max_new_tokens, self.settings.max_reason_tokens)
        tokenizer = self.pipeline.tokenizer
        pieces: queue.Queue = queue.Queue()
        done = object()

        def job() -> None:
            try:
                text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                ids = torch.tensor(tokenizer.tokenize(text), dtype=torch.long)
                stops = {tokenizer.eos_token_id, *tokenizer.special_token_ids.values()}
                produced: list[int] = []
                emitted = ""
                for token in generate(self.pipeline.transformer, ids, limit, temperature=temperature,
                                      stop_token_ids=stops, seed=seed or 0):
                    if token in stops or (should_abort is not None and should_abort()):
                        break
                    produced.append(token)
                    decoded = tokenizer.decode(produced)
                    if len(decoded) > len(emitted) and not decoded.endswith("\ufffd"):
                        pieces.put(decoded[len(emitted):])
                        emitted = decoded
                pieces.put(done)
            except BaseException as error:
                pieces.put(error)

        self._enqueue(job)

        def stream() -> Iterator[str]:
            while (item := pieces.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item

        return stream()


def settings_from_config(config) -> EngineSettings:
    """EngineSettings from the CLI's `ServerConfig`."""
    return EngineSettings(
        default_budget_ms=config.latency_budget_ms,
        max_sessions=config.max_sessions,
        max_batch=config.max_batch,
        diffusion_cache=config.diffusion_cache,
        cache_threshold=config.diffusion_cache_thresh,
        residual_order=config.diffusion_cache_residual_order,
        max_consecutive_cached=config.diffusion_cache_max_consecutive,
    )


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _settle(result: Future, fn, *args) -> None:
    """Run `fn(*args)` and put its return value or exception into `result`."""
    try:
        result.set_result(fn(*args))
    except BaseException as error:  # the caller of `act` gets it, the worker keeps serving
        result.set_exception(error)
