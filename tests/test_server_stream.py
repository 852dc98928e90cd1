"""The Control stream: newest observation wins, superseded frames are reported, stale epochs are
rejected, bad frames do not end the stream, budgets change mid-stream, the client reconnects."""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from fake_engine import LIBERO, PUSHT, FakeEngine, expected_actions, serve_fake

from policy_server.client import Backoff, ControlStream, PolicyClient, PolicyServerError, build_observation
from policy_server.client import types as client_types
from policy_server.config import build_config
from policy_server.engine.api import Observation
from policy_server.limits import MAX_FRAME_SIDE, MAX_PENDING_FRAMES, MAX_QUEUED_EVENTS, MAX_STARTING_STREAMS
from policy_server.server import control_stream
from policy_server.server.app import build_server
from policy_server.v1 import policy_server_pb2 as pb
from policy_server.v1 import policy_server_pb2_grpc as pb_grpc

STATE = np.array([0.1, 0.2], np.float32)
IMAGE = np.full((48, 64, 3), 90, np.uint8)


def expected(step: int) -> np.ndarray:
    return expected_actions(Observation({"image": IMAGE}, STATE, "", step), 8, PUSHT)


@pytest.fixture(scope="module")
def engine():
    return FakeEngine(max_sessions=16)


@pytest.fixture(scope="module")
def server(engine):
    with serve_fake(engine, max_message_mb=0.25, max_sessions=16) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with PolicyClient(server.target) as c:
        yield c


@pytest.fixture
def stream(client, engine):
    session = client.open_session("pusht", "push")
    with ControlStream(client, session) as s:
        yield s
    engine.release()
    client.close_session(s.session)  # the fake engine closes no session unused: its 16 places would run out


def send(stream: ControlStream, step: int, **kwargs) -> int:
    return stream.send({"image": IMAGE}, STATE, step_index=step, encoding="png", **kwargs)


def test_chunks_answer_their_frames(stream):
    for step in (0, 8, 16):
        obs_id = send(stream, step)
        chunk = stream.next_chunk()
        assert chunk.obs_id == obs_id and chunk.first_step_index == step
        np.testing.assert_array_equal(chunk.actions, expected(step))


def test_newest_observation_wins_and_superseded_frames_are_reported(stream, engine):
    engine.hold()
    first = send(stream, 1)
    engine.wait_entered()  # frame 1 is being computed
    second, third = send(stream, 2), send(stream, 3)
    event = stream.next_event()
    assert (event.kind, event.obs_id, event.by_obs_id) == ("superseded", second, third)
    engine.release()
    answered = [stream.next_chunk(), stream.next_chunk()]
    assert [c.obs_id for c in answered] == [first, third]
    assert [c.first_step_index for c in answered] == [1, 3]


def test_a_superseded_frame_is_never_decoded(stream, engine):
    # Only the frames the model uses are decoded: a robot streaming its camera faster than it asks for chunks
    # costs the server the frames it acts on. A corrupt frame superseded before its turn is no error.
    engine.hold()
    first = send(stream, 1)
    engine.wait_entered()
    corrupt = build_observation({"image": IMAGE}, STATE, encoding="png")
    corrupt.images["image"].data = corrupt.images["image"].data[:40]
    second, third = stream.send_observation(corrupt), send(stream, 3)
    event = stream.next_event()
    assert (event.kind, event.obs_id, event.by_obs_id) == ("superseded", second, third)
    engine.release()
    assert [stream.next_chunk().obs_id, stream.next_chunk().obs_id] == [first, third]
    wrong = stream.send_observation(corrupt)  # one that is its turn is decoded, and answered
    event = stream.next_event()
    assert (event.kind, event.obs_id, event.error.reason) == ("error", wrong, "IMAGE_DECODE_FAILED")


def test_must_answer_frames_are_never_superseded(stream, engine):
    engine.hold()
    first = send(stream, 1)
    engine.wait_entered()
    kept = send(stream, 2, must_answer=True)
    dropped = send(stream, 3)
    newest = send(stream, 4)
    event = stream.next_event()
    assert (event.kind, event.obs_id, event.by_obs_id) == ("superseded", dropped, newest)
    engine.release()
    assert [stream.next_chunk().obs_id for _ in range(3)] == [first, kept, newest]


def test_must_answer_frames_beyond_the_limit_are_refused(stream, engine):
    engine.hold()
    first = send(stream, 1)
    engine.wait_entered()
    kept = [send(stream, 2 + i, must_answer=True) for i in range(MAX_PENDING_FRAMES)]
    refused = send(stream, 9, must_answer=True)
    event = stream.next_event()
    assert (event.kind, event.obs_id, event.error.reason) == ("error", refused, "TOO_MANY_PENDING_FRAMES")
    assert event.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    engine.release()
    assert [stream.next_chunk().obs_id for _ in range(1 + MAX_PENDING_FRAMES)] == [first, *kept]


def test_frames_whose_obs_id_does_not_increase_are_refused(client):
    session = client.open_session("pusht", "count up")
    frame = build_observation({"image": IMAGE}, STATE, encoding="png")
    requests = [pb.ControlRequest(start=pb.ControlStart(session_id=session.session_id)),
                *(pb.ControlRequest(observation=pb.ObservationFrame(epoch=1, obs_id=obs_id, observation=frame,
                                                                    must_answer=True)) for obs_id in (5, 5, 3, 6))]
    events = list(client.stub.Control(iter(requests), timeout=30))
    refused = [(e.error.obs_id, e.error.error.reason) for e in events if e.WhichOneof("kind") == "error"]
    assert refused == [(5, "BAD_VALUE"), (3, "BAD_VALUE")]
    assert [e.chunk.obs_id for e in events if e.WhichOneof("kind") == "chunk"] == [5, 6]
    client.close_session(session)


