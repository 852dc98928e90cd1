"""A real `policy-server` process (real engine, untrained embedded-size model) on a free loopback port,
driven with the client library: health while warming, a session, the control stream, the reasoner,
and bad input answered while the server keeps serving."""

import os
import socket
import subprocess
import sys

import grpc
import numpy as np
import pytest

from policy_server.client import ControlStream, PolicyClient, PolicyServerError
from robots.embedded import build_random_pipeline


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("e2e-model")
    build_random_pipeline(model_dir, seed=2)
    port = _free_port()
    log = open(tmp_path_factory.mktemp("e2e-log") / "server.log", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "policy_server.cli", "--checkpoint", str(model_dir), "--port", str(port),
         "--latency-budget-ms", "5000", "--device", "cpu"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    client = PolicyClient(f"127.0.0.1:{port}", timeout_s=30)
    try:
        client.wait_until_serving(timeout_s=240)
    except TimeoutError:
        log.seek(0)
        process.kill()
        raise AssertionError("server did not become SERVING:\n" + log.read()) from None
    yield client
    client.close()
    process.terminate()
    process.wait(timeout=30)
    log.close()


def _image(seed=0):
    return np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)


STATE = np.array([0.25, 0.25], np.float32)


def test_session_act_and_record(server):
    info = server.server_info()
    assert [e.name for e in info.embodiments] == ["pusht"]
    session = server.open_session("pusht", "reach the red circle")
    chunk = server.act(session, {"image": _image()}, STATE, step_index=5)
    assert chunk.actions.shape == (8, 2)
    assert chunk.first_step_index == 5
    assert chunk.tick.deadline_met
    server.close_session(session)


def test_control_stream_answers_each_observation(server):
    session = server.open_session("pusht", "reach the blue circle")
    with ControlStream(server, session) as stream:
        for step in range(3):
            stream.send({"image": _image(step)}, STATE, step_index=step, must_answer=True, encoding="png")
            chunk = stream.next_chunk(timeout_s=60)
            assert chunk.actions.shape == (8, 2)
    server.close_session(session)


def test_reasoner_streams(server):
    pieces = list(server.reason("what is on the table?", max_new_tokens=8, seed=1))
    assert 0 < len(pieces) <= 8


@pytest.mark.parametrize(
    "images, state, reason",
    [
        ({"image": _image()[:32]}, STATE, "SCHEMA_MISMATCH"),
        ({"image": _image()}, np.array([np.nan, 0.1], np.float32), "NON_FINITE"),
        ({"wrist": _image()}, STATE, "SCHEMA_MISMATCH"),
    ],
)
def test_bad_input_then_good_input(server, images, state, reason):
    session = server.open_session("pusht", "reach the green circle")
    with pytest.raises(PolicyServerError) as error:
        server.act(session, images, state)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.reason == reason
    assert server.act(session, {"image": _image()}, STATE).actions.shape == (8, 2)
    server.close_session(session)


def test_unknown_session_and_infeasible_budget(server):
    session = server.open_session("pusht", "reach the red circle")
    with pytest.raises(PolicyServerError) as error:
        server.set_budget(session, 0.01)
    assert error.value.reason == "BUDGET_INFEASIBLE"
    server.close_session(session)
    with pytest.raises(PolicyServerError) as error:
        server.act(session, {"image": _image()}, STATE)
    assert error.value.code == grpc.StatusCode.NOT_FOUND
    assert server.health() == "SERVING"
