"""openpi-compatible WebSocket endpoint (``--websocket-port``), so ``openpi-client`` works unchanged.

The openpi wire: on connect the server sends one msgpack frame of metadata (once the model is warm: openpi's own
server takes no connection before, so its clients wait for that frame through a warmup); then strictly one
msgpack-numpy observation dict in, one reply dict out. ``GET /healthz`` answers 200 once the model
is warm (503 before). Arrays travel as ``{"__ndarray__": True, "data", "dtype", "shape"}``; only
bool, integer and float dtypes are accepted (no object arrays, nothing is ever unpickled).

Each connection is one session of the server's default budget, opened on the first observation
(it needs the ``prompt``). Observation keys, for each declared camera ``cam``:
``observation/cam``, ``observation/images/cam`` or ``images: {cam: ...}``, uint8 [H, W, 3] or
[3, H, W] with sides within the camera's declared bounds (cameras of different heights side by side, as over gRPC),
passed to the engine as they are (the pipeline fits them to its canvas, as for gRPC); state under
``observation/state`` or ``state``; text under ``prompt``; optional integer ``step_index`` (default: one past
the connection's last, at most 2^63 - 1); optional ``committed_actions``, float [d, action_dim] with d below the
chunk size: the actions the robot executes while the chunk is computed, which the chunk starts with (as the gRPC
``Observation.committed_actions``).
``{"reset": True}`` starts a new episode (epoch + 1).

Replies: ``actions`` float32 [K, action_dim] plus ``first_step_index``, ``epoch``, the tick record
and openpi's ``policy_timing`` / ``server_timing`` blocks. An error is a *text* frame
``"REASON: message"`` (openpi-client raises it as RuntimeError); the connection stays usable
after a bad observation and is closed (1011) on an internal error, and (1000) after answering
``SESSION_NOT_FOUND`` where its session was closed meanwhile (a CloseSession call naming it). Each refused
message costs the server its receipt and unpacking (about 12 ms of CPU at 12 MiB), so a connection whose refused
messages go beyond a burst of
``MAX_REFUSED_MESSAGES`` (16) at ``REFUSED_MESSAGES_HZ`` (2) per second is closed with 1008 (policy violation) after
the answer to the one too many, and its address's new connections are closed before
their handshake for the ``BARRED_S`` (8 s) a burst takes to refill. Connections beyond
``max_sessions + 4`` are closed at once with 1013 (try again later), and TCP connections beyond twice that plus 8,
those still in their handshake counted, are closed before it; one that sends nothing for
``session_idle_timeout_s`` is closed with 1001 (going away), so that it frees its place; its session lives as long
as the connection, and a client that closes while its observation is served ends that tick (as a gRPC caller that
goes away does). A connection that opens its session while the server is full waits, for at most
``CLOSING_WAIT_S`` (1 s), for the session of a connection already closing (a client that reconnected at once).
On shutdown the port refuses new connections at once (openpi's client retries a refused connection) and those
still in their handshake are closed; a connection answers the observation it is serving, then is closed with 1001;
one that arrives meanwhile is answered ``SHUTTING_DOWN``.
"""

from __future__ import annotations

import contextlib
import http
import logging
import math
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgpack
import numpy as np
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State
from websockets.sync.server import Server, ServerConnection, serve

from policy_server.engine.api import (
    CameraSpec,
    EmbodimentSpec,
    Engine,
    InvalidArgument,
    Overloaded,
    SchemaMismatch,
    SessionHandle,
    ShuttingDown,
    TooManySessions,
    UnknownSession,
)
from policy_server.limits import MAX_REFUSED_MESSAGES, REFUSED_MESSAGES_HZ
from policy_server.rate_limiter import RateLimiter
from policy_server.server import listen, validate
from policy_server.server.auth import bearer_token_matches
from policy_server.server.convert import PROTOCOL_VERSION, tick_to_dict
from policy_server.server.errors import from_exception, renamed
from policy_server.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

