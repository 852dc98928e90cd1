"""`ModelEngine`: the `Engine` the transport calls, backed by one `PolicyPipeline` on one device.

A facade: each request goes to the part that owns it. One model worker (`engine/worker.py`) takes all work
off one queue, control ticks first, and is the only thread that runs the model: a tick (`engine/tick.py`), its
frames put on the model's canvas on the caller's thread before it queues, runs alone or, with queued ticks of
one shape from other sessions, as a micro-batch whose full GEN-stack calls run as one stack
(`engine/batching.py`). Reasoner calls (`engine/reasoning.py`) and forward / inverse dynamics calls
(`engine/dynamics.py`) run between ticks, one piece per worker step. Warmup (`engine/warmup.py`) fills the
cost model before `ready()`, and a session is admitted only when every open session's ticks still meet their
budgets (`engine/admission.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_for

import numpy as np
import torch

from policy_server.budget.guard import monotonic_ms
from policy_server.budget.profile import QualityProfile
from policy_server.engine import api
from policy_server.engine.admission import Admission, default_rate_hz
from policy_server.engine.call_end import CallEnd
from policy_server.engine.dynamics import Dynamics
from policy_server.engine.reasoning import Reasoning
from policy_server.engine.served import EngineSettings, ServedModel
from policy_server.engine.sessions import Opening, SessionState, SessionTable
from policy_server.engine.tick import Tick, TickRequest
from policy_server.engine.warmup import Warmup
from policy_server.engine.worker import GeneratorJob, ModelWorker, TickJob
from policy_server.limits import MAX_INSTRUCTION_TOKENS, MAX_PROMPT_TOKENS
from policy_server.pipeline.policy import PolicyPipeline
from policy_server.rate_limiter import RateLimiter
from policy_server.throttled_log import ThrottledLog

logger = logging.getLogger(__name__)
_ABANDONED_WAIT_S = 1.0  # how long a new tick waits for its session's abandoned one to stop
_CLOSE_TIMEOUT_S = 5.0
_log_refusal = ThrottledLog(logger, logging.INFO, period_s=10.0)  # one line per client (or session) and reason
_log_repeat = ThrottledLog(logger, logging.INFO, period_s=10.0)  # one line per session each 10 s
_log_budget = ThrottledLog(logger, logging.INFO, period_s=10.0)  # one line per session each 10 s
_SWEEP_S = 5.0  # how often idle sessions are looked for besides at each call (at most half the idle time)


class ModelEngine:
    """Thread-safe `Engine` over a `PolicyPipeline`. Call `start()` to warm up."""

    def __init__(self, pipeline: PolicyPipeline, settings: EngineSettings | None = None):
        self.settings = settings or EngineSettings()
        self.served = ServedModel(pipeline, self.settings, monotonic_ms)
        self.sessions = SessionTable(self.settings.max_sessions)
        self._worker = ModelWorker(
            lambda job, batch: Tick(self.served, job.session, job.payload, len(batch),
                                    sum(tick.payload.slot_ms for tick in batch)).steps(),
            self.served.gen_stack, self.settings.max_batch)
        self._warmup = Warmup(self.served)
        self._admission = Admission(self.served, self.sessions, lambda key: self._on_worker(self._warmup.retime(key)))
        self._reasoning = Reasoning(self.served, self._worker)
        self._dynamics = Dynamics(self.served, self._worker)
        # The declared schema, read on every request: the pipeline floors frames to multiples of the VAE's
        # spatial compression, so a side needs at least that.
        self._specs = tuple(e.to_spec(pipeline.config.canvas_hw, pipeline.vae.spatial_compression,
                                      pipeline.normalizers(e)) for e in self.served.embodiments.values())

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Warm up in the background; `ready()` turns True when the cost model is filled."""
        self._worker.submit(GeneratorJob(self._warmup.steps(), self._warmup.failed))
        threading.Thread(target=self._sweep_idle, daemon=True, name="idle-sessions").start()

    def _sweep_idle(self) -> None:
        """Close idle sessions on time, not only when a call comes: their places, the log and the sessions gauge
        say so when it happens."""
        while not self.served.closing.wait(min(_SWEEP_S, self.settings.session_idle_s / 2)):
            self._admission.close_idle(self.settings.session_idle_s)

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        if not self._warmup.ready.wait(timeout_s):
            return False
        if self._warmup.error is not None:
            raise RuntimeError("warmup failed") from self._warmup.error
        return True

    def close(self) -> bool:
        """Abandon the running tick (or warmup tick) within one step, fail everything queued, stop the worker.
        Returns whether the worker stopped within `_CLOSE_TIMEOUT_S` (a device call may hold it longer)."""
        self.served.closing.set()
        for session in self.sessions.all():
            logger.info("closed session %s: the server is shutting down", session.describe())
        return self._worker.close(_CLOSE_TIMEOUT_S)

    def ready(self) -> bool:
        return self._warmup.ready.is_set() and self._warmup.error is None

    def stats(self) -> api.EngineStats:
        return api.EngineStats(sessions=len(self.sessions), queue_depth=self._worker.queue_depth,
                               warmup_progress=self._warmup.progress)

    def _profile_provenance(self) -> str:
        """Where the quality profile that ticks are planned on comes from; empty: none (the ladder, or uncached)."""
        profile = self.served.profile
        if profile is None or not self.settings.diffusion_cache:
            return ""
        return profile.calibration.describe()

    def info(self) -> api.ServerInfo:
        pipeline = self.served.pipeline
        config = pipeline.config
        return api.ServerInfo(
            model_name=config.name,
            embodiments=self._specs,
            default_budget_ms=self.settings.default_budget_ms,
            max_sessions=self.settings.max_sessions,
            model_digest=pipeline.digest,
            device=str(pipeline.device),
            max_reason_tokens=self.settings.max_reason_tokens,
            max_reason_calls=self.settings.max_reason_calls,
            max_instruction_tokens=MAX_INSTRUCTION_TOKENS,
            max_prompt_tokens=MAX_PROMPT_TOKENS,
            warmup_profile=self._warmup.profile,
            num_steps=config.num_steps,
            diffusion_cache=self.settings.diffusion_cache,
            temporal_compression=pipeline.vae.temporal_compression,
            quality_profile=self._profile_provenance(),
            max_dynamics_calls=self.settings.max_dynamics_calls,
        )

    # ------------------------------------------------------------------------------ sessions

    def capacity(self, budget_ms: float | None = None, rate_hz: float | None = None) -> tuple[api.Capacity, ...]:
        if not self.ready():
            return ()
        self._admission.close_idle(self.settings.session_idle_s)
        return self._admission.capacity(self.settings.default_budget_ms if budget_ms is None else budget_ms, rate_hz)

    def open_session(self, embodiment: str, instruction: str, budget_ms: float | None = None,
                     chunk_size: int | None = None, seed: int | None = None, rate_hz: float | None = None,
                     actions_per_chunk: int | None = None, preview: bool = False,
                     client_name: str = "", request_id: str = "") -> api.SessionHandle:
        self._require_ready()
        self._admission.close_idle(self.settings.session_idle_s)
        served = self.served
        if embodiment not in served.embodiments:
            raise api.UnknownEmbodiment(embodiment, tuple(served.embodiments))
        spec = served.embodiments[embodiment]
        chunk = spec.default_chunk_size if chunk_size is None else chunk_size
        executed = chunk if actions_per_chunk is None else actions_per_chunk
        rate = default_rate_hz(spec.fps, executed) if rate_hz is None else rate_hz
        budget = self.settings.default_budget_ms if budget_ms is None else budget_ms
        key = served.cost_key(embodiment, chunk, served.instruction_tokens(instruction, "instruction"))
        opening = Opening(request_id, embodiment, instruction, budget, chunk, 0 if seed is None else seed, rate,
                          preview, client_name)
        try:
            session, opened = self._admission.open(opening, lambda demand: self.sessions.open(
                self.settings.session_idle_s, opening, cost_key=key, demand=demand,
                limiter=RateLimiter(rate, time.monotonic())))
        except (api.BudgetInfeasible, api.Overloaded, api.TooManySessions) as refused:
            # What an operator asks when a robot says it was turned away (a client retrying in a loop: one line).
            _log_refusal((client_name, refused.reason), "refused a session%s: %s, chunks of %d, budget %g ms, %g Hz: "
                         "%s %s", f" for {client_name!r}" if client_name else "", embodiment, chunk, budget, rate,
                         refused.reason, refused.message)
            raise
        if not opened:
            # A retry of an OpenSession whose answer was lost: one line per session, however often it comes.
            _log_repeat(session.session_id, "answered a repeated OpenSession (request id %s) with session %s",
                        request_id, session.describe())
            return session.handle()
        if served.graphs is not None:
            # Its first tick then replays the graphs rather than paying for a capture inside its budget.
            try:
                self._on_worker(self._warmup.session_graphs(spec, chunk, instruction))
            except BaseException:
                self._admission.close(session.session_id, "its opening failed")
                raise
            session.graphed_instruction = instruction
        logger.info("opened session %s: %s, chunks of %d, budget %g ms, slot %.0f ms, %g Hz", session.describe(),
                    embodiment, chunk, budget, session.slot_ms, rate)
        return session.handle()

    def _on_worker(self, pieces: Iterator[None]) -> None:
        """Run `pieces` on the model worker, one per worker step between other sessions' ticks, and wait."""
        done: Future = Future()

        def run():
            yield from pieces
            done.set_result(None)

        self._worker.submit(GeneratorJob(run(), done.set_exception))
        done.result()

    def session(self, session_id: str) -> api.SessionHandle:
        self._admission.close_idle(self.settings.session_idle_s)  # an idle session is gone, not revived by the call
        return self.sessions.get(session_id).handle()

    @contextlib.contextmanager
    def attach(self, session_id: str, on_close: Callable[[api.UnknownSession], None] | None = None
               ) -> Iterator[api.SessionHandle]:
        session = self.sessions.get(session_id)
        with session.lock:
            if session.closed:  # since `get`: `tell_closed` may have looked for on_close before it was set
                raise session.closure.error(session_id)
            if session.attached:
                raise api.StreamAttached(session_id)
            session.attached, session.on_close = True, on_close
        try:
            yield session.handle()
        finally:
            with session.lock:
                session.attached, session.on_close = False, None
                session.last_used_s = time.monotonic()  # its idle time starts when the stream ends

    def reset_session(self, session_id: str) -> api.SessionHandle:
        return self.sessions.reset(session_id).handle()

    def close_session(self, session_id: str, why: str = api.CLOSED_BY_CLIENT) -> None:
        session = self._admission.close(session_id, why)
        logger.info("closed session %s: %s", session.describe(), why)

    def set_budget(self, session_id: str, budget_ms: float) -> api.SessionHandle:
        session = self.sessions.get(session_id)
        old_ms = session.budget_ms
        try:
            self._admission.change_budget(session, budget_ms)
        except (api.BudgetInfeasible, api.Overloaded) as refused:
            _log_refusal((session_id, refused.reason), "session %s: refused a budget of %g ms, kept %g ms: %s %s",
                         session.describe(), budget_ms, old_ms, refused.reason, refused.message)
            raise
        # What an operator asks when a robot's ticks got slower or coarser; a robot may change it every tick.
        _log_budget(session_id, "session %s: budget %g -> %g ms, slot %.0f ms", session.describe(), old_ms, budget_ms,
                    session.slot_ms)
        return session.handle()

    # ------------------------------------------------------------------------------ model calls

    @contextlib.contextmanager
    def reserve_tick(self, session_id: str) -> Iterator[TickJob]:
        """The session's place for one tick and a token of its rate, taken before the transport decodes the
        observation; a place no tick was queued on is freed on leaving."""
        self._require_ready()
        self._admission.close_idle(self.settings.session_idle_s)
        session = self.sessions.get(session_id)  # its epoch is checked when the tick starts
        prior = session.in_flight
        if prior is not None and prior.payload is not None and prior.payload.end.reason() is not None:
            wait_for([prior.result], timeout=_ABANDONED_WAIT_S)  # it stops within one step: wait, not refuse
        with session.lock:
            if session.ticking():  # queued, running, or its observation being decoded
                raise api.SessionBusy(session_id)
            _refuse_early(session, session.limiter.take(time.monotonic()))
            job = TickJob(session, (session.opening.embodiment, session.opening.chunk_size), payload=None)
            session.in_flight = job
        try:
            yield job
        finally:
            if job.payload is None:
                job.result.cancel()

    def act(self, session_id: str, epoch: int, observation: api.Observation, deadline_s: float | None = None,
            should_abort: Callable[[], bool] | None = None, reservation: TickJob | None = None) -> api.ActResult:
        with contextlib.nullcontext(reservation) if reservation else self.reserve_tick(session_id) as job:
            return self._run_tick(job, epoch, observation, deadline_s, should_abort)

    def _run_tick(self, job: TickJob, epoch: int, observation: api.Observation, deadline_s: float | None,
                  should_abort: Callable[[], bool] | None) -> api.ActResult:
        """Prepare the frames of the tick `job` reserved, queue it, and wait for its chunk."""
        session = job.session
        tokens = self.served.instruction_tokens(observation.instruction, "observation.instruction") \
            if observation.instruction else 0
        budget_ms = deadline_ms = session.budget_ms
        if deadline_s is not None:
            deadline_ms = min(deadline_ms, (deadline_s - time.monotonic()) * 1e3)
        end = CallEnd(self.served.closing, deadline_s, should_abort,
                      late="the caller's deadline passed before the tick finished")
        request = TickRequest(epoch, observation, tokens, self.served.clock(), budget_ms, session.slot_ms, deadline_ms,
                              end)
        try:
            job.payload = self._prepare_frames(session, request)
        except BaseException as error:  # the session must not stay busy
            job.fail(error)
            raise
        self._worker.submit(job)
        result = self._worker.wait(job, end)
        if self.served.graphs is not None and session.instruction != session.graphed_instruction:
            # The tick ran a new instruction's calls eagerly; its next ones replay graphs captured in the background.
            session.graphed_instruction = session.instruction
            opening = session.opening
            pieces = self._warmup.session_graphs(self.served.embodiments[opening.embodiment], opening.chunk_size,
                                                 session.instruction)
            with contextlib.suppress(api.ShuttingDown):  # the tick's answer stands
                self._worker.submit(GeneratorJob(pieces, lambda error: logger.warning(
                    "capturing the CUDA graphs of session %s's new instruction failed: %s", session.session_id, error)))
        return result

    def _prepare_frames(self, session: SessionState, request: TickRequest) -> TickRequest:
        """`request` with its frames put on their canvas here, on the caller's thread: the model worker, which
        every session shares, then spends only the VAE encode of the canvas on them, whatever their size."""
        started = self.served.clock()
        frames = self.served.pipeline.prepare_images(session.opening.embodiment, request.observation.images)
        return dataclasses.replace(request, frames=frames, prepare_ms=self.served.clock() - started)

    @contextlib.contextmanager
    def reserve_dynamics(self, session_id: str, inverse: bool = False) -> Iterator[SessionState]:
        """A place for one dynamics call of the session (`inverse`: an inverse one, which the session's chunk size
        must allow), taken before the transport decodes its frames and held until the context ends."""
        self._require_ready()
        session = self.sessions.get(session_id)
        with self._dynamics.place(session, inverse):
            with session.lock:
                session.dynamics += 1
            try:
                yield session
            finally:
                with session.lock:
                    session.dynamics -= 1
                    session.last_used_s = time.monotonic()  # its idle time starts when the call ends

    def forward_dynamics(self, session_id: str, epoch: int, observation: api.Observation, actions: np.ndarray,
                         seed: int | None = None, deadline_s: float | None = None,
                         should_abort: Callable[[], bool] | None = None,
                         reservation: SessionState | None = None) -> api.PredictedVideo:
        with contextlib.nullcontext(reservation) if reservation else self.reserve_dynamics(session_id) as session:
            self.served.check_epoch(session, epoch)
            return self._dynamics.forward(session, observation, actions, seed, deadline_s, should_abort)

    def inverse_dynamics(self, session_id: str, epoch: int, clip: api.VideoClip, seed: int | None = None,
                         deadline_s: float | None = None, should_abort: Callable[[], bool] | None = None,
                         reservation: SessionState | None = None) -> api.ActResult:
        with (contextlib.nullcontext(reservation) if reservation else self.reserve_dynamics(session_id, inverse=True)
              as session):
            self.served.check_epoch(session, epoch)
            return self._dynamics.inverse(session, clip, seed, deadline_s, should_abort)

    def reason(self, prompt: str, max_new_tokens: int, temperature: float = 0.0, seed: int | None = None,
               should_abort: Callable[[], bool] | None = None, deadline_s: float | None = None
               ) -> Generator[str, None, api.ReasonEnd]:
        """Autoregressive text over the UND weights with a KV cache; never touches the diffusion cache."""
        self._require_ready()
        return self._reasoning.reason(prompt, max_new_tokens, temperature, seed, should_abort, deadline_s)

    def _require_ready(self) -> None:
        if self.served.closing.is_set():
            raise api.ShuttingDown()
        if self._warmup.error is not None:
            raise RuntimeError("the engine failed to warm up") from self._warmup.error
        if not self._warmup.ready.is_set():
            raise api.WarmingUp(progress=self._warmup.progress)


