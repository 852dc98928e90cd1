"""The openpi-compatible WebSocket endpoint, driven by the published ``openpi-client`` package.

openpi-client declares numpy<2; it is installed with ``pip install --no-deps openpi-client`` (its
WebSocket client needs only msgpack and websockets, which the server depends on anyway).
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import ssl
import struct
import threading
import time
import urllib.error
import urllib.request

import msgpack
import numpy as np
import pytest
import websockets.sync.client
from fake_engine import LIBERO, PUSHT, FakeEngine, expected_actions, self_signed_cert, serve_fake
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy
from websockets.exceptions import ConnectionClosed, InvalidMessage, InvalidStatus

from policy_server.config import build_config
from policy_server.engine.api import CLOSED_BY_CLIENT, ActionSpec, Observation, TooManySessions
from policy_server.engine.engine import ModelEngine
from policy_server.engine.served import EngineSettings
from policy_server.limits import MAX_FRAME_SIDE, MAX_INSTRUCTION_TOKENS, MAX_REFUSED_MESSAGES, REFUSED_MESSAGES_HZ
from policy_server.server.app import build_server
from policy_server.server.websocket import BARRED_S, OPEN_TIMEOUT_S
from robots.embedded import build_random_pipeline

IMAGE = np.random.default_rng(3).integers(0, 256, (48, 64, 3), dtype=np.uint8)
STATE = np.array([0.3, -0.1], np.float32)

# openpi-client 0.1.2 calls websockets' connect() outside a context manager.
pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")


def openpi_observation(step: int | None = None, **extra) -> dict:
    obs = {"observation/image": IMAGE, "observation/state": STATE, "prompt": "push the T", **extra}
    if step is not None:
        obs["step_index"] = step
    return obs


@pytest.fixture(scope="module")
def engine():
    return FakeEngine()


@pytest.fixture(scope="module")
def server(engine):
    with serve_fake(engine, websocket_port=0) as running:
        yield running


@pytest.fixture
def policy(server):
    client = WebsocketClientPolicy(host="127.0.0.1", port=server.websocket_port)
    yield client
    client._ws.close()


def test_metadata_frame_describes_the_embodiment(policy):
    meta = policy.get_server_metadata()
    assert meta["server"] == "policy-server" and meta["embodiment"] == "pusht"
    assert meta["cameras"] == {"image": [48, 64, 3]}
    assert meta["frame_sides"] == {"image": [1, MAX_FRAME_SIDE]} and meta["images_resized_with_pad"] is False
    assert (meta["state_dim"], meta["action_dim"], meta["chunk_size"]) == (2, 2, 8)
    assert meta["observation_keys"]["images"] == ["observation/image"]
    assert meta["observation_keys"]["committed_actions"] == "committed_actions"
    assert meta["budget_ms"] == 120.0


def test_the_metadata_limits_hold_actions_clipped_to_them():
    """Actions travel as float32: one the engine clipped to a limit of 0.2 is float32(0.2), 3e-9 above 0.2, and a
    robot that checks them against the metadata's limits (as against ServerInfo's float32 ones) must not refuse it."""
    limits = ActionSpec(dim=2, low=(-0.2, -0.2), high=(0.2, 0.2))
    with serve_fake(FakeEngine(embodiments=(dataclasses.replace(PUSHT, action=limits),)), websocket_port=0) as server:
        policy = WebsocketClientPolicy(host="127.0.0.1", port=server.websocket_port)
        meta = policy.get_server_metadata()
        policy._ws.close()
    clipped = np.clip(np.array([[5.0, -5.0]]), limits.low, limits.high).astype(np.float32)  # as the engine serves
    assert np.all(clipped <= np.asarray(meta["action_high"])) and np.all(clipped >= np.asarray(meta["action_low"]))


def test_infer_returns_the_exact_chunk(policy):
    for step in (0, 8):
        reply = policy.infer(openpi_observation(step))
        expected = expected_actions(Observation({"image": IMAGE}, STATE, "", step), 8, PUSHT)
        np.testing.assert_array_equal(reply["actions"], expected)
        assert reply["actions"].dtype == np.float32
        assert reply["first_step_index"] == step and reply["epoch"] == 1
        assert reply["server_timing"]["infer_ms"] > 0 and reply["policy_timing"]["infer_ms"] == 3.0
        assert reply["tick"]["full_calls"] == 12 and reply["tick"]["deadline_met"] is True


def test_committed_actions_lead_the_chunk(policy):
    committed = np.array([[0.1, -0.1], [0.05, 0.0]], np.float32)
    for sent in (committed, committed.tolist()):
        reply = policy.infer(openpi_observation(3, committed_actions=sent))
        expected = expected_actions(Observation({"image": IMAGE}, STATE, "", 3, committed), 8, PUSHT)
        np.testing.assert_array_equal(reply["actions"], expected)
        np.testing.assert_array_equal(reply["actions"][:2], committed)
    with pytest.raises(RuntimeError, match=r"SCHEMA_MISMATCH: committed_actions: expected shape \[d, 2\] with "
                                           r"1 <= d < 8 \(the session's chunk size\), got shape \[8, 2\]"):
        policy.infer(openpi_observation(committed_actions=np.zeros((8, 2), np.float32)))
    with pytest.raises(RuntimeError, match="SCHEMA_MISMATCH: committed_actions: expected rows of one length"):
        policy.infer(openpi_observation(committed_actions=[[0.1, 0.2], [0.1]]))
    with pytest.raises(RuntimeError, match="BAD_DTYPE: committed_actions"):
        policy.infer(openpi_observation(committed_actions="stop"))


def test_step_index_defaults_to_a_per_connection_counter(policy):
    assert policy.infer(openpi_observation())["first_step_index"] == 0
    assert policy.infer(openpi_observation(step=5))["first_step_index"] == 5
    assert policy.infer(openpi_observation())["first_step_index"] == 6


def test_chw_and_other_sizes_reach_the_engine_as_sent(policy):
    big = np.random.default_rng(1).integers(0, 256, (96, 160, 3), dtype=np.uint8)
    reply = policy.infer({"observation/image": np.transpose(big, (2, 0, 1)), "observation/state": STATE,
                          "prompt": "push", "step_index": 2})
    expected = expected_actions(Observation({"image": big}, STATE, "", 2), 8, PUSHT)  # no resize on the way
    np.testing.assert_array_equal(reply["actions"], expected)


def test_frames_beyond_the_side_limit_are_refused_and_cameras_of_different_heights_pass_as_sent(server, policy):
    with pytest.raises(RuntimeError, match=f"SCHEMA_MISMATCH: observation/image: expected \\[H, W, 3\\] with H and "
                                           f"W in 1..{MAX_FRAME_SIDE}"):
        policy.infer(openpi_observation() | {"observation/image": np.zeros((MAX_FRAME_SIDE + 1, 4, 3), np.uint8)})
    url = f"ws://127.0.0.1:{server.websocket_port}?embodiment=libero"
    with websockets.sync.client.connect(url, compression=None) as ws:
        msgpack_numpy.unpackb(ws.recv())
        state = np.zeros(8, np.float32)
        ws.send(msgpack_numpy.packb({"observation/image": IMAGE, "observation/wrist": IMAGE[:40], "prompt": "stack",
                                     "observation/state": state}))
        reply = msgpack_numpy.unpackb(ws.recv())  # validation lets the shorter wrist through to the engine
    expected = expected_actions(Observation({"image": IMAGE, "wrist": IMAGE[:40]}, state, "", 0), 16, LIBERO)
    np.testing.assert_array_equal(reply["actions"], expected)


def test_bad_input_is_a_text_error_and_the_connection_stays_usable(policy):
    with pytest.raises(RuntimeError, match="NON_FINITE"):
        policy.infer(openpi_observation() | {"observation/state": np.array([np.nan, 0.0])})
    # openpi's LIBERO example names its wrist camera `observation/wrist_image`: the error shows the keys it got.
    with pytest.raises(RuntimeError, match=r"SCHEMA_MISMATCH: observation/image: expected uint8 \[H, W, 3\] for camera "
                       r"'image', got no such key \(the message has observation/state, observation/wrist_image, "
                       r"prompt\)"):
        policy.infer({"observation/wrist_image": IMAGE, "observation/state": STATE, "prompt": "no image"})
    with pytest.raises(RuntimeError, match="SCHEMA_MISMATCH"):
        policy.infer(openpi_observation() | {"observation/state": np.zeros(7, np.float32)})
    with pytest.raises(RuntimeError, match="OUT_OF_RANGE"):  # finite, but no float32 holds it
        policy.infer(openpi_observation() | {"observation/state": np.array([1e300, 0.0])})
    with pytest.raises(RuntimeError, match="SCHEMA_MISMATCH"):  # a frame with no pixels
        policy.infer(openpi_observation() | {"observation/image": np.zeros((0, 64, 3), np.uint8)})
    no_state = openpi_observation()
    del no_state["observation/state"]
    with pytest.raises(RuntimeError, match="SCHEMA_MISMATCH: observation/state: expected float \\[2\\], got no such"):
        policy.infer(no_state)  # named by the key the metadata gives
    reply = policy.infer(openpi_observation(step=1))
    assert reply["actions"].shape == (8, 2)


def test_first_observation_needs_a_prompt(policy):
    obs = openpi_observation()
    del obs["prompt"]
    with pytest.raises(RuntimeError, match="MISSING_FIELD"):
        policy.infer(obs)
    assert policy.infer(openpi_observation())["epoch"] == 1
    assert policy.infer(obs)["actions"].shape == (8, 2)  # later ones keep the session's instruction


def test_a_connections_session_lives_as_long_as_the_connection(tmp_path):
    """A connection whose observations are all refused runs no tick; the engine must not close its session as
    idle while the connection is open (the connection has its own idle timeout)."""
    engine = ModelEngine(build_random_pipeline(tmp_path, seed=2),
                         EngineSettings(warmup_ticks=1, default_budget_ms=10_000.0, session_idle_s=1.0))
    engine.start()
    assert engine.wait_ready(timeout_s=300)
    config = build_config(overrides={"port": 0, "websocket_port": 0, "session_idle_timeout_s": 1.0})
    server = build_server(config, engine).start()
    try:
        policy = WebsocketClientPolicy(host="127.0.0.1", port=server.websocket_port)
        image = np.zeros((64, 64, 3), np.uint8)
        good = {"observation/image": image, "observation/state": np.zeros(2, np.float32), "prompt": "reach"}
        assert policy.infer(good)["epoch"] == 1
        for _ in range(5):  # 2.5 s of refused observations, each within the connection's idle timeout
            time.sleep(0.5)
            with pytest.raises(RuntimeError, match="SCHEMA_MISMATCH"):
                policy.infer({"observation/image": image, "prompt": "reach"})
        assert policy.infer(good)["actions"].shape[0] > 0
        with pytest.raises(RuntimeError, match=f"TOO_LONG: prompt: expected at most {MAX_INSTRUCTION_TOKENS} tokens"):
            policy.infer(good | {"prompt": "reach " * (2 * MAX_INSTRUCTION_TOKENS)})  # openpi's name for the field
        policy._ws.close()
    finally:
        server.stop(grace_s=0.2)
        engine.close()


class _SessionsCloseAfterARefusal(ModelEngine):
    """The real engine, whose sessions close only once an opening was refused for want of room: the thread of a
    connection that closed is always behind the client that reconnects at once."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.closing, self.refused = threading.Event(), threading.Event()
        self.refusals = 0

    def open_session(self, *args, **kwargs):
        try:
            return super().open_session(*args, **kwargs)
        except TooManySessions:
            self.refusals += 1
            self.refused.set()
            raise

    def close_session(self, session_id: str, why: str = CLOSED_BY_CLIENT) -> None:
        self.closing.set()
        self.refused.wait(timeout=60)
        super().close_session(session_id, why)


