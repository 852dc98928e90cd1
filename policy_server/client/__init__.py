"""Python client library for policy-server (no torch).

- ``PolicyClient``: blocking calls with deadlines (server info, health, sessions, ``act``, forward and
  inverse dynamics, ``reason``).
- ``ControlStream``: the real-time bidirectional stream, with reconnect and backoff.
- ``ActionQueue``: robot-side buffer (stale-prefix drop by step index, chunk aggregation, refill threshold).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from policy_server.client.action_queue import ActionQueue, Aggregation
    from policy_server.client.backoff import Backoff
    from policy_server.client.errors import PolicyServerError
    from policy_server.client.streaming import ControlStream, StreamEvent
    from policy_server.client.sync_client import PolicyClient, ReasonStream, make_channel
    from policy_server.client.types import ActionChunk, PredictedFrames, Session, build_observation

# Each name is imported from its module when first asked for: importing the package imports no grpc, so that
# `python -m policy_server.client` can keep gRPC core's log to errors before grpc is imported (gRPC core reads
# GRPC_VERBOSITY then, once), which a program that imports this library decides for itself.
_MODULES = {
    "ActionChunk": "types",
    "ActionQueue": "action_queue",
    "Aggregation": "action_queue",
    "Backoff": "backoff",
    "ControlStream": "streaming",
    "PolicyClient": "sync_client",
    "PolicyServerError": "errors",
    "PredictedFrames": "types",
    "ReasonStream": "sync_client",
    "Session": "types",
    "StreamEvent": "streaming",
    "build_observation": "types",
    "make_channel": "sync_client",
}

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


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    globals()[name] = value  # asked for once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
