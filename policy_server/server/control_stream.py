"""One ``Control`` call: the real-time observation -> action-chunk loop of a session.

Three threads cooperate so that events are never held back by inference:

- the *reader* consumes client messages, checks each observation frame's order, rate, size and epoch
  (bad ones are answered with an error event and the stream lives on) and puts it in the pending list;
- the *worker* takes the oldest pending frame, takes the session's place for a tick, decodes the frame
  (a bad one is answered with an error event) and runs ``engine.act`` on it;
- the gRPC handler thread yields events from the outbound queue as soon as they exist.

Newest observation wins: while the worker is busy, a new frame replaces every waiting frame not
marked ``must_answer``, and each replaced frame is reported as ``Superseded`` right away, never decoded. Frames
whose epoch is not the session's current one are rejected with STALE_EPOCH, both on arrival and
again when the worker picks them up (a reset may happen in between). A frame that comes sooner than
the session's declared rate allows waits (throttled) until its tick is due, unless a newer frame
replaces it meanwhile; a message that does not parse is answered with an error event. Frames beyond
``MAX_FRAME_RATE_HZ`` are answered RATE_EXCEEDED without being decoded, so that a flood of frames cannot
take the CPU from the model, and frames beyond ``MAX_PENDING_FRAMES`` waiting ``must_answer`` ones are
answered TOO_MANY_PENDING_FRAMES, so that they cannot take its memory. Each frame's ``obs_id`` must exceed
the last one's. At most ``MAX_QUEUED_EVENTS`` events wait to be sent: while a client does not read them, the
stream reads no more of its messages (gRPC's flow control then holds the client's sends) and computes no more
chunks, so that a client that sends and never reads cannot grow the server's memory.

On shutdown (`drain`) a stream answers the frame the worker is on, refuses the waiting ones and those that arrive
(SHUTTING_DOWN) and ends with that status, UNAVAILABLE, on which a client's stream reconnects.

A session closed while its stream is open (a CloseSession call from elsewhere) ends the stream at once: the events
queued before are sent, the frames waiting or being served are dropped, and the stream ends with the error every
later call naming the session gets (NOT_FOUND / SESSION_NOT_FOUND, saying what closed it and when), once, rather than
an error event for every frame that follows.

A stream holds a server thread from the moment it opens, so one that sends no ``start`` within
``CONTROL_START_S`` is ended (STREAM_NOT_STARTED), and at most ``MAX_STARTING_STREAMS`` wait for theirs at
once (`StartingStreams`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from policy_server.engine.api import EmbodimentSpec, Engine, RateExceeded, ShuttingDown, UnknownSession
from policy_server.limits import (
    CONTROL_START_S,
    MAX_FRAME_RATE_HZ,
    MAX_PENDING_FRAMES,
    MAX_QUEUED_EVENTS,
    MAX_STARTING_STREAMS,
    STARTING_RETRY_MS,
)
from policy_server.rate_limiter import RateLimiter
from policy_server.server import convert, validate
from policy_server.server.errors import ServiceError, Undecodable, from_exception, make_error, renamed
from policy_server.server.metrics import ServerMetrics
from policy_server.v1 import policy_server_pb2 as pb

_MADE_ROOM = object()  # put in a waiting stream's inbox: a newer stream took its place
_DRAINED = object()  # put in a waiting stream's inbox: the server is shutting down
_FRAME_OBSERVATION = "observation.observation"  # a ControlRequest's observation frame's Observation


class StartingStreams:
    """The places of the streams waiting for their `start`, at most ``MAX_STARTING_STREAMS``: each holds a server
    thread. A stream that finds them all taken ends the one that has waited longest (TOO_MANY_STARTING_STREAMS, with
    a retry delay). A client that sends its start does so at once and holds a place for milliseconds, so the one
    ended is, all but always, a silent stream: silent streams reopened in a loop cannot keep other clients out, as
    refusing the newcomer let them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: deque[queue.Queue] = deque()  # each waiting stream's inbox, the longest waiting first

    @contextmanager
    def place(self, inbox: queue.Queue) -> Iterator[None]:
        with self._lock:
            if len(self._waiting) == MAX_STARTING_STREAMS:
                self._waiting.popleft().put(_MADE_ROOM)
            self._waiting.append(inbox)
        try:
            yield
        finally:
            with self._lock:
                if inbox in self._waiting:  # not when it was ended to make room
                    self._waiting.remove(inbox)