@pytest.mark.parametrize("gone", ["closed", "reset"])
def test_a_client_that_reconnects_at_once_gets_the_place_of_its_closing_connection(tmp_path, gone):
    """openpi's client does not retry a refusal, and its protocol has no request id: a robot whose controller
    restarts (its old connection closed, or its process killed: the socket reset) reconnected to a full server
    before the old connection's thread had closed its session, and was refused TOO_MANY_SESSIONS (10 of 1000
    reconnects, --max-sessions 1). An opening that finds no room while a connection already closing holds a session
    waits for it; one that finds the server full of open connections is refused."""
    engine = _SessionsCloseAfterARefusal(build_random_pipeline(tmp_path, seed=2), EngineSettings(
        warmup_ticks=1, default_budget_ms=10_000.0, max_sessions=1))
    engine.start()
    assert engine.wait_ready(timeout_s=300)
    server = build_server(build_config(overrides={"port": 0, "websocket_port": 0, "max_sessions": 1}), engine).start()
    good = {"observation/image": np.zeros((64, 64, 3), np.uint8), "observation/state": np.zeros(2, np.float32),
            "prompt": "reach"}
    try:
        old = WebsocketClientPolicy(host="127.0.0.1", port=server.websocket_port)
        assert old.infer(good)["epoch"] == 1
        if gone == "closed":
            old._ws.close()
        else:  # as the kernel closes a killed process's socket
            old._ws.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            old._ws.socket.close()
        assert engine.closing.wait(timeout=30)  # the old connection's thread has seen it go
        new = WebsocketClientPolicy(host="127.0.0.1", port=server.websocket_port)
        assert new.infer(good)["epoch"] == 1
        assert engine.refusals == 1  # it was turned away once, while the old session was open
        third = WebsocketClientPolicy(host="127.0.0.1", port=server.websocket_port)
        with pytest.raises(RuntimeError, match="TOO_MANY_SESSIONS: all 1 sessions are in use"):
            third.infer(good)  # the one place is the new connection's, which is open
        assert engine.refusals == 2  # at once: it did not wait and ask again
        third._ws.close()
        new._ws.close()
    finally:
        server.stop(grace_s=0.2)
        engine.close()


