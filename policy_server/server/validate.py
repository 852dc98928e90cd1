"""Request validation: protobuf in, engine dataclasses out, or a precise error naming the field.

Everything the wire can get wrong is caught here, before the engine is called: missing fields,
tensors whose bytes do not match dtype x shape, images that do not decode or do not match the
session's declared cameras, states outside the declared range, wrong state dimension, budgets,
rates and texts outside ``policy_server.limits``. The engine checks only what needs its model:
token counts.
"""

from __future__ import annotations

import math

import numpy as np

from policy_server import limits
from policy_server.engine.api import (
    EmbodimentSpec,
    InvalidArgument,
    Observation,
    SchemaMismatch,
    ServerInfo,
    UnknownEmbodiment,
)
from policy_server.server.proto import policy_server_pb2 as pb
from policy_server.server.wire import decode_image, tensor_from_proto

_STATE_DTYPES = (np.float32, np.float64)
_MAX_ID_CHARS = 128  # session ids are 32 hex characters; embodiment names are short


def require(present: bool, field: str, expected: str) -> None:
    if not present:
        raise InvalidArgument(field, expected, "nothing (field unset or empty)", reason="MISSING_FIELD")


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
    if not (math.isfinite(value) and 0 <= value <= limits.MAX_RATE_HZ):
        raise InvalidArgument(field, f"a request rate in [0, {limits.MAX_RATE_HZ:g}] Hz (0: closed loop)",
                              f"{value!r}", reason="BAD_VALUE")
    return float(value)


def text(value: str, field: str, what: str) -> str:
    """A non-empty text within ``MAX_TEXT_BYTES`` (its token count is the engine's to check)."""
    require(bool(value.strip()), field, f"a non-empty {what}")
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


def embodiment(info: ServerInfo, name: str) -> EmbodimentSpec:
    require(bool(name), "embodiment", f"one of {[e.name for e in info.embodiments]}")
    spec = info.embodiment(name)
    if spec is None:
        raise UnknownEmbodiment(name[:_MAX_ID_CHARS], tuple(e.name for e in info.embodiments))
    return spec


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


def state(values: np.ndarray, spec: EmbodimentSpec, field: str) -> np.ndarray:
    """A decoded state vector (any numeric dtype): the declared width, finite, inside the declared range.
    Returns float32 ``[state_dim]``."""
    if values.shape != (spec.state_dim,):
        raise SchemaMismatch(field, f"shape [{spec.state_dim}]", f"shape {list(values.shape)}")
    wide = values.astype(np.float64)
    if not np.all(np.isfinite(wide)):
        bad = [int(i) for i in np.flatnonzero(~np.isfinite(wide))]
        raise InvalidArgument(field, "finite values", f"NaN/Inf at index {bad}", reason="NON_FINITE")
    if spec.state_low:
        low, high = np.asarray(spec.state_low, np.float64), np.asarray(spec.state_high, np.float64)
        expected = f"values within the declared state range [{list(spec.state_low)}, {list(spec.state_high)}]"
    else:  # no declared range: what float32 can hold
        high = np.full(spec.state_dim, np.finfo(np.float32).max, np.float64)
        low, expected = -high, "values float32 can represent"
    outside = np.flatnonzero((wide < low) | (wide > high))
    if outside.size:
        i = int(outside[0])
        raise InvalidArgument(
            field, expected,
            f"{wide[i]:g} at index {i}" + (f" ({outside.size} out of range)" if outside.size > 1 else ""),
            reason="OUT_OF_RANGE")
    return wide.astype(np.float32)


def observation(obs: pb.Observation, spec: EmbodimentSpec, field: str = "observation") -> Observation:
    """Decode and check one observation against the embodiment's declared schema."""
    declared = {c.name for c in spec.cameras}
    unexpected = sorted(set(obs.images) - declared)
    if unexpected:
        shown = [name[:_MAX_ID_CHARS] for name in unexpected[:4]]
        raise SchemaMismatch(
            f"{field}.images", f"cameras {sorted(declared)}",
            f"unknown camera(s) {shown}" + (f" and {len(unexpected) - 4} more" if len(unexpected) > 4 else ""),
        )
    images: dict[str, np.ndarray] = {}
    for camera in spec.cameras:
        camera_field = f"{field}.images[{camera.name}]"
        if camera.name not in obs.images:
            raise SchemaMismatch(
                camera_field,
                f"a {camera.height}x{camera.width} RGB frame",
                f"no frame (sent: {sorted(obs.images)})",
            )
        images[camera.name] = decode_image(
            obs.images[camera.name], camera_field, camera.height, camera.width, camera.channels
        )

    state_values = None
    state_field = f"{field}.state"
    if spec.state_dim > 0:
        if not obs.HasField("state"):
            raise SchemaMismatch(state_field, f"float32 [{spec.state_dim}]", "no state")
        values = tensor_from_proto(obs.state, state_field)
        if values.dtype not in _STATE_DTYPES:
            raise InvalidArgument(
                f"{state_field}.dtype",
                "DTYPE_FLOAT32 or DTYPE_FLOAT64",
                str(values.dtype),
                reason="BAD_DTYPE",
            )
        state_values = state(values, spec, state_field)
    elif obs.HasField("state") and len(obs.state.shape) and math.prod(obs.state.shape) > 0:
        raise SchemaMismatch(state_field, f"no state for {spec.name}", f"shape {list(obs.state.shape)}")

    instruction_text = optional_instruction(obs.instruction, f"{field}.instruction")
    return Observation(images=images, state=state_values, instruction=instruction_text, step_index=obs.step_index)