_ALLOWED_KINDS = {"b", "i", "u", "f"}
MAX_STEP_INDEX = 2**63 - 1
OPEN_TIMEOUT_S = 10.0  # a connection's handshake must be done within this
_WARM_POLL_S = 0.5  # a connection waiting for the warmup looks this often whether the server is stopping
_SHUTTING_DOWN = "server shutting down"  # the reason of the 1001 that closes each connection on shutdown
# A connection that finds no room waits at most this long (s) for a place held by a connection already closing: a
# client that reconnects at once (a restarted controller) otherwise races its old connection's thread, which frees
# the place within a millisecond once it sees the close, or, when the close came during a tick, once that tick stops
# at its next model step (the engine gives an abandoned tick as long). The wait ends as the place frees; a server
# full of open connections refuses at once.
CLOSING_WAIT_S = 1.0
# After a connection is closed for its refused messages, its address may open none for the time its burst takes to
# refill (s): a client that reconnects gets no new burst.
BARRED_S = MAX_REFUSED_MESSAGES / REFUSED_MESSAGES_HZ
# What unpacking one message may build. Every msgpack map and array becomes a Python object however few bytes it
# takes, so 16 MiB of empty arrays would cost about 6 s of CPU (the GIL held) and 1.2 GB; an observation is a
# handful of maps and short lists (openpi's own, under 20 containers of at most a few dozen items).
MAX_CONTAINERS = 256  # maps and arrays in one message, nested ones included
MAX_CONTAINER_ITEMS = 1024  # items of one array, keys of one map
_KEYS_SHOWN, _KEY_CHARS = 16, 64  # a missing key's error lists the message's keys, bounded
# The engine names the instruction after gRPC's fields; openpi sends it as `prompt`.
_PROMPT_FIELDS = ("instruction", "observation.instruction")


# ---------------------------------------------------------------------------------------------
# msgpack-numpy (openpi's array convention), implemented without any pickle fallback
# ---------------------------------------------------------------------------------------------


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _ALLOWED_KINDS:
            raise TypeError(f"cannot send arrays of dtype {obj.dtype}")
        return {
            b"__ndarray__": True,
            b"data": np.ascontiguousarray(obj).tobytes(),
            b"dtype": obj.dtype.str,
            b"shape": list(obj.shape),
        }
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot pack {type(obj).__name__}")


class ArrayError(ValueError):
    """A msgpack-numpy array or scalar map that does not describe an allowed array."""


def _require_keys(obj: dict, kind: str, keys: tuple[bytes, ...]) -> None:
    missing = [key.decode() for key in keys if key not in obj]
    if missing:
        raise ArrayError(f"a {kind} map without key {missing[0]!r} (it needs {', '.join(k.decode() for k in keys)})")


def _dtype(obj: dict) -> np.dtype:
    name = obj[b"dtype"]
    try:
        dtype = np.dtype(name) if isinstance(name, str) else None
    except (TypeError, ValueError):  # numpy's ways of saying "no such dtype"
        dtype = None
    if dtype is None or dtype.kind not in _ALLOWED_KINDS:
        raise ArrayError(f"dtype {name!r:.40}, which is not allowed (bool, int, uint or float only)")
    return dtype


def _unpack_hook(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        _require_keys(obj, "__ndarray__", (b"data", b"dtype", b"shape"))
        dtype, shape, data = _dtype(obj), obj[b"shape"], obj[b"data"]
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise ArrayError(f"shape {shape!r:.80}, not a list of non-negative integers")
        needed = math.prod(shape) * dtype.itemsize  # exact: a numpy product can overflow to a match
        if not isinstance(data, bytes) or len(data) != needed:
            got = f"{len(data)} bytes" if isinstance(data, bytes) else type(data).__name__
            raise ArrayError(f"data of {got} for shape {shape} {dtype}, which needs {needed} bytes")
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    if b"__npgeneric__" in obj:
        _require_keys(obj, "__npgeneric__", (b"data", b"dtype"))
        dtype = _dtype(obj)
        try:
            with np.errstate(over="raise", invalid="raise"):  # a value the dtype cannot hold is refused, not cast
                return dtype.type(obj[b"data"])
        except (TypeError, ValueError, OverflowError, FloatingPointError) as exc:
            raise ArrayError(f"scalar data {obj[b'data']!r:.40} that is not a {dtype}") from exc
    return obj


class TooManyContainers(ValueError):
    """A message of more maps and arrays than ``MAX_CONTAINERS``; unpacking stopped at the one too many."""


class TooManyItems(ValueError):
    """An array or map of more than ``MAX_CONTAINER_ITEMS`` items; msgpack refused it before building it."""


# How msgpack (its C and its Python unpacker alike) says an array or map is over `max_array_len` / `max_map_len`.
_OVER_ITEMS = re.compile(r"(\d+) exceeds max_(array|map)_len\(\d+\)")


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_pack_default)


