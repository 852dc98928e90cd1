"""The contract between the transport (gRPC / WebSocket) and the engine.

Plain dataclasses, typed errors and an ``Engine`` protocol: no torch, no protobuf. The transport
validates the *shape* of every request against the schema the engine declares in ``info()``
(camera names and sizes, state and action dims, chunk-size range, budget > 0) before it calls the
engine, so an engine receives well-formed inputs and raises only the errors that need its state
(unknown session, stale epoch, infeasible budget, warming up, too many sessions).

Clocks: ``deadline_s`` values are absolute ``time.monotonic()`` seconds; durations are ms.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

# The embodiment schema is part of this contract; it lives in a leaf module so the pipeline can build it.
from policy_server.limits import MAX_REASON_CALLS
from policy_server.specs import ActionSpec as ActionSpec
from policy_server.specs import CameraSpec as CameraSpec
from policy_server.specs import EmbodimentSpec as EmbodimentSpec
from policy_server.specs import ImageEncoding as ImageEncoding

# ---------------------------------------------------------------------------------------------
# Server and schema description
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfilePoint:
    """One measured operating point of the warmup latency profile (ms per tick)."""

    label: str
    p50_ms: float
    p95_ms: float
    full_calls: int = 0
    skipped_calls: int = 0


@dataclass(frozen=True)
class Capacity:
    """How many sessions of one embodiment (at its default chunk size) fit at a budget (ms) and rate (Hz)."""

    embodiment: str
    chunk_size: int
    budget_ms: float
    rate_hz: float
    sessions_alone: int  # on an otherwise idle server
    sessions_more: int  # beside the sessions open now


@dataclass(frozen=True)
class ServerInfo:
    """What the engine serves; the transport publishes it verbatim (plus its own limits).
    Token limits count tokens of the model's own tokenizer."""

    model_name: str
    embodiments: tuple[EmbodimentSpec, ...]
    default_budget_ms: float
    max_sessions: int
    model_digest: str = ""
    device: str = "cpu"
    max_reason_tokens: int = 256
    max_reason_calls: int = MAX_REASON_CALLS  # Reason calls at once
    max_instruction_tokens: int = 0
    max_prompt_tokens: int = 0
    warmup_profile: tuple[ProfilePoint, ...] = ()
    num_steps: int = 0
    diffusion_cache: bool = False
    temporal_compression: int = 1  # video frames per latent frame: a chunk of K predicts 1 + t * (K // t) frames
    quality_profile: str = ""  # the planner's profile, by provenance; empty: none (the SeaCache ladder)
    max_dynamics_calls: int = 0  # forward / inverse dynamics calls at once

    def embodiment(self, name: str) -> EmbodimentSpec | None:
        return next((e for e in self.embodiments if e.name == name), None)


@dataclass(frozen=True)
class EngineStats:
    """Live counters for metrics and health."""

    sessions: int
    queue_depth: int
    warmup_progress: float = 1.0  # 0..1


# ---------------------------------------------------------------------------------------------
# Sessions, observations, results
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionHandle:
    """A session as the engine sees it now. ``epoch`` starts at 1 and grows by one per reset.

    rate_hz: the chunk-request rate it was admitted at; slot_ms: the model time reserved for each of
    its ticks (its ticks are planned in it, at most ``budget_ms``); measured_rate_hz: the rate the
    engine has seen (0 before two ticks); preview: its chunks carry the predicted frames; client_name: who
    opened it, as they said (for logs).
    """

    session_id: str
    epoch: int
    embodiment: str
    instruction: str
    budget_ms: float
    chunk_size: int
    seed: int = 0
    rate_hz: float = 0.0
    slot_ms: float = 0.0
    measured_rate_hz: float = 0.0
    preview: bool = False
    client_name: str = ""


@dataclass(frozen=True)
class Observation:
    """One validated observation.

    images: camera name -> uint8 [H, W, 3] RGB, exactly the embodiment's cameras, sides within their
        declared bounds, each at most its camera's max_side wide once scaled to the tallest camera's height.
    state: float32 [state_dim] in physical units, finite; None when the embodiment takes none.
    instruction: the task text; "" keeps the session's current instruction.
    step_index: the robot's control-step counter when the observation was captured.
    committed_actions: act only: float32 [d, action_dim], 1 <= d < the session's chunk size, physical units,
        inside the declared limits, or None: the actions the robot executes from `step_index` on while the chunk is
        computed. The chunk starts with them, exactly, and its other actions are sampled to continue them. (The
        transports refuse them with a dynamics call's observation.)
    """

    images: Mapping[str, np.ndarray]
    state: np.ndarray | None
    instruction: str = ""
    step_index: int = 0
    committed_actions: np.ndarray | None = None


