"""Request validation: wire messages in, engine dataclasses out, or a precise error naming the field.

Everything the wire can get wrong is caught here, before the engine is called: messages over the size
limit, missing fields, tensors whose bytes do not match dtype x shape, images that do not decode or do
not match the session's declared cameras (names, side bounds, the width beside the tallest camera), states
and actions outside the declared range or of the wrong dimension, budgets, rates and texts outside
``policy_server.limits``. The engine checks only what needs its model: token counts.

Every entry point that acts (unary ``Act``, the ``Control`` stream, the openpi WebSocket) turns its
observation into an ``Observation`` through ``observation``: each wire only reads its own encoding
(``SentObservation``), and the checks against the embodiment are made here, once, the same for all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np

from policy_server import limits
from policy_server.engine.api import (
    Cancelled,
    EmbodimentSpec,
    Engine,
    InvalidArgument,
    Observation,
    SchemaMismatch,
    ServerInfo,
    SessionHandle,
    StaleEpoch,
    UnknownEmbodiment,
    VideoClip,
)
from policy_server.server.errors import make_error
from policy_server.specs import too_wide_beside
from policy_server.v1 import policy_server_pb2 as pb
from policy_server.v1.wire import decode_image, tensor_from_proto

_MAX_ID_CHARS = 128  # session ids are 32 hex characters; embodiment names are short


def require(present: bool, field: str, expected: str) -> None:
    if not present:
        raise InvalidArgument(field, expected, "nothing (field unset or empty)", reason="MISSING_FIELD")


def message_size(size: int, limit: int, field: str, what: str) -> None:
    """A message of ``size`` bytes within ``limit`` (the server's ``max_message_bytes``): PAYLOAD_TOO_LARGE otherwise.
    gRPC core already refuses anything above twice the limit (see app.py); this check gives the messages in
    between a precise reason."""
    if size > limit:
        raise make_error("PAYLOAD_TOO_LARGE", f"{what} of {size} bytes exceeds the message limit of {limit} bytes",
                         field=field,
                         expected=f"<= {limit} bytes", got=f"{size} bytes")


def session_id(value: str, field: str = "session_id") -> str:
    require(bool(value), field, "the id returned by OpenSession")
    if len(value) > _MAX_ID_CHARS:
        raise InvalidArgument(field, "the id returned by OpenSession", f"{len(value)} characters", reason="BAD_VALUE")
    return value


def epoch(value: int, field: str = "epoch") -> int:
    require(value >= 1, field, "the session epoch (>= 1) from OpenSession / ResetSession")
    return value


def budget_ms(value: float, field: str = "budget_ms") -> float:
    if not (math.isfinite(value) and 0 < value <= limits.MAX_BUDGET_MS):
        raise InvalidArgument(field, f"a latency budget in (0, {limits.MAX_BUDGET_MS:g}] ms", f"{value!r}",
                              reason="BAD_VALUE")
    return float(value)


def rate_hz(value: float, field: str = "rate_hz") -> float:
    if not (value == 0 or limits.MIN_RATE_HZ <= value <= limits.MAX_RATE_HZ):  # NaN fails both
        raise InvalidArgument(field, f"0 (a closed loop) or a request rate in [{limits.MIN_RATE_HZ:g}, "
                              f"{limits.MAX_RATE_HZ:g}] Hz", f"{value!r}", reason="BAD_VALUE")
    return float(value)


def client_name(value: str, field: str = "client_name") -> str:
    """Who opens a session, for the log: printable, so that a name cannot forge or split log lines."""
    if len(value) > limits.MAX_CLIENT_NAME_CHARS:
        raise InvalidArgument(field, f"a name of at most {limits.MAX_CLIENT_NAME_CHARS} characters",
                              f"{len(value)} characters", reason="TOO_LONG")
    unprintable = next((c for c in value if not c.isprintable()), None)
    if unprintable is not None:
        raise InvalidArgument(field, "printable characters (no line breaks or control characters)",
                              f"{unprintable!r} in the name", reason="BAD_VALUE")
    return value


def request_id(value: str) -> str:
    """The caller's id of one OpenSession (empty: none), bounded and of a plain charset: the log and errors name it,
    and the Python client sends it as Ray Serve's routing key (call metadata)."""
    expected = (f"{limits.MIN_REQUEST_ID_CHARS} to {limits.MAX_REQUEST_ID_CHARS} characters of A-Z a-z 0-9 '-' '_' "
                "(a uuid4 hex), or none")
    if len(value) > limits.MAX_REQUEST_ID_CHARS:
        raise InvalidArgument("request_id", expected, f"{len(value)} characters", reason="TOO_LONG")
    if value and len(value) < limits.MIN_REQUEST_ID_CHARS:  # guessable: another client could take the session
        raise InvalidArgument("request_id", expected, f"{len(value)} characters", reason="BAD_VALUE")
    other = next((c for c in value if c not in limits.REQUEST_ID_CHARS), None)
    if other is not None:
        raise InvalidArgument("request_id", expected, f"{other!r} in the id", reason="BAD_VALUE")
    return value


def text(value: str, field: str, what: str) -> str:
    """A non-empty text within ``MAX_TEXT_BYTES`` (its token count is the engine's to check)."""
    require(bool(value), field, f"a non-empty {what}")
    if not value.strip():
        raise InvalidArgument(field, f"a non-empty {what}", f"only whitespace ({len(value)} characters)",
                              reason="MISSING_FIELD")
    size = len(value.encode("utf-8", errors="surrogatepass"))
    if size > limits.MAX_TEXT_BYTES:
        raise InvalidArgument(field, f"a {what} of at most {limits.MAX_TEXT_BYTES} UTF-8 bytes", f"{size} bytes",
                              reason="TOO_LONG")
    return value


def instruction(value: str, field: str = "instruction") -> str:
    return text(value, field, "task instruction")


def optional_instruction(value: str, field: str) -> str:
    """An observation's instruction: "" keeps the session's."""
    return text(value, field, "task instruction") if value else value


def temperature(value: float, field: str = "temperature") -> float:
    if not (math.isfinite(value) and 0 <= value <= limits.MAX_TEMPERATURE):
        raise InvalidArgument(field, f"a temperature in [0, {limits.MAX_TEMPERATURE:g}] (0: greedy)", repr(value),
                              reason="BAD_VALUE")
    return float(value)


def max_new_tokens(value: int, limit: int, field: str = "max_new_tokens") -> int:
    """A Reason call's token count: 1..``limit`` (the engine's ``max_reason_tokens``)."""
    if not 1 <= value <= limit:
        raise InvalidArgument(field, f"1..{limit}", str(value), reason="BAD_VALUE")
    return value


def embodiment(info: ServerInfo, name: str) -> EmbodimentSpec:
    require(bool(name), "embodiment", f"one of {[e.name for e in info.embodiments]}")
    spec = info.embodiment(name)
    if spec is None:
        raise UnknownEmbodiment(name[:_MAX_ID_CHARS], tuple(e.name for e in info.embodiments))
    return spec


def session_at(engine: Engine, session_id: str, epoch: int) -> tuple[SessionHandle, EmbodimentSpec]:
    """The session a request names, at the epoch it names, and its embodiment. Raises UnknownSession, StaleEpoch.

    A stale request is refused here, before its frames are decoded; the engine checks the epoch again under its
    lock, since a reset may come in between."""
    handle = engine.session(session_id)
    if epoch != handle.epoch:
        raise StaleEpoch(session_id, handle.epoch, epoch)
    return handle, engine.info().embodiment(handle.embodiment)


def chunk_size(spec: EmbodimentSpec, value: int, field: str = "chunk_size") -> int:
    if not spec.min_chunk_size <= value <= spec.max_chunk_size:
        raise InvalidArgument(
            field,
            f"{spec.min_chunk_size}..{spec.max_chunk_size} for {spec.name}",
            str(value),
            reason="BAD_VALUE",
        )
    return value


def actions_per_chunk(value: int, chunk: int, field: str = "actions_per_chunk") -> int:
    if not 1 <= value <= chunk:
        raise InvalidArgument(field, f"1..{chunk} (the chunk size)", str(value), reason="BAD_VALUE")
    return value


def _indices(values: np.ndarray, flat: np.ndarray) -> list:
    """Positions in ``values`` given flat, as its own indices: ``i`` in a vector, ``[row, dimension]`` in a chunk
    (a flat 7 in a [8, 2] chunk read as row 7, not row 3's second dimension)."""
    if values.ndim == 1:
        return [int(i) for i in flat]
    return [[int(i) for i in index] for index in zip(*np.unravel_index(flat, values.shape), strict=True)]


def _in_range(values: np.ndarray, low: tuple[float, ...], high: tuple[float, ...], what: str,
              field: str) -> np.ndarray:
    """``values`` (any numeric dtype, last axis per dimension) finite and inside ``[low, high]`` per dimension
    (empty: what float32 can hold). Returns them as float32."""
    wide = values.astype(np.float64)
    if not np.all(np.isfinite(wide)):
        bad = _indices(values, np.flatnonzero(~np.isfinite(wide.reshape(-1))))
        raise InvalidArgument(field, "finite values", f"NaN/Inf at index {bad}", reason="NON_FINITE")
    if low:
        # The limits as float32 holds them, as the values are used and as the server clips its own actions: its
        # chunk's -0.2 (float32 -0.2000000030) is inside a declared -0.2.
        lo, hi = np.asarray(low, np.float32).astype(np.float64), np.asarray(high, np.float32).astype(np.float64)
        expected = f"values within the accepted {what} range [{list(low)}, {list(high)}]"
    else:
        hi = np.full(values.shape[-1:], np.finfo(np.float32).max, np.float64)
        lo, expected = -hi, "values float32 can represent"
    outside = np.flatnonzero(((wide < lo) | (wide > hi)).reshape(-1))
    if outside.size:
        i = int(outside[0])
        sent = str(values.reshape(-1)[i])  # in the digits its dtype needs: `:g` showed a float32 1.0000001 as "1"
        more = f" ({outside.size} out of range)" if outside.size > 1 else ""
        raise InvalidArgument(field, expected, f"{sent} at index {_indices(values, outside[:1])[0]}{more}",
                              reason="OUT_OF_RANGE")
    return wide.astype(np.float32)


def state(values: np.ndarray, spec: EmbodimentSpec, field: str) -> np.ndarray:
    """A decoded state vector (any numeric dtype): the declared width, finite, inside the declared range.
    Returns float32 ``[state_dim]``."""
    if values.shape != (spec.state_dim,):
        raise SchemaMismatch(field, f"shape [{spec.state_dim}]", f"shape {list(values.shape)}")
    return _in_range(values, spec.state_low, spec.state_high, "state", field)


def _float_tensor(tensor: pb.Tensor, field: str) -> np.ndarray:
    if tensor.dtype not in (pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT64):
        got = pb.DType.Name(tensor.dtype) if tensor.dtype in pb.DType.values() else str(tensor.dtype)
        raise InvalidArgument(f"{field}.dtype", "DTYPE_FLOAT32 or DTYPE_FLOAT64", got, reason="BAD_DTYPE")
    return tensor_from_proto(tensor, field)


def actions(tensor: pb.Tensor, spec: EmbodimentSpec, chunk: int, field: str = "actions") -> np.ndarray:
    """A forward-dynamics action chunk: float32/float64 ``[chunk, action_dim]`` in physical units, finite, inside
    the range given actions are accepted in (``ActionSpec.given_low`` / ``given_high``). Returns float32."""
    values = _float_tensor(tensor, field)
    if values.shape != (chunk, spec.action.dim):
        raise SchemaMismatch(field, f"shape [{chunk}, {spec.action.dim}] (the session's chunk size x action dim)",
                             f"shape {list(values.shape)}")
    return _in_range(values, spec.action.given_low, spec.action.given_high, "action", field)


def committed_actions(values: np.ndarray, spec: EmbodimentSpec, chunk: int | None, field: str) -> np.ndarray:
    """Actions the robot executes while a chunk is computed (any numeric dtype): ``[d, action_dim]`` with
    ``1 <= d < chunk``, finite, inside the range given actions are accepted in. ``chunk`` None: a call that takes
    none (dynamics). Returns float32."""
    if chunk is None:
        raise InvalidArgument(field, "no committed actions (an act's observation takes them)",
                              f"shape {list(values.shape)}", reason="BAD_VALUE")
    if values.ndim != 2 or not 1 <= values.shape[0] < chunk or values.shape[1] != spec.action.dim:
        raise SchemaMismatch(field, f"shape [d, {spec.action.dim}] with 1 <= d < {chunk} (the session's chunk size)",
                             f"shape {list(values.shape)}")
    return _in_range(values, spec.action.given_low, spec.action.given_high, "action", field)


def _sent_state(message, spec: EmbodimentSpec, field: str) -> np.ndarray | None:
    """The ``state`` tensor of an Observation or InverseDynamicsRequest as sent: float32/float64 values, not yet
    checked against the embodiment; None for an embodiment without state (which must then get none)."""
    if spec.state_dim > 0:
        if not message.HasField("state") or message.state.ByteSize() == 0:  # unset, or set to an empty Tensor
            raise SchemaMismatch(field, f"float32 [{spec.state_dim}]", "no state")
        return _float_tensor(message.state, field)
    if message.HasField("state") and len(message.state.shape) and math.prod(message.state.shape) > 0:
        raise SchemaMismatch(field, f"no state for {spec.name}", f"shape {list(message.state.shape)}")
    return None


def _cameras(sent, spec: EmbodimentSpec, field: str) -> None:
    """``sent`` (a map keyed by camera name) holds exactly the embodiment's cameras."""
    declared = {c.name for c in spec.cameras}
    unexpected = sorted(set(sent) - declared)
    if unexpected:
        shown = [name[:_MAX_ID_CHARS] for name in unexpected[:4]]
        raise SchemaMismatch(
            field, f"cameras {sorted(declared)}",
            f"unknown camera(s) {shown}" + (f" and {len(unexpected) - 4} more" if len(unexpected) > 4 else ""),
        )
    for camera in spec.cameras:
        if camera.name not in sent:
            raise SchemaMismatch(f"{field}[{camera.name}]", f"frames of camera {camera.name!r}",
                                 f"none (sent: {sorted(sent)})")


def _frame(image: pb.Image, camera, field: str) -> np.ndarray:
    return decode_image(image, field, camera.max_side, camera.min_side, camera.channels)


def _side_by_side(frames: Mapping[str, np.ndarray], spec: EmbodimentSpec, field_of: Callable[[str], str]) -> None:
    """The cameras' frames (``[..., H, W, C]``, each within its camera's side bounds) fit side by side: scaled to
    the tallest camera's height, as the model sees them, each is at most its camera's ``max_side`` wide
    (``specs.too_wide_beside``). ``field_of(camera)``: the field that carries a camera's frames."""
    sizes = {camera.name: frames[camera.name].shape[-3:-1] for camera in spec.cameras}
    too_wide = too_wide_beside(sizes, {camera.name: camera.max_side for camera in spec.cameras})
    if too_wide is not None:
        name, tallest, scaled = too_wide
        height, width = sizes[name]
        raise SchemaMismatch(
            field_of(name),
            f"a frame at most {spec.camera(name).max_side} px wide once scaled to the height of camera {tallest!r} "
            f"({sizes[tallest][0]} px, aspect kept), which the model sees it beside",
            f"{height}x{width} px, {scaled} px wide at that height")


# ---------------------------------------------------------------------------------------------
# Observations: one check for every transport
# ---------------------------------------------------------------------------------------------


class SentObservation(Protocol):
    """One observation as a transport carries it. The transport reads its own encoding (and raises its own errors
    for what does not decode); ``observation`` checks what it reads against the embodiment."""

    instruction_field: str
    state_field: str
    committed_field: str

    def frame_field(self, camera: str) -> str:
        """The field that carries ``camera``'s frame, as errors name it."""
        ...

    def frames(self, spec: EmbodimentSpec) -> dict[str, np.ndarray]:
        """Each declared camera's frame: uint8 [H, W, channels], H and W within the camera's side bounds."""
        ...

    def state(self, spec: EmbodimentSpec) -> np.ndarray | None:
        """The state as sent (numeric, not yet checked against the embodiment); None when the embodiment takes
        none."""
        ...

    def instruction(self) -> str:
        """The task text; "" keeps the session's."""
        ...

    def step_index(self) -> int: ...

    def committed_actions(self) -> np.ndarray | None:
        """The committed actions as sent (numeric, not yet checked); None when none are (or no rows)."""
        ...


def observation(sent: SentObservation, spec: EmbodimentSpec, chunk: int | None) -> Observation:
    """``sent`` checked against the session's embodiment: its cameras' frames (``_side_by_side``), the instruction's
    size, the state's width, finiteness and range (float32 [state_dim]), the committed actions (``committed_actions``;
    ``chunk``: the session's chunk size, None where the call takes none)."""
    images = sent.frames(spec)
    _side_by_side(images, spec, sent.frame_field)
    instruction_text = optional_instruction(sent.instruction(), sent.instruction_field)
    values = sent.state(spec)
    committed = sent.committed_actions()
    return Observation(images=images, state=None if values is None else state(values, spec, sent.state_field),
                       instruction=instruction_text, step_index=sent.step_index(),
                       committed_actions=None if committed is None else committed_actions(committed, spec, chunk,
                                                                                          sent.committed_field))


class ProtoObservation:
    """A ``pb.Observation`` at ``field``: ``observation`` of an ActRequest, ``observation.observation`` of a
    Control frame."""

    def __init__(self, message: pb.Observation, field: str) -> None:
        self._message, self._field = message, field
        self.instruction_field = f"{field}.instruction"
        self.state_field = f"{field}.state"
        self.committed_field = f"{field}.committed_actions"

    @classmethod
    def of(cls, parent, field: str) -> ProtoObservation:
        """``parent.observation``, which must be set."""
        require(parent.HasField("observation"), field, "an Observation")
        return cls(parent.observation, field)

    def frame_field(self, camera: str) -> str:
        return f"{self._field}.images[{camera}]"

    def frames(self, spec: EmbodimentSpec) -> dict[str, np.ndarray]:
        images = self._message.images
        _cameras(images, spec, f"{self._field}.images")
        return {camera.name: _frame(images[camera.name], camera, self.frame_field(camera.name))
                for camera in spec.cameras}

    def state(self, spec: EmbodimentSpec) -> np.ndarray | None:
        return _sent_state(self._message, spec, self.state_field)

    def instruction(self) -> str:
        return self._message.instruction

    def step_index(self) -> int:
        return self._message.step_index

    def committed_actions(self) -> np.ndarray | None:
        if not self._message.HasField("committed_actions"):
            return None
        values = _float_tensor(self._message.committed_actions, self.committed_field)  # a tensor, if without rows
        return None if values.size == 0 else values


def video_clip(request: pb.InverseDynamicsRequest, spec: EmbodimentSpec, chunk: int,
               ended: Callable[[], bool]) -> VideoClip:
    """Decode and check an inverse-dynamics video: per camera ``chunk + 1`` frames of one size, the cameras fitting
    side by side (``_side_by_side``), plus the state at frame 0. Cancelled between two frames once ``ended()`` (the
    call's deadline passed or its caller went away: 17 frames of 2048x2048 take 0.7 s)."""
    _cameras(request.videos, spec, "videos")
    frames: dict[str, np.ndarray] = {}
    for camera in spec.cameras:
        video_field = f"videos[{camera.name}].frames"
        sent = request.videos[camera.name].frames
        if len(sent) != chunk + 1:
            raise SchemaMismatch(video_field, f"{chunk + 1} frames (the session's chunk size + 1)",
                                 f"{len(sent)} frames")
        decoded = []
        for i, image in enumerate(sent):
            if ended():
                raise Cancelled("the call ended (its deadline, or its caller gone) while its frames were decoded")
            decoded.append(_frame(image, camera, f"{video_field}[{i}]"))
        for i, frame in enumerate(decoded[1:], start=1):
            if frame.shape != decoded[0].shape:
                raise SchemaMismatch(f"{video_field}[{i}]", f"the size of frame 0, {list(decoded[0].shape)}",
                                     f"{list(frame.shape)}")
        frames[camera.name] = np.stack(decoded)
    _side_by_side(frames, spec, lambda name: f"videos[{name}].frames")
    values = _sent_state(request, spec, "state")
    return VideoClip(frames=frames, state=None if values is None else state(values, spec, "state"),
                     instruction=optional_instruction(request.instruction, "instruction"),
                     step_index=request.step_index)