def test_frames_with_an_old_epoch_are_rejected(stream):
    old_epoch = stream.session.epoch
    session = stream.reset()
    assert session.epoch == old_epoch + 1
    stale = stream.send_observation(pb.Observation(), epoch=old_epoch)  # rejected before decoding
    event = stream.next_event()
    assert (event.kind, event.obs_id, event.error.reason) == ("error", stale, "STALE_EPOCH")
    assert event.error.code == grpc.StatusCode.FAILED_PRECONDITION
    fresh = send(stream, 0)
    chunk = stream.next_chunk()
    assert chunk.obs_id == fresh and chunk.epoch == session.epoch


def test_a_reply_computed_across_a_reset_is_never_delivered(stream, engine):
    engine.hold()
    in_flight = send(stream, 5)
    engine.wait_entered()
    stream.reset()
    engine.release()
    event = stream.next_event()
    assert (event.kind, event.obs_id, event.error.reason) == ("error", in_flight, "STALE_EPOCH")


def test_next_chunk_after_a_reset_is_the_new_episodes(stream, engine):
    # What the last episode left in the queue, a chunk that came before the reset and the STALE_EPOCH answer to a
    # frame in flight at it, is never what next_chunk hands a robot after it.
    send(stream, 0)
    while stream._events.empty():  # the old episode's chunk waits, unread
        time.sleep(0.01)
    engine.hold()
    send(stream, 8)
    engine.wait_entered()
    session = stream.reset()
    engine.release()
    fresh = send(stream, 0)
    chunk = stream.next_chunk()
    assert (chunk.obs_id, chunk.epoch) == (fresh, session.epoch)


def test_next_chunk_raises_stale_epoch_where_the_session_was_reset_outside_the_stream(stream, client):
    # A unary reset is not seen by the stream: each frame after it comes back STALE_EPOCH at the stream's own epoch,
    # which next_chunk skipped as the last episode's, waiting out its timeout on every frame.
    client.reset_session(stream.session)
    send(stream, 0)
    with pytest.raises(PolicyServerError) as raised:
        stream.next_chunk(timeout_s=5)
    assert (raised.value.reason, raised.value.detail.got) == ("STALE_EPOCH", str(stream.session.epoch))


def test_bad_frames_get_error_events_and_the_stream_lives_on(stream):
    nan = stream.send({"image": IMAGE}, np.array([np.nan, 0.0]), step_index=1)
    event = stream.next_event()
    assert (event.kind, event.obs_id, event.error.reason, event.error.field) == (
        "error", nan, "NON_FINITE", "observation.observation.state")
    wide = stream.send({"image": np.zeros((1, MAX_FRAME_SIDE + 1, 3), np.uint8)}, STATE, step_index=2, encoding="png")
    assert stream.next_event().error.reason == "SCHEMA_MISMATCH"  # wider than any frame may be
    big = pb.Observation(instruction="x" * 300_000, step_index=3)
    too_big = stream.send_observation(big)
    event = stream.next_event()
    assert (event.obs_id, event.error.reason) == (too_big, "PAYLOAD_TOO_LARGE")
    assert wide != too_big
    good = send(stream, 4)
    assert stream.next_chunk().obs_id == good


def test_a_frame_over_twice_the_message_limit_ends_the_stream_saying_why(client, engine):
    # gRPC core cuts it before the servicer reads it (the README's bounded inputs): no error event can answer it.
    session = client.open_session("pusht", "push")
    with ControlStream(client, session) as stream:
        stream.send({"image": np.zeros((512, 512, 3), np.uint8)}, STATE, encoding="raw", must_answer=True)  # 0.75 MiB
        event = stream.next_event()
        assert (event.kind, event.error.reason) == ("closed", "PAYLOAD_TOO_LARGE")
    client.close_session(session)
    engine.release()


def test_budget_update_and_ping(stream):
    stream.set_budget(45.0)
    event = stream.next_event()
    assert event.kind == "budget" and event.session.budget_ms == 45.0
    stream.set_budget(1.0)
    event = stream.next_event()
    assert event.kind == "error" and event.error.reason == "BUDGET_INFEASIBLE"
    assert event.error.best_achievable_ms == pytest.approx(5.0)
    stream.ping()
    event = stream.next_event()
    assert event.kind == "pong" and event.client_time_ns > 0
    stream._requests.put(pb.ControlRequest(start=pb.ControlStart(session_id=stream.session.session_id)))
    event = stream.next_event()
    assert (event.kind, event.error.reason, event.error.field) == ("error", "BAD_VALUE", "start")
    send(stream, 0)
    assert stream.next_chunk().tick.budget_ms == 45.0


def test_a_budget_answer_read_after_a_reset_keeps_the_new_epoch(client, monkeypatch):
    # set_budget() then reset(): the budget event, answered at the old epoch, may reach the stream's reader after
    # reset() returned. It must not put the stream back on the old epoch (every frame after: STALE_EPOCH).
    reset_done = threading.Event()
    convert = ControlStream._convert

    def late_budget(event: pb.ControlEvent):
        if event.WhichOneof("kind") == "budget":
            reset_done.wait(10)  # the reader thread is scheduled after the reset
        return convert(event)

    monkeypatch.setattr(ControlStream, "_convert", staticmethod(late_budget))
    session = client.open_session("pusht", "push")
    with ControlStream(client, session) as stream:
        stream.set_budget(100.0)
        time.sleep(0.2)  # answered at epoch 1
        reset = stream.reset()
        reset_done.set()
        assert stream.next_event().kind == "budget"
        assert (stream.session.epoch, stream.session.budget_ms) == (reset.epoch, 100.0) == (2, 100.0)
        obs_id = send(stream, 0)
        assert stream.next_chunk().obs_id == obs_id
    client.close_session(session)