def test_a_client_that_sends_without_reading_is_held_back_by_tcp_not_queued_for():
    """openpi's protocol is one observation, then its answer. A client that sends on while its observation is being
    served had 16 messages read ahead and held for it (websockets' default queue): 16 x the message limit per
    connection. The server now reads one ahead; TCP's flow control holds the client's sends."""
    engine = FakeEngine()
    image = np.zeros((2000, 2000, 3), np.uint8)  # 12 MB: a valid frame, of which the kernel's buffers hold few
    message = msgpack_numpy.packb(openpi_observation() | {"observation/image": image})
    with serve_fake(engine, websocket_port=0) as server:
        ws = websockets.sync.client.connect(f"ws://127.0.0.1:{server.websocket_port}", compression=None,
                                            max_size=None)
        ws.recv(timeout=10)
        engine.hold()
        ws.send(message)
        engine.wait_entered()  # the first observation is being served
        sent = [0]

        def send_on():
            for _ in range(30):
                ws.send(message)
                sent[0] += 1

        sender = threading.Thread(target=send_on, daemon=True)
        sender.start()
        held, last = 0, -1
        while held != last:  # until the client's sends stop moving
            last = held
            time.sleep(0.5)
            held = sent[0]
        engine.release()
        sender.join(timeout=30)
        with open("/proc/sys/net/ipv4/tcp_rmem") as rmem, open("/proc/sys/net/ipv4/tcp_wmem") as wmem:
            socket_buffers = int(rmem.read().split()[2]) + int(wmem.read().split()[2])  # loopback's, at most
        in_transport = socket_buffers // len(message) + 2  # the kernel's buffers, and a message part way in each
        assert held <= 1 + in_transport  # 16 + in_transport before
        answers = [msgpack_numpy.unpackb(ws.recv(timeout=10)) for _ in range(31)]  # each answered once read
        assert all(answer["actions"].shape == (8, 2) for answer in answers)
        ws.close()


