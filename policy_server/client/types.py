"""Client-side values: sessions, action chunks, observation encoding."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from policy_server.server.proto import policy_server_pb2 as pb
from policy_server.server.wire import encode_image, tensor_from_proto, tensor_to_proto


@dataclass(frozen=True)
class Session:
    """A session as last reported by the server; ``epoch`` grows by one per reset.

    rate_hz: the request rate it was admitted at (0: closed loop); slot_ms: the model time the server
    reserves for each of its ticks; measured_rate_hz: the rate the server has seen from it.
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
        )


@dataclass(frozen=True)
class ActionChunk:
    """actions: float32 [K, action_dim] in physical units; ``actions[i]`` is for control step
    ``first_step_index + i``. ``tick`` holds the server's timing and cache record (ms)."""

    actions: np.ndarray
    first_step_index: int
    obs_step_index: int
    session_id: str
    epoch: int
    obs_id: int
    served_ms: float
    tick: pb.TickRecord = field(repr=False)
    client_time_ns: int = 0

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
        )

    @property
    def round_trip_ms(self) -> float | None:
        """Client-measured round trip (ms), when the observation carried client_time_ns."""
        if not self.client_time_ns:
            return None
        return (time.monotonic_ns() - self.client_time_ns) / 1e6


def build_observation(
    images: Mapping[str, np.ndarray],
    state: np.ndarray | None = None,
    instruction: str = "",
    step_index: int = 0,
    encoding: str = "jpeg",
    jpeg_quality: int = 90,
) -> pb.Observation:
    """Encode camera frames (uint8 RGB [H, W, 3]) and state (float [S]: float64 stays float64, anything
    else is sent as float32)."""
    msg = pb.Observation(instruction=instruction, step_index=step_index, client_time_ns=time.monotonic_ns())
    for name, image in images.items():
        msg.images[name].CopyFrom(encode_image(image, encoding, jpeg_quality))
    if state is not None:
        state = np.asarray(state)
        # A float64 value float32 cannot hold must reach the server as it is, to be refused as out of range,
        # not turn into inf on the way.
        msg.state.CopyFrom(tensor_to_proto(state if state.dtype == np.float64 else state.astype(np.float32)))
    return msg