def test_opening_an_open_stream_again_is_the_same_stream(client):
    # `with ControlStream(...).open() as stream` opens it twice: one call and one reader, none left after close.
    before = set(threading.enumerate())
    session = client.open_session("pusht", "push")
    stream = ControlStream(client, session).open()
    with stream.open() as again:
        assert again is stream
        assert [t.name for t in set(threading.enumerate()) - before].count("control-events") == 1
        obs_id = send(stream, 0)
        assert stream.next_chunk().obs_id == obs_id
    started = [t for t in set(threading.enumerate()) - before if t.name == "control-events" or "(_run)" in t.name]
    for thread in started:
        thread.join(5)
    assert not [t.name for t in started if t.is_alive()]  # no reader, no request consumer left behind
    client.close_session(session)


def test_a_reply_the_client_cannot_read_ends_the_stream_saying_why(client, engine, monkeypatch):
    # A robot without OpenCV (it sends raw frames) opens a preview session, whose predicted frames come as JPEG.
    act = engine.act
    monkeypatch.setattr(engine, "act", lambda *args, **kwargs: dataclasses.replace(
        act(*args, **kwargs), preview_frames=np.zeros((1, 8, 8, 3), np.uint8)))

    decode = client_types.decode_image

    def decode_without_opencv(*args, **kwargs):
        with monkeypatch.context() as without:  # the server encoded the frames before
            without.setitem(sys.modules, "cv2", None)
            return decode(*args, **kwargs)

    monkeypatch.setattr(client_types, "decode_image", decode_without_opencv)
    session = client.open_session("pusht", "push", preview=True)
    with ControlStream(client, session) as stream:
        send(stream, 0)
        closed = stream.next_event()  # not silence: the reader thread reports why it stopped
        assert closed.kind == "closed" and closed.error.reason == "UNREADABLE_REPLY"
        assert "OpenCV to decode it (pip install opencv-python-headless), got no cv2 module" in closed.error.message
        with pytest.raises(PolicyServerError) as refused:
            send(stream, 1)
        assert refused.value.reason == "UNREADABLE_REPLY"
    client.close_session(session)


def test_half_close_still_answers_accepted_frames(client):
    session = client.open_session("pusht", "finish up")
    stream = ControlStream(client, session).open()
    ids = [send(stream, step, must_answer=True) for step in range(3)]
    stream.close()
    events = []
    while not events or events[-1].kind != "closed":
        events.append(stream.next_event())
    assert [e.obs_id for e in events if e.kind == "chunk"] == ids
    assert events[-1].error is None


def test_stream_for_an_unknown_session_fails_with_not_found(client):
    session = client.open_session("pusht", "gone")
    client.close_session(session)
    with pytest.raises(PolicyServerError) as err:
        ControlStream(client, session).open()
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND")


def _events_until_quiet(stream: ControlStream, quiet_s: float = 0.5) -> list:
    """The stream's events until none comes for ``quiet_s``."""
    events = []
    with contextlib.suppress(TimeoutError):
        while True:
            events.append(stream.next_event(timeout_s=quiet_s))
    return events


@pytest.mark.parametrize("serving", [False, True])
def test_a_session_closed_while_its_stream_is_open_ends_the_stream_once_saying_what_closed_it(server, client, engine,
                                                                                              serving):
    """Another call closes the session (the robot's own shutdown path, an operator): the stream ends at once, a frame
    being served or not, with NOT_FOUND naming the CloseSession, rather than staying open and answering every later
    frame with an error event, which a controller had to tell from a bad frame's; the client reports it once and
    reopens nothing."""
    session = client.open_session("pusht", "push")
    stream = ControlStream(client, session).open()  # reconnect on: a closed session is no lost connection
    opened = len(engine.request_ids)
    try:
        send(stream, 0)
        assert stream.next_chunk().obs_id == 1
        shutting_down = server.metrics.registry.get_sample_value("policy_server_errors_total",
                                                                  {"reason": "SHUTTING_DOWN"}) or 0.0
        if serving:
            engine.hold()
            send(stream, 1)
            engine.wait_entered()  # frame 2 is being served as the session closes
            send(stream, 2, must_answer=True)  # and frame 3 waits behind it
        client.close_session(session)
        events = _events_until_quiet(stream)
        assert [e.kind for e in events] == ["closed"], events
        error = events[0].error
        assert (error.code, error.reason) == (grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND")
        assert error.message == f"session {session.session_id!r} was closed 0 s ago: a CloseSession call closed it"
        assert error.detail.metadata["session_end"] == "closed"
        with pytest.raises(PolicyServerError) as refused:
            send(stream, 3)
        assert refused.value.reason == "SESSION_NOT_FOUND"
    finally:
        engine.release()
        stream.close()
    assert len(engine.request_ids) == opened  # nothing reopened
    # The frame left waiting goes unanswered, not counted as refused by a shutdown that never came (was: +1 once the
    # frame being served was done).
    time.sleep(0.5)
    assert (server.metrics.registry.get_sample_value("policy_server_errors_total",
                                                     {"reason": "SHUTTING_DOWN"}) or 0.0) == shutting_down


def test_stream_must_start_with_start(client):
    frame = pb.ControlRequest(ping=pb.Ping(client_time_ns=1))
    with pytest.raises(grpc.RpcError) as err:
        list(client.stub.Control(iter([frame]), timeout=5))
    error = PolicyServerError.from_rpc_error(err.value)
    assert (error.code, error.reason, error.field) == (
        grpc.StatusCode.FAILED_PRECONDITION, "STREAM_NOT_STARTED", "start")


def test_a_stream_that_sends_no_start_is_ended(client, monkeypatch):
    monkeypatch.setattr(control_stream, "CONTROL_START_S", 0.3)
    silent = queue.Queue()  # the client sends nothing until the test ends
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stub.Control(iter(silent.get, None), timeout=30))
    finally:
        silent.put(None)
    error = PolicyServerError.from_rpc_error(err.value)
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "STREAM_NOT_STARTED")
    assert "no `start` within 0.3 s" in error.message