@contextlib.contextmanager
def _stopping_while_serving(engine: FakeEngine, server, policy: WebsocketClientPolicy, grace_s: float):
    """`server.stop(grace_s)` on a thread while `policy`'s observation is held in the engine; yields that thread and
    the list the observation's answer goes to, then lets the observation through and waits for both."""
    engine.hold()
    replies = []
    acting = threading.Thread(target=lambda: replies.append(policy.infer(openpi_observation())))
    acting.start()
    engine.wait_entered()
    stopping = threading.Thread(target=server.stop, kwargs={"grace_s": grace_s})
    stopping.start()
    try:
        yield stopping, replies
    finally:
        engine.release()
        acting.join(timeout=10)
        stopping.join(timeout=10)


def test_shutdown_answers_the_observation_being_served_then_closes():
    engine = FakeEngine()
    with serve_fake(engine, websocket_port=0) as server:
        policy = WebsocketClientPolicy(host="127.0.0.1", port=server.websocket_port)
        idle = websockets.sync.client.connect(f"ws://127.0.0.1:{server.websocket_port}", compression=None)
        idle.recv(timeout=10)
        with _stopping_while_serving(engine, server, policy, grace_s=5.0) as (stopping, replies):
            time.sleep(0.3)  # the server waits for the observation it is serving
            assert stopping.is_alive() and not replies
        assert replies[0]["actions"].shape == (8, 2)  # answered, not cut off
        for ws in (policy._ws, idle):
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1001, "server shutting down")


def _close_reasons(engine: FakeEngine) -> list[str]:
    """The reasons the engine is given as it closes sessions, in order, as the server's log names them."""
    reasons, close_session = [], engine.close_session
    engine.close_session = lambda session_id, why: (reasons.append(why), close_session(session_id, why))
    return reasons


def test_shutdown_refuses_new_connections_and_ends_handshakes_at_once():
    """During the grace the port refused nothing: a client reconnecting after its SHUTTING_DOWN got the metadata frame
    of the stopping server, then SHUTTING_DOWN again; openpi's client retries a refused connection only. A socket in
    its handshake held the shutdown until its handshake timed out (10 s). The log says why each session closed."""
    engine = FakeEngine()
    closed_why = _close_reasons(engine)
    with serve_fake(engine, websocket_port=0) as server:
        policy = WebsocketClientPolicy(host="127.0.0.1", port=server.websocket_port)
        idle = WebsocketClientPolicy(host="127.0.0.1", port=server.websocket_port)
        idle.infer(openpi_observation())
        handshaking = socket.create_connection(("127.0.0.1", server.websocket_port))
        handshaking.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the request never ends
        with _stopping_while_serving(engine, server, policy, grace_s=30.0) as (stopping, replies):
            handshaking.settimeout(OPEN_TIMEOUT_S / 2)
            assert handshaking.recv(1) == b""  # closed by the stop, not left to its handshake's timeout
            with pytest.raises(ConnectionRefusedError):  # while the observation is still being served
                websockets.sync.client.connect(f"ws://127.0.0.1:{server.websocket_port}", open_timeout=5)
            assert stopping.is_alive() and not replies
        assert replies[0]["actions"].shape == (8, 2)
        handshaking.close()
    assert sorted(closed_why) == ["its WebSocket connection closed with 1001 ('server shutting down')"] * 2


def test_a_client_gone_right_after_its_observation_is_no_internal_error(server, engine):
    """A client that sent its first observation and then reset its connection (a robot's process killed) made the
    server log an internal error with a traceback, and count it as INTERNAL: its socket, closed, had no address to
    name the session's client by."""
    def internal_errors():
        return server.metrics.registry.get_sample_value("policy_server_errors_total", {"reason": "INTERNAL"}) or 0

    before, sessions = internal_errors(), engine.stats().sessions
    for _ in range(20):
        ws = websockets.sync.client.connect(f"ws://127.0.0.1:{server.websocket_port}", compression=None)
        ws.recv(timeout=10)
        ws.send(msgpack_numpy.packb(openpi_observation()))
        ws.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        ws.socket.close()
        ws.close()
    for _ in range(500):
        if engine.stats().sessions == sessions:
            break
        time.sleep(0.01)
    assert engine.stats().sessions == sessions
    assert internal_errors() == before


def test_a_client_gone_while_its_tick_waits_ends_the_tick_and_frees_its_place():
    """The connection's thread waits on the engine while its tick queues and runs; a client that closes meanwhile (a
    robot's script restarted) ends the tick, so that its session closes then, not after a tick computed for nobody,
    whose session kept the place the reconnecting client needs. A server of its own: a connection another test reset
    may still be served, and its tick would end here too."""
    engine = FakeEngine()
    engine.hold()
    with serve_fake(engine, websocket_port=0) as server:
        try:
            ws = websockets.sync.client.connect(f"ws://127.0.0.1:{server.websocket_port}", compression=None)
            ws.recv(timeout=10)
            ws.send(msgpack_numpy.packb(openpi_observation()))
            engine.wait_entered()
            ws.close()
            for _ in range(500):
                if engine.stats().sessions == 0:
                    break
                time.sleep(0.01)
            assert (engine.aborted, engine.stats().sessions) == (1, 0)
        finally:
            engine.release()


