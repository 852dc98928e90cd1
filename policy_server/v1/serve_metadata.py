"""Call metadata for a server behind Ray Serve's gRPC proxy, written by the client and read by the replica.

Serve's proxy routes a call by two of its metadata keys and passes every key on to the replica, but not the
call's deadline:
- ``application``: the Serve application to route to (needed only when the cluster runs several);
- ``session_id``: the routing key; with the consistent-hash router every call with one key reaches the same
  replica. The client picks a fresh key when it opens a session and sends it on each of that session's calls,
  so that the replica which opened the session answers all of them. It is not the session's id: that is
  known only once a replica has answered.
- ``policy-timeout-ms``: the time the caller gives the call, in ms (gRPC's own ``grpc-timeout`` stops at the
  proxy). The replica counts it from the moment the call reaches it.
"""

from __future__ import annotations

APPLICATION_KEY = "application"  # Serve's own key
ROUTING_KEY = "session_id"  # Serve's own key, read by ConsistentHashRouter
TIMEOUT_KEY = "policy-timeout-ms"
REPLICA_KEY = "replica_id"  # trailing metadata: the replica that answered (its Ray actor name)


def timeout_ms(metadata: dict[str, str]) -> float | None:
    """The caller's timeout from a call's metadata, ms; None when it sent none. ``ValueError`` for a value that
    is not a positive number."""
    if TIMEOUT_KEY not in metadata:
        return None
    text = metadata[TIMEOUT_KEY]
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{TIMEOUT_KEY} metadata: expected a positive number of ms, got {text!r}")
    return value
