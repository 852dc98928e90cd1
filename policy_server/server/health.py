"""The standard health service (``grpc.health.v1.Health``): ``Check``, unbounded, and ``Watch`` streams that hold no
server thread, at most ``MAX_HEALTH_WATCHES`` open at once (each holds server memory for as long as its client keeps
it).

Ours rather than grpc_health's ``HealthServicer``, which sends a status while it holds the lock that the end of every
``Watch`` takes on gRPC's poller thread: a send waits for that thread, so a Watch that ended while a status was being
sent wedged the whole server, every call unanswered (grpc/grpc#43403; here, within 3 runs of 3000 Watch-then-cancel
calls on one connection). Here the lock that the poller thread takes is never held while sending.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

from grpc_health.v1 import health_pb2, health_pb2_grpc

from policy_server.limits import MAX_HEALTH_WATCHES
from policy_server.server.errors import abort, make_error

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
Send = Callable[[health_pb2.HealthCheckResponse | None], object]  # gRPC's send_response_callback; None ends the call


class HealthService(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self._statuses: dict[str, int] = {}  # service name -> status ("" is the whole server)
        self._watchers: dict[str, set[Send]] = {}  # service name -> the open Watch streams' sends
        self._final = False  # shutting down: statuses no longer change
        self._lock = threading.Lock()  # the tables above; taken on gRPC's poller thread, never held while sending
        self._sending = threading.Lock()  # statuses go out one at a time, in the order they were set
        self._places = threading.BoundedSemaphore(MAX_HEALTH_WATCHES)

    def set(self, service: str, status: int) -> None:
        """`service`'s status from now on, sent to its Watch streams (ignored once shutting down)."""
        with self._sending:
            with self._lock:
                if self._final:
                    return
                self._statuses[service] = status
            self._send(service, status)

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, for good."""
        with self._sending:
            with self._lock:
                self._final = True
                services = list(self._statuses)
                self._statuses.update(dict.fromkeys(services, NOT_SERVING))
            for service in services:
                self._send(service, NOT_SERVING)

    def _send(self, service: str, status: int) -> None:
        with self._lock:
            sends = list(self._watchers.get(service, ()))
        response = health_pb2.HealthCheckResponse(status=status)
        for send in sends:
            send(response)  # False for a stream that has ended meanwhile: its end removes it

    def Check(self, request, context):  # noqa: N802 - gRPC's method name
        with self._lock:
            status = self._statuses.get(request.service)
        if status is None:
            abort(context, make_error("SERVICE_NOT_FOUND", f"no health status for service {request.service!r}",
                                      expected="'' (the whole server) or a served service's full name"))
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request, context, send_response_callback: Send):  # noqa: N802 - gRPC's method name
        if not self._places.acquire(blocking=False):
            abort(context, make_error(
                "TOO_MANY_HEALTH_WATCHES", f"{MAX_HEALTH_WATCHES} health Watch streams are open already",
                expected="a Watch stream closed once its client has seen what it waits for (or health Check)",
                retry_after_ms=1000.0))
        service = request.service
        with self._sending:  # no status goes out between this stream's first and its registration
            with self._lock:
                status = self._statuses.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                self._watchers.setdefault(service, set()).add(send_response_callback)
            ended = functools.partial(self._ended, service, send_response_callback)
            if not context.add_callback(ended):  # the stream ended already (cancelled as it came)
                ended()
                return
            send_response_callback(health_pb2.HealthCheckResponse(status=status))

    # gRPC's sync server passes `send_response_callback` and holds no thread for the stream.
    Watch.experimental_non_blocking = True
    Watch.experimental_thread_pool = None

    def _ended(self, service: str, send: Send) -> None:
        with self._lock:
            self._watchers[service].discard(send)
        self._places.release()
        send(None)  # the stream's status, where it has not ended with one already
