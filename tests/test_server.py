"""A real gRPC server on a free loopback port, driven with the client library: a full session,
server info, health and reflection, auth, TLS, Unix sockets, deadlines, the reasoner, metrics."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from fake_engine import BEST_ACHIEVABLE_MS, PUSHT, FakeEngine, expected_actions, self_signed_cert, serve_fake
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from policy_server.client import PolicyClient, PolicyServerError
from policy_server.client.__main__ import main as client_main
from policy_server.client.errors import explain_connection_failure
from policy_server.client.sync_client import make_channel
from policy_server.client.types import build_observation
from policy_server.config import build_config
from policy_server.engine.api import Observation
from policy_server.limits import MAX_REFLECTION_STREAMS
from policy_server.server import health
from policy_server.server.app import exposure_warnings, max_concurrent_calls
from policy_server.v1 import policy_server_pb2 as pb
from robots.rollout import main as rollout_main
from robots.soak import main as soak_main

STATE = np.array([0.5, -0.25], np.float32)
REPO = Path(__file__).resolve().parents[1]


def frame(seed=0, height=48, width=64):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def expected(step: int, seed: int = 0, chunk: int = 8, instruction: str = "") -> np.ndarray:
    return expected_actions(Observation({"image": frame(seed)}, STATE, instruction, step), chunk, PUSHT)


@pytest.fixture(scope="module")
def engine():
    return FakeEngine()


@pytest.fixture(scope="module")
def server(engine):
    with serve_fake(engine, reflection=True, metrics_port=0) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with PolicyClient(server.target) as c:
        yield c


def test_server_info_publishes_schema_limits_budget_and_profile(client):
    info = client.server_info()
    assert info.protocol_version == "policy_server.v1" and info.ready
    assert info.model.name == "fake-policy" and info.model.digest == "sha256:fake"
    assert [e.name for e in info.embodiments] == ["pusht", "libero"]
    pusht = info.embodiments[0]
    assert [(c.name, c.height, c.width, c.channels) for c in pusht.cameras] == [("image", 48, 64, 3)]
    assert pusht.state_dim == 2 and pusht.action.dim == 2 and list(pusht.action.units) == ["px", "px"]
    assert list(pusht.action.low) == [-1.0, -1.0] and list(pusht.action.high) == [1.0, 1.0]
    assert (pusht.default_chunk_size, pusht.min_chunk_size, pusht.max_chunk_size) == (8, 1, 16)
    assert info.limits.max_sessions == 4 and info.limits.max_message_bytes == 16 * 1024 * 1024
    assert info.limits.max_request_id_chars == 64  # OpenSessionRequest.request_id
    assert info.default_budget_ms == 120.0
    assert [(p.label, p.p95_ms) for p in info.warmup_profile] == [("uncached", 4.5), ("seacache", 3.0)]


def test_full_session(client, engine):
    session = client.open_session("pusht", "push the T", budget_ms=80, chunk_size=4, seed=7)
    assert (session.epoch, session.budget_ms, session.chunk_size, session.seed) == (1, 80.0, 4, 7)

    for step in (0, 4, 8):
        chunk = client.act(session, {"image": frame()}, STATE, step_index=step, encoding="png")
        np.testing.assert_array_equal(chunk.actions, expected(step, chunk=4))
        assert chunk.actions.dtype == np.float32
        assert (chunk.first_step_index, chunk.obs_step_index, chunk.epoch) == (step, step, 1)
        assert chunk.served_ms > 0 and chunk.round_trip_ms >= chunk.served_ms
        assert chunk.tick.budget_ms == 80.0 and chunk.tick.deadline_met
        assert (chunk.tick.full_calls, chunk.tick.skipped_calls, chunk.tick.forced_skips) == (12, 8, 1)
        assert dict(chunk.tick.knobs)["threshold"] == pytest.approx(0.25)
        assert dict(chunk.tick.actual_ms)["total"] == pytest.approx(3.0)

    client.act(session, {"image": frame()}, STATE, instruction="now push it left", step_index=12)
    assert engine.instructions[session.session_id] == "now push it left"

    session = client.set_budget(session, 60)
    assert session.budget_ms == 60.0
    session = client.reset_session(session)
    assert session.epoch == 2
    chunk = client.act(session, {"image": frame(1)}, STATE, step_index=0, encoding="raw")
    np.testing.assert_array_equal(chunk.actions, expected(0, seed=1, chunk=4))
    assert chunk.epoch == 2 and chunk.tick.budget_ms == 60.0

    client.close_session(session)
    with pytest.raises(PolicyServerError) as err:
        client.act(session, {"image": frame()}, STATE)
    assert err.value.reason == "SESSION_NOT_FOUND"


def test_the_retries_of_an_open_session_send_its_request_id(client, engine):
    # The client saw UNAVAILABLE, as when the answer was lost with its connection: open_session's retries send the
    # same request_id, with which a server that did open the session answers it (test_server_e2e) rather than another.
    calls = len(engine.request_ids)
    engine.refuse_opens(2)
    session = client.open_session("pusht", "answers lost twice")
    sent = engine.request_ids[calls:]
    assert len(sent) == 3 and len(set(sent)) == 1 and len(sent[0]) == 32, sent  # one uuid4 hex for every try
    client.close_session(session)
    client.close_session(client.open_session("pusht", "answers lost twice"))
    assert engine.request_ids[-1] != sent[0]  # a new call, a new id


def test_deadline_is_passed_to_the_engine_and_expired_work_is_abandoned(client, engine):
    session = client.open_session("pusht", "hold")
    engine.hold()
    aborted = engine.aborted
    try:
        sent = time.monotonic()
        with pytest.raises(PolicyServerError) as err:
            client.act(session, {"image": frame()}, STATE, timeout_s=0.3)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        # The server's deadline is its receipt plus the timeout gRPC carried: the client's, late by the transit.
        assert engine.deadlines[-1] == pytest.approx(sent + 0.3, abs=0.15)
        for _ in range(200):  # the engine notices within one poll
            if engine.aborted > aborted:
                break
            time.sleep(0.01)
        assert engine.aborted == aborted + 1
        engine.release()
        chunk = client.act(session, {"image": frame()}, STATE, step_index=2, encoding="png")
        np.testing.assert_array_equal(chunk.actions, expected(2))
    finally:
        engine.release()
        client.close_session(session)  # the next tests count the server's sessions


def test_reasoner_streams_pieces(client):
    pieces = list(client.reason("stack the blocks", max_new_tokens=5))
    assert pieces == ["To", " stack", " the", " blocks:", " first"]
    full = client.reason("stack the blocks", max_new_tokens=32)
    assert "".join(full) == "To stack the blocks: first approach the object, then grasp it, then place it."
    assert (full.finish_reason, full.tokens) == ("stop", 14)  # its own end, before max_new_tokens
    cut = client.reason("stack the blocks", max_new_tokens=5)
    assert list(cut) == pieces and (cut.finish_reason, cut.tokens) == ("length", 5)


def test_reasoner_stream_can_be_abandoned_early(client):
    stream = client.reason("wipe the table", max_new_tokens=20)
    assert next(stream) == "To"
    stream.close()  # cancels the call
    assert list(client.reason("wipe", max_new_tokens=2)) == ["To", " wipe:"]


def test_health_and_warmup(engine):
    engine = FakeEngine(ready=False)
    with serve_fake(engine) as server, PolicyClient(server.target) as client:
        assert client.health() == "NOT_SERVING"
        assert client.health("policy_server.v1.PolicyService") == "NOT_SERVING"
        assert client.server_info().ready is False
        with pytest.raises(PolicyServerError) as err:  # at once: the server asks for a try after the timeout
            client.open_session("pusht", "too early", timeout_s=0.5)
        assert (err.value.code, err.value.reason) == (grpc.StatusCode.UNAVAILABLE, "WARMING_UP")
        assert err.value.retry_after_ms > 0
        with pytest.raises(TimeoutError):
            client.wait_until_serving(timeout_s=0.2)
        engine.set_ready(True)
        client.wait_until_serving(timeout_s=10)
        assert client.health("policy_server.v1.PolicyService") == "SERVING"
        assert client.open_session("pusht", "now").epoch == 1
        server.stop(grace_s=0.1)


def test_reflection_lists_and_describes_the_service(server):
    with grpc.insecure_channel(server.target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"policy_server.v1.PolicyService", "grpc.health.v1.Health"} <= services
        file = database.FindFileContainingSymbol("policy_server.v1.PolicyService")
        assert file.name == "policy_server/v1/policy_server.proto"
        assert "ActRequest" in [m.name for m in file.message_type]


def test_idle_reflection_streams_are_bounded_and_leave_the_server_its_threads(server, client):
    # A reflection stream holds a server thread for as long as its client keeps it open: as many idle ones as the
    # server has threads took them all, and every other call got RESOURCE_EXHAUSTED "Concurrent RPC limit exceeded".
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        threads = max_concurrent_calls(server.config.max_sessions, server.config.max_dynamics_calls, reflection=True)
        requests = [queue.Queue() for _ in range(threads)]  # as many as the server has threads
        answers, calls = [], []  # the calls kept: a call collected is cancelled
        for waiting in requests:
            waiting.put(reflection_pb2.ServerReflectionRequest(list_services=""))
            call = stub.ServerReflectionInfo(iter(waiting.get, None))
            calls.append(call)
            try:
                answers.append(next(call).WhichOneof("message_response"))
            except grpc.RpcError as exc:
                error = PolicyServerError.from_rpc_error(exc)
                answers.append((error.code, error.reason, error.retry_after_ms > 0))
        assert answers[:MAX_REFLECTION_STREAMS] == ["list_services_response"] * MAX_REFLECTION_STREAMS
        assert set(answers[MAX_REFLECTION_STREAMS:]) == {
            (grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_REFLECTION_STREAMS", True)}
        assert client.server_info(timeout_s=10).embodiments  # the open ones idle, other calls are served
        for waiting in requests:
            waiting.put(None)  # each ends its stream, which frees its place
    with grpc.insecure_channel(server.target) as channel:
        assert "policy_server.v1.PolicyService" in ProtoReflectionDescriptorDatabase(channel).get_services()


def test_one_connection_holds_at_most_the_pools_calls_and_other_connections_are_served(server):
    # Was: a client that held more calls at once than the thread pool (tens of threads flooding one session's Acts)
    # got the calls of every other client refused, RESOURCE_EXHAUSTED "Concurrent RPC limit exceeded!". Now HTTP/2
    # lets one connection hold at most the pool's count of calls; its calls beyond wait on that connection. Each
    # client of a process has a connection of its own (gRPC shares one between channels of the same options).
    calls = max_concurrent_calls(server.config.max_sessions, server.config.max_dynamics_calls, reflection=True)
    request = health_pb2.HealthCheckRequest(service="")
    with make_channel(server.target) as channel, PolicyClient(server.target) as client:
        stub = health_pb2_grpc.HealthStub(channel)
        watches = [stub.Watch(request) for _ in range(calls)]  # streams that hold no thread: the count is the cap's
        assert {next(watch).status for watch in watches} == {health_pb2.HealthCheckResponse.SERVING}
        with pytest.raises(grpc.RpcError) as waited:
            next(stub.Watch(request, timeout=1.0))
        assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # it waited for a place on its connection
        assert client.server_info(timeout_s=10).embodiments  # another connection is served meanwhile
        watches.pop().cancel()
        assert next(stub.Watch(request, timeout=10)).status == health_pb2.HealthCheckResponse.SERVING
        for watch in watches:
            watch.cancel()


def test_reflection_is_off_by_default():
    with serve_fake() as server, grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as err:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def scrape(server, token: str | None = None) -> dict[tuple[str, frozenset], float]:
    """The server's /metrics, parsed: (sample name, its labels) -> value."""
    request = urllib.request.Request(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    text = urllib.request.urlopen(request, timeout=5).read().decode()
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def sample(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_export_ticks_in_seconds_cache_sessions_process_and_build(server, client):
    session = client.open_session("pusht", "measure")
    before = scrape(server)
    client.act(session, {"image": frame()}, STATE, encoding="png")
    after = scrape(server)
    client.close_session(session)

    def added(name: str, **labels) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert added("policy_server_ticks_total", transport="grpc") == 1
    # The fake tick's 20 calls, each under one decision: 12 full (2 of them fail-open), 8 skipped (1 of them forced).
    decisions = {d: added("policy_server_cache_decisions_total", decision=d)
                 for d in ("full", "fail_open", "skipped", "forced_skip")}
    assert decisions == {"full": 10, "fail_open": 2, "skipped": 7, "forced_skip": 1}
    # The fake tick: denoise 2.5 ms of a 3 ms total; stages and total are separate metrics, in seconds.
    assert added("policy_server_stage_duration_seconds_count", stage="denoise") == 1
    assert added("policy_server_stage_duration_seconds_sum", stage="denoise") == pytest.approx(0.0025)
    assert not any(name.startswith("policy_server_stage") and ("stage", "total") in labels for name, labels in after)
    assert added("policy_server_tick_duration_seconds_sum", transport="grpc") == pytest.approx(0.003)
    assert added("policy_server_tick_duration_seconds_bucket", transport="grpc", le="0.005") == 1
    assert added("policy_server_tick_duration_seconds_bucket", transport="grpc", le="0.002") == 0
    assert added("policy_server_tick_served_duration_seconds_count", transport="grpc") == 1
    assert added("policy_server_tick_served_duration_seconds_sum", transport="grpc") > 0
    assert [labels for name, labels in after if name == "policy_server_tick_duration_seconds_bucket"
            and ("transport", "grpc") in labels] == [
        frozenset({("transport", "grpc"), ("le", le)}) for le in
        ("0.001", "0.002", "0.005", "0.01", "0.02", "0.035", "0.05", "0.075", "0.1", "0.11", "0.12", "0.13", "0.15",
         "0.2", "0.3", "0.5", "1.0", "2.0", "5.0", "10.0", "+Inf")]
    assert sample(after, "policy_server_sessions") == 1 and sample(after, "policy_server_ready") == 1
    assert ("policy_server_queue_depth", frozenset()) in after and ("policy_server_deadline_misses_total",
                                                                   frozenset()) in after
    assert added("policy_server_batch_size_bucket", le="1.0") == 1  # the fake engine runs ticks alone
    assert sample(after, "process_resident_memory_bytes") > 0 and sample(after, "process_cpu_seconds_total") > 0
    info = client.server_info()
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    build = {"version": version, "model": info.model.name, "model_digest": info.model.digest}
    assert [(labels, value) for (name, labels), value in after.items() if name == "policy_server_build_info"] == [
        (frozenset(build.items()), 1.0)]


def test_grpc_calls_are_counted_per_method_and_status_code(server, client):
    def handled(method: str, code: str, grpc_type: str = "unary") -> float:
        return sample(scrape(server), "grpc_server_handled_total", grpc_type=grpc_type,
                      grpc_service="policy_server.v1.PolicyService", grpc_method=method, grpc_code=code)

    def reason(prompt: str):  # read to the status: the client library stops reading at the last piece
        return list(client.stub.Reason(pb.ReasonRequest(prompt=prompt, max_new_tokens=8), timeout=5))

    def control(*requests: pb.ControlRequest):  # send, half-close, read to the status
        return list(client.stub.Control(iter(requests), timeout=5))

    session = client.open_session("pusht", "count calls")
    calls = [  # (method, its type, what the client does, the code it gets)
        ("GetServerInfo", "unary", client.server_info, "OK"),
        ("OpenSession", "unary", lambda: client.open_session("no-such-robot", "push"), "INVALID_ARGUMENT"),
        ("CloseSession", "unary", lambda: client.close_session("no-such-session"), "NOT_FOUND"),
        ("Reason", "server_stream", lambda: reason("pick the cube"), "OK"),
        ("Reason", "server_stream", lambda: reason("   "), "INVALID_ARGUMENT"),
        ("Control", "bidi_stream", lambda: control(pb.ControlRequest(start=pb.ControlStart(
            session_id=session.session_id))), "OK"),
        ("Control", "bidi_stream", lambda: control(pb.ControlRequest(start=pb.ControlStart(
            session_id="no-such-session"))), "NOT_FOUND"),
        ("Control", "bidi_stream", lambda: control(pb.ControlRequest(ping=pb.Ping(client_time_ns=1))),
         "FAILED_PRECONDITION"),
        ("CloseSession", "unary", lambda: client.close_session(session), "OK"),
    ]
    for method, grpc_type, do, code in calls:
        before = handled(method, code, grpc_type)
        if code == "OK":
            do()
        else:
            with pytest.raises((PolicyServerError, grpc.RpcError)) as error:
                do()
            got = error.value.code if isinstance(error.value, PolicyServerError) else error.value.code()
            assert got.name == code
        assert handled(method, code, grpc_type) == before + 1, (method, code)
    with grpc.insecure_channel(server.target) as channel:  # an unknown method makes no label
        with pytest.raises(grpc.RpcError) as error:
            channel.unary_unary("/policy_server.v1.PolicyService/NoSuchMethod")(b"", timeout=5)
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert not any(("grpc_method", "NoSuchMethod") in labels for _, labels in scrape(server))


def test_deadline_misses_are_counted(server, client):
    before = server.metrics.deadline_misses._value.get()
    session = client.open_session("pusht", "tight", budget_ms=BEST_ACHIEVABLE_MS)  # fake answers in 3 ms
    chunk = client.act(session, {"image": frame()}, STATE)
    assert chunk.tick.deadline_met and server.metrics.deadline_misses._value.get() == before
    client.close_session(session)


# -- security ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "token"
    path.write_text("s3cret-server-token\n")
    path.chmod(0o600)
    return path


def test_token_auth(token_file):
    with serve_fake(auth_token_file=token_file) as server:
        with PolicyClient(server.target) as anonymous:
            assert anonymous.health() == "SERVING"  # health stays open for probes
            with pytest.raises(PolicyServerError) as err:
                anonymous.open_session("pusht", "no token")
            assert (err.value.code, err.value.reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
            assert "missing" in err.value.message
            with pytest.raises(PolicyServerError) as err:
                list(anonymous.reason("no token", 3))
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        with PolicyClient(server.target, token="wrong") as wrong:
            with pytest.raises(PolicyServerError) as err:
                wrong.server_info()
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED and "invalid" in err.value.message
        refused = server.metrics.registry.get_sample_value("policy_server_errors_total", {"reason": "UNAUTHENTICATED"})
        assert refused == 3  # counted with the other refusals, by reason
        with PolicyClient(server.target, token_file=token_file) as good:
            session = good.open_session("pusht", "with token")
            chunk = good.act(session, {"image": frame()}, STATE, step_index=1, encoding="png")
            np.testing.assert_array_equal(chunk.actions, expected(1))


def test_a_health_watch_takes_the_token_and_a_check_does_not(token_file):
    """Each Watch stream holds server memory (about 23 kB) while its client keeps it, and anyone who reached the port
    could open them without the token, as many as it liked. Probes (docker, k8s) Check; `wait_until_serving` watches
    with the client's token."""
    with serve_fake(auth_token_file=token_file) as server:
        with grpc.insecure_channel(server.target) as channel:
            with pytest.raises(grpc.RpcError) as err:
                next(health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with PolicyClient(server.target) as anonymous:
            assert anonymous.health() == "SERVING"
        with PolicyClient(server.target, token_file=token_file) as client:
            client.wait_until_serving(timeout_s=10)


SERVING = health_pb2.HealthCheckResponse.SERVING


def test_health_watch_streams_are_bounded_and_a_waiting_client_waits_for_a_place(monkeypatch):
    """Each held server memory for as long as its client kept it, as many as anyone opened (1548 streams: +35 MB)."""
    monkeypatch.setattr(health, "MAX_HEALTH_WATCHES", 2)
    with serve_fake() as server, grpc.insecure_channel(server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        held = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(2)]
        assert [next(stream).status for stream in held] == [SERVING] * 2
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.Watch(health_pb2.HealthCheckRequest(), timeout=5))
        assert (refused.value.code(), PolicyServerError.from_rpc_error(refused.value).reason) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_HEALTH_WATCHES")
        with PolicyClient(server.target) as client:
            assert client.health() == "SERVING"  # Check takes no place
            with pytest.raises(TimeoutError, match=r"not SERVING after 0.5 s \(last: TOO_MANY_HEALTH_WATCHES\)"):
                client.wait_until_serving(timeout_s=0.5)  # tried again within its wait, not raised
            held.pop().cancel()  # its place frees as the stream ends
            client.wait_until_serving(timeout_s=10)
        # Streams cancelled as they come: one whose call had ended before its place's release was registered kept
        # the place for good (5 of 64 in 300 tries, all in 3000).
        held.pop().cancel()
        for _ in range(1000):
            stub.Watch(health_pb2.HealthCheckRequest(), timeout=5).cancel()
        end = time.monotonic() + 10
        while True:  # a cancelled stream's place comes back once the server has seen it end
            try:
                assert next(stub.Watch(health_pb2.HealthCheckRequest(), timeout=5)).status == SERVING
                break
            except grpc.RpcError as refused:  # its place, or the connection's (the server counts the cancelled too)
                reason = PolicyServerError.from_rpc_error(refused).reason
                assert reason in ("TOO_MANY_HEALTH_WATCHES", "TOO_MANY_CALLS") and time.monotonic() < end
                time.sleep(0.05)


def test_watch_streams_that_end_as_others_are_answered_leave_the_server_serving(server):
    # Was: grpc_health's servicer sent a Watch's status holding the lock that every Watch's end takes on gRPC's
    # poller thread, and a send waits for that thread: Watch-then-cancel calls wedged the whole server, every later
    # call unanswered (grpc/grpc#43403).
    request = health_pb2.HealthCheckRequest(service="")

    def watch_and_cancel(ends_s: float) -> None:
        with grpc.insecure_channel(server.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < ends_s:
                watch = stub.Watch(request, timeout=5)
                assert next(watch).status == SERVING
                watch.cancel()

    ends_s = time.monotonic() + 5
    with futures.ThreadPoolExecutor(4) as pool:
        for watching in [pool.submit(watch_and_cancel, ends_s) for _ in range(4)]:
            watching.result()
    with grpc.insecure_channel(server.target) as channel:
        assert health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status == SERVING


def test_health_names_an_unknown_service_and_refuses_a_name_no_service_has(server):
    # Was: a Watch kept any name it was given, 32 MiB at most, for as long as its stream was open, and the server's
    # table of watched names kept each for good.
    with grpc.insecure_channel(server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert next(stub.Watch(health_pb2.HealthCheckRequest(service="x" * 256), timeout=5)).status == (
            health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.Watch(health_pb2.HealthCheckRequest(service="x" * 257), timeout=5))
        error = PolicyServerError.from_rpc_error(refused.value)
        assert (error.code, error.reason, error.field) == (grpc.StatusCode.INVALID_ARGUMENT, "TOO_LONG", "service")
        with pytest.raises(grpc.RpcError) as unknown:
            stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        error = PolicyServerError.from_rpc_error(unknown.value)
        assert (error.code, error.reason) == (grpc.StatusCode.NOT_FOUND, "SERVICE_NOT_FOUND")


def test_a_watch_is_sent_a_status_only_when_it_changes():
    """Was: SERVING, then NOT_SERVING and SERVING again while the stream's sender was still sending the first SERVING,
    sent SERVING twice; the health protocol's Watch sends a status when it changes. The sender's send does what a
    status flapping during a slow send does: it sets the two statuses as it sends the first."""
    service = health.HealthService()
    service.set("", SERVING)
    sent, senders = [], []

    def send(response):
        sent.append(None if response is None else response.status)
        senders.append(threading.current_thread())
        if len(sent) == 1:
            service.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            service.set("", SERVING)
            service.set("", SERVING)  # set again as it is: no change either
        return True

    class Context:
        def add_callback(self, ended) -> bool:
            return True

    service.Watch(health_pb2.HealthCheckRequest(), Context(), send)
    ends_s = time.monotonic() + 10
    while not sent:
        assert time.monotonic() < ends_s, "the Watch was sent no status"
        time.sleep(0.01)
    service.close()  # its sender ends once it has sent what it was going to
    senders[0].join(10)
    assert not senders[0].is_alive()
    assert sent == [SERVING]


def test_a_watch_whose_client_reads_nothing_holds_up_only_itself():
    # Was: statuses went out under the servicer's lock, on the thread that set them: the readiness poller, every
    # other Watch (each holding a server thread as it waited) and the server's stop waited for good on that send.
    # The server runs in a process of its own, killed if it has not ended in time: a regression fails this test, and
    # leaves no stuck thread in pytest's process for its exit to wait on.
    process = subprocess.Popen([sys.executable, str(REPO / "tests" / "stuck_watch_server.py")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=60)  # a few seconds when it works, the process' start included
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"the server did not answer beside a stuck Watch and stop within 60 s; it said:\n{output[-3000:]}")
    assert process.returncode == 0, output[-3000:]
    assert output.splitlines()[-1] == "stopped"


def test_a_tls_mismatch_is_named_in_one_line_without_grpc_cores_log(tmp_path):
    """Was: a plaintext client of a TLS server said only "failed to connect to all addresses; last error: UNAVAILABLE:
    ipv4:127.0.0.1:PORT: Socket closed"; a TLS client of a plaintext server or with a CA that does not trust the
    server's certificate said OpenSSL's words (WRONG_VERSION_NUMBER, CERTIFICATE_VERIFY_FAILED), after a line of gRPC
    core's own log ("I1208 ... ssl_transport_security.cc:2563] Handshake failed ..."); policy-rollout waited 10 min
    for a server it could never reach. The commands run as processes: gRPC core writes to the process' stderr."""
    cert, key = self_signed_cert(tmp_path)
    (tmp_path / "other").mkdir()
    other_cert, _ = self_signed_cert(tmp_path / "other")
    probe = [sys.executable, "-m", "policy_server.client", "health", "--timeout-s", "5"]
    rollout = [sys.executable, "-c", "import sys; from robots.console import rollout; sys.exit(rollout())",
               "--episodes", "1", "--out", str(tmp_path / "rollout.json")]
    environ = {name: value for name, value in os.environ.items() if name != "GRPC_VERBOSITY"}
    with serve_fake(tls_cert=cert, tls_key=key) as tls_server, serve_fake() as plaintext_server:
        tls_at, plaintext_at = tls_server.target, plaintext_server.target
        cases = [
            (["--server", tls_at], f"the server at {tls_at} closed the connection before a word of gRPC: a TLS "
                                   "server (connect with --tls-ca FILE"),
            (["--server", plaintext_at, "--tls-ca", str(cert)], f"the server at {plaintext_at} does not speak TLS"),
            (["--server", tls_at, "--tls-ca", str(other_cert)],
             f"TLS handshake with {tls_at} failed: its certificate (self signed certificate) is not trusted by the "
             "given CA"),
            (["--server", tls_at, "--tls"], "is not trusted by the system's root certificates; pass the server's CA"),
            (["--server", tls_at, "--tls-ca", str(cert), "--tls-server-name", "robot.example"],
             f"TLS handshake with {tls_at} failed: its certificate does not hold the name 'robot.example'"),
        ]
        for flags, cause in cases:
            done = subprocess.run([*probe, *flags], capture_output=True, text=True, timeout=60, env=environ)
            lines = done.stderr.splitlines()
            assert (done.returncode, done.stdout, len(lines)) == (2, "", 1), done.stderr  # no line of gRPC core's
            assert lines[0].startswith("UNAVAILABLE: ") and cause in lines[0], lines[0]
        for flags, cause in cases[1:2]:  # a TLS client's: it waits at most SERVING_NOTICE_S, not 10 minutes more
            done = subprocess.run([*rollout, *flags], capture_output=True, text=True, timeout=120, env=environ)
            lines = done.stderr.splitlines()
            assert (done.returncode, len(lines)) == (2, 1), done.stderr
            assert lines[0].startswith("policy-rollout: UNAVAILABLE: ") and cause in lines[0], lines[0]
        # The library says the same. A plaintext client's is a guess that may yet change (a tunnel whose far end
        # starts): wait_until_serving waits on, and names it when it times out.
        with PolicyClient(tls_at, timeout_s=5) as plaintext:
            with pytest.raises(PolicyServerError, match="a TLS server .connect with --tls-ca FILE"):
                plaintext.health()
            with pytest.raises(TimeoutError, match="or a tunnel or proxy with nothing behind it yet"):
                plaintext.wait_until_serving(timeout_s=0.5)
        with PolicyClient(plaintext_at, root_certificates=cert.read_bytes(), timeout_s=5) as tls:
            with pytest.raises(PolicyServerError, match="does not speak TLS"):
                tls.health()
            with pytest.raises(PolicyServerError, match="does not speak TLS"):
                tls.server_info(timeout_s=0.5)  # these wait for a connection
            with pytest.raises(PolicyServerError, match="does not speak TLS"):
                tls.open_session("pusht", "tls", timeout_s=0.5)
            with pytest.raises(PolicyServerError, match="does not speak TLS"):
                tls.wait_until_serving(timeout_s=0.5)


def test_a_connection_closed_before_a_word_of_grpc_is_waited_on_as_a_tunnel_may_yet_connect():
    """A tunnel or proxy with nothing behind it yet (ssh -L, docker-proxy, kubectl port-forward) accepts and closes,
    as a TLS server does to a plaintext client: it was named "it likely speaks TLS", and wait_until_serving (and
    policy-rollout's wait) gave up at once."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        stop = threading.Event()

        def accept_and_close():
            listener.settimeout(0.05)
            while not stop.is_set():
                try:
                    listener.accept()[0].close()
                except TimeoutError:
                    pass

        closer = threading.Thread(target=accept_and_close)
        closer.start()
        try:
            with PolicyClient(f"127.0.0.1:{listener.getsockname()[1]}") as client:
                with pytest.raises(TimeoutError, match="a TLS server .* or a tunnel or proxy with nothing behind"):
                    client.wait_until_serving(timeout_s=1.0)
                with pytest.raises(PolicyServerError, match="or a tunnel or proxy"):
                    client.server_info(timeout_s=0.5)
        finally:
            stop.set()
            closer.join()


@pytest.mark.parametrize("grpc_text, cause", [
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.1:50051: Ssl handshake failed (TSI_PROTOCOL"
     "_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: certificate "
     "has expired", "its certificate was refused (certificate has expired); check its validity dates against this "
                    "machine's clock (gRPC: failed to connect"),
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.1:50051: Ssl handshake failed (TSI_PROTOCOL"
     "_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: self signed "
     "certificate", "its certificate (self signed certificate) is not trusted by the given CA"),
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.1:50051: Ssl handshake failed (TSI_PROTOCOL"
     "_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unsuitable "
     "certificate purpose", "its certificate was refused (unsuitable certificate purpose) (gRPC: failed"),
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.1:50051: Peer name robot.example is not in "
     "peer certificate; Hostname Verification Check failed.", "does not hold the name 'robot.example'; pass"),
])
def test_a_tls_handshakes_failure_is_named_by_its_cause(grpc_text, cause):
    """An expired certificate (or one not valid yet: a robot's clock) was blamed on the CA."""
    failed = PolicyServerError(grpc.StatusCode.UNAVAILABLE, "", grpc_text)
    named = explain_connection_failure(failed, "dns:///robot.example:50051", True, b"ca", None)
    assert cause in named.message and named.message.endswith(f"(gRPC: {grpc_text})")


def test_importing_the_client_library_leaves_grpc_cores_log_alone():
    """The client commands keep gRPC core's log to errors; a program importing the library decides for itself (gRPC
    core reads GRPC_VERBOSITY once, as grpc is imported: the package imports none until a name is used)."""
    script = ("import os, sys\nimport policy_server.client\nassert 'grpc' not in sys.modules\n"
              "from policy_server.client import PolicyClient\nimport robots.rollout\n"
              "assert 'grpc' in sys.modules and 'GRPC_VERBOSITY' not in os.environ")
    environ = {name: value for name, value in os.environ.items() if name != "GRPC_VERBOSITY"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=environ)
    assert done.returncode == 0, done.stderr


def test_tls(tmp_path, capsys):
    cert, key = self_signed_cert(tmp_path)
    (tmp_path / "other").mkdir()
    other_cert, _ = self_signed_cert(tmp_path / "other")
    with serve_fake(tls_cert=cert, tls_key=key) as server:
        with PolicyClient(server.target, root_certificates=cert.read_bytes(), server_name="localhost") as client:
            session = client.open_session("pusht", "encrypted")
            chunk = client.act(session, {"image": frame()}, STATE, step_index=3, encoding="png")
            np.testing.assert_array_equal(chunk.actions, expected(3))
        with PolicyClient(server.target, timeout_s=1.0) as plaintext:
            with pytest.raises(PolicyServerError) as err:
                plaintext.health()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
        # A name to check the certificate against means TLS, as the CLI's --tls-server-name does: never plaintext.
        with serve_fake() as plaintext_server, PolicyClient(plaintext_server.target, server_name="localhost",
                                                            timeout_s=1.0) as named:
            with pytest.raises(PolicyServerError) as err:
                named.health()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
        with PolicyClient(server.target, root_certificates=other_cert.read_bytes(), timeout_s=1.0) as untrusted:
            with pytest.raises(PolicyServerError) as err:
                untrusted.health()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
        # The command-line tools' TLS flags (the probe's; policy-rollout and policy-soak share them).
        probe = ["health", "--server", server.target, "--timeout-s", "1", "--tls-ca", str(cert)]
        assert client_main(probe) == 0
        assert client_main([*probe, "--tls-server-name", "localhost"]) == 0
        assert client_main([*probe, "--tls-server-name", "robot.example"]) == 2  # not a name the certificate holds
        assert client_main(probe[:-2]) == 2  # plaintext
        assert client_main([*probe[:-2], "--tls"]) == 2  # the system's roots do not hold a self-signed certificate
        assert rollout_main(["--server", server.target, "--tls-ca", str(cert), "--episodes", "1",
                             "--out", str(tmp_path / "rollout.json")]) == 0
    for main, argv in ((rollout_main, ["--in-process", "--tls"]), (soak_main, ["--tls-server-name", "localhost"])):
        with pytest.raises(SystemExit):  # a server the tool runs itself has no TLS
            main(argv)
        assert "need --server" in capsys.readouterr().err
    (tmp_path / "empty").write_text(" \n")
    for flag, bad, why in (("--tls-ca", tmp_path / "missing.pem", "cannot read"),
                           ("--tls-ca", key, "is not a PEM certificate file"),
                           ("--auth-token-file", tmp_path / "missing", "cannot read"),
                           ("--auth-token-file", tmp_path / "empty", "is empty; expected a single token"),
                           ("--timeout-s", "0", "expected seconds above 0, up to 86400, got '0'"),
                           ("--timeout-s", "nan", "expected seconds above 0, up to 86400, got 'nan'"),
                           # gRPC's deadline overflowed: DEADLINE_EXCEEDED at once
                           ("--timeout-s", "1e300", "expected seconds above 0, up to 86400, got '1e300'"),
                           ("--server", "127.0.0.1:99999", "expected HOST:PORT with a port from 1 to 65535"),
                           ("--server", "unix:", "or unix:PATH; got 'unix:'"),  # was UNAVAILABLE: empty address list
                           ("--server", "", "expected HOST:PORT"),
                           # health took and ignored them
                           ("--budget-ms", "50", "--budget-ms: only info takes them"),
                           ("--rate-hz", "2", "--rate-hz: only info takes them")):
        with pytest.raises(SystemExit) as exit_:
            client_main(["health", flag, str(bad)])
        assert exit_.value.code == 2 and why in capsys.readouterr().err


def test_a_token_file_other_users_may_read_is_warned_of(token_file):
    config = build_config(overrides={"auth_token_file": token_file})
    assert exposure_warnings(config) == []
    token_file.chmod(0o644)
    try:
        assert exposure_warnings(config) == [f"auth token file {token_file} may be read by other users of this machine "
                                             "(mode 644): chmod 600 it"]
    finally:
        token_file.chmod(0o600)


def test_a_tls_key_other_users_may_read_is_warned_of(tmp_path):
    """The token file was checked, and the private key that proves the server's identity was not."""
    cert, key = self_signed_cert(tmp_path)  # mode 600
    config = build_config(overrides={"tls_cert": cert, "tls_key": key})
    assert exposure_warnings(config) == []
    key.chmod(0o640)
    assert exposure_warnings(config) == [f"TLS key file {key} may be read by other users of this machine (mode 640): "
                                         "chmod 600 it"]


@pytest.mark.parametrize(("settings", "warning"), [
    ({}, None),  # loopback
    ({"host": "::1", "metrics_host": "localhost", "metrics_port": 0}, None),
    ({"host": "0.0.0.0"}, "gRPC on 0.0.0.0 may be reached from other machines, with no token asked"),
    ({"host": "10.1.2.3", "websocket_port": 0},
     "gRPC and the openpi WebSocket on 10.1.2.3 may be reached from other machines, with no token asked"),
    ({"host": "0.0.0.0", "metrics_host": "0.0.0.0", "metrics_port": 0},
     "gRPC on 0.0.0.0 and /metrics on 0.0.0.0 may be reached from other machines, with no token asked: whoever reaches "
     "them may open sessions and get action chunks"),
    # It said 'may open sessions and get action chunks' of /metrics alone too.
    ({"metrics_host": "0.0.0.0", "metrics_port": 0}, "/metrics on 0.0.0.0 may be reached from other machines, with no "
     "token asked: whoever reaches them may read the server's metrics (its sessions, errors and the model's digest)"),
    ({"host": socket.gethostname(), "auth_token_file": "token"},  # a name: a host's settings name no other machine's
     f"gRPC on {socket.gethostname()} may be reached from other machines in plaintext: the auth token crosses the "
     "network"),
    ({"host": "[::]", "auth_token_file": "token", "tls": True}, None),
])
def test_listeners_other_machines_may_reach_without_a_token_or_tls_are_warned_of(token_file, tmp_path, settings,
                                                                                    warning):
    settings = dict(settings)
    if settings.get("auth_token_file"):
        settings["auth_token_file"] = token_file
    if settings.pop("tls", False):
        settings["tls_cert"], settings["tls_key"] = self_signed_cert(tmp_path)
    warnings = exposure_warnings(build_config(overrides=settings))
    if warning is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warnings[0].startswith(warning), warnings


def test_unix_socket(tmp_path):
    socket_path = tmp_path / "policy.sock"
    with serve_fake(unix_socket=socket_path) as server:
        with PolicyClient(f"unix:{socket_path}") as client:
            session = client.open_session("pusht", "local")
            np.testing.assert_array_equal(
                client.act(session, {"image": frame()}, STATE, step_index=5, encoding="png").actions, expected(5))
        assert server.grpc_port > 0


def test_concurrent_sessions_are_isolated(client):
    sessions = [client.open_session("pusht", f"robot {i}") for i in range(3)]
    results: dict[int, np.ndarray] = {}

    def run(i: int) -> None:
        results[i] = client.act(sessions[i], {"image": frame(i)}, STATE, step_index=i, encoding="png").actions

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for i in range(3):
        np.testing.assert_array_equal(results[i], expected(i, seed=i))
        client.close_session(sessions[i])


def test_metrics_need_the_token_when_the_server_does_and_stay_on_loopback(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("metrics-secret-token")
    with serve_fake(FakeEngine(), metrics_port=0, auth_token_file=str(token_file)) as running:
        assert running.metrics._http.server_address[0] == "127.0.0.1"
        url = f"http://127.0.0.1:{running.metrics_port}/metrics"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=5)
        assert refused.value.code == 401
        wrong = urllib.request.Request(url, headers={"Authorization": "Bearer nope"})
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(wrong, timeout=5)
        with PolicyClient(running.target) as anonymous, pytest.raises(PolicyServerError):
            anonymous.server_info()
        samples = scrape(running, token="metrics-secret-token")
        assert ("policy_server_sessions", frozenset()) in samples
        refused = {"grpc_type": "unary", "grpc_service": "policy_server.v1.PolicyService",
                   "grpc_method": "GetServerInfo", "grpc_code": "UNAUTHENTICATED"}
        assert sample(samples, "grpc_server_handled_total", **refused) == 1


def test_a_float64_state_float32_cannot_hold_is_refused_not_turned_into_inf(client):
    session = client.open_session("pusht", "push the T")
    with pytest.raises(PolicyServerError) as refused:
        client.act(session, {"image": frame()}, np.array([1e300, 0.0]))
    assert (refused.value.reason, refused.value.field) == ("OUT_OF_RANGE", "observation.state")
    assert client.act(session, {"image": frame()}, np.array([0.1, 0.2])).actions.shape == (8, 2)  # float64 is fine
    client.close_session(session)


def test_a_value_just_beyond_a_limit_is_named_as_sent(client):
    session = client.open_session("pusht", "push the T")
    beyond = np.nextafter(np.float32(1), np.float32(2))  # the float32 after the declared 1
    with pytest.raises(PolicyServerError) as refused:
        client.act(session, {"image": frame()}, STATE, committed_actions=np.array([[0.0, beyond]], np.float32))
    assert refused.value.reason == "OUT_OF_RANGE"
    assert str(refused.value).endswith("got 1.0000001 at index [0, 1]")  # not "got 1", the limit itself
    client.close_session(session)


def test_a_bad_value_in_a_chunk_is_named_by_its_row_and_dimension(client):
    session = client.open_session("pusht", "push the T")
    committed = np.zeros((3, 2), np.float32)
    committed[1, 1] = np.nan
    with pytest.raises(PolicyServerError) as refused:
        client.act(session, {"image": frame()}, STATE, committed_actions=committed)
    assert str(refused.value).endswith("got NaN/Inf at index [[1, 1]]")  # not [3], read as row 3
    committed[1, 1], committed[2, 0], committed[2, 1] = 0.0, 5.0, 5.0
    with pytest.raises(PolicyServerError) as refused:
        client.act(session, {"image": frame()}, STATE, committed_actions=committed)
    assert str(refused.value).endswith("got 5.0 at index [2, 0] (2 out of range)")
    with pytest.raises(PolicyServerError) as refused:
        client.act(session, {"image": frame()}, np.array([0.1, np.inf], np.float32))
    assert str(refused.value).endswith("got NaN/Inf at index [1]")  # a vector's index as it was
    client.close_session(session)


@pytest.mark.parametrize("tensor, reason", [
    (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[0, 2], data=bytes(64)), "BAD_TENSOR"),  # bytes no row holds
    (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[0, -3]), "BAD_TENSOR"),
    (pb.Tensor(dtype=pb.DTYPE_UINT8, shape=[0, 2]), "BAD_DTYPE"),
])
def test_committed_actions_without_rows_are_none_only_when_well_formed(client, tensor, reason):
    session = client.open_session("pusht", "push the T")
    observation = build_observation({"image": frame()}, STATE, step_index=3, encoding="png")
    request = pb.ActRequest(session_id=session.session_id, epoch=session.epoch, observation=observation)
    request.observation.committed_actions.CopyFrom(tensor)
    with pytest.raises(PolicyServerError) as refused:
        client.act_request(request)
    assert (refused.value.reason, refused.value.field.split(".")[:2]) == (reason, ["observation", "committed_actions"])
    request.observation.committed_actions.CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[0, 2]))  # none
    np.testing.assert_array_equal(client.act_request(request).actions, expected(3))
    client.close_session(session)