def _first_message(requests: Iterator[pb.ControlRequest], starting: StartingStreams,
                   inbox: queue.Queue) -> pb.ControlRequest | None:
    """The stream's first message, None when the client ended the stream without one, STREAM_NOT_STARTED when none
    came within ``CONTROL_START_S``, TOO_MANY_STARTING_STREAMS when a newer stream took its place meanwhile,
    SHUTTING_DOWN when the server began to (`ControlCall.drain`). Read on a thread of its own, which ends with the
    call, into ``inbox``."""

    def read() -> None:
        try:
            inbox.put(next(requests, None))
        except Exception:  # noqa: BLE001 - the call ended (cancelled, timed out) before a message came
            inbox.put(None)

    threading.Thread(target=read, daemon=True, name="control-start").start()
    with starting.place(inbox):
        try:
            first = inbox.get(timeout=CONTROL_START_S)
        except queue.Empty:
            raise make_error("STREAM_NOT_STARTED", f"no `start` within {CONTROL_START_S:g} s of opening the stream",
                             field="start", expected="ControlStart{session_id} as the first message",
                             got="nothing") from None
    if first is _DRAINED:
        raise ShuttingDown()
    if first is _MADE_ROOM:
        raise make_error(
            "TOO_MANY_STARTING_STREAMS",
            f"{MAX_STARTING_STREAMS} newer Control streams were waiting for their `start`: this one, waiting longest, "
            "made room",
            field="start", expected="a stream that sends `start` as soon as it opens; retry shortly",
            got="no `start` yet", retry_after_ms=STARTING_RETRY_MS)
    return first


@dataclass
class _PendingFrame:
    """A frame waiting for the worker, not decoded yet: `spec` is its session's embodiment, `chunk` its chunk size."""

    obs_id: int
    epoch: int
    sent: validate.ProtoObservation
    spec: EmbodimentSpec
    chunk: int
    must_answer: bool
    received_s: float  # time.monotonic() at arrival
    client_time_ns: int