def test_a_new_stream_takes_the_place_of_the_one_that_waited_longest_for_its_start(client, monkeypatch):
    # Each waiting stream holds a server thread: they are bounded. Silent streams that hold every place (and are
    # reopened as soon as they end) must not keep a robot out: a newcomer ends the one that waited longest, which a
    # client that sends its start at once never is.
    monkeypatch.setattr(control_stream, "CONTROL_START_S", 3.0)
    session = client.open_session("pusht", "open into a crowd")
    silent = queue.Queue()
    waiting = []
    try:
        for _ in range(MAX_STARTING_STREAMS):
            waiting.append(client.stub.Control(iter(silent.get, None), timeout=30))
            time.sleep(0.1)  # they reach the server in this order
        with ControlStream(client, session, backoff=Backoff(max_attempts=0)) as stream:  # no retry needed
            obs_id = send(stream, 0)
            assert stream.next_chunk().obs_id == obs_id
        ended = []
        for call in waiting:
            with pytest.raises(grpc.RpcError) as error:
                list(call)
            ended.append(PolicyServerError.from_rpc_error(error.value))
        oldest, *others = ended
        assert (oldest.code, oldest.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_STARTING_STREAMS")
        assert oldest.retry_after_ms > 0 and "made room" in oldest.message
        assert {e.reason for e in others} == {"STREAM_NOT_STARTED"}  # at their start timeout
    finally:
        for _ in waiting:
            silent.put(None)
    client.close_session(session)


def test_cancelling_the_stream_abandons_work_in_flight(client, engine):
    session = client.open_session("pusht", "cancel me")
    stream = ControlStream(client, session, reconnect=False).open()
    aborted = engine.aborted
    engine.hold()
    try:
        send(stream, 1)
        engine.wait_entered()
        stream._call.cancel()
        for _ in range(200):
            if engine.aborted > aborted:
                break
            time.sleep(0.01)
        assert engine.aborted == aborted + 1
    finally:
        engine.release()


QUICK_RECONNECT = Backoff(initial_s=0.05, max_s=0.2, max_attempts=100)


@contextlib.contextmanager
def _stream_across_a_restart(session: dict | None = None, client_timeout_s: float = 10.0,
                             backoff: Backoff = QUICK_RECONNECT, first: FakeEngine | None = None, **options):
    """`(client, stream, restart)`: a ControlStream on a server of its own (serving `first`, else a fresh FakeEngine);
    `restart(engine, meanwhile)` stops that server, calls `meanwhile` and serves `engine` (a fresh FakeEngine, as a
    server that restarted lost its sessions) on its port."""
    servers = [build_server(build_config(overrides={"port": 0}), first or FakeEngine()).start()]
    port = servers[0].grpc_port
    client = PolicyClient(servers[0].target, timeout_s=client_timeout_s)
    opened = client.open_session("pusht", "reach the red circle", **(session or {}))
    stream = ControlStream(client, opened, backoff=backoff, **options).open()

    def restart(engine: FakeEngine | None = None, meanwhile: Callable[[], None] = lambda: None) -> None:
        servers.pop().stop(grace_s=0.1)
        meanwhile()  # while no server answers the stream
        servers.append(build_server(build_config(overrides={"port": port}), engine or FakeEngine()).start())

    try:
        yield client, stream, restart
    finally:
        stream.close()
        client.close()
        servers.pop().stop(grace_s=0.1)


def test_reconnects_and_replaces_the_session_after_a_server_restart():
    settings = {"budget_ms": 90, "preview": True, "client_name": "arm-3"}
    with _stream_across_a_restart(settings) as (_, stream, restart):
        assert stream.session.client_name == "arm-3"
        send(stream, 0)
        assert stream.next_chunk().epoch == 1
        restart()
        lost = stream.next_event(timeout_s=20)
        assert lost.kind == "disconnected" and lost.error.code == grpc.StatusCode.UNAVAILABLE
        event = stream.next_event(timeout_s=20)
        assert event.kind == "reconnected" and event.session_replaced
        assert event.session.budget_ms == 90.0 and event.session.instruction == "reach the red circle"
        assert event.session.preview and event.session.client_name == "arm-3"  # the same settings
        obs_id = send(stream, 1)
        chunk = stream.next_chunk(timeout_s=10)
        assert chunk.obs_id == obs_id and chunk.session_id == stream.session.session_id
        np.testing.assert_array_equal(chunk.actions, expected(1))


def test_a_shutdown_answers_the_frame_being_computed_and_ends_the_stream_without_waiting_out_its_grace():
    """A stream open at shutdown: its frame being computed is answered, the frames waiting are refused SHUTTING_DOWN,
    and it ends with that status (UNAVAILABLE: its client reconnects, to a restart or another replica). The server
    stops once that is done; neither the stream nor a health Watch holds it for its whole grace (both did)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    engine = FakeEngine()
    server = build_server(build_config(overrides={"port": 0}), engine).start()
    client = PolicyClient(server.target)
    stream = ControlStream(client, client.open_session("pusht", "push"), reconnect=False).open()
    channel = grpc.insecure_channel(server.target)
    try:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        engine.hold()
        computing = send(stream, 1)
        engine.wait_entered()
        waiting = [send(stream, 2, must_answer=True), send(stream, 3, must_answer=True)]
        stream.ping()
        assert stream.next_event().kind == "pong"  # the server has read the frames sent before it
        stopping = threading.Thread(target=server.stop, kwargs={"grace_s": 30.0})
        started = time.monotonic()
        stopping.start()
        assert health_pb2.HealthCheckResponse.NOT_SERVING in (update.status for update in watch)
        time.sleep(0.5)  # the drain reaches the stream meanwhile
        engine.release()
        events = [stream.next_event(timeout_s=10)]
        while events[-1].kind != "closed":
            events.append(stream.next_event(timeout_s=10))
        stopping.join(timeout=10)
        assert not stopping.is_alive() and time.monotonic() - started < 5.0
        assert (events[0].kind, events[0].obs_id) == ("chunk", computing)
        refused = [(e.obs_id, e.error.reason) for e in events[1:-1]]
        assert refused == [(obs_id, "SHUTTING_DOWN") for obs_id in waiting]
        assert (events[-1].error.code, events[-1].error.reason) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")
    finally:
        engine.release()
        stream.close()
        client.close()
        channel.close()
        server.stop(grace_s=0.1)


def test_a_stream_tries_again_once_its_channel_reconnects_not_a_whole_delay_later():
    # After a link's outage gRPC's channel reconnects on its own backoff; the stream's next try came up to a whole
    # delay of its own after that (after a 2 s cut its first chunk came ~1 s after a unary act's).
    slow = Backoff(initial_s=3.0, max_s=3.0, jitter=0.0, max_attempts=3)
    with _stream_across_a_restart(backoff=slow) as (_, stream, restart):
        restart()
        assert stream.next_event(timeout_s=5).kind == "disconnected"
        lost = time.monotonic()
        event = stream.next_event(timeout_s=5)
        assert event.kind == "reconnected" and time.monotonic() - lost < 2.0, (event, time.monotonic() - lost)


def test_a_stream_reconnects_through_a_warmup_longer_than_the_clients_call_timeout():
    # A robot's client has a short call timeout; a restarted server warms up for longer (57 s compiling on 2 cores).
    # Reopening the session is refused WARMING_UP while it warms up: the stream tries again, as its backoff allows.
    warming = FakeEngine(ready=False)
    with _stream_across_a_restart(client_timeout_s=0.5) as (_, stream, restart):
        restart(warming)
        assert stream.next_event(timeout_s=20).kind == "disconnected"
        threading.Timer(2.0, warming.set_ready, (True,)).start()
        event = stream.next_event(timeout_s=20)
        assert event.kind == "reconnected" and event.session_replaced, event
        obs_id = send(stream, 1)
        assert stream.next_chunk(timeout_s=10).obs_id == obs_id


def test_a_stream_reopens_its_session_once_a_full_server_has_room():
    # RESOURCE_EXHAUSTED without a retry delay (TOO_MANY_SESSIONS here; behind Ray Serve every stream refusal loses
    # its delay) may pass: the stream tries again as its backoff allows, rather than ending.
    full = FakeEngine(max_sessions=1)
    with _stream_across_a_restart() as (_, stream, restart):
        full.close_session(full.open_session("pusht", "reach the red circle").session_id)  # not the lost one's id
        other = full.open_session("pusht", "reach the red circle")
        restart(full)
        assert stream.next_event(timeout_s=20).kind == "disconnected"
        refused_from = time.monotonic()
        threading.Timer(1.0, full.close_session, (other.session_id,)).start()
        event = stream.next_event(timeout_s=20)
        assert event.kind == "reconnected" and event.session_replaced, event
        # Each try waited its delay (once grown, at least max_s less its jitter; 4 for the first, shorter ones and the
        # try under way): a server that refuses is not tried in a storm.
        tries = len(full.request_ids) - 2
        least_s = QUICK_RECONNECT.max_s * (1 - QUICK_RECONNECT.jitter)
        assert tries <= 4 + (time.monotonic() - refused_from) / least_s, tries


def test_every_try_of_a_reopening_sends_one_request_id():
    # The restarted server's answer is lost on 5 tries, more than one open_session tries within 0.5 s: the stream's
    # next try sends the same request_id, so a server that opened the session on one of them answers it
    # (test_server_e2e) rather than another.
    restarted = FakeEngine()
    restarted.refuse_opens(5)
    with _stream_across_a_restart(client_timeout_s=0.5) as (_, stream, restart):
        restart(restarted)
        assert stream.next_event(timeout_s=20).kind == "disconnected"
        event = stream.next_event(timeout_s=20)
        assert event.kind == "reconnected" and event.session_replaced, event
        assert restarted.stats().sessions == 1
        sent = restarted.request_ids
        assert len(sent) == 6 and len(set(sent)) == 1, sent
        obs_id = send(stream, 1)
        assert stream.next_chunk(timeout_s=10).obs_id == obs_id


def test_a_session_reopened_on_one_try_and_attached_on_the_next_is_reported_as_replaced(monkeypatch):
    # The restarted server drops the connection again right after the reopening (a flapping link), so the stream
    # neither attaches to the new session nor closes it: the next try attaches to it, and it is still a new episode.
    restarted = FakeEngine()
    with _stream_across_a_restart() as (client, stream, restart):
        lost, connect, dropped = stream.session.session_id, stream._connect, []

        def connect_dropped_once_after_the_reopening():
            if stream.session.session_id != lost and not dropped:
                dropped.append(stream.session.session_id)
                raise PolicyServerError(grpc.StatusCode.UNAVAILABLE, "", "the connection dropped")
            connect()

        def close_unreachable(session, timeout_s=None):
            raise PolicyServerError(grpc.StatusCode.UNAVAILABLE, "", "the connection dropped")

        monkeypatch.setattr(stream, "_connect", connect_dropped_once_after_the_reopening)
        monkeypatch.setattr(client, "close_session", close_unreachable)
        restart(restarted)
        assert stream.next_event(timeout_s=20).kind == "disconnected"
        event = stream.next_event(timeout_s=20)
        assert event.kind == "reconnected" and event.session.session_id == dropped[0] != lost, event
        assert event.session_replaced, event


def test_a_reopened_session_keeps_the_budget_granted_and_the_instruction_the_server_acted_on():
    with _stream_across_a_restart({"budget_ms": 90}) as (_, stream, restart):
        stream.set_budget(150.0)
        assert stream.next_event().kind == "budget"
        send(stream, 0, instruction="reach the blue square")
        stream.next_chunk()
        refused = send(stream, 1, instruction="x" * 20_000)  # over the text limit: never the session's
        event = stream.next_event()
        assert (event.kind, event.obs_id) == ("error", refused), event
        restart()
        assert stream.next_event(timeout_s=20).kind == "disconnected"
        event = stream.next_event(timeout_s=20)
        assert event.kind == "reconnected" and event.session_replaced
        assert (event.session.budget_ms, event.session.instruction) == (150.0, "reach the blue square")


def test_a_budget_asked_while_disconnected_is_asked_again_once_reconnected():
    # It went into the lost call's requests: no budget or error event ever answered it, and the reopened session kept
    # the budget granted before.
    server = build_server(build_config(overrides={"port": 0}), FakeEngine()).start()
    port = server.grpc_port
    with PolicyClient(server.target) as client:
        session = client.open_session("pusht", "reach the red circle", budget_ms=90)
        with ControlStream(client, session, backoff=QUICK_RECONNECT) as stream:
            server.stop(grace_s=0.1)
            assert stream.next_event(timeout_s=20).kind == "disconnected"
            stream.set_budget(120.0)
            stream.set_budget(150.0)  # the last one asked is the one asked again
            server = build_server(build_config(overrides={"port": port}), FakeEngine()).start()
            event = stream.next_event(timeout_s=20)
            assert event.kind == "reconnected" and event.session_replaced and event.session.budget_ms == 90.0
            event = stream.next_event(timeout_s=5)
            assert event.kind == "budget" and event.session.budget_ms == 150.0 == stream.session.budget_ms
            obs_id = send(stream, 0)
            chunk = stream.next_chunk()
            assert chunk.obs_id == obs_id and chunk.tick.budget_ms == 150.0
    server.stop(grace_s=0.1)


def test_a_stale_epoch_of_the_session_a_restart_replaced_is_skipped():
    """A reopened session starts at epoch 1 again: an error of its predecessor's epoch 1, read after the reconnect,
    was taken for a reset made elsewhere and raised."""
    engine = FakeEngine()
    server = build_server(build_config(overrides={"port": 0}), engine).start()
    port = server.grpc_port
    with PolicyClient(server.target) as client:
        session = client.open_session("pusht", "reach the red circle")
        with ControlStream(client, session, backoff=QUICK_RECONNECT) as stream:
            stream.reset()  # epoch 2
            observation = build_observation({"image": IMAGE}, STATE, step_index=0, encoding="png")
            stream.send_observation(observation, epoch=1, must_answer=True)  # answered STALE_EPOCH, got 1
            send(stream, 1, must_answer=True)  # answered after it
            end = time.monotonic() + 20
            while len(engine.acts) < 1 and time.monotonic() < end:
                time.sleep(0.01)
            time.sleep(0.5)  # both answers on their way over loopback, queued before the connection ends
            server.stop(grace_s=0.1)
            server = build_server(build_config(overrides={"port": port}), FakeEngine()).start()
            end = time.monotonic() + 20
            while stream.session.session_id == session.session_id and time.monotonic() < end:
                time.sleep(0.01)  # reopened: the error is read at the new session's epoch 1
            assert stream.session.epoch == 1
            sent = []
            while True:  # a frame sent before the new call is attached is dropped: sent again until one is answered
                sent.append(send(stream, 2))
                try:
                    chunk = stream.next_chunk(timeout_s=0.5)  # the old session's error first: raised, or skipped
                    break
                except TimeoutError:
                    assert time.monotonic() < end, "no chunk from the reopened session"
            assert chunk.obs_id in sent and chunk.session_id == stream.session.session_id
    server.stop(grace_s=0.1)


def test_a_stream_that_gives_up_says_why_and_refuses_what_is_sent_after():
    with _stream_across_a_restart() as (_, stream, restart):
        # Where the session cannot be opened again, the reopening's refusal is the reason, not the lost connection.
        restart(FakeEngine(embodiments=(LIBERO,)))
        assert stream.next_event(timeout_s=20).kind == "disconnected"
        closed = stream.next_event(timeout_s=20)
        assert closed.kind == "closed" and closed.error.reason == "UNKNOWN_EMBODIMENT"
        with pytest.raises(PolicyServerError) as refused:
            send(stream, 1)
        assert refused.value.reason == "UNKNOWN_EMBODIMENT"
    with pytest.raises(PolicyServerError) as closed_here:  # closing it does not hide why it ended
        stream.set_budget(100.0)
    assert closed_here.value.reason == "UNKNOWN_EMBODIMENT"


@pytest.mark.parametrize("ended", ["closed", "expired"])
def test_a_session_closed_while_its_stream_was_away_is_not_reopened_and_one_that_expired_is(ended):
    """The stream's connection dropped and its session ended meanwhile, on a server that kept running. Closed by a
    CloseSession call, its closer meant it: the stream reports that once, `closed`, and opens nothing. Expired (no
    call for the idle time while the link was down), it is lost as with a restart: the stream reopens it."""
    engine = FakeEngine()
    with _stream_across_a_restart(first=engine) as (_, stream, restart):
        lost = stream.session.session_id
        end = engine.close_session if ended == "closed" else engine.expire
        restart(engine, meanwhile=lambda: end(lost))
        assert stream.next_event(timeout_s=20).kind == "disconnected"
        event = stream.next_event(timeout_s=20)
        if ended == "expired":
            assert event.kind == "reconnected" and event.session_replaced and event.session.session_id != lost
            return
        assert event.kind == "closed", event
        assert (event.error.reason, event.error.detail.metadata["session_end"]) == ("SESSION_NOT_FOUND", "closed")
        assert "was closed" in event.error.message and "a CloseSession call closed it" in event.error.message
        assert len(engine.request_ids) == 1 and engine.stats().sessions == 0  # only the first opening
        assert _events_until_quiet(stream) == []


def test_a_session_that_expired_as_its_stream_attached_is_reopened():
    """The idle sweep can close a session as a stream attaches to it (the engine then ends the stream, expired): the
    session was lost, not closed by anyone, and the stream reopens it (was: `closed`, and the stream ended)."""
    engine = FakeEngine()
    with serve_fake(engine) as server, PolicyClient(server.target) as client:
        session = client.open_session("pusht", "push")
        with ControlStream(client, session, backoff=Backoff(initial_s=0.05, max_s=0.2, max_attempts=20)) as stream:
            engine.expire(session.session_id)
            assert stream.next_event(timeout_s=20).kind == "disconnected"
            event = stream.next_event(timeout_s=20)
            assert event.kind == "reconnected" and event.session_replaced
            assert event.session.session_id != session.session_id


def test_a_stream_told_not_to_reopen_ends_when_its_session_is_lost():
    with _stream_across_a_restart(reopen_session=False) as (_, stream, restart):
        restart()
        assert stream.next_event(timeout_s=20).kind == "disconnected"
        closed = stream.next_event(timeout_s=20)
        assert closed.kind == "closed" and closed.error.reason == "SESSION_NOT_FOUND"


def test_closing_a_stream_while_it_reopens_its_session_leaves_nothing_open(monkeypatch):
    second_engine = FakeEngine()
    reopening, release = threading.Event(), threading.Event()
    with _stream_across_a_restart() as (client, stream, restart):
        open_session = client.open_session

        def slow_open_session(*args, **kwargs):  # as through a warmup: the stream is closed meanwhile
            reopening.set()
            release.wait(20)
            return open_session(*args, **kwargs)

        monkeypatch.setattr(client, "open_session", slow_open_session)
        try:
            restart(second_engine)
            assert reopening.wait(20)
            stream.close(wait_s=0.1)  # returns before the reopening does
            with pytest.raises(PolicyServerError) as refused:
                send(stream, 1)
            assert refused.value.reason == "STREAM_CLOSED"
        finally:
            release.set()
        stream._reader.join(20)
        assert not stream._reader.is_alive() and second_engine.stats().sessions == 0
        kinds = []
        with contextlib.suppress(TimeoutError):
            while True:
                kinds.append(stream.next_event(0.1).kind)
        assert kinds == ["disconnected", "closed"]


def test_a_stream_reconnects_while_silent_streams_hold_every_starting_place(monkeypatch):
    # After a failover every stream of the lost server reconnects at once, and the places for streams waiting for
    # their `start` may all be taken: the reconnecting stream takes the place of the one that waited longest.
    monkeypatch.setattr(control_stream, "CONTROL_START_S", 2.0)
    first = build_server(build_config(overrides={"port": 0}), FakeEngine()).start()
    port = first.grpc_port
    client = PolicyClient(first.target)
    session = client.open_session("pusht", "reconnect into a crowd")
    # Its first try comes about 1 s after the loss, when the silent streams below hold every place.
    stream = ControlStream(client, session, backoff=Backoff(initial_s=1.0, max_s=1.0, max_attempts=20)).open()
    second = crowd = None
    silent = queue.Queue()
    try:
        send(stream, 0)
        stream.next_chunk()
        first.stop(grace_s=0.1)
        second = build_server(build_config(overrides={"port": port}), FakeEngine()).start()
        crowd = PolicyClient(second.target)
        waiting = [crowd.stub.Control(iter(silent.get, None), timeout=30) for _ in range(MAX_STARTING_STREAMS)]
        assert stream.next_event(timeout_s=20).kind == "disconnected"
        event = stream.next_event(timeout_s=20)
        assert event.kind == "reconnected" and event.session_replaced, event
        obs_id = send(stream, 1)
        assert stream.next_chunk(timeout_s=10).obs_id == obs_id
        for call in waiting:
            with pytest.raises(grpc.RpcError):
                list(call)
    finally:
        for _ in range(MAX_STARTING_STREAMS):
            silent.put(None)
        stream.close()
        client.close()
        if crowd is not None:
            crowd.close()
        if second is not None:
            second.stop(grace_s=0.1)


def test_a_flood_of_frames_is_refused_undecoded_and_the_stream_lives_on(client):
    # A client of its own: ControlStream sends at most MAX_FRAMES_IN_FLIGHT frames at once.
    from policy_server.limits import MAX_FRAME_RATE_HZ

    session = client.open_session("pusht", "floods")
    requests: queue.Queue = queue.Queue()
    requests.put(pb.ControlRequest(start=pb.ControlStart(session_id=session.session_id)))
    flood = range(1, int(MAX_FRAME_RATE_HZ) + 1)  # far faster than 100 per second
    for obs_id in flood:
        requests.put(pb.ControlRequest(observation=pb.ObservationFrame(
            epoch=session.epoch, obs_id=obs_id, observation=pb.Observation(instruction="x", step_index=obs_id))))
    call = client.stub.Control(iter(requests.get, None), timeout=30)
    refused = set()
    for event in call:
        if event.WhichOneof("kind") == "error" and event.error.error.reason == "RATE_EXCEEDED":
            error = PolicyServerError.from_detail(event.error.error)
            assert error.retry_after_ms > 0 and error.field == "observation"
            refused.add(event.error.obs_id)
            if len(refused) == len(flood) // 2:
                break
    assert refused <= set(flood)
    time.sleep(1.0)  # the bucket refills
    good = pb.ObservationFrame(epoch=session.epoch, obs_id=1000,
                               observation=build_observation({"image": IMAGE}, STATE, "", 1, "png"))
    requests.put(pb.ControlRequest(observation=good))
    while (event := next(call)).WhichOneof("kind") != "chunk":
        pass
    assert event.chunk.obs_id == good.obs_id
    requests.put(None)
    client.close_session(session)


class _StallingLink:
    """A loopback TCP forwarder to ``port`` that forwards nothing while ``flowing`` is clear (a stalled WiFi link, no
    FIN or RST): what either side sends meanwhile waits in the socket buffers and then arrives at once."""

    def __init__(self, port: int) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.flowing = threading.Event()
        self.flowing.set()
        threading.Thread(target=self._accept, args=(port,), daemon=True).start()

    def _accept(self, port: int) -> None:
        while True:
            try:
                near, _ = self._listener.accept()
            except OSError:  # closed
                return
            far = socket.create_connection(("127.0.0.1", port))
            threading.Thread(target=self._pump, args=(near, far, self.flowing), daemon=True).start()
            threading.Thread(target=self._pump, args=(far, near, self.flowing), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, gate: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                gate.wait()
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()


def _across_a_stall(server, sends) -> tuple[list[int], list]:
    """A ControlStream through a link that stalls while ``sends(stream)`` sends frames (their obs_ids) after a first
    answered one: ``(those obs_ids, the events until the last of them is answered)``."""
    link = _StallingLink(int(server.target.rsplit(":", 1)[1]))
    with PolicyClient(link.target) as client:
        session = client.open_session("pusht", "push", rate_hz=0)
        with ControlStream(client, session) as stream:
            send(stream, 0)
            stream.next_chunk()
            link.flowing.clear()
            sent = sends(stream)
            link.flowing.set()
            events = []
            while not (events and events[-1].kind in ("chunk", "error") and events[-1].obs_id == sent[-1]):
                events.append(stream.next_event())
    link.close()
    return sent, events


def test_frames_sent_while_the_uplink_stalls_are_not_delivered_as_a_backlog(server):
    # A 10 Hz robot whose WiFi stalls for 3 s sends 30 frames meanwhile. They used to reach the server all at once
    # when the link came back, beyond its frame rate: the newest were refused RATE_EXCEEDED (an error the robot's
    # next_chunk raised) and an older frame was acted on. The client keeps the newest frame back while a frame is on
    # its way (sent, its receipt not back), so the stalled link carries one frame and then the newest. With up to 3
    # frames on their way, a slow uplink (48 kB frames at 200 kbit/s: 5.8 s) held a ping's answer past gRPC's 5 s
    # ping timeout, and the server ended the connection every 5.4 s.
    sent, events = _across_a_stall(server, lambda stream: [send(stream, step) for step in range(1, 31)])
    assert not [e.error.message for e in events if e.kind == "error"]
    chunks = [e.obs_id for e in events if e.kind == "chunk"]
    assert chunks in ([sent[0], sent[-1]], [sent[-1]])  # what was on its way (unless the newest came first), the newest
    assert {e.obs_id for e in events if e.kind == "superseded"} == set(sent) - set(chunks)
    # Each frame but the one on its way was replaced in the client, by the next; none reached the server to wait.
    assert all(e.by_obs_id == e.obs_id + 1 for e in events if e.kind == "superseded" and e.obs_id != sent[0])


def test_a_must_answer_frame_replaces_the_frame_waiting_behind_the_one_on_its_way(server):
    # The must_answer frame goes at once; the frame waiting went after it, with a lower obs_id, and the server refused
    # it (BAD_VALUE: obs_ids must increase), an error the robot's next_chunk raised.
    (on_its_way, waiting, urgent), events = _across_a_stall(
        server, lambda stream: [send(stream, 1), send(stream, 2), send(stream, 3, must_answer=True)])
    assert not [e.error.message for e in events if e.kind == "error"]
    assert ("superseded", waiting, urgent) in [(e.kind, e.obs_id, e.by_obs_id) for e in events]
    assert {e.obs_id for e in events if e.kind == "chunk"} <= {on_its_way, urgent}


def test_a_stream_notices_a_dead_link_within_its_ping_timeout(server):
    # A WiFi link that goes dead sends no FIN or RST. gRPC waited 60 s (its default ping timeout) for the answer to a
    # ping sent just before, whatever the keepalive timeout said: the robot learned nothing for a minute or more.
    link = _StallingLink(int(server.target.rsplit(":", 1)[1]))
    with PolicyClient(link.target) as client:
        session = client.open_session("pusht", "push", rate_hz=0)
        with ControlStream(client, session) as stream:
            for step in range(5):  # traffic, so that gRPC pings the link
                send(stream, step)
                stream.next_chunk()
            link.flowing.clear()
            dead = time.monotonic()
            send(stream, 5)
            while (event := stream.next_event(timeout_s=9.0)).kind != "disconnected":
                pass
            assert time.monotonic() - dead < 9.0 and "ping timeout" in event.error.message
            link.flowing.set()
            while stream.next_event().kind != "reconnected":
                pass
    link.close()


def test_a_client_that_does_not_read_its_events_is_held_back_not_queued_for(server, client):
    # Every message here is answered (an error event): a client that sends and never reads is held back by gRPC's
    # flow control once the stream holds MAX_QUEUED_EVENTS for it, rather than growing the server's memory. The
    # client's channel keeps HTTP/2's first 64 KiB window (no BDP probes), so that it buffers few of the events.
    session = client.open_session("pusht", "sends and never reads")
    channel = grpc.insecure_channel(server.target, options=[("grpc.http2.bdp_probe", 0)])
    taken = [0]  # messages gRPC took from the client's iterator
    refused = pb.ControlRequest(observation=pb.ObservationFrame(obs_id=0, observation=pb.Observation(
        instruction="x" * 16_000, step_index=1)))  # obs_id 0 again: BAD_VALUE, each answered
    in_transport = 2_000  # requests and events gRPC's windows and buffers hold besides the queue (about 800 here)
    sent = 4 * (MAX_QUEUED_EVENTS + in_transport)  # far more than the server may hold back for the client

    def requests():
        yield pb.ControlRequest(start=pb.ControlStart(session_id=session.session_id))
        for _ in range(sent):
            taken[0] += 1
            yield refused

    call = pb_grpc.PolicyServiceStub(channel).Control(requests(), timeout=60)
    held, last = 0, -1
    while held != last:  # until the client's sends stop moving
        last = held
        time.sleep(0.5)
        held = taken[0]
    assert MAX_QUEUED_EVENTS <= held < MAX_QUEUED_EVENTS + in_transport
    events = [event.WhichOneof("kind") for event in call]  # reading lets the rest through, each answered
    assert events[0] == "started" and len(events) == 1 + sent and set(events[1:]) == {"error"}
    channel.close()
    client.close_session(session)
