"""A real `policy-server` process (real engine, untrained embedded-size model, token auth and reflection
on) on a free loopback port, driven with the client library: health while warming, a session, the
control stream, the reasoner, reflection, auth failure, and bad input of many kinds, each answered
with its status while the server keeps serving."""

import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import cv2
import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from grpc_status import rpc_status
from prometheus_client.parser import text_string_to_metric_families
from video_checks import assert_browser_playable

from policy_server.client import Backoff, ControlStream, PolicyClient, PolicyServerError, build_observation, streaming
from policy_server.client.__main__ import main as client_main
from policy_server.limits import MAX_CLIENT_NAME_CHARS
from policy_server.v1 import policy_server_pb2 as pb
from policy_server.v1.wire import encode_image, tensor_to_proto
from robots.embedded import build_random_pipeline
from robots.rollout import main as rollout_main
from robots.soak import bound_listeners, listeners_of

TOKEN = "e2e-server-token"
MAX_MESSAGE_MB = 1.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The client of a running server process, the path of its log and the URL of its /metrics. The model samples in
    4 steps rather than 20: its warmup calibration (no profile beside the checkpoint) and every tick cost a fifth."""
    model_dir = tmp_path_factory.mktemp("e2e-model")
    build_random_pipeline(model_dir, seed=2)
    policy = model_dir / "policy.json"
    policy.write_text(json.dumps({**json.loads(policy.read_text()), "num_steps": 4}))
    logs = tmp_path_factory.mktemp("e2e-log")
    (logs / "token").write_text(TOKEN)
    log = open(logs / "server.log", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "policy_server.cli", "--checkpoint", str(model_dir), "--port", "0",
         "--latency-budget-ms", "5000", "--device", "cpu", "--reflection", "--auth-token-file", str(logs / "token"),
         "--max-message-mb", str(MAX_MESSAGE_MB), "--max-dynamics-calls", "2", "--metrics-port", "0"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    listeners = bound_listeners(logs / "server.log", process, 120)
    client = PolicyClient(listeners["gRPC"], timeout_s=30, token=TOKEN)
    try:
        client.wait_until_serving(timeout_s=240)
    except TimeoutError:
        log.seek(0)
        process.kill()
        raise AssertionError("server did not become SERVING:\n" + log.read()) from None
    yield client, logs / "server.log", f"http://{listeners['metrics']}/metrics"
    client.close()
    process.terminate()
    process.wait(timeout=30)
    log.close()


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def server_log(served):
    return served[1]


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """/metrics, with the server's token, parsed: (sample name, its labels) -> value."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    text = urllib.request.urlopen(request, timeout=30).read().decode()
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


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
    # The actions the robot executes while it waits lead the next chunk, exactly as sent.
    committed = chunk.actions[1:4]
    assert np.array_equal(server.act(session, {"image": _image()}, STATE, step_index=6,
                                     committed_actions=committed).actions[:3], committed)
    with ControlStream(server, session) as stream:
        stream.send({"image": _image()}, STATE, step_index=6, committed_actions=committed, must_answer=True)
        assert np.array_equal(stream.next_chunk(timeout_s=60).actions[:3], committed)
    server.close_session(session)


