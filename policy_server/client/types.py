"""Client-side values: sessions, action chunks, observation encoding."""

from __future__ import annotations

import reprlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from policy_server.v1 import policy_server_pb2 as pb
from policy_server.v1.wire import WireError, decode_image, encode_image, tensor_from_proto, tensor_to_proto


@dataclass(frozen=True)
class Session:
    """A session as last reported by the server; ``epoch`` grows by one per reset.

    rate_hz: the request rate it was admitted at (0: closed loop); slot_ms: the model time the server
    reserves for each of its ticks; measured_rate_hz: the rate the server has seen from it; preview: its
    chunks carry the predicted frames; client_name: the name it was opened with (in the server's log).
    """

    session_id: str
    epoch: int
    embodiment: str
    instruction: str
    budget_ms: float
    chunk_size: int
    seed: int
    rate_hz: float = 0.0
    slot_ms: float = 0.0
    measured_rate_hz: float = 0.0
    preview: bool = False
    client_name: str = ""

    @classmethod
    def from_proto(cls, msg: pb.Session) -> Session:
        return cls(
            msg.session_id,
            msg.epoch,
            msg.embodiment,
            msg.instruction,
            msg.budget_ms,
            msg.chunk_size,
            msg.seed,
            msg.rate_hz,
            msg.slot_ms,
            msg.measured_rate_hz,
            msg.preview,
            msg.client_name,
        )


def decode_frames(images, field: str) -> np.ndarray | None:
    """JPEG frames from the server -> uint8 RGB [F, H, W, 3]; None when there are none."""
    if not images:
        return None
    return np.stack([decode_image(image, f"{field}[{i}]") for i, image in enumerate(images)])


@dataclass(frozen=True)
class ActionChunk:
    """actions: float32 [K, action_dim] in physical units; ``actions[i]`` is for control step
    ``first_step_index + i``. ``tick`` holds the server's timing and cache record (ms). preview_frames: for a
    session opened with preview, the predicted frames, uint8 RGB [F, H, W, 3] (else None)."""

    actions: np.ndarray
    first_step_index: int
    obs_step_index: int
    session_id: str
    epoch: int
    obs_id: int
    served_ms: float
    tick: pb.TickRecord = field(repr=False)
    client_time_ns: int = 0
    preview_frames: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def from_proto(cls, msg: pb.ActionChunk) -> ActionChunk:
        return cls(
            actions=tensor_from_proto(msg.actions, "actions"),
            first_step_index=msg.first_step_index,
            obs_step_index=msg.obs_step_index,
            session_id=msg.session_id,
            epoch=msg.epoch,
            obs_id=msg.obs_id,
            served_ms=msg.served_ms,
            tick=msg.tick,
            client_time_ns=msg.client_time_ns,
            preview_frames=decode_frames(msg.preview_frames, "preview_frames"),
        )

    @property
    def round_trip_ms(self) -> float | None:
        return _round_trip_ms(self.client_time_ns)


def _round_trip_ms(client_time_ns: int) -> float | None:
    """Client-measured round trip (ms) of an answer that echoes its request's client_time_ns (None without one)."""
    if not client_time_ns:
        return None
    return (time.monotonic_ns() - client_time_ns) / 1e6


@dataclass(frozen=True)
class PredictedFrames:
    """Forward dynamics: frames uint8 RGB [F, H, W, 3] the model predicts (frame 0 reconstructs the
    observation, frame i follows actions[i - 1]); latents_shape: the generated latents [C, T, h, w]; ``tick``:
    the server's timing record (ms); ``round_trip_ms`` as an ActionChunk's."""

    frames: np.ndarray
    latents_shape: tuple[int, ...]
    obs_step_index: int
    session_id: str
    epoch: int
    served_ms: float
    tick: pb.TickRecord = field(repr=False)
    client_time_ns: int = 0

    @classmethod
    def from_proto(cls, msg: pb.PredictedFrames) -> PredictedFrames:
        return cls(
            frames=decode_frames(msg.frames, "frames"),
            latents_shape=tuple(msg.latents_shape),
            obs_step_index=msg.obs_step_index,
            session_id=msg.session_id,
            epoch=msg.epoch,
            served_ms=msg.served_ms,
            tick=msg.tick,
            client_time_ns=msg.client_time_ns,
        )

    @property
    def round_trip_ms(self) -> float | None:
        return _round_trip_ms(self.client_time_ns)


def build_observation(
    images: Mapping[str, np.ndarray],
    state: np.ndarray | None = None,
    instruction: str = "",
    step_index: int = 0,
    encoding: str = "jpeg",
    jpeg_quality: int = 90,
    committed_actions: np.ndarray | None = None,
) -> pb.Observation:
    """Encode camera frames (uint8 RGB [H, W, 3]), state (float [S]: float64 stays float64, anything
    else is sent as float32) and committed actions (float [d, action_dim], as the state)."""
    check_args(pb.Observation, instruction=instruction, step_index=step_index)
    msg = pb.Observation(instruction=instruction, step_index=step_index, client_time_ns=time.monotonic_ns())
    for name, image in _cameras(images, "images", "uint8 [H, W, 3]"):
        msg.images[name].CopyFrom(encode_image(image, encoding, jpeg_quality, field=f"images[{name}]"))
    if state is not None:
        msg.state.CopyFrom(floats_to_proto(state, "state"))
    if committed_actions is not None:
        msg.committed_actions.CopyFrom(floats_to_proto(committed_actions, "committed_actions"))
    return msg