@dataclass(frozen=True)
class VideoClip:
    """One validated video for inverse dynamics.

    frames: camera name -> uint8 [K + 1, H, W, 3] RGB (K: the session's chunk size), the embodiment's
        cameras, sides within their declared bounds, each at most its camera's max_side wide once scaled to the
        tallest camera's height.
    state: float32 [state_dim] at frame 0, physical units; None when the embodiment takes none.
    instruction: "" means the session's; used for this call only.
    step_index: the control step of frame 0.
    """

    frames: Mapping[str, np.ndarray]
    state: np.ndarray | None
    instruction: str = ""
    step_index: int = 0


@dataclass(frozen=True)
class BranchRecord:
    """GEN-stack calls of one CFG branch in one tick. ``skipped`` includes ``forced_skip``; ``full`` includes
    ``fail_open``; ``sequence``: ``F`` full / ``S`` skip per step (e.g. ``FSSFSSFSSF``)."""

    full: int
    skipped: int
    forced_skip: int
    fail_open: int
    sequence: str
    fail_open_reasons: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TickRecord:
    """Why one answer was as fast (or slow) as it was, built once by the tick that ran.

    budget_ms: the session's per-tick budget; deadline_ms: the tick's, from its arrival (the smaller of the
    budget and the caller's deadline). predicted_ms / actual_ms: per stage (e.g. "prepare", "queue", "encode",
    "prefill", "denoise", "decode", and "preview" for a session with preview frames; "video_decode" for
    forward dynamics) and always "total" (engine-side latency of the tick), in ms. knobs: the settings the
    budget planner chose (e.g. "threshold", "cap", "num_steps", "cfg_steps") and "batch_size", the ticks of
    the micro-batch this one ran in (1 = alone). branches: the GEN-stack calls per CFG branch; fallbacks
    name each degradation applied, in order. feasible / best_achievable_ms: whether the planner's cheapest tick
    is predicted to meet the deadline, and its predicted ms, for this tick (its prefill as it ran, no wait); the
    least budget admission takes is `BudgetInfeasible.best_achievable_ms` (the longest instruction, a background
    piece ahead).
    """

    budget_ms: float
    deadline_ms: float
    actual_ms: Mapping[str, float]
    knobs: Mapping[str, float]
    branches: Mapping[str, BranchRecord]
    setting: str
    predicted_ms: Mapping[str, float] = field(default_factory=dict)
    fallbacks: tuple[str, ...] = ()
    thresholds: tuple[float, ...] = ()
    feasible: bool = True
    best_achievable_ms: float = 0.0

    @property
    def deadline_met(self) -> bool:
        return self.actual_ms["total"] <= self.deadline_ms

    @property
    def full_calls(self) -> int:
        return sum(b.full for b in self.branches.values())

    @property
    def skipped_calls(self) -> int:
        return sum(b.skipped for b in self.branches.values())

    @property
    def forced_skips(self) -> int:
        return sum(b.forced_skip for b in self.branches.values())

    @property
    def fail_open(self) -> int:
        return sum(b.fail_open for b in self.branches.values())

    @property
    def fallback_kinds(self) -> tuple[str, ...]:
        """Each fallback without its step or count, e.g. ``late_finish_at_step=4/20`` -> ``late_finish_at_step``."""
        return tuple(fallback.split("=")[0] for fallback in self.fallbacks)


@dataclass(frozen=True)
class ReasonEnd:
    """How a reasoner call ended: `finish_reason` "stop" (an end-of-text token) or "length" (its token limit),
    and the text tokens it generated."""

    finish_reason: str
    tokens: int


@dataclass(frozen=True)
class ActResult:
    """An action chunk: float32 [K, action_dim] in physical units; ``actions[0]`` is meant for
    control step ``first_step_index`` (the observation's step index; for inverse dynamics, frame 0's).
    preview_frames: for a session with preview, the predicted frames, uint8 RGB
    [F, H, W, 3] (F = the frames the VAE decodes for the chunk: K + 1 when K is a multiple of its
    temporal compression)."""

    actions: np.ndarray
    first_step_index: int
    tick: TickRecord
    preview_frames: np.ndarray | None = None