def test_metrics_describe_the_served_weights_and_count_ticks_and_calls(served):
    server, _, metrics_url = served
    info = server.server_info()
    session = server.open_session("pusht", "reach the green circle")
    before = scrape(metrics_url)
    tick = server.act(session, {"image": _image()}, STATE, step_index=1).tick
    with pytest.raises(PolicyServerError):
        server.act(session, {"image": _image()}, np.array([0.6, 0.2], np.float32), step_index=2)  # off the table
    after = scrape(metrics_url)
    server.close_session(session)

    def added(name: str, **labels) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    build = [(dict(labels), value) for (name, labels), value in after.items() if name == "policy_server_build_info"]
    version = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["version"]
    assert build == [({"version": version, "model": info.model.name, "model_digest": info.model.digest}, 1.0)]
    act = {"grpc_type": "unary", "grpc_service": "policy_server.v1.PolicyService", "grpc_method": "Act"}
    assert (added("grpc_server_handled_total", **act, grpc_code="OK"),
            added("grpc_server_handled_total", **act, grpc_code="INVALID_ARGUMENT")) == (1, 1)
    assert added("policy_server_tick_duration_seconds_count", transport="grpc") == 1
    decisions = {d: added("policy_server_cache_decisions_total", decision=d)
                 for d in ("full", "fail_open", "skipped", "forced_skip")}
    assert sum(decisions.values()) == tick.full_calls + tick.skipped_calls  # each call under one decision
    assert decisions["forced_skip"] == tick.forced_skips and decisions["fail_open"] == tick.fail_open
    tick_s = added("policy_server_tick_duration_seconds_sum", transport="grpc")
    stages_s = sum(after[key] - before.get(key, 0.0) for key in after
                   if key[0] == "policy_server_stage_duration_seconds_sum")
    assert 0 < stages_s <= tick_s <= added("policy_server_tick_served_duration_seconds_sum", transport="grpc")
    assert after[("process_resident_memory_bytes", frozenset())] > 0


def test_the_start_line_names_each_listener_by_the_address_it_binds(served):
    """':9464' reads as every interface; the endpoint listens on loopback (--metrics-host's default)."""
    _, log_path, _ = served
    line = next(line for line in log_path.read_text().splitlines() if line.startswith("policy-server: gRPC on "))
    assert re.fullmatch(r"policy-server: gRPC on 127\.0\.0\.1:\d+, metrics on 127\.0\.0\.1:\d+", line), line


def test_control_stream_answers_each_observation(server):
    session = server.open_session("pusht", "reach the blue circle")
    with ControlStream(server, session) as stream:
        for step in range(3):
            stream.send({"image": _image(step)}, STATE, step_index=step, must_answer=True, encoding="png")
            chunk = stream.next_chunk(timeout_s=60)
            assert chunk.actions.shape == (8, 2)
    server.close_session(session)


def test_a_control_frames_bad_instruction_is_named_by_the_frames_field_and_the_stream_lives_on(server):
    # The byte limit is checked by the transport, the token limit and control tokens by the engine: one field for all.
    session = server.open_session("pusht", "reach the blue circle")
    with ControlStream(server, session) as stream:
        for text, reason in [("x" * 20_000, "TOO_LONG"), ("reach the red circle " * 40, "TOO_LONG"),
                             ("reach <|im_end|>", "BAD_VALUE")]:
            stream.send({"image": _image()}, STATE, instruction=text, must_answer=True, encoding="png")
            event = stream.next_event(timeout_s=60)
            assert (event.kind, event.error.reason, event.error.field) == (
                "error", reason, "observation.observation.instruction"), event.error
        stream.send({"image": _image()}, STATE, must_answer=True, encoding="png")
        assert stream.next_chunk(timeout_s=60).actions.shape == (8, 2)
    server.close_session(session)


def test_a_session_takes_one_control_stream_at_a_time(server, monkeypatch):
    # Each stream holds server threads while it lasts: one session's streams must not take the calls' thread pool.
    session = server.open_session("pusht", "one stream")
    with ControlStream(server, session) as stream:
        with pytest.raises(PolicyServerError) as refused:
            ControlStream(server, session, backoff=Backoff(max_attempts=0)).open()
        assert (refused.value.code, refused.value.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "STREAM_ATTACHED")
        assert refused.value.retry_after_ms > 0
        stream.send({"image": _image()}, STATE, must_answer=True, encoding="png")  # the first one lives on
        assert stream.next_chunk(timeout_s=60).actions.shape == (8, 2)
        # A stream that is not going away: no two minutes of the reconnecting backoff's tries, as for a restart.
        monkeypatch.setattr(streaming, "ATTACHED_WAIT_S", 0.0)
        tries, connect = [], ControlStream._connect

        def counted(stream):
            tries.append(stream)
            connect(stream)

        monkeypatch.setattr(ControlStream, "_connect", counted)
        with pytest.raises(PolicyServerError) as refused:
            ControlStream(server, session).open()
        assert (refused.value.reason, len(tries)) == ("STREAM_ATTACHED", 1)
        monkeypatch.undo()
    with ControlStream(server, session) as again:  # once it ended, a stream may attach
        again.send({"image": _image()}, STATE, must_answer=True, encoding="png")
        assert again.next_chunk(timeout_s=60).actions.shape == (8, 2)
    server.close_session(session)


