"""The standard health service (``grpc.health.v1.Health``): ``Check``, unbounded, and ``Watch`` streams that hold no
server thread, at most ``MAX_HEALTH_WATCHES`` open at once (each holds server memory for as long as its client keeps
it).

Ours rather than grpc_health's ``HealthServicer``, which sends a status while it holds the lock that the end of every
``Watch`` takes on gRPC's poller thread: a send waits for that thread, so a Watch that ended while a status was being
sent wedged the whole server, every call unanswered (grpc/grpc#43403; here, within 3 runs of 3000 Watch-then-cancel
calls on one connection). Here no send happens under a lock, nor on the thread that sets a status or serves a
Watch: each stream's statuses go out on a sender of its own, so a stream whose client stopped reading (its send
waits for flow control) holds up only itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from grpc_health.v1 import health_pb2, health_pb2_grpc

from policy_server.limits import MAX_HEALTH_WATCHES, MAX_SERVICE_NAME_CHARS
from policy_server.server.errors import abort, make_error

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
Send = Callable[[health_pb2.HealthCheckResponse | None], object]  # gRPC's send_response_callback; None ends the call


class _Watch:
    """One open Watch stream: the status it is to be sent next (None: nothing new), the last one a sender took for it
    (None: none yet), and whether a sender is on it."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.next_status: int | None = None
        self.sent: int | None = None
        self.sending = False


class HealthService(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self._statuses: dict[str, int] = {}  # service name -> status ("" is the whole server)
        self._watches: dict[str, set[_Watch]] = {}  # service name -> its open Watch streams
        self._final = False  # shutting down: statuses no longer change
        self._lock = threading.Lock()  # all of the above; taken on gRPC's poller thread, so held only briefly
        self._places = threading.BoundedSemaphore(MAX_HEALTH_WATCHES)
        self._senders = ThreadPoolExecutor(MAX_HEALTH_WATCHES, thread_name_prefix="health-watch")

    def set(self, service: str, status: int) -> None:
        """`service`'s status from now on, for Check and its Watch streams (ignored once shutting down)."""
        with self._lock:
            if not self._final:
                self._set(service, status)

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, for good."""
        with self._lock:
            for service in self._statuses:
                self._set(service, NOT_SERVING)
            self._final = True

    def close(self) -> None:
        """Let the senders go, once the server's calls have ended."""
        self._senders.shutdown(wait=False)

    def _set(self, service: str, status: int) -> None:
        self._statuses[service] = status
        for watch in self._watches.get(service, ()):
            self._post(watch, status)

    def _post(self, watch: _Watch, status: int) -> None:
        """Have `status` sent to `watch` (under `_lock`): the latest status wins over one not sent yet, and one the
        stream has been sent last is no change (the health protocol's Watch sends a status when it changes): A, then
        B and A again before the sender came back from sending A, sends nothing more."""
        if status == watch.sent:
            watch.next_status = None
            return
        watch.next_status = status
        if not watch.sending:
            watch.sending = True
            self._senders.submit(self._deliver, watch)

    def _deliver(self, watch: _Watch) -> None:
        while True:
            with self._lock:
                status, watch.next_status = watch.next_status, None
                if status is None:
                    watch.sending = False
                    return
                watch.sent = status
            watch.send(health_pb2.HealthCheckResponse(status=status))  # False once the stream has ended

    def Check(self, request, context):  # noqa: N802 - gRPC's method name
        with self._lock:
            status = self._statuses.get(request.service)
        if status is None:
            abort(context, make_error("SERVICE_NOT_FOUND", f"no health status for service {request.service[:64]!r}",
                                      expected="'' (the whole server) or a served service's full name"))
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request, context, send_response_callback: Send):  # noqa: N802 - gRPC's method name
        service = request.service
        if len(service) > MAX_SERVICE_NAME_CHARS:  # an unknown one is watched too: its name stays while it is open
            abort(context, make_error("TOO_LONG", f"a service name of {len(service)} characters", field="service",
                                      expected=f"a service's full name, at most {MAX_SERVICE_NAME_CHARS} characters"))
        if not self._places.acquire(blocking=False):
            abort(context, make_error(
                "TOO_MANY_HEALTH_WATCHES", f"{MAX_HEALTH_WATCHES} health Watch streams are open already",
                expected="a Watch stream closed once its client has seen what it waits for (or health Check)",
                retry_after_ms=1000.0))
        watch = _Watch(send_response_callback)
        with self._lock:
            self._watches.setdefault(service, set()).add(watch)
            self._post(watch, self._statuses.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN))
        if not context.add_callback(lambda: self._ended(service, watch)):  # it ended already (cancelled as it came)
            self._ended(service, watch)

    # gRPC's sync server passes `send_response_callback` and holds no thread for the stream.
    Watch.experimental_non_blocking = True
    Watch.experimental_thread_pool = None

    def _ended(self, service: str, watch: _Watch) -> None:
        with self._lock:
            watches = self._watches[service]
            watches.discard(watch)
            if not watches:
                del self._watches[service]
            watch.next_status = None
        self._places.release()
        watch.send(None)  # the stream's status, where it has not ended with one already