class ControlCall:
    """The server side of one ``Control`` RPC (the client's counterpart is ``client.ControlStream``)."""

    def __init__(
        self, engine: Engine, metrics: ServerMetrics, max_message_bytes: int, context: grpc.ServicerContext,
        starting: StartingStreams,
    ) -> None:
        """``starting``: the server's places for streams waiting for their start."""
        self._engine = engine
        self._metrics = metrics
        self._max_message_bytes = max_message_bytes
        self._context = context
        self._session_id = ""
        self._cond = threading.Condition()  # guards the pending frames, the outbound events and the flags below
        self._outbound: deque[pb.ControlEvent] = deque()  # at most MAX_QUEUED_EVENTS, sent in order
        self._pending: list[_PendingFrame] = []
        self._starting = starting
        self._last_obs_id = -1  # obs_ids are uint64: any first one is above it
        self._reader_done = False
        self._worker_done = False
        self._stopped = False
        self._draining = False  # the server is shutting down (`drain`)
        self._closed: UnknownSession | None = None  # the session was closed (`_session_closed`)
        self._inbox: queue.Queue = queue.Queue()  # the first message, or why the stream ends before it
        self._frames = RateLimiter(MAX_FRAME_RATE_HZ, time.monotonic(), burst=MAX_FRAME_RATE_HZ / 5)

    # -- the handler thread ------------------------------------------------------------------

    def run(self, requests: Iterator[pb.ControlRequest]) -> Iterator[pb.ControlEvent]:
        first = _first_message(requests, self._starting, self._inbox)
        if first is None:
            return
        if isinstance(first, Undecodable):
            raise first.error("start")
        if first.WhichOneof("kind") != "start":
            raise make_error(
                "STREAM_NOT_STARTED",
                "the first Control message must be `start`",
                field="start",
                expected="ControlStart{session_id}",
                got=first.WhichOneof("kind") or "an empty message",
            )
        self._session_id = validate.session_id(first.start.session_id, "start.session_id")
        # The stream holds its session open between frames; the session's closing ends it (NOT_FOUND).
        with self._engine.attach(self._session_id, on_close=self._session_closed) as handle:
            yield pb.ControlEvent(started=convert.session_to_proto(handle))

            self._context.add_callback(self._on_rpc_done)
            reader = threading.Thread(
                target=self._read, args=(requests,), daemon=True, name=f"control-read-{self._session_id[:8]}"
            )
            worker = threading.Thread(target=self._work, daemon=True, name=f"control-work-{self._session_id[:8]}")
            reader.start()
            worker.start()
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._outbound or self._worker_done or self._stopped or self._closed)
                    # the call ended, or the worker did, or the session closed, and all is sent
                    if self._stopped or not self._outbound:
                        break
                    event = self._outbound.popleft()
                    self._cond.notify_all()  # a place for a reader or worker waiting to queue an event
                yield event
        if self._closed is not None and not self._stopped:
            raise self._closed
        if self._draining and not self._stopped:
            raise ShuttingDown()

    def drain(self) -> None:
        """The server is shutting down: answer the frame being served, refuse the others and end the stream
        (SHUTTING_DOWN, a status the client's stream reconnects on)."""
        with self._cond:
            self._draining = True
            self._cond.notify_all()
        self._inbox.put(_DRAINED)  # read only while the stream waits for its start

    def _session_closed(self, closed: UnknownSession) -> None:
        """The session was closed (on another call's thread, or this stream's that found it gone): send what is
        queued, queue nothing more, and end the stream with ``closed``."""
        with self._cond:
            self._closed = self._closed or closed
            self._cond.notify_all()

    def _on_rpc_done(self) -> None:
        """Client cancelled, deadline passed or the call finished: stop all three threads."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _send(self, event: pb.ControlEvent) -> None:
        """Queue ``event`` for the handler thread, waiting while ``MAX_QUEUED_EVENTS`` wait unsent (the client is
        not reading them); dropped once the call has ended or the session closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopped or self._closed or len(self._outbound) < MAX_QUEUED_EVENTS)
            if not self._stopped and not self._closed:
                self._outbound.append(event)
                self._cond.notify_all()

    def _should_abort(self) -> bool:
        return self._stopped

    # -- the reader thread -------------------------------------------------------------------

    def _read(self, requests: Iterator[pb.ControlRequest]) -> None:
        try:
            for request in requests:
                if isinstance(request, Undecodable):
                    self._emit_error(0, request.error())
                    continue
                kind = request.WhichOneof("kind")
                if kind == "observation":
                    self._accept(request.observation, request.ByteSize())
                elif kind == "budget":
                    self._update_budget(request.budget)
                elif kind == "ping":
                    self._send(pb.ControlEvent(pong=pb.Pong(client_time_ns=request.ping.client_time_ns)))
                elif kind == "start":
                    self._emit_error(0, make_error("BAD_VALUE", "start: the stream is already started", field="start",
                                                   expected="observation, budget or ping", got="a second start"))
                else:
                    self._emit_error(
                        0,
                        make_error(
                            "MISSING_FIELD",
                            "empty ControlRequest",
                            field="kind",
                            expected="observation, budget or ping",
                            got="nothing",
                        ),
                    )
        except Exception:  # noqa: BLE001 - the client went away mid-read; the done-callback stops us
            pass
        finally:
            with self._cond:
                self._reader_done = True
                self._cond.notify_all()

    def _accept(self, frame: pb.ObservationFrame, size: int) -> None:
        received = time.monotonic()
        try:
            if self._draining:
                raise ShuttingDown()
            if frame.obs_id <= self._last_obs_id:
                raise make_error("BAD_VALUE", "observation frames' obs_ids must increase",
                                 field="observation.obs_id", expected=f"an obs_id above {self._last_obs_id}",
                                 got=str(frame.obs_id))
            self._last_obs_id = frame.obs_id
            if frame.must_answer:
                with self._cond:
                    waiting = sum(p.must_answer for p in self._pending)
                if waiting >= MAX_PENDING_FRAMES:
                    raise make_error(
                        "TOO_MANY_PENDING_FRAMES", f"{waiting} must_answer frames are waiting already; this one "
                        "was dropped undecoded", field="observation.must_answer",
                        expected=f"at most {MAX_PENDING_FRAMES} must_answer frames waiting for the model",
                        got=f"frame {waiting + 1}")
            wait_s = self._frames.take(received)
            if wait_s > 0:
                raise make_error(
                    "RATE_EXCEEDED",
                    f"observation frames arrive at about {self._frames.measured_hz:.0f} per second; this one was "
                    "dropped undecoded",
                    field="observation", expected=f"at most {MAX_FRAME_RATE_HZ:g} frames per second",
                    got=f"{self._frames.measured_hz:.0f} per second", retry_after_ms=wait_s * 1e3,
                )
            validate.message_size(size, self._max_message_bytes, "observation", "observation frame")
            epoch = validate.epoch(frame.epoch, "observation.epoch")
            handle, spec = validate.session_at(self._engine, self._session_id, epoch)
            sent = validate.ProtoObservation.of(frame, _FRAME_OBSERVATION)
        except Exception as exc:  # noqa: BLE001 - one bad frame is answered, the stream lives on
            self._emit_error(frame.obs_id, exc)
            return
        incoming = _PendingFrame(frame.obs_id, frame.epoch, sent, spec, handle.chunk_size, frame.must_answer,
                                 received, frame.observation.client_time_ns)
        with self._cond:
            dropped = [p for p in self._pending if not p.must_answer]
            self._pending = [p for p in self._pending if p.must_answer] + [incoming]
            for old in dropped:
                self._metrics.superseded.inc()
                self._send(
                    pb.ControlEvent(
                        superseded=pb.Superseded(
                            obs_id=old.obs_id, by_obs_id=incoming.obs_id, epoch=old.epoch
                        )
                    )
                )
            self._cond.notify_all()

    def _update_budget(self, update: pb.BudgetUpdate) -> None:
        try:
            budget = validate.budget_ms(update.budget_ms, "budget.budget_ms")
            handle = self._engine.set_budget(self._session_id, budget)
        except Exception as exc:  # noqa: BLE001
            self._emit_error(0, exc)
            return
        self._send(pb.ControlEvent(budget=convert.session_to_proto(handle)))

    # -- the worker thread -------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while (not self._pending and not self._reader_done and not self._stopped and not self._draining
                       and not self._closed):
                    self._cond.wait()
                if self._stopped or self._draining or self._closed or not self._pending:
                    break
                frame = self._pending.pop(0)
            try:
                with self._engine.reserve_tick(self._session_id) as reservation:  # a frame held back stays undecoded
                    result = self._engine.act(
                        self._session_id,
                        frame.epoch,
                        validate.observation(frame.sent, frame.spec, frame.chunk),
                        deadline_s=None,
                        should_abort=self._should_abort,
                        reservation=reservation,
                    )
            except RateExceeded as early:
                self._hold(frame, early.retry_after_ms / 1e3)
                continue
            except Exception as exc:  # noqa: BLE001
                # The engine checks the instruction's tokens under an ActRequest's name.
                self._emit_error(frame.obs_id, renamed(exc, ("observation.instruction",),
                                                       f"{_FRAME_OBSERVATION}.instruction"))
                continue
            answer = convert.act_result_to_proto(result, self._session_id, frame.epoch, frame.sent.step_index(),
                                                 frame.received_s, obs_id=frame.obs_id,
                                                 client_time_ns=frame.client_time_ns)
            self._metrics.observe_tick(result, answer.served_ms, "grpc_stream")
            self._send(pb.ControlEvent(chunk=answer))
        with self._cond:
            refused, self._pending = self._pending, []
            draining = self._draining
        for frame in refused if draining else ():  # a drain's; those a closed session leaves go unanswered
            self._emit_error(frame.obs_id, ShuttingDown())
        with self._cond:
            self._worker_done = True
            self._cond.notify_all()

    def _hold(self, frame: _PendingFrame, wait_s: float) -> None:
        """Throttle: put ``frame`` back first in line and wait until its tick is due (a newer frame that
        arrives meanwhile supersedes it as usual)."""
        with self._cond:
            self._pending.insert(0, frame)
            self._cond.wait_for(lambda: self._stopped or self._draining or self._closed, timeout=wait_s)

    def _emit_error(self, obs_id: int, exc: BaseException) -> None:
        """Answer a frame or request with ``exc``; the session's being gone (its closing may reach a frame before
        `_session_closed` does) ends the stream instead."""
        if isinstance(exc, UnknownSession):
            self._session_closed(exc)
            return
        error: ServiceError = from_exception(exc)
        self._metrics.observe_error(error.reason)
        self._send(pb.ControlEvent(error=pb.ControlError(obs_id=obs_id, error=error.detail)))