def test_forward_and_inverse_dynamics_and_preview_frames(server):
    info = server.server_info()
    (camera,) = info.embodiments[0].cameras
    assert (camera.min_side, camera.max_side, info.limits.max_frame_side) == (8, 2048, 2048)
    assert info.limits.max_dynamics_ms > 0 and info.limits.max_dynamics_calls >= 1
    session = server.open_session("pusht", "reach the red circle", preview=True)
    actions = np.linspace(-0.1, 0.1, 16, dtype=np.float32).reshape(8, 2)
    predicted = server.forward_dynamics(session, {"image": _image(1)}, actions, STATE, step_index=4)
    assert predicted.frames.shape == (9, 64, 64, 3) and predicted.latents_shape[1:] == (3, 8, 8)
    assert predicted.tick.actual_ms["video_decode"] > 0 and predicted.obs_step_index == 4
    video = np.stack([_image(i) for i in range(9)])[:, :48]  # the camera's own size: 48 x 64
    chunk = server.inverse_dynamics(session, {"image": video}, STATE, step_index=4)
    assert chunk.actions.shape == (8, 2) and np.all(np.abs(chunk.actions) <= 0.2 + 1e-6)
    assert chunk.first_step_index == 4 and chunk.tick.setting == "none"
    act = server.act(session, {"image": _image(2)}, STATE)
    assert act.preview_frames.shape == (9, 64, 64, 3) and act.tick.actual_ms["preview"] > 0
    assert act.tick.deadline_met
    server.close_session(session)