def test_reset_starts_a_new_episode(server):
    with websockets.sync.client.connect(f"ws://127.0.0.1:{server.websocket_port}", compression=None) as ws:
        msgpack_numpy.unpackb(ws.recv())
        for step in range(2):
            ws.send(msgpack_numpy.packb(openpi_observation()))
            reply = msgpack_numpy.unpackb(ws.recv())
            assert (reply["epoch"], reply["first_step_index"]) == (1, step)  # counted for a client that sends none
        for not_a_flag in (1, "true"):  # read as an observation, they were refused for its missing frame
            ws.send(msgpack_numpy.packb({"reset": not_a_flag}))
            assert ws.recv() == f"BAD_VALUE: reset: expected true (a new episode) or false, got {not_a_flag!r}"
        ws.send(msgpack_numpy.packb({"reset": True}))
        assert msgpack_numpy.unpackb(ws.recv()) == {"reset": True, "epoch": 2}
        ws.send(msgpack_numpy.packb(openpi_observation()))
        reply = msgpack_numpy.unpackb(ws.recv())
        assert (reply["epoch"], reply["first_step_index"]) == (2, 0)  # a new episode counts from 0


def test_object_arrays_are_refused_without_unpickling(server):
    evil = {b"__ndarray__": True, b"data": b"\x80\x04K\x01.", b"dtype": "|O", b"shape": [1]}
    with websockets.sync.client.connect(f"ws://127.0.0.1:{server.websocket_port}", compression=None) as ws:
        ws.recv()
        ws.send(msgpack.packb({"observation/image": evil, "prompt": "x"}))
        reply = ws.recv()
        assert isinstance(reply, str) and reply.startswith("BAD_VALUE") and "not allowed" in reply
        ws.send(b"\xc1 not msgpack")
        assert ws.recv().startswith("BAD_VALUE")


def test_session_is_closed_when_the_connection_closes(server, engine):
    # Its own session, found by its client's address (the server's log names it so): an earlier test's connection
    # may still be closing its session, so the count of sessions says nothing.
    policy = WebsocketClientPolicy(host="127.0.0.1", port=server.websocket_port)
    policy.infer(openpi_observation())
    host, port = policy._ws.local_address[:2]
    (mine,) = [sid for sid, s in engine._sessions.items() if s.client_name == f"openpi client at {host}:{port}"]
    policy._ws.close()
    for _ in range(200):
        if mine not in engine._sessions:
            break
        time.sleep(0.01)
    assert mine not in engine._sessions


def test_a_connection_whose_session_was_closed_by_another_call_answers_why_once_and_closes(server, engine):
    """Its session closed by a CloseSession call naming it (an operator, from the server's log): the connection stayed
    open and answered every later observation SESSION_NOT_FOUND. It answers that once, saying what closed the session,
    and closes (1000), so openpi-client's next call fails on the closed connection rather than on another error."""
    policy = WebsocketClientPolicy(host="127.0.0.1", port=server.websocket_port)
    policy.infer(openpi_observation())
    host, port = policy._ws.local_address[:2]
    (mine,) = [sid for sid, s in engine._sessions.items() if s.client_name == f"openpi client at {host}:{port}"]
    engine.close_session(mine)
    with pytest.raises(RuntimeError, match=f"SESSION_NOT_FOUND: session {mine!r} was closed 0 s ago: a CloseSession "
                                           "call closed it"):
        policy.infer(openpi_observation())
    with pytest.raises(ConnectionClosed) as closed:
        policy._ws.recv(timeout=5)
    assert closed.value.rcvd.code == 1000
    assert closed.value.rcvd.reason == f"session {mine!r} was closed 0 s ago: a CloseSession call closed it"


def test_a_close_reason_cannot_forge_or_split_log_lines():
    """The log names why a connection's session closed with the reason its client sent, which was written as sent:
    a reason of 'bye\\n<a log line>' (123 bytes may hold one) wrote a second, forged line."""
    engine = FakeEngine()
    closed_why = _close_reasons(engine)
    with serve_fake(engine, websocket_port=0) as server:
        policy = WebsocketClientPolicy(host="127.0.0.1", port=server.websocket_port)
        policy.infer(openpi_observation())
        policy._ws.close(code=1000, reason="bye\n2026-01-01 00:00:00,000 INFO x: forged\x1b[2K\u2028")
        for _ in range(500):
            if closed_why:
                break
            time.sleep(0.01)
    assert closed_why == [
        "its WebSocket connection closed with 1000 ('bye\\n2026-01-01 00:00:00,000 INFO x: forged\\x1b[2K\\u2028')"]