@dataclass(frozen=True)
class PredictedVideo:
    """Forward dynamics: frames uint8 RGB [F, H, W, 3] predicted for the given actions (frame 0
    reconstructs the observation); latents_shape: the generated video latents [C, T, h, w]."""

    frames: np.ndarray
    latents_shape: tuple[int, ...]
    tick: TickRecord


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class EngineError(Exception):
    """Base of every error a client can cause or observe. ``reason`` is a stable machine-readable
    code (UPPER_SNAKE); ``details()`` holds the fields that explain it."""

    reason: ClassVar[str] = "ENGINE_ERROR"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def details(self) -> dict[str, str]:
        return {}


class InvalidArgument(EngineError):
    """A request field is missing or malformed. ``field`` is a dotted path such as
    ``observation.images[wrist]``."""

    reason = "INVALID_ARGUMENT"

    def __init__(self, field: str, expected: str, got: str, reason: str | None = None) -> None:
        super().__init__(f"{field}: expected {expected}, got {got}")
        self.field, self.expected, self.got = field, expected, got
        if reason is not None:
            self.reason = reason  # a finer code, e.g. MISSING_FIELD, NON_FINITE, BAD_TENSOR

    def details(self) -> dict[str, str]:
        return {"field": self.field, "expected": self.expected, "got": self.got}


class SchemaMismatch(InvalidArgument):
    """The observation does not match the session's declared observation schema."""

    reason = "SCHEMA_MISMATCH"

    def __init__(self, field: str, expected: str, got: str) -> None:
        super().__init__(field, expected, got)


class UnknownEmbodiment(InvalidArgument):
    """The embodiment is not one this server serves (``ServerInfo.embodiments``). A registered but
    unserved embodiment is unknown here too; the pipeline's registry lookup raises its own
    ``pipeline.errors.UnregisteredEmbodiment`` instead, which never reaches the wire."""

    reason = "UNKNOWN_EMBODIMENT"

    def __init__(self, name: str, known: tuple[str, ...]) -> None:
        super().__init__("embodiment", f"one of {list(known)}", repr(name))


class RequestIdReused(InvalidArgument):
    """An OpenSession names the request_id of an open session it does not repeat: other settings (``fields``
    name them; their values are the other request's, so they are not echoed)."""

    reason = "REQUEST_ID_REUSED"

    def __init__(self, request_id: str, fields: tuple[str, ...]) -> None:
        super().__init__("request_id", f"a new id, or the settings of the open session {request_id!r} opened",
                         f"other settings ({', '.join(fields)})")


class UnknownSession(EngineError):
    """No open session has this id. Where the server remembers how it ended, ``ended`` says so, as the error's
    ``session_end`` metadata: "closed" (a CloseSession call, or its openpi WebSocket connection's end, closed it) or
    "expired" (no call for the idle time); ``how`` is the rest of the message, saying when and why. "" for an id the
    server does not know (never opened here, ended long ago, or the server restarted)."""

    reason = "SESSION_NOT_FOUND"

    def __init__(self, session_id: str, ended: str = "", how: str = "") -> None:
        super().__init__(f"session {session_id!r} {how}" if ended else
                         f"no open session {session_id!r} (closed, expired, or the server restarted)")
        self.session_id, self.ended = session_id, ended

    def details(self) -> dict[str, str]:
        return {"session_id": self.session_id, **({"session_end": self.ended} if self.ended else {})}


class StaleEpoch(EngineError):
    """The request names an epoch older (or newer) than the session's current one: it was
    captured before a reset, so answering it would act on a finished episode."""

    reason = "STALE_EPOCH"

    def __init__(self, session_id: str, current_epoch: int, got_epoch: int) -> None:
        super().__init__(f"session {session_id!r} is at epoch {current_epoch}, request has epoch {got_epoch}")
        self.session_id, self.current_epoch, self.got_epoch = session_id, current_epoch, got_epoch

    def details(self) -> dict[str, str]:
        return {
            "session_id": self.session_id,
            "expected": str(self.current_epoch),
            "got": str(self.got_epoch),
        }


