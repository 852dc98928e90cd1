"""Per-session state: identity, epoch, the task, the budget and rate, and what carries over between ticks."""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from policy_server.budget.history import SessionHistory
from policy_server.engine.admission import Demand
from policy_server.engine.api import RequestIdReused, SessionHandle, TooManySessions, UnknownSession
from policy_server.pipeline.policy import PromptState
from policy_server.rate_limiter import RateLimiter


@dataclass(frozen=True)
class Opening:
    """What a session was opened with, defaults resolved (ms, Hz), and the caller's id of that opening
    (``request_id``, "" for none): an OpenSession that repeats it gets the session again."""

    request_id: str
    embodiment: str
    instruction: str
    budget_ms: float
    chunk_size: int
    seed: int
    rate_hz: float
    preview: bool
    client_name: str

    def differences(self, other: Opening) -> tuple[str, ...]:
        """The names of the settings in which ``other`` differs."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name))


# How many ended sessions the table remembers (`Closure`), the oldest forgotten first: a call naming one is told how it
# ended rather than only that it is unknown. About 0.4 kB each (an expiry's, measured): at most 1.6 MB.
REMEMBERED_CLOSURES = 4096


@dataclass(frozen=True)
class Closure:
    """How a session left the table: ``expired`` (no call for the idle time) or closed (a CloseSession call, or its
    WebSocket connection's end), ``why`` in words, at ``at_s`` (``time.monotonic()``)."""

    expired: bool
    why: str
    at_s: float

    def error(self, session_id: str) -> UnknownSession:
        """What a call naming the session gets."""
        ago = f"{time.monotonic() - self.at_s:.0f} s ago"
        if self.expired:
            return UnknownSession(session_id, "expired", f"expired {ago}: {self.why}")
        return UnknownSession(session_id, "closed", f"was closed {ago}: {self.why}")


@dataclass(eq=False)
class SessionState:
    """The engine's mutable state of one open session: one robot (or simulated episode stream)
    talking to the server. ``handle()`` is the snapshot the transport sees (``api.SessionHandle``;
    on the wire ``Session``, which the client reads as ``client.Session``).

    cost_key: what its ticks cost is learned under (``ServedModel.cost_key``: latent frames, state row,
        instruction-length group; embodiments alike in these share it).
    demand: what admission reserved it for; slot_ms: the model time each of its ticks is planned in.
    limiter: refuses ticks asked for faster than the declared rate.
    in_flight: its last tick (queued, running or done; a session has at most one queued or running) while it is open.
    prompt: the text K/V of the current instruction, reused while it does not change.
    graphed_instruction: the instruction whose CUDA graphs were captured for its ticks (`pipeline/cuda_graphs.py`).
    history: full-call counts of the episode's previous ticks per cache setting, for the budget planner.
    last_used_s: when a call last named it (``time.monotonic()`` s).
    attached: a Control stream holds it (one at a time); on_close: what the one attached asked to be told its closing
    with (`Engine.attach`); dynamics: its forward / inverse dynamics calls running.
    closure: how it left the table (closed, or for being idle), once it has: a tick of it queued or running then ends.
    opening: what it was opened with (``embodiment``, ``chunk_size``, ``seed``, ``preview``: its ticks decode and return
    the predicted frames; ``client_name``: who opened it, for logs); of those, only its instruction and budget change,
    held here (``instruction``, ``budget_ms``).
    """

    session_id: str
    opening: Opening
    instruction: str
    budget_ms: float
    cost_key: Hashable
    demand: Demand
    limiter: RateLimiter
    slot_ms: float = 0.0
    epoch: int = 1
    ticks: int = 0
    in_flight: Any = None
    prompt: PromptState | None = None
    graphed_instruction: str | None = None
    history: SessionHistory = field(default_factory=SessionHistory)
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used_s: float = field(default_factory=time.monotonic)
    attached: bool = False
    on_close: Callable[[UnknownSession], None] | None = None
    dynamics: int = 0
    closure: Closure | None = None

    @property
    def closed(self) -> bool:
        return self.closure is not None

    def ticking(self) -> bool:
        """A tick of it is queued or running."""
        job = self.in_flight  # read once: leaving the table lets go of it
        return job is not None and not job.result.done()

    def idle(self, now_s: float, idle_s: float) -> bool:
        """No call for ``idle_s``, no tick or dynamics call in flight and no stream attached."""
        return now_s - self.last_used_s > idle_s and not self.ticking() and not self.attached and not self.dynamics

    def handle(self) -> SessionHandle:
        opening = self.opening
        return SessionHandle(self.session_id, self.epoch, opening.embodiment, self.instruction, self.budget_ms,
                             opening.chunk_size, opening.seed, rate_hz=self.demand.rate_hz, slot_ms=self.slot_ms,
                             measured_rate_hz=self.limiter.measured_hz, preview=opening.preview,
                             client_name=opening.client_name)

    def leave(self, closure: Closure) -> None:
        """Mark it closed as it leaves the table, and let go of its last tick: that job refers back to the session,
        and the cycle kept a closed session, its instruction's text K/V among it (0.7 MB on the embedded model), until
        Python's full collection, which runs seldom: 3000 sessions of 3 ticks grew a server by 45 MB."""
        self.closure = closure
        self.in_flight = None  # a tick still running holds its job, and the job the session, until it ends

    def tell_closed(self) -> None:
        """Once it has left the table, and outside the table's lock: tell the stream attached to it, if any."""
        with self.lock:  # `Engine.attach` sets on_close under it, then checks `closed`: one of the two sees the other
            on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close(self.closure.error(self.session_id))

    def describe(self) -> str:
        """The session and who opened it, for a log line."""
        name = self.opening.client_name
        return f"{self.session_id} ({name!r})" if name else self.session_id


def _longest_unused(sessions: Iterable[SessionState], idle_s: float) -> str:
    """For a refusal, which another client gets: when an unused session closes, and how long the one of
    ``sessions`` (not empty) longest without a call has had none, of those no Control stream or openpi WebSocket
    connection holds open (those never close unused). It names its client, never its id (the id is what a call on the
    session needs)."""
    closes = f"a session with no call (and no Control stream or WebSocket connection) for {idle_s:g} s closes"
    unheld = [s for s in sessions if not s.attached]
    if not unheld:
        return f"{closes}; each open session is held by its Control stream or WebSocket connection"
    session = min(unheld, key=lambda s: s.last_used_s)
    whose = f"client {session.opening.client_name!r}" if session.opening.client_name else "no client_name"
    return (f"{closes}; the one longest without a call ({whose}) has had none for "
            f"{time.monotonic() - session.last_used_s:.0f} s")


class SessionTable:
    """Thread-safe map of open sessions with a size limit."""

    def __init__(self, max_sessions: int):
        self.max_sessions = max_sessions
        self._sessions: dict[str, SessionState] = {}
        self._ended: OrderedDict[str, Closure] = OrderedDict()  # the last REMEMBERED_CLOSURES to leave, by id
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def all(self) -> list[SessionState]:
        with self._lock:
            return list(self._sessions.values())

    def open(self, idle_s: float, opening: Opening, **fields) -> SessionState:
        """A new session of ``opening``'s settings and ``fields``; ``idle_s``: how long one goes unused before it
        closes, which a refusal names (the places may be held by a crashed client's sessions, which nobody can
        close)."""
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise TooManySessions(self.max_sessions, _longest_unused(self._sessions.values(), idle_s))
            session = SessionState(session_id=uuid.uuid4().hex, opening=opening, instruction=opening.instruction,
                                   budget_ms=opening.budget_ms, **fields)
            self._sessions[session.session_id] = session
            return session

    def longest_unused(self, idle_s: float) -> str:
        """For a refusal while sessions are open: when an unused one closes, and which has gone longest unused."""
        with self._lock:
            return _longest_unused(self._sessions.values(), idle_s)

    def opened_by(self, opening: Opening) -> SessionState | None:
        """The open session an OpenSession with ``opening.request_id`` opened, if any (None for no id): a scan of at
        most ``max_sessions``. RequestIdReused when that session was opened with other settings."""
        if not opening.request_id:
            return None
        session = next((s for s in self.all() if s.opening.request_id == opening.request_id), None)
        if session is not None and session.opening != opening:
            raise RequestIdReused(opening.request_id, session.opening.differences(opening))
        return session

    def get(self, session_id: str) -> SessionState:
        """The open session ``session_id``, used now (every call on a session gets it here). UnknownSession, saying
        how it ended where the table remembers."""
        session = self._sessions.get(session_id)
        if session is None:
            closure = self._ended.get(session_id)
            raise UnknownSession(session_id) if closure is None else closure.error(session_id)
        session.last_used_s = time.monotonic()
        return session

    def _leave(self, session: SessionState, closure: Closure) -> None:
        """Under the lock: take ``session`` out of the table, remembering how it left."""
        del self._sessions[session.session_id]
        session.leave(closure)
        self._ended[session.session_id] = closure
        while len(self._ended) > REMEMBERED_CLOSURES:
            self._ended.popitem(last=False)

    def close(self, session_id: str, why: str) -> SessionState:
        """Close the session (``why``: what closed it, in words) and return it."""
        with self._lock:
            session = self.get(session_id)
            self._leave(session, Closure(expired=False, why=why, at_s=time.monotonic()))
        return session

    def close_idle(self, now_s: float, idle_s: float) -> list[SessionState]:
        """Close the sessions idle for ``idle_s`` (``SessionState.idle``) and return them."""
        with self._lock:
            idle = [session for session in self._sessions.values() if session.idle(now_s, idle_s)]
            for session in idle:
                self._leave(session, Closure(expired=True, at_s=now_s, why=(
                    f"no call for {now_s - session.last_used_s:.0f} s (a session with no call for {idle_s:g} s "
                    "closes)")))
        return idle

    def reset(self, session_id: str) -> SessionState:
        """Start a new episode: epoch + 1, tick count and learned history new (the instruction's K/V stay)."""
        session = self.get(session_id)
        session.epoch += 1
        session.ticks = 0
        session.history = SessionHistory()  # not cleared: a tick still running teaches the one it was planned on
        return session