def test_embodiment_is_chosen_by_query_parameter(server):
    policy = WebsocketClientPolicy(host=f"ws://127.0.0.1:{server.websocket_port}/?embodiment=libero")
    try:
        assert policy.get_server_metadata()["embodiment"] == "libero"
        images = {"image": np.zeros((32, 32, 3), np.uint8), "wrist": np.ones((32, 48, 3), np.uint8)}
        state = np.arange(8, dtype=np.float32) / 10
        reply = policy.infer({"images": images, "state": state, "prompt": "bowl"})
        expected = expected_actions(Observation(images, state, "", 0), 16, LIBERO)
        np.testing.assert_array_equal(reply["actions"], expected)
    finally:
        policy._ws.close()
    refused = server.metrics.registry.get_sample_value("policy_server_errors_total", {"reason": "UNKNOWN_EMBODIMENT"})
    for query, answer in (("hexapod", b"UNKNOWN_EMBODIMENT"), ("", b"MISSING_FIELD: embodiment"),
                          ("pusht&embodiment=libero", b"BAD_VALUE: embodiment: expected one ?embodiment=")):
        with pytest.raises(InvalidStatus) as err:
            WebsocketClientPolicy(host=f"ws://127.0.0.1:{server.websocket_port}/?embodiment={query}")
        assert err.value.response.status_code == 400 and err.value.response.body.startswith(answer)
    assert server.metrics.registry.get_sample_value(
        "policy_server_errors_total", {"reason": "UNKNOWN_EMBODIMENT"}) == (refused or 0) + 1


def test_a_message_over_the_limit_closes_the_connection_and_is_counted():
    with serve_fake(websocket_port=0, max_message_mb=1) as server:
        with websockets.sync.client.connect(f"ws://127.0.0.1:{server.websocket_port}", compression=None) as ws:
            ws.recv(timeout=10)
            ws.send(msgpack_numpy.packb(openpi_observation() | {"observation/image": np.zeros((1024, 1024, 3),
                                                                                             np.uint8)}))
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
        assert closed.value.rcvd.code == 1009
        counted = time.monotonic() + 10  # by the connection's handler, as it ends
        while server.metrics.registry.get_sample_value("policy_server_errors_total",
                                                       {"reason": "PAYLOAD_TOO_LARGE"}) != 1:
            assert time.monotonic() < counted
            time.sleep(0.02)


def test_a_client_connecting_during_warmup_waits_for_the_metadata_frame():
    # openpi's own server takes no connection before its model is ready, so openpi clients infer as soon as they
    # are connected: through a warmup they must wait in their constructor, not fail their first observation.
    engine = FakeEngine(ready=False)
    with serve_fake(engine, websocket_port=0) as server:
        url = f"http://127.0.0.1:{server.websocket_port}/healthz"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=5)
        assert err.value.code == 503
        err.value.close()  # an open 503 response would hold the server's shutdown for its close timeout
        connected: list[WebsocketClientPolicy] = []
        waiting = threading.Thread(
            target=lambda: connected.append(WebsocketClientPolicy(host="127.0.0.1", port=server.websocket_port)))
        waiting.start()
        waiting.join(0.5)
        assert not connected  # no metadata frame before the model is warm
        engine.set_ready(True)
        waiting.join(5)
        assert urllib.request.urlopen(url, timeout=5).status == 200
        assert connected[0].infer(openpi_observation())["actions"].shape == (8, 2)
        connected[0]._ws.close()


def test_api_key_is_checked(tmp_path):
    token = tmp_path / "token"
    token.write_text("openpi-api-key-16")
    with serve_fake(websocket_port=0, auth_token_file=token) as server:
        with pytest.raises(InvalidStatus) as err:
            WebsocketClientPolicy(host="127.0.0.1", port=server.websocket_port)
        assert err.value.response.status_code == 401
        with pytest.raises(InvalidStatus):
            WebsocketClientPolicy(host="127.0.0.1", port=server.websocket_port, api_key="wrong")
        # Counted as gRPC's are: the openpi port's refusals were not, so that an alert on them missed openpi robots.
        assert server.metrics.registry.get_sample_value("policy_server_errors_total",
                                                        {"reason": "UNAUTHENTICATED"}) == 2
        policy = WebsocketClientPolicy(host="127.0.0.1", port=server.websocket_port, api_key="openpi-api-key-16")
        assert policy.infer(openpi_observation())["actions"].shape == (8, 2)
        policy._ws.close()
        # /healthz stays open for probes
        assert urllib.request.urlopen(f"http://127.0.0.1:{server.websocket_port}/healthz", timeout=5).status == 200


