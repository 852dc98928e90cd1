"""A real `policy-server` process (real engine, untrained embedded-size model, token auth and reflection
on) on a free loopback port, driven with the client library: health while warming, a session, the
control stream, the reasoner, reflection, auth failure, and bad input of many kinds, each answered
with its status while the server keeps serving."""

import math
import os
import socket
import subprocess
import sys

import cv2
import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from policy_server.client import ControlStream, PolicyClient, PolicyServerError, build_observation
from policy_server.server.proto import policy_server_pb2 as pb
from policy_server.server.wire import encode_image, tensor_to_proto
from robots.embedded import build_random_pipeline

TOKEN = "e2e-token"
MAX_MESSAGE_MB = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("e2e-model")
    build_random_pipeline(model_dir, seed=2)
    port = _free_port()
    logs = tmp_path_factory.mktemp("e2e-log")
    (logs / "token").write_text(TOKEN)
    log = open(logs / "server.log", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "policy_server.cli", "--checkpoint", str(model_dir), "--port", str(port),
         "--latency-budget-ms", "5000", "--device", "cpu", "--reflection", "--auth-token-file", str(logs / "token"),
         "--max-message-mb", str(MAX_MESSAGE_MB)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    client = PolicyClient(f"127.0.0.1:{port}", timeout_s=30, token=TOKEN)
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


class _BearerToken(grpc.StreamStreamClientInterceptor):
    """Adds the token to reflection's stream, which the client library does not make."""

    def intercept_stream_stream(self, continuation, details, request_iterator):
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {TOKEN}")]
        return continuation(details._replace(metadata=metadata), request_iterator)


def test_reflection_and_auth(server):
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as error:  # reflection is behind the token like the API
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        authed = grpc.intercept_channel(channel, _BearerToken())
        services = set(ProtoReflectionDescriptorDatabase(authed).get_services())
    assert {"policy_server.v1.PolicyService", "grpc.health.v1.Health"} <= services
    with PolicyClient(server.target, timeout_s=30) as anonymous:
        assert anonymous.health() == "SERVING"
        with pytest.raises(PolicyServerError) as error:
            anonymous.open_session("pusht", "no token")
        assert error.value.code == grpc.StatusCode.UNAUTHENTICATED
    with PolicyClient(server.target, timeout_s=30, token="wrong") as wrong:
        with pytest.raises(PolicyServerError) as error:
            wrong.server_info()
        assert error.value.code == grpc.StatusCode.UNAUTHENTICATED


INVALID = grpc.StatusCode.INVALID_ARGUMENT
JPEG, PNG, RAW = pb.IMAGE_ENCODING_JPEG, pb.IMAGE_ENCODING_PNG, pb.IMAGE_ENCODING_RAW


def _request(session, image=None, state=STATE, camera="image"):
    """An ActRequest for `session`; `image`: a `pb.Image` replacing the good frame."""
    observation = build_observation({"image": _image()}, state, step_index=1, encoding="png")
    if image is not None:
        observation.images.clear()
        observation.images[camera].CopyFrom(image)
    return pb.ActRequest(session_id=session.session_id, epoch=session.epoch, observation=observation)


def _with_state(tensor):
    def build(session):
        request = _request(session)
        request.observation.ClearField("state")
        if tensor is not None:
            request.observation.state.CopyFrom(tensor)
        return request

    return lambda client, session: client.act_request(build(session))


def _act(**fields):
    return lambda client, session: client.act_request(_request(session, **fields))


def _png(image):
    return cv2.imencode(".png", image)[1].tobytes()


def _stale_epoch(client, session):
    client.reset_session(session)  # epoch 1 -> 2; the request still says 1
    return client.act_request(_request(session))


def _oversized(client, session):
    request = _request(session)
    request.observation.instruction = "x" * int(1.5 * MAX_MESSAGE_MB * 2**20)
    return client.act_request(request)


BAD_INPUTS = {
    "bad_jpeg": (_act(image=pb.Image(encoding=JPEG, data=b"\xff\xd8\xffgarbage")), INVALID, "IMAGE_DECODE_FAILED"),
    "truncated_jpeg": (_act(image=pb.Image(encoding=JPEG, data=encode_image(_image(), "jpeg").data[:300])),
                       INVALID, "IMAGE_DECODE_FAILED"),
    "wrong_image_size": (_act(image=encode_image(_image()[:32], "png")), INVALID, "SCHEMA_MISMATCH"),
    "grayscale_png": (_act(image=pb.Image(encoding=PNG, data=_png(_image()[..., 0]))), INVALID, "SCHEMA_MISMATCH"),
    "raw_length_mismatch": (_act(image=pb.Image(encoding=RAW, height=64, width=64, channels=3, data=bytes(10))),
                            INVALID, "BAD_IMAGE"),
    "unknown_encoding": (_act(image=pb.Image(encoding=17, data=b"x")), INVALID, "UNKNOWN_ENCODING"),
    "unknown_camera": (_act(image=encode_image(_image(), "png"), camera="wrist"), INVALID, "SCHEMA_MISMATCH"),
    "nan_state": (_act(state=np.array([np.nan, 0.1], np.float32)), INVALID, "NON_FINITE"),
    "wrong_state_dim": (_with_state(tensor_to_proto(np.zeros(5, np.float32))), INVALID, "SCHEMA_MISMATCH"),
    "missing_state": (_with_state(None), INVALID, "SCHEMA_MISMATCH"),
    "integer_state": (_with_state(tensor_to_proto(np.array([1, 2], np.int32))), INVALID, "BAD_DTYPE"),
    "missing_observation": (lambda c, s: c.act_request(pb.ActRequest(session_id=s.session_id, epoch=s.epoch)),
                            INVALID, "MISSING_FIELD"),
    "unknown_session": (lambda c, s: c.act_request(pb.ActRequest(session_id="nope", epoch=1,
                                                                 observation=_request(s).observation)),
                        grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND"),
    "stale_epoch": (_stale_epoch, grpc.StatusCode.FAILED_PRECONDITION, "STALE_EPOCH"),
    "oversized_message": (_oversized, grpc.StatusCode.RESOURCE_EXHAUSTED, "PAYLOAD_TOO_LARGE"),
    "unknown_embodiment": (lambda c, s: c.open_session("hexapod", "walk"), INVALID, "UNKNOWN_EMBODIMENT"),
    "empty_instruction": (lambda c, s: c.open_session("pusht", "  "), INVALID, "MISSING_FIELD"),
    "nan_budget": (lambda c, s: c.open_session("pusht", "go", budget_ms=math.nan), INVALID, "BAD_VALUE"),
    "chunk_size_out_of_range": (lambda c, s: c.open_session("pusht", "go", chunk_size=999), INVALID, "BAD_VALUE"),
    "infeasible_budget": (lambda c, s: c.set_budget(s, 0.01), grpc.StatusCode.FAILED_PRECONDITION,
                          "BUDGET_INFEASIBLE"),
    "empty_reasoner_prompt": (lambda c, s: list(c.reason("", max_new_tokens=4)), INVALID, "MISSING_FIELD"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_then_good_input(server, name):
    call, code, reason = BAD_INPUTS[name]
    session = server.open_session("pusht", "reach the green circle")
    with pytest.raises(PolicyServerError) as error:
        call(server, session)
    assert (error.value.code, error.value.reason) == (code, reason), error.value
    if reason == "STALE_EPOCH":
        session = server.reset_session(session)  # the client's copy of the epoch is behind the server's
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
