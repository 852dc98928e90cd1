"""gRPC server metrics per method and status code, from a server interceptor.

The metric and label names are those of grpc-ecosystem/go-grpc-prometheus, so its dashboards apply:

- ``grpc_server_started_total{grpc_type, grpc_service, grpc_method}``: calls that reached a handler;
- ``grpc_server_handled_total{grpc_type, grpc_service, grpc_method, grpc_code}``: calls completed,
  by the status the client got, as ``grpc.StatusCode`` names it (``OK``, ``INVALID_ARGUMENT``, ...; Go
  writes ``InvalidArgument``, so a Go dashboard's filters on codes other than ``OK`` need the other spelling);
- ``grpc_server_handling_seconds{grpc_type, grpc_service, grpc_method}``: handler start to completion.

``grpc_type`` is ``unary``, ``client_stream``, ``server_stream`` or ``bidi_stream``. Only the methods
of the services the server registers get labels (their started count exists from the start, at 0): a call
to any other name is answered UNIMPLEMENTED by gRPC and counted nowhere, so clients cannot grow the
label set. Calls refused before any handler runs (``maximum_concurrent_rpcs``, or a connection's streams beyond
``grpc.max_concurrent_streams``) are not counted. A
handler that returns just as its client cancels (its request stream ends with the cancel, before gRPC
marks the call cancelled) is counted with the status it returned; its client got CANCELLED.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from prometheus_client import CollectorRegistry, Counter, Histogram

_TYPES = {
    (False, False): "unary",
    (True, False): "client_stream",
    (False, True): "server_stream",
    (True, True): "bidi_stream",
}


class GrpcMetricsInterceptor(grpc.ServerInterceptor):
    """Counts and times every call to the methods of ``services``; put it first so that it also sees
    the calls later interceptors refuse (authentication)."""

    def __init__(
        self, registry: CollectorRegistry, services: Iterable[ServiceDescriptor], buckets: tuple[float, ...]
    ) -> None:
        names = ["grpc_type", "grpc_service", "grpc_method"]
        self._started = Counter("grpc_server_started", "RPCs started on the server", names, registry=registry)
        self._handled = Counter(
            "grpc_server_handled", "RPCs completed on the server, by status code, success or failure",
            [*names, "grpc_code"], registry=registry,
        )
        self._seconds = Histogram(
            "grpc_server_handling_seconds", "Time from the handler's start to the call's completion (s)",
            names, buckets=buckets, registry=registry,
        )
        self._labels: dict[str, tuple[str, str, str]] = {}  # "/pkg.Service/Method" -> label values
        for service in services:
            for method in service.methods:
                labels = (_TYPES[(method.client_streaming, method.server_streaming)], service.full_name, method.name)
                self._labels[f"/{service.full_name}/{method.name}"] = labels
                self._started.labels(*labels)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        labels = self._labels.get(handler_call_details.method)
        if labels is None:  # not a registered method: gRPC answers UNIMPLEMENTED
            return handler
        return _measured(handler, lambda context: self._start(labels, context))

    def _start(self, labels: tuple[str, str, str], context: grpc.ServicerContext) -> _Call:
        self._started.labels(*labels).inc()
        return _Call(labels, context, self._handled, self._seconds)


class _Call:
    """One call being measured, from its handler's start; ``finish`` records it once."""

    def __init__(self, labels: tuple[str, str, str], context: grpc.ServicerContext, handled: Counter,
                 seconds: Histogram) -> None:
        self._labels = labels
        self._context = context
        self._handled = handled
        self._seconds = seconds
        self._started = time.perf_counter()
        self._done = False

    def finish(self, raised: bool) -> None:
        """Record the call's status. Called as the handler ends, before gRPC sends that status."""
        if self._done:
            return
        self._done = True
        self._handled.labels(*self._labels, _status(self._context, raised).name).inc()
        self._seconds.labels(*self._labels).observe(time.perf_counter() - self._started)

    def stream(self, responses):
        """``responses``, passed through; the call ends when they do, when they raise, or when gRPC
        stops reading them (the client went away)."""
        raised = True
        try:
            yield from responses
            raised = False
        finally:
            self.finish(raised)


def _status(context: grpc.ServicerContext, raised: bool) -> grpc.StatusCode:
    """The status the client gets for a handler that ended now (``raised``: with an exception)."""
    if not context.is_active():  # the client cancelled, or its deadline passed: nothing else reaches it
        return grpc.StatusCode.DEADLINE_EXCEEDED if context.time_remaining() == 0 else grpc.StatusCode.CANCELLED
    if context.code() is not None:  # context.abort() or set_code()
        return context.code()
    # gRPC's own rule: an exception without a code set is UNKNOWN, a return without one is OK
    return grpc.StatusCode.UNKNOWN if raised else grpc.StatusCode.OK


def _measured(handler: grpc.RpcMethodHandler, start) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour wrapped so each call is measured; ``start(context)`` makes its ``_Call``.
    Serializers, streaming kind and the behaviour's results, errors and trailers are unchanged."""
    if handler.response_streaming:
        behavior = handler.stream_stream if handler.request_streaming else handler.unary_stream
        if getattr(behavior, "experimental_non_blocking", False):
            measured = _non_blocking(behavior, start)
        else:
            def measured(request, context):
                call = start(context)
                try:
                    responses = behavior(request, context)  # a generator function runs nothing yet
                except BaseException:
                    call.finish(raised=True)
                    raise
                return call.stream(responses)
    else:
        behavior = handler.stream_unary if handler.request_streaming else handler.unary_unary

        def measured(request, context):
            call = start(context)
            try:
                response = behavior(request, context)
            except BaseException:
                call.finish(raised=True)
                raise
            call.finish(raised=False)
            return response

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(measured, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _non_blocking(behavior, start):
    """A measured handler for gRPC's experimental non-blocking streams (health's ``Watch``): the handler
    returns at once and ends the stream by sending ``None``, which it also does once the call is closed."""

    def measured(request, context, send_response_callback):
        call = start(context)

        def send(response):
            if response is None:
                call.finish(raised=False)
            send_response_callback(response)

        try:
            behavior(request, context, send)
        except BaseException:
            call.finish(raised=True)
            raise

    measured.experimental_non_blocking = True
    return measured