def unpackb(data: bytes) -> Any:
    """``data`` unpacked, within ``MAX_CONTAINERS`` maps and arrays of ``MAX_CONTAINER_ITEMS`` items each (beyond:
    ``TooManyContainers``, ``TooManyItems``)."""
    containers = 0

    def counted(container):
        nonlocal containers
        containers += 1
        if containers > MAX_CONTAINERS:
            raise TooManyContainers(f"more than {MAX_CONTAINERS} maps and arrays")
        return container

    try:
        return msgpack.unpackb(data, object_hook=lambda obj: _unpack_hook(counted(obj)), list_hook=counted,
                               max_array_len=MAX_CONTAINER_ITEMS, max_map_len=MAX_CONTAINER_ITEMS)
    except ValueError as exc:
        over = _OVER_ITEMS.fullmatch(str(exc))
        if over is None:
            raise
        raise TooManyItems(f"{'an array' if over[2] == 'array' else 'a map'} of {over[1]} items") from None


# ---------------------------------------------------------------------------------------------
# Observation mapping
# ---------------------------------------------------------------------------------------------


def _camera_frame(message: dict, name: str) -> tuple[str, Any]:
    nested = message.get("images")
    if isinstance(nested, dict) and name in nested:
        return f"images/{name}", nested[name]
    for key in (f"observation/{name}", f"observation/images/{name}"):
        if key in message:
            return key, message[key]
    return f"observation/{name}", None


def _numeric(raw: object, field: str) -> np.ndarray:
    """A numeric array, or a list of numbers as one."""
    if isinstance(raw, list | tuple) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in raw):
        raw = np.asarray(raw, np.float64)
    if not isinstance(raw, np.ndarray) or raw.dtype.kind not in ("f", "i", "u"):
        got = str(raw.dtype) if isinstance(raw, np.ndarray) else type(raw).__name__
        raise InvalidArgument(field, "a numeric array", got, reason="BAD_DTYPE")
    return raw