class BudgetInfeasible(EngineError):
    """Even the most aggressive caching and every fallback cannot meet the budget. ``stages_ms``: what the best
    achievable tick spends per stage (e.g. encode, prefill, denoise), named in the message."""

    reason = "BUDGET_INFEASIBLE"

    def __init__(self, budget_ms: float, best_achievable_ms: float,
                 stages_ms: Mapping[str, float] | None = None) -> None:
        breakdown = ", ".join(f"{stage} {ms:.1f}" for stage, ms in (stages_ms or {}).items())
        super().__init__(
            f"budget {budget_ms:g} ms is below the best achievable latency {best_achievable_ms:.1f} ms"
            + (f" ({breakdown})" if breakdown else "")
        )
        self.budget_ms, self.best_achievable_ms = budget_ms, best_achievable_ms

    def details(self) -> dict[str, str]:
        return {"budget_ms": f"{self.budget_ms:g}", "best_achievable_ms": f"{self.best_achievable_ms:.3f}"}


class WarmingUp(EngineError):
    """The model is loading or warming up; retry after ``retry_after_ms``."""

    reason = "WARMING_UP"

    def __init__(self, progress: float = 0.0, retry_after_ms: float = 1000.0) -> None:
        super().__init__(f"the server is warming up ({progress:.0%} done)")
        self.progress, self.retry_after_ms = progress, retry_after_ms

    def details(self) -> dict[str, str]:
        return {"progress": f"{self.progress:.3f}", "retry_after_ms": f"{self.retry_after_ms:g}"}


class Overloaded(EngineError):
    """The open sessions plus this one could not all meet their budgets at their request rates.
    ``sessions_fit``: how many sessions like this one an idle server would take."""

    reason = "OVERLOADED"

    def __init__(self, message: str, sessions_fit: int) -> None:
        super().__init__(message)
        self.sessions_fit = sessions_fit

    def details(self) -> dict[str, str]:
        return {"sessions_fit": str(self.sessions_fit)}


class RateExceeded(EngineError):
    """A session asked for a tick sooner than its declared rate allows; retry after ``retry_after_ms``."""

    reason = "RATE_EXCEEDED"

    def __init__(self, session_id: str, rate_hz: float, measured_hz: float, retry_after_ms: float) -> None:
        super().__init__(
            f"session {session_id!r} declared {rate_hz:g} Hz but asks at about {measured_hz:.3g} Hz; "
            f"the next tick is due in {retry_after_ms:.0f} ms (declare a higher rate_hz on OpenSession)"
        )
        self.rate_hz, self.measured_hz, self.retry_after_ms = rate_hz, measured_hz, retry_after_ms

    def details(self) -> dict[str, str]:
        return {"rate_hz": f"{self.rate_hz:g}", "measured_hz": f"{self.measured_hz:.3f}",
                "retry_after_ms": f"{self.retry_after_ms:.1f}"}


class SessionBusy(EngineError):
    """The session already has a tick queued or running; a session asks for one chunk at a time."""

    reason = "SESSION_BUSY"

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"session {session_id!r} already has a tick in flight; send the next observation after its "
            "answer (or use the Control stream, where the newest observation wins)"
        )


class StreamAttached(EngineError):
    """The session has a Control stream already. Each stream holds server threads for as long as it lasts, so a
    session takes one at a time; retry after ``retry_after_ms`` (a stream whose connection dropped without a word
    is ended within gRPC keepalive's 15 s)."""

    reason = "STREAM_ATTACHED"
    retry_after_ms = 1000.0

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} has a Control stream attached already; a session takes one at a "
                         "time (end the other one first)")


class TooManyReasonCalls(EngineError):
    reason = "TOO_MANY_REASON_CALLS"

    def __init__(self, limit: int) -> None:
        super().__init__(f"all {limit} reasoner calls are in use; retry when one finishes")


class TooManyDynamicsCalls(EngineError):
    reason = "TOO_MANY_DYNAMICS_CALLS"

    def __init__(self, limit: int) -> None:
        super().__init__(f"all {limit} forward / inverse dynamics calls are in use; retry when one finishes")


class DynamicsOff(EngineError):
    """The server was started without dynamics calls (`--max-dynamics-calls 0`)."""

    reason = "DYNAMICS_OFF"

    def __init__(self) -> None:
        super().__init__("this server takes no forward / inverse dynamics calls; start it with "
                         "--max-dynamics-calls N (each session's admission then reserves room for one call's piece)")


