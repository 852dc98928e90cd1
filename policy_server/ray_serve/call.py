"""One call that came through Ray Serve's gRPC proxy, as the servicer sees it.

``PolicyServicer`` is written against ``grpc.ServicerContext``. A replica gets Serve's ``RayServegRPCContext``
instead: the call's metadata and a status to set, but no deadline, no liveness and no abort. ``ServeCall``
adds them:
- the deadline, from the caller's ``policy-timeout-ms`` metadata counted from the call's arrival here;
- liveness: a call is active until it ends, its caller goes away (Serve cancels the replica's task, and the
  deployment ends the call) or its deadline passes;
- ``abort_with_status``: the status's code, message and trailing metadata (the rich error details) go on
  Serve's context, and ``CallAborted`` ends the servicer's method. For a unary call the deployment then
  returns an empty response and Serve sends that status, trailers included; a ``Control`` stream sends one
  empty event, which takes the status and trailers to the call, and ends. A stream that raises instead (a
  ``Reason`` stream) keeps only the code and the message ("REASON: message", which the client parses too).
Every answer's trailing metadata names the replica that gave it (``replica_id``).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import grpc

from policy_server.server.auth import AUTH_HEADER, authentication_error
from policy_server.server.errors import ServiceError, make_error
from policy_server.v1 import serve_metadata


class CallAborted(Exception):
    """The call ended with the status now set on Serve's context."""


class ServeCall:
    """The ``grpc.ServicerContext`` subset ``PolicyServicer`` uses, over Serve's context of one call."""

    def __init__(self, serve_context, replica_id: str, received_s: float) -> None:
        self._context = serve_context
        self._replica_id = replica_id
        self.metadata = dict(serve_context.invocation_metadata())
        self._received_s = received_s
        self._deadline_s: float | None = None
        self._ended = threading.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        serve_context.set_trailing_metadata([(serve_metadata.REPLICA_KEY, replica_id)])

    def admit(self, token: str | None) -> None:
        """Check the caller's token, then read its deadline; an error ends the call (``CallAborted``)."""
        error = authentication_error(self.metadata.get(AUTH_HEADER), token) if token else None
        if error is not None:  # first: a caller without the token learns nothing of the rest
            self.abort(error)
        try:
            timeout_ms = serve_metadata.timeout_ms(self.metadata)
        except ValueError as exc:
            self.abort(make_error("BAD_VALUE", str(exc), field=serve_metadata.TIMEOUT_KEY,
                                  expected="a positive number of ms", got=self.metadata[serve_metadata.TIMEOUT_KEY]))
        if timeout_ms is not None:
            self._deadline_s = self._received_s + timeout_ms / 1e3

    def abort(self, error: ServiceError) -> None:
        self.abort_with_status(error.status())

    # -- grpc.ServicerContext ---------------------------------------------------------------------

    def time_remaining(self) -> float:
        """Seconds left before the caller's deadline; infinite without one."""
        if self._deadline_s is None:
            return math.inf
        return max(0.0, self._deadline_s - time.monotonic())

    def is_active(self) -> bool:
        return not self._ended.is_set() and self.time_remaining() > 0

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Run ``callback`` once the call ends (at once if it has)."""
        with self._lock:
            if not self._ended.is_set():
                self._callbacks.append(callback)
                return True
        callback()
        return True

    def abort_with_status(self, status: grpc.Status) -> None:
        self._context.set_code(status.code)
        self._context.set_details(status.details)
        self._context.set_trailing_metadata([*status.trailing_metadata, (serve_metadata.REPLICA_KEY, self._replica_id)])
        raise CallAborted(status.details)

    # -- the deployment's side ------------------------------------------------------------------------

    def end(self) -> None:
        """The call is over (answered, failed or abandoned by its caller): run the callbacks."""
        with self._lock:
            self._ended.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()