class OpenpiObservation:
    """An openpi observation dict (keys in the module docstring), read for ``validate.observation``.
    ``default_step``: the step index when the dict has none (the connection's counter)."""

    instruction_field = "prompt"
    committed_field = "committed_actions"

    def __init__(self, message: dict, default_step: int) -> None:
        self._message, self._default_step = message, default_step
        self.state_field = "state" if "state" in message and "observation/state" not in message else "observation/state"

    def frame_field(self, camera: str) -> str:
        return _camera_frame(self._message, camera)[0]

    def frames(self, spec: EmbodimentSpec) -> dict[str, np.ndarray]:
        return {camera.name: self._frame(camera) for camera in spec.cameras}

    def _frame(self, camera: CameraSpec) -> np.ndarray:
        """uint8 [H, W, C] (or [C, H, W], transposed here), passed on at the size it was sent."""
        key, frame = _camera_frame(self._message, camera.name)
        if frame is None:
            raise SchemaMismatch(key, f"uint8 [H, W, 3] for camera {camera.name!r}", self._no_such_key())
        if not isinstance(frame, np.ndarray) or frame.dtype != np.uint8 or frame.ndim != 3:
            got = f"{frame.dtype} {list(frame.shape)}" if isinstance(frame, np.ndarray) else type(frame).__name__
            raise SchemaMismatch(key, "uint8 [H, W, 3] or [3, H, W]", got)
        if frame.shape[-1] != camera.channels and frame.shape[0] == camera.channels:
            frame = np.transpose(frame, (1, 2, 0))  # CHW, as several openpi examples send
        bounds = range(camera.min_side, camera.max_side + 1)
        if frame.shape[-1] != camera.channels or not all(side in bounds for side in frame.shape[:2]):
            raise SchemaMismatch(key, f"[H, W, {camera.channels}] with H and W in {camera.min_side}..{camera.max_side}",
                                 f"shape {list(frame.shape)}")
        return np.ascontiguousarray(frame)

    def _no_such_key(self) -> str:
        """What a missing key's error says was sent: the message's keys (a misnamed camera shows among them), at
        most `_KEYS_SHOWN`, each cut to `_KEY_CHARS`."""
        keys = sorted(str(key)[:_KEY_CHARS] for key in self._message)
        more = f" and {len(keys) - _KEYS_SHOWN} more" if len(keys) > _KEYS_SHOWN else ""
        return f"no such key (the message has {', '.join(keys[:_KEYS_SHOWN]) or 'no keys'}{more})"

    def state(self, spec: EmbodimentSpec) -> np.ndarray | None:
        """A numeric array or a list of numbers; a state sent to an embodiment without one is ignored."""
        if spec.state_dim == 0:
            return None
        raw = self._message.get(self.state_field)
        if raw is None:
            raise SchemaMismatch(self.state_field, f"float [{spec.state_dim}]", self._no_such_key())
        return _numeric(raw, self.state_field)

    def committed_actions(self) -> np.ndarray | None:
        """A numeric array or a list of rows of numbers; None when absent or without rows."""
        raw = self._message.get(self.committed_field)
        if raw is None:
            return None
        if isinstance(raw, list | tuple) and all(isinstance(row, list | tuple) for row in raw):
            raw = [_numeric(row, self.committed_field) for row in raw]
            if len({row.shape for row in raw}) > 1:
                raise SchemaMismatch(self.committed_field, "rows of one length", "rows of different lengths")
            raw = np.stack(raw) if raw else np.zeros((0, 0))
        values = _numeric(raw, self.committed_field)
        return None if values.size == 0 else values

    def instruction(self) -> str:
        prompt = self._message.get("prompt", "")
        if not isinstance(prompt, str):
            raise InvalidArgument("prompt", "a string", type(prompt).__name__, reason="BAD_VALUE")
        return prompt

    def step_index(self) -> int:
        step = self._message.get("step_index", self._default_step)
        if isinstance(step, np.generic):
            step = step.item()
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP_INDEX:
            raise InvalidArgument("step_index", "an integer in [0, 2^63)", repr(step), reason="BAD_VALUE")
        return step


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------


@dataclass
class _ConnectionState:
    """One connection's embodiment, its session (opened on the first observation), step counter and the
    bucket its refused messages draw on."""

    spec: EmbodimentSpec
    peer: tuple[str, int]  # the client's host and port: its socket has none once the client has gone
    session: SessionHandle | None = None
    steps: int = 0  # the step_index of an observation that gives none
    prev_total_ms: float = 0.0  # the previous answer's time from receipt to sent, ms
    refusals: RateLimiter = field(default_factory=lambda: RateLimiter(
        REFUSED_MESSAGES_HZ, time.monotonic(), burst=MAX_REFUSED_MESSAGES))