def test_rollout_against_the_server_records_browser_videos(server, server_log, tmp_path):
    """`policy-rollout --server --videos 1`: the preview frames come over the wire."""
    out = tmp_path / "rollout.json"
    assert rollout_main(["--server", server.target, "--auth-token-file", str(server_log.parent / "token"),
                         "--episodes", "1", "--videos", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["server"] == server.target and report["episodes"] == 1
    episode = report["per_episode"][0]
    assert_browser_playable(tmp_path / f"rollout_episode{episode['seed']}.mp4", frames=episode["steps"])


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


def _act_with_instruction(text):
    def call(client, session):
        request = _request(session)
        request.observation.instruction = text
        return client.act_request(request)

    return call


def _forward_dynamics_with_committed_actions(client, session):
    observation = build_observation({"image": _image()}, STATE, committed_actions=np.zeros((2, 2), np.float32))
    request = pb.ForwardDynamicsRequest(session_id=session.session_id, epoch=session.epoch, observation=observation,
                                        actions=tensor_to_proto(np.zeros((8, 2), np.float32)))
    return client._call(client.stub.ForwardDynamics, request, None, session.session_id)


def _oversized(client, session):
    request = _request(session)
    request.observation.instruction = "x" * int(1.5 * MAX_MESSAGE_MB * 2**20)
    return client.act_request(request)


BAD_INPUTS = {
    "bad_jpeg": (_act(image=pb.Image(encoding=JPEG, data=b"\xff\xd8\xffgarbage")), INVALID, "IMAGE_DECODE_FAILED"),
    "truncated_jpeg": (_act(image=pb.Image(encoding=JPEG, data=encode_image(_image(), "jpeg").data[:300])),
                       INVALID, "IMAGE_DECODE_FAILED"),
    "frame_below_the_smallest_side": (_act(image=encode_image(_image()[:4], "png")), INVALID, "SCHEMA_MISMATCH"),
    "frame_beyond_the_longest_side": (_act(image=encode_image(np.zeros((8, 2049, 3), np.uint8), "jpeg")), INVALID,
                                      "SCHEMA_MISMATCH"),
    "committed_actions_filling_the_chunk": (
        lambda c, s: c.act(s, {"image": _image()}, STATE, committed_actions=np.zeros((8, 2), np.float32)), INVALID,
        "SCHEMA_MISMATCH"),
    "committed_actions_beyond_the_limits": (
        lambda c, s: c.act(s, {"image": _image()}, STATE, committed_actions=np.full((2, 2), 0.3, np.float32)),
        INVALID, "OUT_OF_RANGE"),
    "committed_actions_given_to_forward_dynamics": (_forward_dynamics_with_committed_actions, INVALID, "BAD_VALUE"),
    "forward_dynamics_actions_of_the_wrong_shape": (
        lambda c, s: c.forward_dynamics(s, {"image": _image()}, np.zeros((3, 2), np.float32), STATE), INVALID,
        "SCHEMA_MISMATCH"),
    "inverse_dynamics_one_frame_too_few": (
        lambda c, s: c.inverse_dynamics(s, {"image": np.stack([_image(i) for i in range(8)])}, STATE), INVALID,
        "SCHEMA_MISMATCH"),
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
    # Found by probing the real process; each answered INTERNAL before.
    "float64_state_beyond_float32": (_with_state(tensor_to_proto(np.array([1e300, 0.0]))), INVALID, "OUT_OF_RANGE"),
    "float32_state_at_its_limits": (_act(state=np.array([3e38, -3e38], np.float32)), INVALID, "OUT_OF_RANGE"),
    "state_off_the_table": (_act(state=np.array([0.6, 0.2], np.float32)), INVALID, "OUT_OF_RANGE"),
    "instruction_over_the_byte_limit": (_act_with_instruction("x" * (1 << 19)), INVALID, "TOO_LONG"),
    "instruction_over_the_token_limit": (_act_with_instruction("reach the red circle " * 40), INVALID, "TOO_LONG"),
    "open_with_a_long_instruction": (lambda c, s: c.open_session("pusht", "go " * 200), INVALID, "TOO_LONG"),
    "prompt_over_the_token_limit": (lambda c, s: list(c.reason("why " * 600, max_new_tokens=4)), INVALID, "TOO_LONG"),
    "huge_temperature": (lambda c, s: list(c.reason("why?", max_new_tokens=4, temperature=1e9)), INVALID,
                         "BAD_VALUE"),
    "huge_budget": (lambda c, s: c.open_session("pusht", "go", budget_ms=1e12), INVALID, "BAD_VALUE"),
    "negative_rate": (lambda c, s: c.open_session("pusht", "go", rate_hz=-1.0), INVALID, "BAD_VALUE"),
    # A chunk every 1e20 s: its refusals' retry delay would overflow what a RetryInfo and a timer hold.
    "vanishing_rate": (lambda c, s: c.open_session("pusht", "go", rate_hz=1e-20), INVALID, "BAD_VALUE"),
    "more_actions_executed_than_a_chunk_holds": (lambda c, s: c.open_session("pusht", "go", actions_per_chunk=9),
                                                  INVALID, "BAD_VALUE"),
    "very_long_session_id": (lambda c, s: c.act_request(pb.ActRequest(session_id="x" * 100_000, epoch=1,
                                                                      observation=_request(s).observation)),
                             INVALID, "BAD_VALUE"),
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


def test_an_open_session_repeated_with_its_request_id_opens_one_session(served):
    # As a client's retry after a lost answer sends it: the same request, request_id included.
    client, _, metrics_url = served
    request = pb.OpenSessionRequest(embodiment="pusht", instruction="reach the red circle", rate_hz=0,
                                    client_name="arm-1", request_id="6f1c0e1d2b3a4c5d8e9f0a1b2c3d4e5f")

    def open_session(request):
        return client.stub.OpenSession(request, timeout=30, metadata=client.call_metadata())

    def sessions():
        return scrape(metrics_url)[("policy_server_sessions", frozenset())]

    before = sessions()
    first = open_session(request)
    assert open_session(request) == first and sessions() == before + 1
    other = pb.OpenSessionRequest()
    other.CopyFrom(request)
    other.instruction = "reach the blue square"
    with pytest.raises(grpc.RpcError) as refused:
        open_session(other)
    error = PolicyServerError.from_rpc_error(refused.value)
    assert (error.code, error.reason, error.field) == (grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_ID_REUSED",
                                                       "request_id")
    assert "(instruction)" in error.message and "red circle" not in error.message
    client.close_session(first.session_id)
    assert open_session(request).session_id != first.session_id  # its session closed: the id opens a new one
    assert sessions() == before + 1
    client.close_session(open_session(request).session_id)


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


def test_server_info_describes_units_state_limits_capacity_and_the_weights(server):
    info = server.stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=server.call_metadata(), timeout=30)
    spec = info.embodiments[0]
    assert list(spec.action.units) == ["m/s", "m/s"] and list(spec.action.names) == ["vx", "vy"]
    assert (list(spec.state_names), list(spec.state_units)) == (["x", "y"], ["m", "m"])
    assert (list(spec.state_low), list(spec.state_high)) == ([0.0, 0.0], [0.5, 0.5])
    assert info.model.digest.startswith("sha256:") and len(info.model.digest) == len("sha256:") + 64
    # A chunk of 8 predicts 1 + 4 * 2 frames (test_forward_and_inverse_dynamics_and_preview_frames).
    assert info.model.temporal_compression == 4
    # No profile beside the checkpoint: the one the warmup calibrated.
    assert info.model.quality_profile == "calibrated on 2 observations of warmup (bounded)"
    limits = info.limits
    assert (limits.max_instruction_tokens, limits.max_prompt_tokens) == (128, 512)
    assert (limits.max_reason_tokens, limits.max_reason_calls) == (256, 2)
    assert limits.max_text_bytes > 0 and limits.max_budget_ms > 0 and limits.max_rate_hz > limits.min_rate_hz > 0
    (capacity,) = info.capacity
    assert capacity.embodiment == "pusht" and capacity.budget_ms == info.default_budget_ms
    assert capacity.rate_hz == spec.control_hz / spec.default_chunk_size
    assert capacity.sessions_alone >= capacity.sessions_more >= 1


@pytest.mark.parametrize("chunk", range(1, 17))
def test_every_advertised_chunk_size_is_served(server, chunk):
    session = server.open_session("pusht", "reach the red circle", chunk_size=chunk)
    assert server.act(session, {"image": _image()}, STATE).actions.shape == (chunk, 2)
    server.close_session(session)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324])
