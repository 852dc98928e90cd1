"""The Ray Serve deployment: each replica is one engine (one GPU) behind the ``policy_server.v1`` servicer.

- The constructor loads the model and waits for warmup, so Serve routes nothing to a replica that is not warm;
  ``check_health`` fails once the engine is no longer ready, and Serve replaces the replica.
- Routing is strict consistent hashing on the routing key the client sends (Serve's ``session_id`` metadata,
  see ``policy_server.v1.serve_metadata``): every call of a session reaches the replica that holds it, and none
  falls back to another replica (``num_fallback_replicas=0``), which would answer SESSION_NOT_FOUND anyway.
- ``max_ongoing_requests`` is what the direct server serves at once for the same ``max_sessions``.
- Each RPC is a method named after it (the unary ones made from the service descriptor). The servicer runs as
  in ``policy-server``, on a thread pool of that size, with a ``ServeCall`` for its context (deadline,
  liveness, auth, errors through the proxy).
- Serve's proxy puts a streaming call's status and trailers on the call only with a message (each carries the
  replica's context as it was when sent): a stream that raises keeps its code and "REASON: message" alone. A failed
  ``Control`` stream therefore ends with one empty ``ControlEvent`` (no kind; the client skips it), sent once the
  error is set, and no exception: the proxy then ends the call with the error's code, message and trailers, its
  ``ErrorDetail`` included (``session_end``, ``retry_after_ms``, ...), as the direct server does.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray import serve

from policy_server.allocator import return_large_frees
from policy_server.config import ServerConfig
from policy_server.ray_serve.call import CallAborted, ServeCall
from policy_server.server.app import max_concurrent_calls
from policy_server.server.metrics import ServerMetrics
from policy_server.server.running_calls import RunningCalls
from policy_server.server.servicer import PolicyServicer
from policy_server.v1 import policy_server_pb2 as pb

_SERVICE = pb.DESCRIPTOR.services_by_name["PolicyService"]
# The response of each method, sent empty with the error status of a unary call that failed.
_RESPONSES = {method.name: getattr(pb, method.output_type.name) for method in _SERVICE.methods}
_END = object()


class _BlockingRequests:
    """A client stream as the blocking iterator the servicer reads on its own thread, fed by a task that reads
    Serve's asynchronous stream on the replica's event loop."""

    def __init__(self, stream: AsyncIterator) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._task = asyncio.get_running_loop().create_task(self._pump(stream))

    async def _pump(self, stream: AsyncIterator) -> None:
        try:
            async for request in stream:
                self._queue.put(request)
        finally:
            self._queue.put(_END)

    def __iter__(self) -> _BlockingRequests:
        return self

    def __next__(self):
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)  # every later read ends too
            raise StopIteration
        return item

    def close(self) -> None:
        self._task.cancel()


class PolicyDeployment:
    """One replica. Serve calls the RPC methods with the request (or the request stream) and ``grpc_context``."""

    def __init__(self, config: ServerConfig) -> None:
        from policy_server.engine import build_engine  # torch and the model: only in the replica

        return_large_frees()  # as `policy-server` does
        self._engine = build_engine(config)
        self._engine.start()
        self._engine.wait_ready()  # raises if warmup failed: Serve retries the replica
        # Nothing drains its streams: Serve ends a replica's calls itself, after its graceful wait.
        self._servicer = PolicyServicer(self._engine, ServerMetrics(self._engine), config.max_message_bytes,
                                        RunningCalls())
        self._token = config.auth_token()
        calls = max_concurrent_calls(config.max_sessions, config.max_dynamics_calls, reflection=False)
        self._pool = ThreadPoolExecutor(calls, thread_name_prefix="rpc")
        self._replica_id = serve.get_replica_context().replica_id.to_full_id_str()

    def check_health(self) -> None:
        if not self._engine.ready():
            raise RuntimeError("the engine is not ready (warmup failed or it is shutting down)")

    def __del__(self) -> None:
        if "_engine" in vars(self):  # Serve calls this where the constructor raised before building it, too
            self._engine.close()

    # -- unary RPCs: one method each, made below from the service (so a new RPC cannot be missed here) -------

    # -- streaming RPCs ------------------------------------------------------------------------------

    async def Control(self, request_stream, grpc_context):
        requests = _BlockingRequests(request_stream)
        try:
            async for event in self._stream("Control", requests, grpc_context, carrier=pb.ControlEvent):
                yield event
        finally:
            requests.close()

    async def Reason(self, request, grpc_context):
        async for chunk in self._stream("Reason", request, grpc_context):
            yield chunk

    # -- running the servicer ------------------------------------------------------------------------

    def _call(self, grpc_context) -> ServeCall:
        call = ServeCall(grpc_context, self._replica_id, time.monotonic())
        try:
            call.admit(self._token)
        except CallAborted:
            call.end()
            raise
        return call

    async def _unary(self, name: str, request, grpc_context):
        try:
            call = self._call(grpc_context)
        except CallAborted:
            return _RESPONSES[name]()
        try:
            method = getattr(self._servicer, name)
            return await asyncio.get_running_loop().run_in_executor(self._pool, method, request, call)
        except CallAborted:
            return _RESPONSES[name]()  # Serve sends the status set on its context, with its trailers
        finally:
            call.end()  # also when the caller went away (cancelled): the engine drops its tick

    async def _stream(self, name: str, request, grpc_context, carrier: type | None = None) -> AsyncIterator[Any]:
        """The servicer's stream ``name``. ``carrier``: the response type whose empty message ends the stream where it
        fails, carrying the error's status and trailers to the client (without one, the error is raised: its code and
        message only reach the client)."""
        try:
            call = self._call(grpc_context)
            try:
                responses = getattr(self._servicer, name)(request, call)
                loop = asyncio.get_running_loop()
                while (response := await loop.run_in_executor(self._pool, next, responses, _END)) is not _END:
                    yield response
            finally:
                call.end()
        except CallAborted:
            if carrier is None:
                raise
            yield carrier()  # Serve's context holds the error's status now: this message takes it to the call


def _unary_rpc(name: str):
    """The deployment method Serve calls for the unary RPC ``name``."""

    async def rpc(self: PolicyDeployment, request, grpc_context):
        return await self._unary(name, request, grpc_context)

    rpc.__name__ = rpc.__qualname__ = name
    return rpc


for _method in _SERVICE.methods:
    if not (_method.client_streaming or _method.server_streaming):
        setattr(PolicyDeployment, _method.name, _unary_rpc(_method.name))
