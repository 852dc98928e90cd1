"""The gRPC metrics interceptor on a probe service of all four call kinds: each call is counted with the
status its client got (returns, aborts, set codes, exceptions, cancels, deadlines), and the wrapped
handlers answer exactly as they do without it (messages, codes, details, trailers)."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from policy_server.server.grpc_metrics import GrpcMetricsInterceptor
from policy_server.server.health import HealthService
from policy_server.server.metrics import LATENCY_BUCKETS_S

KINDS = {"Unary": (False, False), "ClientStream": (True, False), "ServerStream": (False, True), "Bidi": (True, True)}
TYPES = {"Unary": "unary", "ClientStream": "client_stream", "ServerStream": "server_stream", "Bidi": "bidi_stream"}
TRAILERS = (("reason", "PROBE"),)


def probe_service():
    """A ``test.Probe`` service descriptor with one method of each kind (bytes in, bytes out)."""
    file = descriptor_pb2.FileDescriptorProto(name="probe.proto", package="test")
    file.message_type.add(name="Bytes")
    service = file.service.add(name="Probe")
    for name, (client_streaming, server_streaming) in KINDS.items():
        service.method.add(name=name, input_type=".test.Bytes", output_type=".test.Bytes",
                           client_streaming=client_streaming, server_streaming=server_streaming)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return pool.FindServiceByName("test.Probe")


def act(command: bytes, context: grpc.ServicerContext) -> bytes:
    """What a probe handler does at its end, as its last request says."""
    if command == b"abort":
        context.set_trailing_metadata(TRAILERS)
        context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")
    if command == b"raise":
        raise ValueError("handler bug")
    if command == b"set_code":
        context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
        context.set_details("bad value")
    if command == b"wait":  # until the client's deadline passes
        while context.is_active():
            time.sleep(0.01)
    return b"done:" + command


def unary(request, context):
    return act(request, context)


def client_stream(requests, context):
    return act(list(requests)[-1], context)


def server_stream(request, context):
    yield b"first"
    yield act(request, context)


def bidi(requests, context):
    for request in requests:
        yield request  # the echo tells the client its request arrived
        if request != b"echo":
            yield act(request, context)
            return


def serve(interceptors):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=interceptors)
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "ClientStream": grpc.stream_unary_rpc_method_handler(client_stream),
        "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Probe", handlers),))
    watched = HealthService()
    health_pb2_grpc.add_HealthServicer_to_server(watched, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}", watched


@pytest.fixture(scope="module")
def registry():
    return CollectorRegistry()


@pytest.fixture(scope="module")
def measured(registry):
    services = (probe_service(), health_pb2.DESCRIPTOR.services_by_name["Health"])
    server, target, watched = serve([GrpcMetricsInterceptor(registry, services, LATENCY_BUCKETS_S)])
    yield target, watched
    server.stop(0)


@pytest.fixture(scope="module")
def plain():
    server, target, _ = serve([])
    yield target
    server.stop(0)


def call(target: str, method: str, command: bytes) -> tuple:
    """(responses, code, details, trailing metadata) of one probe call ending in ``command``."""
    path = f"/test.Probe/{method}"
    with grpc.insecure_channel(target) as channel:
        client_streaming, server_streaming = KINDS[method]
        requests = iter([b"echo", command] if client_streaming else [command])
        if (client_streaming, server_streaming) == (False, False):
            future = channel.unary_unary(path).future(command, timeout=0.3 if command == b"wait" else 5)
            try:
                return [future.result()], future.code(), future.details(), future.trailing_metadata()
            except grpc.RpcError as error:
                return [], error.code(), error.details(), error.trailing_metadata()
        if not server_streaming:
            future = channel.stream_unary(path).future(requests, timeout=5)
            try:
                return [future.result()], future.code(), future.details(), future.trailing_metadata()
            except grpc.RpcError as error:
                return [], error.code(), error.details(), error.trailing_metadata()
        stream = (channel.stream_stream(path)(requests, timeout=5) if client_streaming
                  else channel.unary_stream(path)(command, timeout=5))
        responses = []
        try:
            responses.extend(stream)
        except grpc.RpcError:
            pass
        return responses, stream.code(), stream.details(), stream.trailing_metadata()


def probe(method: str) -> dict[str, str]:
    return {"grpc_type": TYPES[method], "grpc_service": "test.Probe", "grpc_method": method}


WATCH = {"grpc_type": "server_stream", "grpc_service": "grpc.health.v1.Health", "grpc_method": "Watch"}


def handled(registry, labels: dict[str, str], code: str) -> float:
    return registry.get_sample_value("grpc_server_handled_total", {**labels, "grpc_code": code}) or 0.0


def wait_for(condition) -> None:
    """Server-side ends (a cancel, a deadline) are recorded a moment after the client sees them."""
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, "the call was never recorded as handled"
        time.sleep(0.01)


COMMANDS = {b"ok": "OK", b"abort": "NOT_FOUND", b"raise": "UNKNOWN", b"set_code": "INVALID_ARGUMENT"}


@pytest.mark.parametrize("method", list(KINDS))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_call_is_counted_with_the_status_its_client_got_and_answered_as_without_it(
    registry, measured, plain, method, command
):
    code = COMMANDS[command]

    def counts():
        return [handled(registry, probe(method), code), registry.get_sample_value("grpc_server_started_total",
                probe(method)), registry.get_sample_value("grpc_server_handling_seconds_count", probe(method)) or 0]

    before = counts()
    outcome = call(measured[0], method, command)
    assert outcome == call(plain, method, command)
    assert outcome[1].name == code
    if command == b"abort":
        assert (outcome[2], outcome[3]) == ("no such thing", TRAILERS)
    assert counts() == [value + 1 for value in before]


def test_a_passed_deadline_counts_as_deadline_exceeded(registry, measured):
    before = handled(registry, probe("Unary"), "DEADLINE_EXCEEDED")
    assert call(measured[0], "Unary", b"wait")[1] == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: handled(registry, probe("Unary"), "DEADLINE_EXCEEDED") == before + 1)


@pytest.mark.parametrize("method", ["ServerStream", "Bidi"])
def test_a_cancelled_stream_counts_as_cancelled(registry, measured, method):
    before = handled(registry, probe(method), "CANCELLED")
    more = threading.Event()

    def requests():
        yield b"wait"
        more.wait(5)  # no half-close: the call ends by the cancel alone

    # Once the first answer is in, the handler is waiting for the call to end (a cancel that came with
    # the request stream's end could otherwise end the handler's loop before gRPC marks the call cancelled).
    with grpc.insecure_channel(measured[0]) as channel:
        stream = (channel.stream_stream("/test.Probe/Bidi")(requests(), timeout=5) if method == "Bidi"
                  else channel.unary_stream("/test.Probe/ServerStream")(b"wait", timeout=5))
        assert next(stream) == (b"wait" if method == "Bidi" else b"first")
        stream.cancel()
        more.set()
    wait_for(lambda: handled(registry, probe(method), "CANCELLED") == before + 1)


def test_a_non_blocking_health_watch_still_streams_and_is_counted_when_cancelled(registry, measured):
    target, watched = measured
    watched.set("probe", health_pb2.HealthCheckResponse.SERVING)
    before = handled(registry, WATCH, "CANCELLED")
    with grpc.insecure_channel(target) as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="probe"), timeout=5)
        assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
        watched.set("probe", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert next(stream).status == health_pb2.HealthCheckResponse.NOT_SERVING
        stream.cancel()
    wait_for(lambda: handled(registry, WATCH, "CANCELLED") == before + 1)


def test_unregistered_methods_get_no_labels_and_registered_ones_exist_from_the_start(registry, measured):
    with grpc.insecure_channel(measured[0]) as channel:
        with pytest.raises(grpc.RpcError) as error:
            channel.unary_unary("/test.Probe/Nope")(b"x", timeout=5)
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
    methods = {sample.labels["grpc_method"] for metric in registry.collect() if metric.name.startswith("grpc_server")
               for sample in metric.samples}
    assert methods == {*KINDS, *(m.name for m in health_pb2.DESCRIPTOR.services_by_name["Health"].methods)}
    never_called = {"grpc_type": "unary", "grpc_service": "grpc.health.v1.Health", "grpc_method": "Check"}
    assert registry.get_sample_value("grpc_server_started_total", never_called) == 0.0