def test_reasoner_at_a_vanishing_temperature_answers(server, temperature):
    assert list(server.reason("what is on the table?", max_new_tokens=4, temperature=temperature, seed=1)) == \
        list(server.reason("what is on the table?", max_new_tokens=4, seed=1))


def error_info_and_violations(error: grpc.RpcError):
    """The standard ErrorInfo and BadRequest field violations of a failed call (grpcio-status reads them)."""
    info, violations = error_details_pb2.ErrorInfo(), []
    for packed in rpc_status.from_call(error).details:
        if packed.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            packed.Unpack(info)
        elif packed.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            packed.Unpack(bad)
            violations += bad.field_violations
    return info, violations


def test_request_bytes_that_do_not_parse_are_invalid_argument_and_logged_in_one_line(server, server_log):
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(server.target) as channel:
        for method in ("OpenSession", "Act", "GetServerInfo", "SetBudget"):
            call = channel.unary_unary(f"/policy_server.v1.PolicyService/{method}")
            with pytest.raises(grpc.RpcError) as error:
                call(b"\xff\xff\xff\xff", metadata=metadata, timeout=30)
            assert error.value.code() == INVALID, method
            assert error.value.details().startswith("BAD_REQUEST: ")
            info, violations = error_info_and_violations(error.value)
            assert info.reason == "BAD_REQUEST" and info.domain == "policy_server.v1"
            assert [v.field for v in violations] == ["request"], method
    session = server.open_session("pusht", "reach the red circle")
    assert server.act(session, {"image": _image()}, STATE).actions.shape == (8, 2)
    server.close_session(session)
    log = server_log.read_text()
    assert log.count("undecodable policy_server.v1.") >= 4
    assert re.search(r"undecodable policy_server\.v1\.ActRequest request of 4 bytes from ipv4:127\.0\.0\.1:\d+: ", log)
    assert "Traceback" not in log and "Exception deserializing" not in log
    # Garbage in a loop: each answered, the log's line for its message type written once in 10 s (one more line
    # at most, should the loop start 10 s after the line above; a line each would be 20).
    lines = log.count("undecodable policy_server.v1.ActRequest")
    with grpc.insecure_channel(server.target) as channel:
        act = channel.unary_unary("/policy_server.v1.PolicyService/Act")
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as error:
                act(b"\xff\xff\xff\xff", metadata=metadata, timeout=30)
            assert error.value.code() == INVALID
    assert server_log.read_text().count("undecodable policy_server.v1.ActRequest") <= lines + 1