def test_websocket_uses_tls_when_the_server_does(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    context = ssl.create_default_context(cafile=str(cert))
    with serve_fake(websocket_port=0, tls_cert=cert, tls_key=key) as server:
        uri = f"wss://127.0.0.1:{server.websocket_port}"
        with websockets.sync.client.connect(uri, ssl=context, compression=None) as ws:
            assert msgpack_numpy.unpackb(ws.recv())["embodiment"] == "pusht"
            ws.send(msgpack_numpy.packb(openpi_observation(step=4)))
            assert msgpack_numpy.unpackb(ws.recv())["first_step_index"] == 4
        with pytest.raises(InvalidMessage):  # plaintext against TLS: no valid HTTP response
            with websockets.sync.client.connect(f"ws://127.0.0.1:{server.websocket_port}", open_timeout=2):
                pass


def test_the_tls_port_sends_no_session_tickets(tmp_path):
    """A TLS 1.3 ticket lands on websockets' sync client (openpi's) while it writes its upgrade request on another
    thread, which Python's TLS sockets do not support: about 1 connection in 270 lost its request (10 s timeout)."""
    cert, key = self_signed_cert(tmp_path)
    context = ssl.create_default_context(cafile=str(cert))
    with serve_fake(websocket_port=0, tls_cert=cert, tls_key=key) as server:
        with context.wrap_socket(socket.create_connection(("127.0.0.1", server.websocket_port), timeout=10),
                                 server_hostname="127.0.0.1") as tls:
            tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert tls.recv(4096).startswith(b"HTTP/1.1 200")  # past the handshake: any ticket would have come
            assert tls.version() == "TLSv1.3" and not tls.session.has_ticket


def test_connections_beyond_the_session_limit_are_turned_away(server):
    limit = server.engine.info().max_sessions + 4
    url = f"ws://127.0.0.1:{server.websocket_port}"
    held = [websockets.sync.client.connect(url, compression=None) for _ in range(limit)]
    try:
        for ws in held:
            ws.recv()  # the metadata frame: each of these is being served
        with websockets.sync.client.connect(url, compression=None) as extra:
            with pytest.raises(ConnectionClosed) as closed:
                extra.recv(timeout=10)
            assert closed.value.rcvd.code == 1013
    finally:
        for ws in held:
            ws.close()
    with websockets.sync.client.connect(url, compression=None) as again:  # room again once they left
        assert msgpack_numpy.unpackb(again.recv(timeout=10))["embodiment"]


def test_the_step_counter_stays_a_valid_step_index_after_the_largest_one(policy):
    last = 2**63 - 1
    assert policy.infer(openpi_observation(step=last))["first_step_index"] == last
    assert policy.infer(openpi_observation())["first_step_index"] == last  # the counter holds at the largest
    with pytest.raises(RuntimeError, match=r"BAD_VALUE: step_index: expected an integer in \[0, 2\^63\), got "
                                           r"9223372036854775808$"):
        policy.infer(openpi_observation(step=2**63))


@pytest.mark.parametrize(("frame", "error"), [
    (b"\xc1 not msgpack", "BAD_VALUE: frame: expected a msgpack map of observation keys, got 13 bytes msgpack "
                          "cannot decode: a byte that begins no msgpack value"),
    (msgpack.packb([1, 2]), "BAD_VALUE: frame: expected a msgpack map of observation keys, got a msgpack list"),
    (msgpack.packb({"observation/image": {b"__ndarray__": True, b"dtype": "|u1", b"shape": [0]}}),
     "BAD_VALUE: frame: expected arrays as msgpack-numpy maps {__ndarray__, data, dtype, shape}, got a __ndarray__ "
     "map without key 'data' (it needs data, dtype, shape)"),
    (msgpack.packb({"observation/image": {b"__ndarray__": True, b"data": b"", b"dtype": "zz", b"shape": [0]}}),
     "BAD_VALUE: frame: expected arrays as msgpack-numpy maps {__ndarray__, data, dtype, shape}, got dtype 'zz', "
     "which is not allowed (bool, int, uint or float only)"),
    (msgpack.packb({"observation/image": {b"__ndarray__": True, b"data": b"\0" * 5, b"dtype": "|u1",
                                          b"shape": [2, 2]}}),
     "BAD_VALUE: frame: expected arrays as msgpack-numpy maps {__ndarray__, data, dtype, shape}, got data of 5 bytes "
     "for shape [2, 2] uint8, which needs 4 bytes"),
    (msgpack.packb({"observation/image": {b"__ndarray__": True, b"data": b"\0" * 3, b"dtype": "|u1",
                                          b"shape": [True, 3]}}),
     "BAD_VALUE: frame: expected arrays as msgpack-numpy maps {__ndarray__, data, dtype, shape}, got shape "
     "[True, 3], not a list of non-negative integers"),
    (msgpack.packb({"step_index": {b"__npgeneric__": True, b"data": 300, b"dtype": "|u1"}}),
     "BAD_VALUE: frame: expected arrays as msgpack-numpy maps {__ndarray__, data, dtype, shape}, got scalar data "
     "300 that is not a uint8"),
    (msgpack.packb({"step_index": {b"__npgeneric__": True, b"data": 1e10, b"dtype": "<f2"}}),
     "BAD_VALUE: frame: expected arrays as msgpack-numpy maps {__ndarray__, data, dtype, shape}, got scalar data "
     "10000000000.0 that is not a float16"),
    # Each container is a Python object however few bytes it takes: 16 MiB of them cost seconds and gigabytes.
    (msgpack.packb({"observation/image": [[]] * 300}),
     "BAD_VALUE: frame: expected a msgpack map of at most 256 maps and arrays, nested ones included, got more than "
     "256 maps and arrays"),
    (msgpack.packb({"junk": [None] * 2000}),
     "BAD_VALUE: frame: expected a msgpack map whose maps and arrays hold at most 1024 items each, got an array of "
     "2000 items"),
    (msgpack.packb({"observation/state": {i: 0 for i in range(1025)}}),
     "BAD_VALUE: frame: expected a msgpack map whose maps and arrays hold at most 1024 items each, got a map of "
     "1025 items"),
], ids=["not msgpack", "a list", "array without data", "unknown dtype", "short data", "a bool side",
        "a scalar its dtype cannot hold", "a float its dtype cannot hold", "too many containers", "a long array",
        "a long map"])
def test_an_undecodable_frame_is_named_with_what_was_expected(server, frame, error):
    with websockets.sync.client.connect(f"ws://127.0.0.1:{server.websocket_port}", compression=None) as ws:
        ws.recv()
        ws.send(frame)
        assert ws.recv(timeout=10) == error


@pytest.fixture
def own_server():
    """A server of the test's own: one that bars the test's address must not bar the next test's."""
    with serve_fake(FakeEngine(), websocket_port=0) as running:
        yield running


def test_a_connection_that_keeps_sending_refused_messages_is_closed_and_its_address_barred(own_server):
    """Each refused message costs the server its receipt and unpacking: a burst is answered, a flood is closed, and
    its address gets no new burst by reconnecting."""
    server = own_server

    def refusals() -> float:
        return server.metrics.registry.get_sample_value("policy_server_errors_total", {"reason": "RATE_EXCEEDED"}) or 0
    with websockets.sync.client.connect(f"ws://127.0.0.1:{server.websocket_port}", compression=None) as ws:
        ws.recv(timeout=10)
        started = time.monotonic()
        for _ in range(MAX_REFUSED_MESSAGES):  # each answered with its error, as openpi clients read them
            ws.send(b"\xc1 not msgpack")
            assert ws.recv(timeout=10).startswith("BAD_VALUE: frame: expected a msgpack map")
        ws.send(msgpack_numpy.packb(openpi_observation()))  # and the next good observation is served
        assert msgpack_numpy.unpackb(ws.recv(timeout=10))["actions"].shape == (8, 2)
        answered = 0
        with pytest.raises(ConnectionClosed) as closed:
            for _ in range(10 * MAX_REFUSED_MESSAGES):
                ws.send(msgpack_numpy.packb(openpi_observation() | {"observation/state": np.zeros(7, np.float32)}))
                assert ws.recv(timeout=10).startswith("SCHEMA_MISMATCH: observation/state")
                answered += 1
        refilled = (time.monotonic() - started) * REFUSED_MESSAGES_HZ  # what the bucket regained meanwhile
    assert 1 <= answered <= 1 + refilled  # the one too many is answered too, then the connection closed
    assert closed.value.rcvd.code == 1008
    assert closed.value.rcvd.reason.startswith("too many refused messages: ")
    assert closed.value.rcvd.reason.endswith(f"per second, beyond a burst of {MAX_REFUSED_MESSAGES} at "
                                             f"{REFUSED_MESSAGES_HZ:g} per second")
    assert refusals() == 1
    barred_at = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.websocket_port)) as sock:  # closed before its handshake
        sock.settimeout(5)
        assert sock.recv(1) == b""
    assert time.monotonic() - barred_at < BARRED_S