class OpenpiWebsocketServer:
    """Threaded WebSocket server; one handler thread per connection."""

    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics,
        host: str,
        port: int,
        max_message_bytes: int,
        idle_timeout_s: float,
        token: str | None = None,
        embodiment: str | None = None,
        ssl_context=None,
    ) -> None:
        """``idle_timeout_s``: a connection that sends nothing for this long is closed."""
        self._engine = engine
        self._metrics = metrics
        self._host, self._port = host, port
        self._max_message_bytes = max_message_bytes
        self._token = token
        self._default_embodiment = embodiment
        self._ssl = ssl_context
        self._idle_timeout_s = idle_timeout_s
        self._server: Server | None = None
        self._stopping = threading.Event()
        self._answering = 0  # connections serving an observation now
        self._answered = threading.Condition()
        # Each connection holds a thread: beyond one per session (plus a few that are closing), refuse.
        self._connections = threading.BoundedSemaphore(engine.info().max_sessions + 4)
        # A TCP connection holds two threads (its handler, its reader) from its accept, through its handshake (at
        # most `OPEN_TIMEOUT_S`): beyond twice as many connections, plus a few, it is closed at once.
        self._sockets = threading.BoundedSemaphore(2 * (engine.info().max_sessions + 4) + 8)
        self._barred: dict[str, float] = {}  # host -> until when it may not connect (time.monotonic() s)
        self._handshaking: set[socket.socket] = set()  # sockets accepted whose HTTP request has not come yet
        self._lock = threading.Lock()  # guards _barred, _handshaking and the start of a stop
        self._holding: set[ServerConnection] = set()  # the connections whose session is open
        self._released = threading.Condition()  # guards _holding and _releases; notified as a session closes
        self._releases = 0  # sessions closed by their connections so far

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return int(self._server.socket.getsockname()[1])

    def start(self) -> int:
        if self._default_embodiment is not None:
            validate.embodiment(self._engine.info(), self._default_embodiment)
        try:
            sock = listen.tcp_socket(self._host, self._port)
        except OSError as error:  # in use, or not an address of this machine
            raise listen.bind_failed("the openpi WebSocket", listen.address(self._host, self._port), error) from None
        sock.listen()
        self._server = serve(
            self._handle,
            sock=sock,
            ssl=self._ssl,
            compression=None,
            max_size=self._max_message_bytes,
            # openpi sends an observation, then waits for its answer: read one message ahead (websockets pauses once
            # more than max_queue wait), not its default 16 (16 x max_size held per connection for a client that
            # sends on); TCP holds a client that sends on.
            max_queue=0,
            process_request=self._process_request,
            open_timeout=OPEN_TIMEOUT_S,
            close_timeout=2,  # shutdown waits this long at most for a client that does not close
        )
        self._server.handler = self._bounded(self._server.handler)
        threading.Thread(target=self._server.serve_forever, daemon=True, name="openpi-ws").start()
        return self.port

    def _bounded(self, handle_socket):
        """`handle_socket(sock, addr)`, websockets' handshake and connection, for at most `_sockets` sockets at once,
        from addresses not barred. Any other socket is closed on its thread's start, before its handshake (the least
        a flood of them can cost), and still handed to websockets, whose handler then fails on it at once and forgets
        its thread as for any socket that fails; so is one accepted as the server stops."""
        def bounded(sock, addr) -> None:
            with self._lock:
                refused = (self._stopping.is_set() or self._barred.get(addr[0], 0.0) > time.monotonic()
                           or not self._sockets.acquire(blocking=False))
                if not refused:
                    self._handshaking.add(sock)
            if refused:
                sock.close()
                handle_socket(sock, addr)
                return
            try:
                handle_socket(sock, addr)
            finally:
                with self._lock:
                    self._handshaking.discard(sock)
                self._sockets.release()

        return bounded

    def stop(self, grace_s: float) -> None:
        """Refuse new connections and end those in their handshake, answer the observations being served (for at
        most ``grace_s``), then close every connection (1001)."""
        if self._server is None:
            return
        with self._lock:
            self._stopping.set()
            handshaking = list(self._handshaking)
        # Closed now, not after the grace by shutdown() below: a client reconnecting meanwhile is refused, which
        # openpi's client retries on, rather than handed the metadata frame and then SHUTTING_DOWN.
        self._server.socket.close()
        for sock in handshaking:  # shutdown() would wait for each until its handshake timed out (OPEN_TIMEOUT_S)
            with contextlib.suppress(OSError):  # its client has closed it meanwhile
                sock.shutdown(socket.SHUT_RDWR)
        with self._answered:
            self._answered.wait_for(lambda: self._answering == 0, timeout=grace_s)
        self._server.shutdown(reason=_SHUTTING_DOWN)
        self._server = None

    def _bar(self, host: str) -> None:
        """Close `host`'s new connections for `BARRED_S`; forget the addresses whose time is up."""
        log.warning("closed a WebSocket connection from %s for its refused messages; its address may not connect "
                    "for %g s", host, BARRED_S)
        now_s = time.monotonic()
        with self._lock:
            self._barred = {h: until for h, until in self._barred.items() if until > now_s}
            self._barred[host] = now_s + BARRED_S

    # -- HTTP side: /healthz, auth, embodiment selection ---------------------------------------

    def _embodiment_for(self, path: str) -> EmbodimentSpec:
        info = self._engine.info()
        names = parse_qs(urlsplit(path).query, keep_blank_values=True).get("embodiment")
        if names is not None and len(names) > 1:
            raise InvalidArgument("embodiment", "one ?embodiment= in the URL", f"{len(names)} of them",
                                  reason="BAD_VALUE")
        return validate.embodiment(info, names[0] if names else (self._default_embodiment or info.embodiments[0].name))

    def _process_request(self, connection: ServerConnection, request):
        with self._lock:  # its request has come: the rest of its handshake is the answer
            self._handshaking.discard(connection.socket)
        if urlsplit(request.path).path == "/healthz":
            if self._engine.ready():
                return connection.respond(http.HTTPStatus.OK, "OK\n")
            return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, "warming up\n")
        if self._token is not None and not bearer_token_matches(
            request.headers.get("Authorization"), self._token
        ):
            self._metrics.observe_error("UNAUTHENTICATED")
            return connection.respond(
                http.HTTPStatus.UNAUTHORIZED, "UNAUTHENTICATED: missing or invalid token\n"
            )
        try:
            self._embodiment_for(request.path)
        except InvalidArgument as exc:
            self._metrics.observe_error(exc.reason)
            return connection.respond(http.HTTPStatus.BAD_REQUEST, f"{exc.reason}: {exc.message}\n")
        return None

    # -- WebSocket side ------------------------------------------------------------------------

    def _metadata(self, spec: EmbodimentSpec) -> dict:
        info = self._engine.info()
        return {
            "server": "policy-server",
            "protocol_version": PROTOCOL_VERSION,
            "model": info.model_name,
            "model_digest": info.model_digest,
            "embodiment": spec.name,
            "cameras": {c.name: [c.height, c.width, c.channels] for c in spec.cameras},  # the size to send
            "frame_sides": {c.name: [c.min_side, c.max_side] for c in spec.cameras},
            "state_dim": spec.state_dim,
            "action_dim": spec.action.dim,
            "action_units": list(spec.action.units),
            # as float32, the actions' dtype (ServerInfo's are float32 too): an action clipped to a limit of 0.2 is
            # float32(0.2), above the float64 0.2, and a robot's check against the limits must let it pass
            "action_low": [float(np.float32(v)) for v in spec.action.low],
            "action_high": [float(np.float32(v)) for v in spec.action.high],
            "chunk_size": spec.default_chunk_size,
            "control_hz": spec.control_hz,
            "budget_ms": info.default_budget_ms,
            "observation_keys": {
                "images": [f"observation/{c.name}" for c in spec.cameras],
                "state": "observation/state" if spec.state_dim else None,
                "prompt": "prompt",
                "committed_actions": "committed_actions",  # optional: what the chunk starts with (module docstring)
            },
            # openpi's example robots resize_with_pad their frames to the model's 224x224; here none needs to: a frame
            # is taken at any size within frame_sides, and the server scales cameras of different heights itself
            "images_resized_with_pad": False,
        }

    def _handle(self, connection: ServerConnection) -> None:
        if not self._connections.acquire(blocking=False):
            connection.close(code=1013, reason="too many connections; try again later")
            return
        try:
            self._serve_connection(connection)
        finally:
            self._connections.release()

    def _serve_connection(self, connection: ServerConnection) -> None:
        try:
            peer = connection.remote_address[:2]
        except OSError:  # the client has gone since its handshake, and its socket is closed
            return
        state = _ConnectionState(self._embodiment_for(connection.request.path), peer)
        try:
            with contextlib.ExitStack() as attached:  # its session, held open while the connection is
                if not self._wait_until_warm():
                    connection.close(code=1001, reason=_SHUTTING_DOWN)
                    return
                connection.send(packb(self._metadata(state.spec)))
                while True:
                    try:
                        raw = connection.recv(timeout=self._idle_timeout_s)
                    except TimeoutError:  # a silent client would hold one of the limited connections forever
                        connection.close(code=1001, reason=f"idle for {self._idle_timeout_s:g} s")
                        return
                    with self._answering_one():
                        if not self._answer(connection, raw, state, attached):
                            return
        except ConnectionClosed as closed:
            if closed.sent is not None and closed.sent.code == 1009:  # websockets refused a message over max_size
                self._metrics.observe_error("PAYLOAD_TOO_LARGE")
        finally:
            if state.session is not None:
                why = f"its WebSocket connection closed with {connection.close_code}"
                if connection.close_reason:  # the client's text (123 bytes at most): repr escapes line breaks
                    why += f" ({connection.close_reason!r})"
                try:
                    self._engine.close_session(state.session.session_id, why)
                except UnknownSession:  # the engine shut down, or a CloseSession call closed it
                    log.debug("session %s was already closed", state.session.session_id)
                with self._released:
                    self._holding.discard(connection)
                    self._releases += 1
                    self._released.notify_all()

    def _open_session(self, connection: ServerConnection, state: _ConnectionState, instruction: str) -> SessionHandle:
        """Open the connection's session. Refused for want of room while a connection already closing (its close
        frame or its end of the TCP stream received) still holds its session, it waits for a session to close, at most
        `CLOSING_WAIT_S`, and asks once more: the place a client that reconnected at once
        needs is its old connection's. Refused with nothing closing, it is refused at once."""
        host, port = state.peer

        def open_session() -> SessionHandle:
            # The openpi protocol cannot declare a rate (its clients ask again when a chunk runs out) nor a name.
            return self._engine.open_session(state.spec.name, instruction, rate_hz=0.0,
                                             client_name=f"openpi client at {host}:{port}")

        with self._released:
            releases = self._releases
        try:
            session = open_session()
        except (TooManySessions, Overloaded):
            with self._released:
                if self._releases == releases and all(c.state is State.OPEN for c in self._holding):
                    raise
                self._released.wait_for(lambda: self._releases != releases, timeout=CLOSING_WAIT_S)
            session = open_session()
        with self._released:
            self._holding.add(connection)
        return session

    def _wait_until_warm(self) -> bool:
        """Wait for the model's warmup; False when the server stops first. openpi's own server takes no connection
        before its model is ready, so its clients infer as soon as the metadata frame has come: sent only once warm,
        it keeps them waiting through a warmup rather than failing their first observation with WARMING_UP."""
        while not self._stopping.is_set():
            if self._engine.wait_ready(timeout_s=_WARM_POLL_S):
                return True
        return False

    def _answer(self, connection: ServerConnection, raw: bytes | str, state: _ConnectionState,
                attached: contextlib.ExitStack) -> bool:
        """Answer one message: a chunk, a reset's epoch or an error text frame. False when it closed the
        connection (an internal error, the server stopping, or refused messages beyond their rate)."""
        started = time.monotonic()
        try:
            if self._stopping.is_set():
                raise ShuttingDown()
            if isinstance(raw, str):
                raise InvalidArgument("frame", "a binary msgpack frame", "a text frame", reason="BAD_VALUE")
            message = self._decode(raw)
            if not isinstance(message.get("reset", False), bool):  # 1 or "true" would be read as an observation
                raise InvalidArgument("reset", "true (a new episode) or false", repr(message["reset"]),
                                      reason="BAD_VALUE")
            if message.get("reset") is True:
                if state.session is not None:
                    state.session = self._engine.reset_session(state.session.session_id)
                state.steps = 0
                connection.send(packb({"reset": True, "epoch": state.session.epoch if state.session else 0}))
                return True
            observation = validate.observation(OpenpiObservation(message, state.steps), state.spec,
                                               state.spec.default_chunk_size)  # the chunk its sessions open with
            if state.session is None:
                validate.instruction(observation.instruction, "prompt")
                state.session = self._open_session(connection, state, observation.instruction)
                attached.enter_context(self._engine.attach(state.session.session_id))
            # A client gone meanwhile (websockets' reader sees its close) ends the tick: its session, whose place a
            # reconnecting client needs, closes only once this returns.
            result = self._engine.act(state.session.session_id, state.session.epoch, observation,
                                      should_abort=lambda: connection.state is not State.OPEN)
        except Exception as exc:  # noqa: BLE001 - answered as a text frame
            error = from_exception(renamed(exc, _PROMPT_FIELDS, "prompt"))
            self._metrics.observe_error(error.reason)
            connection.send(f"{error.reason}: {error.detail.message}")
            if error.reason in _ENDING:  # the connection's session is gone with SESSION_NOT_FOUND: it serves no more
                connection.close(code=_ENDING[error.reason], reason=_close_reason(error.detail.message))
                return False
            # Receiving them takes CPU from the sessions' ticks.
            if state.refusals.take(started) > 0:
                self._metrics.observe_error("RATE_EXCEEDED")
                reason = (f"too many refused messages: {state.refusals.measured_hz:.1f} per second, beyond a burst of "
                          f"{MAX_REFUSED_MESSAGES} at {REFUSED_MESSAGES_HZ:g} per second")
                self._bar(state.peer[0])
                connection.close(code=1008, reason=reason)
                return False
            return True
        state.steps = min(observation.step_index + 1, MAX_STEP_INDEX)  # the default stays a valid step_index
        served_ms = (time.monotonic() - started) * 1e3
        self._metrics.observe_tick(result, served_ms, "websocket")
        connection.send(packb({
            "actions": np.asarray(result.actions, dtype=np.float32),
            "first_step_index": result.first_step_index,
            "epoch": state.session.epoch,
            "tick": tick_to_dict(result.tick),
            "policy_timing": {"infer_ms": float(result.tick.actual_ms["total"])},
            "server_timing": {"infer_ms": served_ms, "prev_total_ms": state.prev_total_ms},
        }))
        state.prev_total_ms = (time.monotonic() - started) * 1e3
        return True

    @contextlib.contextmanager
    def _answering_one(self):
        """Counts the connections serving an observation: `stop` lets them answer before it closes them."""
        with self._answered:
            self._answering += 1
        try:
            yield
        finally:
            with self._answered:
                self._answering -= 1
                self._answered.notify_all()

    @staticmethod
    def _decode(raw: bytes) -> dict:
        try:
            message = unpackb(raw)
        except ArrayError as exc:
            raise InvalidArgument(
                "frame", "arrays as msgpack-numpy maps {__ndarray__, data, dtype, shape}", str(exc), reason="BAD_VALUE"
            ) from exc
        except TooManyContainers as exc:
            raise InvalidArgument("frame", f"a msgpack map of at most {MAX_CONTAINERS} maps and arrays, nested ones "
                                  "included", str(exc), reason="BAD_VALUE") from exc
        except TooManyItems as exc:
            raise InvalidArgument("frame", f"a msgpack map whose maps and arrays hold at most {MAX_CONTAINER_ITEMS} "
                                  "items each", str(exc), reason="BAD_VALUE") from exc
        except Exception as exc:  # noqa: BLE001 - msgpack raises many types for bad input
            got = f"{len(raw)} bytes msgpack cannot decode: {_undecodable(exc)}"
            raise InvalidArgument("frame", "a msgpack map of observation keys", got, reason="BAD_VALUE") from exc
        if not isinstance(message, dict):
            raise InvalidArgument(
                "frame", "a msgpack map of observation keys", f"a msgpack {type(message).__name__}", reason="BAD_VALUE"
            )
        return message


# The errors that close the connection after their answer, and the close code of each.
_ENDING = {"INTERNAL": 1011, "SHUTTING_DOWN": 1001, "SESSION_NOT_FOUND": 1000}
_MAX_CLOSE_REASON_BYTES = 123  # what a close frame holds (RFC 6455)


def _close_reason(text: str) -> str:
    """``text`` as a close frame's reason: clipped to its UTF-8 bytes, never within a character."""
    return text.encode()[:_MAX_CLOSE_REASON_BYTES].decode(errors="ignore")


def _undecodable(exc: Exception) -> str:
    """What msgpack found wrong; two of its errors carry no message."""
    if isinstance(exc, msgpack.FormatError):
        return "a byte that begins no msgpack value"
    if isinstance(exc, msgpack.StackError):
        return "nesting deeper than msgpack allows"
    return str(exc)