def test_ticks_asked_for_faster_than_declared_are_refused_with_a_retry_delay(server):
    session = server.open_session("pusht", "reach the red circle", rate_hz=0.2)
    for step in range(2):
        server.act(session, {"image": _image(step)}, STATE)
    with pytest.raises(PolicyServerError) as early:
        server.act(session, {"image": _image()}, STATE)
    assert (early.value.code, early.value.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_EXCEEDED")
    assert early.value.detail.retry_after_ms > 0
    # Refused before its frames are decoded: a corrupt JPEG is answered RATE_EXCEEDED too, not BAD_IMAGE.
    corrupt = build_observation({"image": _image()}, STATE)
    corrupt.images["image"].data = corrupt.images["image"].data[:40]
    act = pb.ActRequest(session_id=session.session_id, epoch=session.epoch, observation=corrupt)
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as undecoded:
        channel.unary_unary("/policy_server.v1.PolicyService/Act", request_serializer=pb.ActRequest.SerializeToString)(
            act, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30)
    assert undecoded.value.details().startswith("RATE_EXCEEDED: ")
    server.close_session(session)


def test_sessions_beyond_capacity_are_refused_with_the_capacity_figure(served, capsys):
    server, server_log, _ = served
    with pytest.raises(PolicyServerError) as infeasible:
        server.open_session("pusht", "reach the red circle", budget_ms=0.01)
    floor = infeasible.value.detail.best_achievable_ms

    def capacity(budget):
        return server.server_info(budget_ms=budget, rate_hz=0.0).capacity[0]

    # The best achievable latency is what one session gets on an idle server: the cheapest tick after the
    # longest background piece (a dynamics decode here) it may wait for.
    assert capacity(floor * 1.001).sessions_alone == 1
    # The smallest budget, in quarters of the best achievable latency, with room for two sessions.
    budget = next(b for b in (floor * k / 4 for k in range(5, 40)) if capacity(b).sessions_alone >= 2)
    fit = capacity(budget).sessions_alone
    assert capacity(budget).sessions_more == fit  # nothing is open
    capsys.readouterr()
    cli = ["info", "--server", server.target, "--auth-token-file", str(server_log.parent / "token")]
    assert client_main([*cli, "--budget-ms", str(budget), "--rate-hz", "0"]) == 0
    (printed,) = json.loads(capsys.readouterr().out)["capacity"]
    assert (printed["budgetMs"], printed["sessionsAlone"], printed["sessionsMore"]) == (budget, fit, fit)
    assert client_main([*cli, "--budget-ms", "-5"]) == 2
    assert "budget_ms: expected a latency budget in (0, 60000] ms" in capsys.readouterr().err
    longest_name = "a" * MAX_CLIENT_NAME_CHARS  # a client_name at its limit, which the refusal still names whole
    opened = [server.open_session("pusht", "reach the red circle", budget_ms=budget, rate_hz=0.0,
                                  client_name=longest_name) for _ in range(fit)]
    capsys.readouterr()
    assert client_main([*cli, "--budget-ms", str(budget), "--rate-hz", "0"]) == 0
    (printed,) = json.loads(capsys.readouterr().out)["capacity"]
    assert printed["sessionsMore"] == 0  # a zero is printed, not left out
    with pytest.raises(PolicyServerError) as refused:
        server.open_session("pusht", "reach the red circle", budget_ms=budget, rate_hz=0.0)
    assert (refused.value.code, refused.value.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED")
    assert f"no session like this one fits beside them, {fit} would on an idle server" in refused.value.detail.message
    assert refused.value.sessions_fit == fit and refused.value.detail.metadata["sessions_fit"] == str(fit)
    assert re.search(rf"the one longest without a call \(client '{longest_name}'\) has had none for \d+ s$",
                     refused.value.detail.message)
    for session in opened:
        assert server.act(session, {"image": _image()}, STATE).tick.deadline_met
        server.close_session(session)
    # Refused for its rate alone, the message names the cap the rates are held to: it said "would claim 90% of the
    # model" of rates that claimed 90.4%, as if 90% were over the limit, and named no limit.
    with pytest.raises(PolicyServerError) as refused:
        server.open_session("pusht", "reach the red circle", budget_ms=60_000, rate_hz=1000)
    assert re.search(r"the declared rates would claim \d+\.\d% of the model, of at most 90%; no session like this one "
                     r"fits beside them, 0 would on an idle server", refused.value.message), refused.value.message


@contextlib.contextmanager
def _ignored(*signals: int) -> Iterator[None]:
    """`signals` ignored here meanwhile, so that a process started inherits them ignored through its exec (without a
    `preexec_fn`: see conftest.py)."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _signal_thread(pid: int, sig: int, main: bool = False) -> None:
    """`sig` as the kernel may deliver a process's signal: to one of its threads other than the main one (``main``:
    to the main one, where Python runs the handler at once)."""
    import ctypes

    thread = pid if main else next(int(tid) for tid in sorted(os.listdir(f"/proc/{pid}/task")) if int(tid) != pid)
    assert ctypes.CDLL(None, use_errno=True).tgkill(pid, thread, sig) == 0


def test_sigterm_stops_the_server_promptly_whatever_it_is_doing(tmp_path):
    """A tick and a long reasoner call are running when SIGTERM comes, delivered to a thread other than the main
    one (which Python's handler waits for): the process still exits within the grace period plus one step, and
    both callers get an answer. The log says which sessions were open (it said nothing of them)."""
    import threading

    build_random_pipeline(tmp_path / "model", seed=4)
    log = open(tmp_path / "server.log", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "policy_server.cli", "--checkpoint", str(tmp_path / "model"), "--port", "0",
         "--latency-budget-ms", "20000", "--device", "cpu", "--quality-profile", "off"],  # no warmup calibration
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    client = PolicyClient(bound_listeners(tmp_path / "server.log", process, 120)["gRPC"], timeout_s=60)
    try:
        client.wait_until_serving(timeout_s=240)
        session = client.open_session("pusht", "reach the red circle", client_name="arm-7")
        answers = []

        def reason():
            try:
                answers.append(list(client.reason("why " * 200, max_new_tokens=256)))  # 400 of 512 tokens
            except PolicyServerError as error:
                answers.append(error.reason)

        thread = threading.Thread(target=reason)
        thread.start()
        time.sleep(0.5)
        _signal_thread(process.pid, signal.SIGTERM)  # it slept through this before: its main thread never woke
        started = time.monotonic()
        process.wait(timeout=30)
        took = time.monotonic() - started
        thread.join(timeout=30)
        assert process.returncode == 0
        assert took < 10, f"exit took {took:.1f} s"
        assert len(answers) == 1 and answers[0] != "TOO_LONG"  # answered (text or an error), not left hanging
        assert f"closed session {session.session_id} ('arm-7'): the server is shutting down" in (
            tmp_path / "server.log").read_text()
    finally:
        if process.poll() is None:
            process.kill()
        client.close()
        log.close()


def test_stop_signals_as_an_operator_sends_them(tmp_path):
    """`nohup policy-server`: SIGHUP was ignored from the start, so a closing terminal's SIGHUP leaves it serving (it
    shut down on it); SIGINT, which a shell's background jobs start ignoring, stops it all the same. Ctrl-C twice: the
    second ends the drain at once, as the default action does; it was Python's KeyboardInterrupt, which came only
    once the main thread woke from the drain, with a traceback. So is Ctrl-C while the server loads torch and the
    model (minutes for a large checkpoint)."""
    log = open(tmp_path / "server.log", "w+")
    with _ignored(signal.SIGHUP, signal.SIGINT):  # as nohup leaves it; and SIGINT, as a shell's background job
        loading = process = subprocess.Popen(
            [sys.executable, "-m", "policy_server.cli", "--port", "0", "--device", "cpu", "--no-compile-gen-stack"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    client = PolicyClient(bound_listeners(tmp_path / "server.log", process, 120)["gRPC"], timeout_s=30)
    try:
        client.wait_until_serving(timeout_s=120)
        process.send_signal(signal.SIGHUP)
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=1)
        assert client.health() == "SERVING"
        with grpc.insecure_channel(client.target) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            # Calls the drain waits for (up to its 2 s grace): two Reason calls, about 1 s of the model's time.
            calls = [client.reason("why " * 200, max_new_tokens=256) for _ in range(2)]
            assert all(next(call) for call in calls)
            _signal_thread(process.pid, signal.SIGINT, main=True)  # the drain begins at once
            assert health_pb2.HealthCheckResponse.NOT_SERVING in (update.status for update in watch)  # draining
            _signal_thread(process.pid, signal.SIGINT)
            assert process.wait(timeout=1) == -signal.SIGINT
        with _ignored(signal.SIGINT):
            loading = subprocess.Popen([sys.executable, "-m", "policy_server.cli", "--port", "0"], stdout=log,
                                       stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 60
        while (tmp_path / "server.log").read_text().count("the rest at their defaults") < 2:
            assert time.monotonic() < deadline, "the second server printed no settings line"
            time.sleep(0.05)  # its settings line: torch and the model load next
        loading.send_signal(signal.SIGINT)
        assert loading.wait(timeout=10) == -signal.SIGINT
        assert "Traceback" not in (tmp_path / "server.log").read_text()
    finally:
        for started in (process, loading):
            if started.poll() is None:
                started.kill()
        client.close()
        log.close()


def test_ctrl_c_ends_a_subcommand_at_once_without_a_traceback(tmp_path):
    # `policy-server bench` printed a KeyboardInterrupt traceback (once a C++ abort at teardown too).
    bench = subprocess.Popen([sys.executable, "-m", "policy_server.cli", "bench", "--out", str(tmp_path / "b.json")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(3.0)  # importing torch, or loading the model
        bench.send_signal(signal.SIGINT)
        output, _ = bench.communicate(timeout=10)
        assert bench.returncode == -signal.SIGINT and "Traceback" not in output
    finally:
        if bench.poll() is None:
            bench.kill()


def test_failed_tls_handshakes_are_not_logged_one_line_each(tmp_path):
    """Anyone who reaches a TLS port can fail its handshake in a loop (a plaintext client, a port scan): gRPC core
    would log a line on each, so the server keeps gRPC's own log to its errors."""
    from fake_engine import self_signed_cert

    cert, key = self_signed_cert(tmp_path)
    env = {name: value for name, value in os.environ.items() if name != "GRPC_VERBOSITY"}
    process = subprocess.Popen(
        [sys.executable, "-m", "policy_server.cli", "--port", "0", "--device", "cpu", "--no-compile-gen-stack",
         "--tls-cert", str(cert), "--tls-key", str(key)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"}, text=True,
    )
    try:
        for line in process.stdout:  # the ports are bound before the warmup begins
            if line.startswith("policy-server: gRPC on"):
                port = int(listeners_of(line)["gRPC"].rsplit(":", 1)[1])
                break
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
                connection.sendall(b"GET / HTTP/1.1\r\n\r\n")
                connection.recv(16)  # the server closes it at the failed handshake
        time.sleep(0.5)
    finally:
        process.terminate()
        rest = process.communicate(timeout=30)[0]
    assert "Handshake failed" not in rest, rest

