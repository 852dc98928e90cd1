"""Streaming client for the ``Control`` bidirectional stream.

    with ControlStream(client, session) as stream:
        obs_id = stream.send({"image": frame}, state=q, step_index=t)
        event = stream.next_event(timeout_s=1.0)   # chunk, superseded, error, pong, budget, disconnected,
                                                   # reconnected, closed

The server answers the newest observation and reports each dropped one as ``superseded``; a bad frame comes back as
an ``error`` event and the stream continues. If the connection drops, the stream reports ``disconnected``,
reconnects with exponential backoff (by default for about two minutes: a server's restart and warmup; a try comes
as soon as the channel has reconnected rather than a whole delay later) and
re-attaches to the session; if the server lost the session (it restarted, behind Ray Serve its replica went
away, or the session expired while the stream was away), it opens a new one with the same settings (the budget last
granted, the instruction the server last acted on) and reports ``reconnected`` with ``session_replaced=True``,
because the episode state (epoch) is new. A session closed by a CloseSession call (this client's or another's) is
never reopened: closed while the stream is open, the server ends the stream at once, and closed while it is away,
re-attaching finds it closed; either way the stream reports ``closed`` once, its error NOT_FOUND /
SESSION_NOT_FOUND saying what closed the session and when. A dropped
connection is UNAVAILABLE, or INTERNAL without a server reason: Ray Serve's proxy ends a stream so when its replica
dies. A refusal that says when to retry, or any RESOURCE_EXHAUSTED, is tried again too, within the backoff, when
opening as when reconnecting: streams that all (re)connect at once, after a failover or at a fleet's start, may find
no place left on the server for those still to send their start, and a lost session's reopening may find the server
full (TOO_MANY_SESSIONS, OVERLOADED) until other sessions close (behind Ray Serve a stream's error does not say when
to retry).
Newest observation wins before the network too: of the frames not ``must_answer``, one at most is on its way (sent,
and the server has not yet said it read it: each frame is followed by a ping, whose pong is its receipt) and at most
``MAX_FRAMES_IN_FLIGHT`` are unanswered (by a chunk, superseded or error); a newer frame waits in the client until
then, and replaces (``superseded``) a frame that was waiting, so that a link slower than the frames (a stalled WiFi
link, a slow uplink) carries the newest rather than a backlog of old ones. The link then holds at most one frame ahead
of gRPC's ping answers, which must come back within 5 s: a frame that takes longer than that to cross the uplink
(48 kB of JPEG at 64 kbit/s) loses the connection (``disconnected``, ping timeout) however few are sent.
Observations sent while disconnected never reach the server (they would be stale by the time a chunk came): the first
is lost with the connection, each later one is superseded by the next, and the last is dropped when the stream
reconnects; a budget asked meanwhile (`set_budget`), or whose answer the connection lost, is asked again. A reply
this client cannot read (preview frames, JPEG, without OpenCV) ends the stream: ``closed`` with UNREADABLE_REPLY.
Once the stream has ended (``closed``, whose error says why, or `close()`), sending raises ``PolicyServerError``
(that error, else STREAM_CLOSED).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import grpc
import numpy as np

from policy_server.client.backoff import Backoff
from policy_server.client.errors import PolicyServerError
from policy_server.client.sync_client import PolicyClient
from policy_server.client.types import ActionChunk, Session, build_observation
from policy_server.v1 import policy_server_pb2 as pb
from policy_server.v1.wire import WireError

log = logging.getLogger(__name__)

_CLOSE = object()
# Reconnection tries for about two minutes: through a server's restart, its warmup included.
RECONNECT_BACKOFF = Backoff(max_attempts=60)
# A session's stream whose connection dropped without a word holds the session until gRPC keepalive ends it, within
# 15 s: a session still taken after this long (STREAM_ATTACHED) has a live stream, another caller's, and `open` says so.
ATTACHED_WAIT_S = 20.0
# Observation frames sent and not yet answered: one the model works on, one waiting for it on the server and one on
# its way, which supersedes the waiting one on arrival (the server keeps the newest: the client need not hold it back).
MAX_FRAMES_IN_FLIGHT = 3


@dataclass(frozen=True)
class StreamEvent:
    """kind: "chunk", "superseded", "error", "pong", "budget", "disconnected", "reconnected" or "closed"."""

    kind: str
    chunk: ActionChunk | None = None
    obs_id: int = 0
    by_obs_id: int = 0
    error: PolicyServerError | None = None
    session: Session | None = None
    session_replaced: bool = False
    client_time_ns: int = 0


class ControlStream:
    """One session's Control stream. A reader thread of its own (``control-events``) receives the server's events,
    decodes them (a chunk's preview frames too) and queues them for `next_event`; nothing runs on the caller's
    threads but the calls it makes. `send` and `next_event` may be called from different threads. ``backoff``
    (default ``RECONNECT_BACKOFF``: 60 tries, about two minutes) paces reconnecting."""

    def __init__(
        self,
        client: PolicyClient,
        session: Session,
        *,
        reconnect: bool = True,
        backoff: Backoff | None = None,
        reopen_session: bool = True,
    ) -> None:
        self._client = client
        self._session = session
        self._reconnect = reconnect
        self._backoff = backoff or RECONNECT_BACKOFF
        self._reopen_session = reopen_session
        self._events: queue.Queue[StreamEvent] = queue.Queue()
        self._lock = threading.Lock()
        self._requests: queue.Queue | None = None
        self._call = None
        self._reader: threading.Thread | None = None
        self._closing = threading.Event()
        self._wake = threading.Event()  # ends a pause between reconnection tries: the channel is back, or closing
        self._ended: PolicyServerError | None = None  # why the stream ended, once it has
        self._instruction = session.instruction  # the last one the server acted on: a reopened session gets it
        self._sent_instructions: dict[int, str] = {}  # obs_id -> the instruction it carries, until it is answered
        self._obs_ids = itertools.count(1)
        self._in_flight: set[int] = set()  # obs_ids of frames (not must_answer) sent on this call, not answered yet
        # The frame sent on this call whose receipt is not back yet (0: none). One at most: what the uplink holds
        # ahead of gRPC's ping answers, which have 5 s to come back, and a slow uplink takes seconds for a frame.
        self._on_its_way = 0
        self._waiting: pb.ControlRequest | None = None  # the newest frame, until it may be sent
        self._resetting = 0  # `reset()` calls under way
        # The last budget `set_budget` asked while some of its asks are unanswered (no budget or error event yet): a
        # connection lost before it was answered loses the ask, so the next connection asks it again.
        self._budget_asked: float | None = None
        self._budget_unanswered = 0

    @property
    def session(self) -> Session:
        return self._session

    # -- connection ----------------------------------------------------------------------------

    def _connect(self) -> None:
        """Start a Control call for the current session and consume its ``started`` event."""
        requests: queue.Queue = queue.Queue()
        requests.put(pb.ControlRequest(start=pb.ControlStart(session_id=self._session.session_id)))

        def request_iterator() -> Iterator[pb.ControlRequest]:
            while True:
                item = requests.get()
                if item is _CLOSE:
                    return
                yield item

        metadata = self._client.call_metadata(self._session.session_id)
        call = self._client.stub.Control(request_iterator(), metadata=metadata)
        try:
            first = next(call)
            while first.WhichOneof("kind") is None:  # Ray Serve's carrier of the error that follows
                first = next(call)
        except grpc.RpcError as exc:
            requests.put(_CLOSE)
            raise self._client.rpc_error(exc) from None
        with self._lock:
            self._requests, self._call = requests, call
            self._session = Session.from_proto(first.started)
            self._in_flight, self._on_its_way, self._waiting = set(), 0, None  # the last call's frames are lost
            if self._budget_unanswered:
                requests.put(pb.ControlRequest(budget=pb.BudgetUpdate(budget_ms=self._budget_asked)))
                self._budget_unanswered = 1

    def open(self) -> ControlStream:
        """Attach to the session (once: opening an opened stream returns it as it is, so ``with stream.open()``
        holds one call). A refusal that says when to retry (streams opened all at once may find no place left for
        those still to send their start) is tried again with the backoff, a session another stream holds for
        `ATTACHED_WAIT_S`; any other error, or the last refusal, raises ``PolicyServerError``."""
        if self._reader is not None:
            return self
        delays, attached_until = self._backoff.delays(), time.monotonic() + ATTACHED_WAIT_S
        while True:
            try:
                self._connect()
                break
            except PolicyServerError as exc:
                delay = next(delays, None)
                held = exc.reason == "STREAM_ATTACHED" and time.monotonic() >= attached_until
                if not _passing(exc) or delay is None or held:
                    raise
                time.sleep(max(delay, exc.retry_after_ms / 1e3))
        self._reader = threading.Thread(target=self._read_events, daemon=True, name="control-events")
        self._reader.start()
        return self

    def _read_events(self) -> None:
        while True:
            try:
                for event in self._call:
                    # No kind: one a newer server sends that this client does not know, or the empty event that ends
                    # a failed stream through Ray Serve's proxy, carrying the error's trailers (which come next).
                    if event.WhichOneof("kind") is None:
                        continue
                    try:
                        converted = self._convert(event)
                    except WireError as exc:  # e.g. preview frames (JPEG) on a client without OpenCV
                        log.exception("control stream: cannot read a reply; ending the stream")
                        self._call.cancel()
                        self._end(PolicyServerError(grpc.StatusCode.CANCELLED, "UNREADABLE_REPLY",
                                                    f"a reply could not be read: {type(exc).__name__}: {exc}"))
                        return
                    if converted.kind == "pong" and converted.client_time_ns < 0:
                        self._received(-converted.client_time_ns)
                        continue
                    if converted.kind == "budget":
                        self._keep(converted.session)
                    if converted.kind == "budget" or (converted.kind == "error" and not converted.obs_id):
                        self._budget_answered()  # an error about no frame answers a budget: nothing else asks one
                    self._answered(converted)
                    self._events.put(converted)
                self._end(None)
                return
            except grpc.RpcError as exc:
                error = self._client.rpc_error(exc)
                # A session expires under an open stream only where the stream attached as the idle sweep closed it.
                expired = error.session_end == "expired" and self._reopen_session
                if self._closing.is_set() or not self._reconnect or not (error.connection_lost or expired):
                    self._end(None if self._closing.is_set() else error)
                    return
                log.warning("control stream lost (%s); reconnecting", error.message)
                self._events.put(StreamEvent("disconnected", error=error))
                failure = self._reconnect_with_backoff(error)
                if failure is not None:
                    self._end(None if self._closing.is_set() else failure)
                    return

    def _keep(self, session: Session) -> None:
        """Make ``session`` the stream's (what a reopened session asks for: the budget granted, ...). An answer about
        the same session never takes its epoch back: a budget answer made before a `reset()` may be read after it."""
        with self._lock:
            if session.session_id == self._session.session_id:
                session = dataclasses.replace(session, epoch=max(session.epoch, self._session.epoch))
            self._session = session

    def _answered(self, event: StreamEvent) -> None:
        """A frame's instruction is the session's once the server acts on the frame (a chunk answers it); one refused
        or superseded never is, so a reopened session does not ask for it."""
        if event.kind not in ("chunk", "error", "superseded") or not event.obs_id:
            return
        with self._lock:
            self._in_flight.discard(event.obs_id)
            self._send_waiting()
            if event.kind != "chunk":
                self._sent_instructions.pop(event.obs_id, None)
                return
            if event.obs_id in self._sent_instructions:
                self._instruction = self._sent_instructions[event.obs_id]
            # Frames are acted on in order: one sent before the answered frame and still here never will be.
            for obs_id in [o for o in self._sent_instructions if o <= event.obs_id]:
                del self._sent_instructions[obs_id]

    def _budget_answered(self) -> None:
        with self._lock:
            self._budget_unanswered = max(0, self._budget_unanswered - 1)

    def _received(self, obs_id: int) -> None:
        """The server has read frame ``obs_id`` (its receipt came): the next frame may go."""
        with self._lock:
            if obs_id == self._on_its_way:
                self._on_its_way = 0
                self._send_waiting()

    def _sendable(self) -> bool:
        """Under the lock: whether a frame (not must_answer) may be sent now rather than wait."""
        return not self._on_its_way and len(self._in_flight) < MAX_FRAMES_IN_FLIGHT

    def _send_frame(self, request: pb.ControlRequest) -> None:
        """Under the lock: send a frame (not must_answer), then the ping whose pong is its receipt: client_time_ns is
        -obs_id (the caller's pings carry time.monotonic_ns(), never negative)."""
        obs_id = request.observation.obs_id
        self._in_flight.add(obs_id)
        self._on_its_way = obs_id
        self._requests.put(request)
        self._requests.put(pb.ControlRequest(ping=pb.Ping(client_time_ns=-obs_id)))

    def _send_waiting(self) -> None:
        """Under the lock: send the frame that waits, if it may go now."""
        if self._waiting is not None and self._sendable():
            self._send_frame(self._waiting)
            self._waiting = None

    def _end(self, error: PolicyServerError | None) -> None:
        """Report the stream's end (``closed``, with ``error`` unless the client closed it)."""
        with self._lock:
            self._ended = self._ended or error or _stream_closed()
        self._events.put(StreamEvent("closed", error=error))

    def _reconnect_with_backoff(self, error: PolicyServerError) -> PolicyServerError | None:
        """Connect again, reopening the session where the server lost it: None once connected, else the last
        error (or `error`, the loss, when none came after it). Every reopening of this loss sends one request id: one
        whose answer was lost (it timed out, the connection dropped) opened the session the next one gets."""
        request_id, lost = uuid.uuid4().hex, self._session.session_id
        for attempt, delay in enumerate(self._backoff.delays()):
            if self._pause(delay, connect=attempt == 0):
                return error
            try:
                self._attach(request_id)
            except PolicyServerError as exc:
                error = exc
                lost_again = _lost(exc) and self._reopen_session  # a reopening raced
                # Reopening got no answer within the client's call timeout: the restarted server is not listening yet.
                timed_out = exc.no_answer
                if lost_again or timed_out or exc.connection_lost or _passing(exc):
                    continue
                return error
            # A new session whichever try opened it: one try may reopen it and lose the connection before attaching.
            replaced = self._session.session_id != lost
            if self._closing.is_set():  # closed meanwhile: nobody will use what was just opened
                self._abandon(replaced)
                return error
            self._events.put(StreamEvent("reconnected", session=self._session, session_replaced=replaced))
            return None
        return error

    def _pause(self, delay_s: float, connect: bool) -> bool:
        """Wait ``delay_s`` before the next try, or less where the channel was not connected and connects again
        meanwhile: True if the stream is closing. A try while the channel is down fails at once, and the channel
        reconnects on its own backoff, not the stream's: after a link's outage the next try would come up to a
        whole delay after the channel is back. A channel that stays connected (a server that refuses) or never
        connects (one that stays down) waits every delay, so that they still grow. ``connect``: ask the idle channel
        a lost connection leaves to connect (the first pause; after a failed try it is reconnecting already). gRPC
        keeps that request pending in its connectivity poller beyond the pause, which fails in a thread of its own
        if the client is closed meanwhile."""
        self._wake.clear()
        if self._closing.is_set():
            return True
        began: list[grpc.ChannelConnectivity] = []  # the channel's state as the pause begins (the first callback)

        def watch(state: grpc.ChannelConnectivity) -> None:
            if not began:
                began.append(state)
            if state == grpc.ChannelConnectivity.READY and began[0] != grpc.ChannelConnectivity.READY:
                self._wake.set()

        channel = self._client.channel
        channel.subscribe(watch, try_to_connect=connect)
        try:
            self._wake.wait(delay_s)
        finally:
            channel.unsubscribe(watch)
        return self._closing.is_set()

    def _attach(self, request_id: str) -> None:
        """Connect to the session, or to a new one with its settings where the server lost it (opened with
        ``request_id``)."""
        try:
            self._connect()
            return
        except PolicyServerError as exc:
            if not _lost(exc) or not self._reopen_session:
                raise
        self._reopen(request_id)

    def _reopen(self, request_id: str) -> None:
        """Open a session with the lost one's settings and attach to it."""
        old = self._session
        self._keep(self._client.open_session(
            old.embodiment,
            self._instruction,
            budget_ms=old.budget_ms,
            chunk_size=old.chunk_size,
            seed=old.seed,
            rate_hz=old.rate_hz,
            preview=old.preview,
            client_name=old.client_name,
            request_id=request_id,
        ))
        try:
            self._connect()
        except PolicyServerError:
            self._close_session()
            raise

    def _abandon(self, replaced: bool) -> None:
        """End the call just connected and, if it was opened here, its session."""
        with self._lock:
            self._requests.put(_CLOSE)
            self._call.cancel()
        if replaced:
            self._close_session()

    def _close_session(self) -> None:
        try:
            self._client.close_session(self._session)
        except PolicyServerError as exc:  # it closes itself once idle
            log.warning("could not close session %s: %s", self._session.session_id, exc)

    @staticmethod
    def _convert(event: pb.ControlEvent) -> StreamEvent:
        kind = event.WhichOneof("kind")
        if kind == "chunk":
            return StreamEvent("chunk", chunk=ActionChunk.from_proto(event.chunk), obs_id=event.chunk.obs_id)
        if kind == "superseded":
            return StreamEvent(
                "superseded", obs_id=event.superseded.obs_id, by_obs_id=event.superseded.by_obs_id
            )
        if kind == "error":
            return StreamEvent(
                "error",
                obs_id=event.error.obs_id,
                error=PolicyServerError.from_detail(event.error.error, event.error.obs_id),
            )
        if kind == "pong":
            return StreamEvent("pong", client_time_ns=event.pong.client_time_ns)
        if kind == "budget":
            return StreamEvent("budget", session=Session.from_proto(event.budget))
        return StreamEvent(kind or "unknown")

    def close(self, wait_s: float = 5.0) -> None:
        """Half-close (the server answers what it already accepted), then wait for the end."""
        self._closing.set()
        self._wake.set()
        with self._lock:
            self._ended = self._ended or _stream_closed()
            if self._requests is not None:
                self._requests.put(_CLOSE)
        if self._reader is not None:
            self._reader.join(wait_s)
        if self._call is not None:
            self._call.cancel()

    def __enter__(self) -> ControlStream:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- sending -------------------------------------------------------------------------------

    def _check_sendable(self) -> None:
        """Under the lock: raise unless the stream is open and not ended."""
        if self._requests is None:
            raise RuntimeError("the stream is not open")
        if self._ended is not None:
            raise self._ended

    def _put(self, request: pb.ControlRequest) -> None:
        with self._lock:
            self._check_sendable()
            self._requests.put(request)

    def send(
        self,
        images: Mapping[str, np.ndarray],
        state: np.ndarray | None = None,
        *,
        instruction: str = "",
        step_index: int = 0,
        committed_actions: np.ndarray | None = None,
        must_answer: bool = False,
        encoding: str = "jpeg",
        jpeg_quality: int = 90,
    ) -> int:
        """Queue one observation (as `PolicyClient.act` takes it) for the current epoch; returns its obs_id.
        Never blocks on the network. A non-empty ``instruction`` becomes the session's from this frame on ("" keeps
        it); ``step_index``: the control step the frame was captured at, the step the answer's ``actions[0]`` is
        for; ``committed_actions``: as `PolicyClient.act`. A frame sent while the stream is disconnected never
        reaches the server (the module's docstring): time out its answer."""
        observation = build_observation(images, state, instruction, step_index, encoding, jpeg_quality,
                                        committed_actions)
        return self.send_observation(observation, must_answer=must_answer)

    def send_observation(
        self, observation: pb.Observation, *, must_answer: bool = False, epoch: int | None = None
    ) -> int:
        obs_id = next(self._obs_ids)
        if observation.instruction:
            with self._lock:
                self._sent_instructions[obs_id] = observation.instruction
        request = pb.ControlRequest(observation=pb.ObservationFrame(obs_id=obs_id, observation=observation,
                                                                    must_answer=must_answer))
        with self._lock:
            self._check_sendable()
            # Under the lock that a reopened session is put in with: a frame at its epoch goes on its call.
            request.observation.epoch = self._session.epoch if epoch is None else epoch
            if must_answer:  # never superseded: the server bounds them (TOO_MANY_PENDING_FRAMES)
                # It goes now, so a frame waiting (a lower obs_id, which the server would refuse after it) is
                # replaced, as the server replaces the frames it holds with a new one.
                replaced, self._waiting = self._waiting, None
                self._requests.put(request)
            elif self._sendable():
                self._send_frame(request)
                return obs_id
            else:  # it waits until the frame on its way is read, or one is answered
                replaced, self._waiting = self._waiting, request
        if replaced is not None:
            superseded = StreamEvent("superseded", obs_id=replaced.observation.obs_id, by_obs_id=obs_id)
            self._answered(superseded)
            self._events.put(superseded)
        return obs_id

    def set_budget(self, budget_ms: float) -> None:
        """Ask for a new per-tick budget; answered by a ``budget`` (or ``error``) event. Asked while the stream is
        disconnected, or lost with the connection before its answer came, it is asked again once reconnected (after
        ``reconnected``), the last one asked only."""
        with self._lock:
            self._check_sendable()
            self._requests.put(pb.ControlRequest(budget=pb.BudgetUpdate(budget_ms=budget_ms)))
            self._budget_asked = budget_ms
            self._budget_unanswered += 1

    def ping(self) -> None:
        """Ask for a ``pong`` event carrying this call's ``time.monotonic_ns()`` (its round trip); one sent while the
        stream is disconnected is lost with the connection."""
        self._put(pb.ControlRequest(ping=pb.Ping(client_time_ns=time.monotonic_ns())))

    def reset(self) -> Session:
        """New episode (the instruction is kept): the epoch grows, frames already in flight will come back
        STALE_EPOCH. A blocking ``ResetSession`` call, within the client's timeout (`PolicyServerError` if it
        fails). Chunks that arrived before it may still wait in `next_event`'s queue (`next_chunk` skips them):
        skip those whose ``epoch`` or ``session_id`` is not ``stream.session``'s."""
        with self._lock:
            self._resetting += 1  # a frame's STALE_EPOCH may come before its answer: `next_chunk` skips it
        try:
            self._keep(self._client.reset_session(self._session))
        finally:
            with self._lock:
                self._resetting -= 1
        return self._session

    # -- receiving -----------------------------------------------------------------------------

    def next_event(self, timeout_s: float = 5.0) -> StreamEvent:
        """The next event, waiting at most ``timeout_s`` (0 polls); TimeoutError if none came."""
        try:
            return self._events.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no control event within {timeout_s:g} s") from None

    def next_chunk(self, timeout_s: float = 5.0) -> ActionChunk:
        """The next chunk of the stream's session at its current epoch; raises PolicyServerError on an error event,
        skips other events. What a reset or a reopened session left stale is skipped too: chunks of the episode
        before, and the STALE_EPOCH errors of frames sent in it (a robot must not act on the last episode). A frame
        sent at the stream's epoch that comes back STALE_EPOCH raises it: the session was reset elsewhere (a unary
        `PolicyClient.reset_session`, which the stream does not see), so every frame after it would be stale too."""
        end = time.monotonic() + timeout_s
        while True:
            event = self.next_event(max(0.0, end - time.monotonic()))
            current = self._session
            if event.kind == "chunk" and (event.chunk.session_id, event.chunk.epoch) == (current.session_id,
                                                                                         current.epoch):
                return event.chunk
            if event.kind == "error" and not self._left_stale(event.error):
                raise event.error
            if event.kind == "closed":
                raise event.error or _stream_closed()

    def _left_stale(self, error: PolicyServerError) -> bool:
        """Whether ``error`` is the STALE_EPOCH of a frame sent before this stream's own reset (or during one). A
        frame sent at the stream's epoch is stale because the session was reset elsewhere (``client.reset_session``):
        every frame after it would be too, so `next_chunk` raises that rather than wait out its timeout."""
        if error.reason != "STALE_EPOCH":
            return False
        with self._lock:  # read with the epoch a reset that has just ended left
            # A session reopened since (a restart) starts at epoch 1 again: its predecessor's errors are stale too.
            return (self._resetting > 0 or error.detail.metadata.get("session_id") != self._session.session_id
                    or int(error.detail.got) < self._session.epoch)


def _stream_closed() -> PolicyServerError:
    return PolicyServerError(grpc.StatusCode.CANCELLED, "STREAM_CLOSED", "the control stream was closed")


def _lost(error: PolicyServerError) -> bool:
    """Whether the server lost the session (it restarted, its replica went away, or the session expired for want of
    calls while the stream was away), as opposed to a CloseSession call closing it: only a lost session is reopened.
    Through Ray Serve's proxy too, a failed Control stream keeps the ``session_end`` that tells the two apart."""
    return error.reason == "SESSION_NOT_FOUND" and not error.session_closed


def _passing(error: PolicyServerError) -> bool:
    """Whether a refusal may pass if tried again: it says when, or it is RESOURCE_EXHAUSTED (one that says no delay:
    a Ray Serve deployment before session 50 kept a failed stream's reason and message only)."""
    return bool(error.retry_after_ms) or error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
