"""Request validation: protobuf in, engine dataclasses out, or a precise error naming the field.

Everything the wire can get wrong is caught here, before the engine is called: missing fields,
tensors whose bytes do not match dtype x shape, images that do not decode or do not match the
session's declared cameras, non-finite state, wrong state dimension, non-positive budgets.
"""

from __future__ import annotations

import math

import numpy as np

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


def require(present: bool, field: str, expected: str) -> None:
    if not present:
        raise InvalidArgument(field, expected, "nothing (field unset or empty)", reason="MISSING_FIELD")


def session_id(value: str, field: str = "session_id") -> str:
    require(bool(value), field, "the id returned by OpenSession")
    return value


def epoch(value: int, field: str = "epoch") -> int:
    require(value >= 1, field, "the session epoch (>= 1) from OpenSession / ResetSession")
    return value


def budget_ms(value: float, field: str = "budget_ms") -> float:
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgument(field, "a finite latency budget > 0 ms", f"{value!r}", reason="BAD_VALUE")
    return float(value)


def instruction(value: str, field: str = "instruction") -> str:
    require(bool(value.strip()), field, "a non-empty task instruction")
    return value


def embodiment(info: ServerInfo, name: str) -> EmbodimentSpec:
    require(bool(name), "embodiment", f"one of {[e.name for e in info.embodiments]}")
    spec = info.embodiment(name)
    if spec is None:
        raise UnknownEmbodiment(name, tuple(e.name for e in info.embodiments))
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


def observation(obs: pb.Observation, spec: EmbodimentSpec, field: str = "observation") -> Observation:
    """Decode and check one observation against the embodiment's declared schema."""
    declared = {c.name for c in spec.cameras}
    unexpected = sorted(set(obs.images) - declared)
    if unexpected:
        raise SchemaMismatch(
            f"{field}.images", f"cameras {sorted(declared)}", f"unknown camera(s) {unexpected}"
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

    state = None
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
        if values.shape != (spec.state_dim,):
            raise SchemaMismatch(state_field, f"shape [{spec.state_dim}]", f"shape {list(values.shape)}")
        if not np.all(np.isfinite(values)):
            bad = [int(i) for i in np.flatnonzero(~np.isfinite(values))]
            raise InvalidArgument(
                state_field, "finite values", f"NaN/Inf at index {bad}", reason="NON_FINITE"
            )
        state = values.astype(np.float32)
    elif obs.HasField("state") and len(obs.state.shape) and int(np.prod(obs.state.shape)) > 0:
        raise SchemaMismatch(state_field, f"no state for {spec.name}", f"shape {list(obs.state.shape)}")

    return Observation(images=images, state=state, instruction=obs.instruction, step_index=obs.step_index)