class ShuttingDown(EngineError):
    """The server is stopping; the request was not (or no longer) served."""

    reason = "SHUTTING_DOWN"

    def __init__(self) -> None:
        super().__init__("the server is shutting down")


class TooManySessions(EngineError):
    """Every place is taken. ``unused``: when a session closes unused, and which one has gone longest without a
    call (a client that crashed cannot close its sessions: its restart learns when their places free themselves)."""

    reason = "TOO_MANY_SESSIONS"

    def __init__(self, limit: int, unused: str) -> None:
        super().__init__(f"all {limit} sessions are in use; close one first, or wait: {unused}")
        self.limit = limit

    def details(self) -> dict[str, str]:
        return {"limit": str(self.limit)}


class Cancelled(EngineError):
    """The caller went away (``should_abort()`` returned True); the work was abandoned."""

    reason = "CANCELLED"


class DeadlineExpired(EngineError):
    """The caller's own deadline passed before an answer existed; the work was abandoned."""

    reason = "DEADLINE_EXCEEDED"


class NonFiniteOutput(EngineError):
    """The model produced NaN/Inf actions; nothing was sent to the robot."""

    reason = "NON_FINITE_OUTPUT"


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------


CLOSED_BY_CLIENT = "a CloseSession call closed it"  # why `Engine.close_session` says a session closed, unless told