def _cameras(values: Mapping[str, object], field: str, each: str) -> list[tuple[str, object]]:
    """The (camera name, frame or video) pairs of ``values``; TypeError naming ``field`` for what is not a mapping of
    str names (a bare array lacks `.items()`, and protobuf refuses an int key with a message that names no field)."""
    if not isinstance(values, Mapping):
        raise TypeError(f"{field} must be a mapping of camera name -> {each}, got {type(values).__name__}")
    if bad := [name for name in values if not isinstance(name, str)]:
        raise TypeError(f"{field} must be keyed by camera name (str), got {reprlib.repr(bad[0])}")
    return list(values.items())


# What `check_args` says a value must be, by the type of its field (those of the fields the client checks).
_FIELD_TYPE_EXPECTS = {
    FieldDescriptor.TYPE_STRING: "a str (valid Unicode)",
    FieldDescriptor.TYPE_BOOL: "a bool",
    FieldDescriptor.TYPE_DOUBLE: "a real number",
    FieldDescriptor.TYPE_UINT32: "an integer in [0, 2^32)",
    FieldDescriptor.TYPE_UINT64: "an integer in [0, 2^64)",
}


def check_args(message_type: type[Message], **args) -> None:
    """Refuse, naming it, an argument protobuf would refuse without a name (``seed=-1``: "Value out of range: -1",
    a prompt of 5: "bad argument type for built-in operation"). Each keyword is a field of ``message_type``; None
    leaves it unset. Protobuf itself judges each value, so what it would carry passes: the server checks the rest."""
    for name, value in args.items():
        try:
            message_type(**{name: value})
        except (TypeError, ValueError) as exc:
            expected = _FIELD_TYPE_EXPECTS[message_type.DESCRIPTOR.fields_by_name[name].type]
            if isinstance(exc, TypeError):
                raise TypeError(f"{name} must be {expected}, got {type(value).__name__}") from None
            raise ValueError(f"{name} must be {expected}, got {reprlib.repr(value)}") from None


def floats_to_proto(values: np.ndarray, field: str) -> pb.Tensor:
    """A state or action array: float64 stays float64, anything else is sent as float32 (a float64 value float32
    cannot hold must reach the server as it is, to be refused as out of range, not turn into inf on the way).
    ValueError naming ``field`` for what is not real numbers of one shape (numpy's own error names no field; a
    complex value would lose its imaginary part)."""
    try:
        values = np.asarray(values)
    except ValueError:  # rows of different lengths
        raise ValueError(f"{field}: expected real numbers of one shape, got rows of different lengths") from None
    if values.dtype.kind not in "biuf":
        raise ValueError(f"{field}: expected real numbers, got {values.dtype} {list(values.shape)}")
    return tensor_to_proto(values if values.dtype == np.float64 else values.astype(np.float32))


def _video(name: str, frames) -> np.ndarray:
    """Camera ``name``'s video, an array or a sequence of frames, as uint8 [F, H, W, 3]; else a WireError naming the
    camera (a frame's error would name neither camera nor video, numpy's own none)."""
    expected = "a video, uint8 [F, H, W, 3]"
    try:
        video = np.asarray(frames)
    except ValueError:  # a sequence of frames of different shapes
        first, other = list(dict.fromkeys(tuple(np.shape(frame)) for frame in frames))[:2]
        raise WireError(f"videos[{name}]", expected, f"frames of different shapes: {list(first)} and {list(other)}",
                        "BAD_IMAGE") from None
    if video.dtype != np.uint8 or video.ndim != 4:
        raise WireError(f"videos[{name}]", expected, f"{video.dtype} {list(video.shape)}", "BAD_IMAGE")
    return video


def build_inverse_dynamics(
    session: Session,
    videos: Mapping[str, np.ndarray],
    state: np.ndarray | None = None,
    instruction: str = "",
    step_index: int = 0,
    seed: int | None = None,
    encoding: str = "jpeg",
    jpeg_quality: int = 90,
) -> pb.InverseDynamicsRequest:
    """Encode camera videos (uint8 RGB [K + 1, H, W, 3] each) and the state at frame 0 (as ``build_observation``)."""
    check_args(pb.InverseDynamicsRequest, instruction=instruction, step_index=step_index, seed=seed)
    msg = pb.InverseDynamicsRequest(session_id=session.session_id, epoch=session.epoch, instruction=instruction,
                                    step_index=step_index, client_time_ns=time.monotonic_ns())
    for name, frames in _cameras(videos, "videos", "uint8 [K + 1, H, W, 3]"):
        frames = _video(name, frames)
        msg.videos[name].frames.extend(encode_image(frame, encoding, jpeg_quality, field=f"videos[{name}][{i}]")
                                       for i, frame in enumerate(frames))
    if state is not None:
        msg.state.CopyFrom(floats_to_proto(state, "state"))
    if seed is not None:
        msg.seed = seed
    return msg
