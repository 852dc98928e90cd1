"""Python client library for policy-server (no torch).

- ``PolicyClient``: blocking calls with deadlines (server info, health, sessions, ``act``, forward and
  inverse dynamics, ``reason``).
- ``ControlStream``: the real-time bidirectional stream, with reconnect and backoff.
- ``ActionQueue``: robot-side buffer (stale-prefix drop by step index, chunk aggregation, refill threshold).
"""

from policy_server.client.action_queue import ActionQueue, Aggregation
from policy_server.client.backoff import Backoff
from policy_server.client.errors import PolicyServerError
from policy_server.client.streaming import ControlStream, StreamEvent
from policy_server.client.sync_client import PolicyClient, ReasonStream, make_channel
from policy_server.client.types import ActionChunk, PredictedFrames, Session, build_observation

__all__ = [
    "ActionChunk",
    "ActionQueue",
    "Aggregation",
    "Backoff",
    "ControlStream",
    "PolicyClient",
    "PolicyServerError",
    "PredictedFrames",
    "ReasonStream",
    "Session",
    "StreamEvent",
    "build_observation",
    "make_channel",
]