def test_refused_messages_within_their_rate_keep_the_connection(server):
    """A client that waits after its errors is never closed."""
    with websockets.sync.client.connect(f"ws://127.0.0.1:{server.websocket_port}", compression=None) as ws:
        ws.recv(timeout=10)
        for sent in range(MAX_REFUSED_MESSAGES + 3):
            if sent >= MAX_REFUSED_MESSAGES:  # past the burst, one each time the bucket regains one
                time.sleep(1.1 / REFUSED_MESSAGES_HZ)
            ws.send(b"\xc1 not msgpack")
            assert ws.recv(timeout=10).startswith("BAD_VALUE: frame")
        ws.send(msgpack_numpy.packb(openpi_observation()))
        assert msgpack_numpy.unpackb(ws.recv(timeout=10))["actions"].shape == (8, 2)


def test_sockets_that_never_finish_their_handshake_cannot_pile_up_threads():
    engine = FakeEngine(max_sessions=1)
    with serve_fake(engine, max_sessions=1, websocket_port=0) as server:
        cap = 2 * (1 + 4) + 8
        threads = threading.active_count()
        silent = [socket.create_connection(("127.0.0.1", server.websocket_port)) for _ in range(3 * cap)]
        time.sleep(0.5)
        # Two threads (handler, reader) for each socket let in; the rest were closed on their threads' start.
        assert threading.active_count() - threads <= 2 * cap + 2
        for sock in silent[cap:]:
            sock.settimeout(5)
            assert sock.recv(1) == b""
        for sock in silent:
            sock.close()
        policy = WebsocketClientPolicy(host="127.0.0.1", port=server.websocket_port)  # places free again
        assert policy.infer(openpi_observation())["actions"].shape == (8, 2)
        policy._ws.close()


def test_connections_that_send_nothing_are_closed_and_free_their_place():
    engine = FakeEngine(max_sessions=1)
    with serve_fake(engine, max_sessions=1, websocket_port=0, session_idle_timeout_s=0.5) as server:
        url = f"ws://127.0.0.1:{server.websocket_port}"
        idle = [websockets.sync.client.connect(url, compression=None) for _ in range(1 + 4)]  # the whole limit
        for ws in idle:
            ws.recv(timeout=10)
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1001, "idle for 0.5 s")
        with websockets.sync.client.connect(url, compression=None) as ws:  # their places are free again
            ws.recv(timeout=10)
            ws.send(msgpack_numpy.packb(openpi_observation()))
            assert msgpack_numpy.unpackb(ws.recv(timeout=10))["actions"].shape == (8, 2)