@runtime_checkable
class Engine(Protocol):
    """What the transport needs from the model side. Every method is thread-safe."""

    def info(self) -> ServerInfo:
        """The served model and schema. Available while warming up."""
        ...

    def start(self) -> None:
        """Begin the warmup, in the background (the server calls it once its ports are bound)."""
        ...

    def ready(self) -> bool:
        """True once weights are loaded and warmup has filled the cost model."""
        ...

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until ready (True) or ``timeout_s`` has passed (False); RuntimeError, raised from the
        warmup's error, when the warmup failed."""
        ...

    def stats(self) -> EngineStats: ...

    def close(self) -> bool:
        """Stop the model worker and free the device; called once at server shutdown. Returns whether the
        worker stopped (False: it is still inside a device call it cannot leave)."""
        ...

    def capacity(self, budget_ms: float | None = None, rate_hz: float | None = None) -> tuple[Capacity, ...]:
        """Per served embodiment: how many sessions at ``budget_ms`` and ``rate_hz`` fit (None: the default
        budget, the embodiment's default rate). Empty while warming up."""
        ...

    def open_session(
        self,
        embodiment: str,
        instruction: str,
        budget_ms: float | None = None,
        chunk_size: int | None = None,
        seed: int | None = None,
        rate_hz: float | None = None,
        actions_per_chunk: int | None = None,
        preview: bool = False,
        client_name: str = "",
        request_id: str = "",
    ) -> SessionHandle:
        """Open a session at epoch 1. ``None`` takes the server default; the default rate is
        ``control_hz / actions_per_chunk`` (and ``actions_per_chunk`` defaults to the chunk size).
        ``preview``: every chunk carries the predicted frames, their decode planned into the tick.
        ``client_name``: who opens it, printable (the transport checks), for logs.
        ``request_id``: the caller's id of this opening (the transport checks its charset; "" for none): while the
        session it opened is open, the same id with the same settings (defaults resolved) returns that session,
        as it is now, rather than opening another (a retry whose first reply was lost).
        Raises InvalidArgument, RequestIdReused (the id with other settings), TooManySessions, BudgetInfeasible,
        Overloaded, WarmingUp."""
        ...

    def session(self, session_id: str) -> SessionHandle:
        """The session's current state. Raises UnknownSession."""
        ...

    def reset_session(self, session_id: str) -> SessionHandle:
        """Start a new episode: epoch + 1, per-episode state cleared. Raises UnknownSession."""
        ...

    def close_session(self, session_id: str, why: str = CLOSED_BY_CLIENT) -> None:
        """Free the session; the log, the stream attached to it (``attach``) and later calls naming it
        (UnknownSession) say `why`. Raises UnknownSession."""
        ...

    def set_budget(self, session_id: str, budget_ms: float) -> SessionHandle:
        """Change the per-tick budget (ms). Raises UnknownSession, BudgetInfeasible, Overloaded."""
        ...

    def attach(self, session_id: str, on_close: Callable[[UnknownSession], None] | None = None
               ) -> AbstractContextManager[SessionHandle]:
        """Hold the session open while the context lasts (a Control stream: its client is there even between
        frames), however long it goes without a call; yields its handle. ``on_close`` is called once, with the error
        that later calls naming the session get, if the session is closed (``close_session``) while the context
        lasts: it must return at once (it runs on the closing call's thread). Raises UnknownSession, and
        StreamAttached while another context holds it."""
        ...

    def reserve_tick(self, session_id: str) -> AbstractContextManager[object]:
        """Take the session's one place for a tick, and a token of its declared rate, before the transport decodes
        a costly observation: a tick refused (SessionBusy, RateExceeded, WarmingUp, UnknownSession) costs no
        decoding, however many of the session's calls arrive at once. Yields the reservation to pass to ``act``;
        leaving the context without a tick queued on it frees the place."""
        ...

    def act(
        self,
        session_id: str,
        epoch: int,
        observation: Observation,
        deadline_s: float | None = None,
        should_abort: Callable[[], bool] | None = None,
        reservation: object | None = None,
    ) -> ActResult:
        """Compute the action chunk for ``observation``, on ``reservation`` (from ``reserve_tick``) or on a
        place it reserves itself.

        The tick is planned against min(session budget, ``deadline_s`` - now). ``should_abort``
        is polled while the tick waits and between denoising steps; when it returns True (or
        ``deadline_s`` passes) the work is abandoned within one step (Cancelled / DeadlineExpired).
        Raises InvalidArgument (an instruction over the token limit), UnknownSession, StaleEpoch,
        SessionBusy, RateExceeded, WarmingUp, Cancelled, DeadlineExpired, NonFiniteOutput, ShuttingDown.
        """
        ...

    def reserve_dynamics(self, session_id: str, inverse: bool = False) -> AbstractContextManager[object]:
        """Take one of the server's places for a dynamics call (``inverse``: for ``inverse_dynamics``) before the
        transport decodes its frames: a call refused (DynamicsOff, InvalidArgument for an inverse call on a session
        whose chunk the model does not see whole, TooManyDynamicsCalls, WarmingUp, UnknownSession) costs no
        decoding. Yields the reservation to pass to ``forward_dynamics`` / ``inverse_dynamics``; the place is held
        until the context ends."""
        ...

    def forward_dynamics(
        self,
        session_id: str,
        epoch: int,
        observation: Observation,
        actions: np.ndarray,
        seed: int | None = None,
        deadline_s: float | None = None,
        should_abort: Callable[[], bool] | None = None,
        reservation: object | None = None,
    ) -> PredictedVideo:
        """The frames ``actions`` (float32 [K, action_dim], physical units, within the declared limits; K the
        session's chunk size) lead to from ``observation``. Uncached at the model's step count, as background
        work between ticks; abandoned at ``deadline_s`` or after ``limits.MAX_DYNAMICS_MS``. ``seed`` None:
        the session's. On ``reservation`` (from ``reserve_dynamics``), or on a place it takes itself. Raises
        InvalidArgument (instruction tokens), UnknownSession, StaleEpoch, WarmingUp, TooManyDynamicsCalls,
        DynamicsOff, Cancelled, DeadlineExpired, ShuttingDown."""
        ...

    def inverse_dynamics(
        self,
        session_id: str,
        epoch: int,
        clip: VideoClip,
        seed: int | None = None,
        deadline_s: float | None = None,
        should_abort: Callable[[], bool] | None = None,
        reservation: object | None = None,
    ) -> ActResult:
        """The action chunk that explains ``clip`` (K + 1 frames); ``actions[i]`` takes frame i to i + 1.
        Runs and raises as ``forward_dynamics`` (and NonFiniteOutput)."""
        ...

    def reason(
        self,
        prompt: str,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        should_abort: Callable[[], bool] | None = None,
        deadline_s: float | None = None,
    ) -> Generator[str, None, ReasonEnd]:
        """Stream reasoner text pieces (autoregressive with a KV cache; never the diffusion cache); the
        generator returns how it ended (`ReasonEnd`).
        Stops after ``max_new_tokens`` tokens or an end token; abandoned within one prefill chunk or
        token when ``should_abort()`` or ``deadline_s`` passes. Control ticks run first: the reasoner
        works between them. Raises InvalidArgument (a prompt over the token limit), TooManyReasonCalls."""
        ...