def _refuse_early(session: SessionState, wait_s: float) -> None:
    """RateExceeded when the session's next tick is due in `wait_s` > 0 s."""
    if wait_s > 0:
        limiter = session.limiter
        raise api.RateExceeded(session.session_id, limiter.rate_hz, limiter.measured_hz, wait_s * 1e3)


def settings_from_config(config, quality_profile: QualityProfile | None = None,
                         calibrate_at_warmup: bool = False) -> EngineSettings:
    """EngineSettings from the CLI's `ServerConfig` (and the profile its `quality_profile` setting found)."""
    return EngineSettings(
        quality_profile=quality_profile,
        calibrate_at_warmup=calibrate_at_warmup,
        default_budget_ms=config.latency_budget_ms,
        max_sessions=config.max_sessions,
        session_idle_s=config.session_idle_timeout_s,
        max_batch=config.max_batch,
        cuda_graphs=config.cuda_graphs,
        compile_gen_stack=config.compile_gen_stack,
        max_dynamics_calls=config.max_dynamics_calls,
        diffusion_cache=config.diffusion_cache,
        cache_threshold=config.diffusion_cache_thresh,
        residual_order=config.diffusion_cache_residual_order,
        max_consecutive_cached=config.diffusion_cache_max_consecutive,
    )


class DeviceUnavailable(ValueError):
    """A device setting torch cannot run on here; the message says what it has."""


def resolve_device(name: str, setting: str = "--device") -> str:
    """A device setting (auto, cpu, cuda or cuda:N) as a device torch can run on here; DeviceUnavailable names it as
    `setting` (the server's `device` may come from a config file or the environment, not only its flag)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:  # torch's way of saying "no such device type"
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise DeviceUnavailable(f"{setting} {name!r}: expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")
            raise DeviceUnavailable(f"{setting} {name}: {build} sees no CUDA device here")
        if (device.index or 0) >= count:
            raise DeviceUnavailable(f"{setting} {name}: torch sees {count} CUDA device(s), cuda:0 to "
                                    f"cuda:{count - 1}")
    return name


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """A `--dtype` name (`config.DTYPES`) on a resolved device: auto is bf16 on CUDA, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return _DTYPES[name]
