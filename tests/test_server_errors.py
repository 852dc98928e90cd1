"""Bad input, one kind at a time: each is answered with its precise gRPC status, machine-readable
reason and offending field, and the server then serves the next good request correctly."""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import cv2
import grpc
import numpy as np
import pytest
import websockets.sync.client
from fake_engine import LIBERO, PUSHT, FakeEngine, expected_actions, serve_fake
from openpi_client import msgpack_numpy

from policy_server.client import ControlStream, PolicyClient, PolicyServerError, Session, build_observation
from policy_server.engine.api import Observation
from policy_server.limits import MAX_FRAME_SIDE, MAX_TEXT_BYTES
from policy_server.server.errors import make_error
from policy_server.v1 import policy_server_pb2 as pb
from policy_server.v1.wire import encode_image, tensor_to_proto

MAX_MESSAGE_MB = 0.25
LIMIT = int(MAX_MESSAGE_MB * 1024 * 1024)
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def frame(height=48, width=64, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


STATE = np.array([0.25, -0.5], np.float32)


@pytest.fixture(scope="module")
def engine():
    return FakeEngine(max_sessions=8)


@pytest.fixture(scope="module")
def server(engine):
    with serve_fake(engine, max_message_mb=MAX_MESSAGE_MB, websocket_port=0) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with PolicyClient(server.target, timeout_s=10) as c:
        yield c


@pytest.fixture
def session(client):
    s = client.open_session("pusht", "push the T into the goal")
    yield s
    try:
        client.close_session(s)
    except PolicyServerError:
        pass


def good_request(session: Session, step: int = 3) -> pb.ActRequest:
    obs = build_observation({"image": frame()}, STATE, step_index=step, encoding="png")
    return pb.ActRequest(session_id=session.session_id, epoch=session.epoch, observation=obs)


def assert_still_serving(client: PolicyClient, session: Session) -> None:
    """The next good request is answered with the exact chunk for its observation."""
    chunk = client.act_request(good_request(session, step=7))
    expected = expected_actions(Observation({"image": frame()}, STATE, "", 7), session.chunk_size, PUSHT)
    np.testing.assert_array_equal(chunk.actions, expected)
    assert chunk.first_step_index == 7


def with_image(session: Session, image: pb.Image, name: str = "image") -> pb.ActRequest:
    request = good_request(session)
    request.observation.images[name].CopyFrom(image)
    return request


def with_state(session: Session, state: pb.Tensor | None) -> pb.ActRequest:
    request = good_request(session)
    request.observation.ClearField("state")
    if state is not None:
        request.observation.state.CopyFrom(state)
    return request


def without_images(session: Session) -> pb.ActRequest:
    request = good_request(session)
    request.observation.images.clear()
    return request


def png_bytes(image: np.ndarray) -> bytes:
    return cv2.imencode(".png", image)[1].tobytes()


@dataclass
class Case:
    name: str
    call: Callable[[PolicyClient, Session], object]
    code: grpc.StatusCode
    reason: str
    field: str


def act(request_builder):
    return lambda client, session: client.act_request(request_builder(session))


def stale_epoch(client: PolicyClient, session: Session):
    client.reset_session(session)  # epoch 1 -> 2; the request still says 1
    return client.act_request(good_request(session))


def oversized(factor: float):
    def build(session):
        request = good_request(session)
        request.observation.instruction = "x" * int(LIMIT * factor)
        return request

    return act(build)


def open_session(**fields):
    def call(client, session):
        return client.open_session(**{"embodiment": "pusht", "instruction": "push", **fields})

    return call


def reason_raw(**fields):
    def call(client, session):
        return list(client.reason(**{"prompt": "plan", "max_new_tokens": 4, **fields}))

    return call


def image_case(name: str, image: pb.Image, reason: str, field: str = "observation.images[image]",
               camera: str = "image") -> Case:
    return Case(name, act(lambda s: with_image(s, image, camera)), INVALID, reason, field)


JPEG, PNG, RAW = pb.IMAGE_ENCODING_JPEG, pb.IMAGE_ENCODING_PNG, pb.IMAGE_ENCODING_RAW
GOOD_JPEG = encode_image(frame(), "jpeg").data

CASES = [
    # images
    image_case("bad_jpeg", pb.Image(encoding=JPEG, data=b"\xff\xd8\xffgarbage"), "IMAGE_DECODE_FAILED"),
    image_case("truncated_jpeg", pb.Image(encoding=JPEG, data=GOOD_JPEG[:600]), "IMAGE_DECODE_FAILED"),
    image_case("png_bytes_labelled_jpeg", pb.Image(encoding=JPEG, data=png_bytes(frame())), "IMAGE_DECODE_FAILED"),
    image_case("frame_wider_than_the_side_limit", encode_image(frame(1, MAX_FRAME_SIDE + 1), "png"),
               "SCHEMA_MISMATCH"),
    image_case("raw_frame_taller_than_the_side_limit",
               pb.Image(encoding=RAW, height=MAX_FRAME_SIDE + 1, width=1, channels=3,
                        data=bytes(3 * (MAX_FRAME_SIDE + 1))),
               "SCHEMA_MISMATCH"),
    image_case("raw_frame_of_zero_width", pb.Image(encoding=RAW, height=48, width=0, channels=3, data=b""),
               "MISSING_FIELD"),
    image_case("grayscale_png", pb.Image(encoding=PNG, data=png_bytes(frame()[..., 0])), "SCHEMA_MISMATCH"),
    image_case("rgba_raw", pb.Image(encoding=RAW, height=48, width=64, channels=4, data=bytes(48 * 64 * 4)),
               "SCHEMA_MISMATCH"),
    image_case("raw_length_mismatch", pb.Image(encoding=RAW, height=48, width=64, channels=3, data=bytes(100)),
               "BAD_IMAGE", "observation.images[image].data"),
    image_case("raw_without_shape", pb.Image(encoding=RAW, data=bytes(48 * 64 * 3)), "MISSING_FIELD"),
    image_case("jpeg_declared_grey", pb.Image(encoding=JPEG, channels=1, data=GOOD_JPEG), "BAD_IMAGE",
               "observation.images[image].channels"),
    image_case("unknown_encoding", pb.Image(encoding=17, data=b"x"), "UNKNOWN_ENCODING",
               "observation.images[image].encoding"),
    image_case("unspecified_encoding", pb.Image(data=png_bytes(frame())), "UNKNOWN_ENCODING",
               "observation.images[image].encoding"),
    image_case("unknown_camera", encode_image(frame(), "png"), "SCHEMA_MISMATCH", "observation.images",
               camera="wrist"),
    Case("missing_camera", act(without_images), INVALID, "SCHEMA_MISMATCH", "observation.images[image]"),
    # state
    Case("nan_state", act(lambda s: with_state(s, tensor_to_proto(np.array([0.1, np.nan], np.float32)))),
         INVALID, "NON_FINITE", "observation.state"),
    Case("inf_state", act(lambda s: with_state(s, tensor_to_proto(np.array([np.inf, 0.0], np.float64)))),
         INVALID, "NON_FINITE", "observation.state"),
    Case("wrong_state_dim", act(lambda s: with_state(s, tensor_to_proto(np.zeros(5, np.float32)))),
         INVALID, "SCHEMA_MISMATCH", "observation.state"),
    Case("missing_state", act(lambda s: with_state(s, None)),
         INVALID, "SCHEMA_MISMATCH", "observation.state"),
    Case("empty_state", act(lambda s: with_state(s, pb.Tensor())),  # what other languages send for "unset"
         INVALID, "SCHEMA_MISMATCH", "observation.state"),
    Case("unspecified_dtype", act(lambda s: with_state(s, pb.Tensor(shape=[2], data=bytes(8)))),
         INVALID, "BAD_DTYPE", "observation.state.dtype"),
    Case("integer_state", act(lambda s: with_state(s, tensor_to_proto(np.array([1, 2], np.int32)))),
         INVALID, "BAD_DTYPE", "observation.state.dtype"),
    Case("shape_data_mismatch", act(lambda s: with_state(s, pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2],
                                                                         data=bytes(12)))),
         INVALID, "BAD_TENSOR", "observation.state.data"),
    Case("negative_dimension", act(lambda s: with_state(s, pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-2],
                                                                        data=bytes(8)))),
         INVALID, "BAD_TENSOR", "observation.state.shape"),
    # request envelope and session state
    Case("missing_observation", act(lambda s: pb.ActRequest(session_id=s.session_id, epoch=s.epoch)),
         INVALID, "MISSING_FIELD", "observation"),
    Case("missing_session_id", act(lambda s: pb.ActRequest(epoch=1, observation=good_request(s).observation)),
         INVALID, "MISSING_FIELD", "session_id"),
    Case("missing_epoch", act(lambda s: pb.ActRequest(session_id=s.session_id,
                                                     observation=good_request(s).observation)),
         INVALID, "MISSING_FIELD", "epoch"),
    Case("unknown_session", act(lambda s: pb.ActRequest(session_id="no-such-session", epoch=1,
                                                       observation=good_request(s).observation)),
         grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND", ""),
    Case("stale_epoch", stale_epoch, grpc.StatusCode.FAILED_PRECONDITION, "STALE_EPOCH", ""),
    Case("oversized_message", oversized(1.2), grpc.StatusCode.RESOURCE_EXHAUSTED, "PAYLOAD_TOO_LARGE", "request"),
    Case("far_oversized_message", oversized(2.5), grpc.StatusCode.RESOURCE_EXHAUSTED, "PAYLOAD_TOO_LARGE", ""),
    # sessions and budgets
    Case("unknown_embodiment", open_session(embodiment="hexapod"), INVALID, "UNKNOWN_EMBODIMENT", "embodiment"),
    Case("missing_embodiment", open_session(embodiment=""), INVALID, "MISSING_FIELD", "embodiment"),
    Case("empty_instruction", open_session(instruction="   "), INVALID, "MISSING_FIELD", "instruction"),
    Case("negative_budget", open_session(budget_ms=-5.0), INVALID, "BAD_VALUE", "budget_ms"),
    Case("nan_budget", open_session(budget_ms=math.nan), INVALID, "BAD_VALUE", "budget_ms"),
    Case("chunk_size_out_of_range", open_session(chunk_size=99), INVALID, "BAD_VALUE", "chunk_size"),
    Case("client_name_too_long", open_session(client_name="a" * 129), INVALID, "TOO_LONG", "client_name"),
    Case("client_name_forging_a_log_line", open_session(client_name="arm\nERROR x"), INVALID, "BAD_VALUE",
         "client_name"),
    Case("request_id_too_long", open_session(request_id="a" * 65), INVALID, "TOO_LONG", "request_id"),
    Case("request_id_with_a_space", open_session(request_id="retry of opening 1"), INVALID, "BAD_VALUE", "request_id"),
    Case("request_id_guessable", open_session(request_id="retry-1"), INVALID, "BAD_VALUE", "request_id"),
    Case("infeasible_budget_at_open", open_session(budget_ms=1.0), grpc.StatusCode.FAILED_PRECONDITION,
         "BUDGET_INFEASIBLE", ""),
    Case("infeasible_budget_update", lambda c, s: c.set_budget(s, 2.0), grpc.StatusCode.FAILED_PRECONDITION,
         "BUDGET_INFEASIBLE", ""),
    Case("zero_budget_update", lambda c, s: c.set_budget(s, 0.0), INVALID, "BAD_VALUE", "budget_ms"),
    Case("reset_unknown_session", lambda c, s: c.reset_session("nope"), grpc.StatusCode.NOT_FOUND,
         "SESSION_NOT_FOUND", ""),
    Case("close_unknown_session", lambda c, s: c.close_session("nope"), grpc.StatusCode.NOT_FOUND,
         "SESSION_NOT_FOUND", ""),
    # reasoner
    Case("empty_prompt", reason_raw(prompt=""), INVALID, "MISSING_FIELD", "prompt"),
    Case("zero_new_tokens", reason_raw(max_new_tokens=0), INVALID, "BAD_VALUE", "max_new_tokens"),
    Case("too_many_new_tokens", reason_raw(max_new_tokens=10_000), INVALID, "BAD_VALUE", "max_new_tokens"),
    Case("negative_temperature", reason_raw(temperature=-1.0), INVALID, "BAD_VALUE", "temperature"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_precise_status_and_server_keeps_serving(case, client, session):
    with pytest.raises(PolicyServerError) as err:
        case.call(client, session)
    assert err.value.code == case.code, err.value
    assert err.value.reason == case.reason, err.value
    assert err.value.field == case.field, err.value
    if case.reason != "PAYLOAD_TOO_LARGE" or case.field:  # the servicer wrote the message itself
        assert err.value.message
    current = client.reset_session(session) if case.reason == "STALE_EPOCH" else session
    assert_still_serving(client, current)


def test_a_message_grpc_cuts_names_its_size_and_the_servers_limit(client, session):
    """Over twice the limit gRPC refuses the request before the server reads it; its message named gRPC's cut,
    "SERVER: Received message larger than max (660061 vs. 524288)", as if that were the limit to keep to."""
    request = oversized(2.5)
    with pytest.raises(PolicyServerError) as err:
        request(client, session)
    said = re.fullmatch(rf"request of (\d+) bytes refused by gRPC before the server read it \(its transport takes "
                        rf"at most {2 * LIMIT}\); expected at most the server's message limit, "
                        r"ServerInfo.limits.max_message_bytes", err.value.message)
    assert said and int(said[1]) > int(LIMIT * 2.5), err.value.message
    assert_still_serving(client, session)


def test_error_details_carry_expected_and_got(client, session):
    with pytest.raises(PolicyServerError) as err:
        client.act_request(with_state(session, tensor_to_proto(np.zeros(5, np.float32))))
    assert err.value.detail.expected == "shape [2]" and err.value.detail.got == "shape [5]"
    assert err.value.detail.code == "INVALID_ARGUMENT"
    with pytest.raises(PolicyServerError) as err:  # the dtypes a state may have, not every dtype a Tensor may
        client.act_request(with_state(session, tensor_to_proto(np.zeros(2, np.float16))))
    assert (err.value.detail.expected, err.value.detail.got) == ("DTYPE_FLOAT32 or DTYPE_FLOAT64", "DTYPE_FLOAT16")


def test_an_error_with_every_text_at_its_clip_fits_grpcs_metadata_limit():
    """gRPC refuses trailing metadata over 8 KiB (HPACK's size: name, value and 32 bytes an entry; a -bin value as
    its base64); an error whose texts were clipped must still reach the client."""
    error = make_error("SCHEMA_MISMATCH", "m" * 5000, field="f" * 5000, expected="e" * 5000, got="g" * 5000,
                       retry_after_ms=5.0)
    assert len(error.detail.message) > len(error.detail.got)  # the message keeps more: the server writes it
    size = sum(len(key) + len(base64.b64encode(value) if key.endswith("-bin") else value) + 32
               for key, value in error.status().trailing_metadata)
    assert size < 8192


def test_a_blank_text_is_named_blank_not_unset(client):
    with pytest.raises(PolicyServerError) as blank:
        list(client.reason(" \n ", max_new_tokens=4))
    assert (blank.value.reason, blank.value.field, blank.value.detail.got) == ("MISSING_FIELD", "prompt",
                                                                               "only whitespace (3 characters)")


def test_budget_infeasible_reports_best_achievable_latency(client, session):
    with pytest.raises(PolicyServerError) as err:
        client.set_budget(session, 2.0)
    assert err.value.best_achievable_ms == pytest.approx(5.0)
    assert client.set_budget(session, 50.0).budget_ms == 50.0


def test_stale_epoch_names_both_epochs(client, session):
    client.reset_session(session)
    with pytest.raises(PolicyServerError) as err:
        client.act_request(good_request(session))
    assert err.value.detail.expected == "2" and err.value.detail.got == "1"


def test_too_many_sessions_is_resource_exhausted(client, engine):
    opened = []
    try:
        while len(opened) < engine.info().max_sessions:
            try:
                opened.append(client.open_session("pusht", "fill"))
            except PolicyServerError as exc:
                assert exc.reason == "TOO_MANY_SESSIONS"
                break
        with pytest.raises(PolicyServerError) as err:
            client.open_session("pusht", "one too many")
        assert (err.value.code, err.value.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_SESSIONS")
    finally:
        for s in opened:
            client.close_session(s)
    assert client.open_session("pusht", "room again").epoch == 1


def test_multi_camera_embodiment_accepts_all_encodings(client):
    session = client.open_session("libero", "put the bowl on the plate")
    images = {"image": frame(32, 32, seed=1), "wrist": frame(32, 40, seed=2)}
    state = np.linspace(-1, 1, 8).astype(np.float32)
    for encoding in ("png", "raw"):
        chunk = client.act(session, images, state, step_index=11, encoding=encoding)
        expected = expected_actions(Observation(images, state, "", 11), 16, LIBERO)
        np.testing.assert_array_equal(chunk.actions, expected)
    chunk = client.act(session, images, state, step_index=11, encoding="jpeg", jpeg_quality=95)
    assert chunk.actions.shape == (16, 7)
    client.close_session(session)


def test_frames_of_any_size_within_the_limit_are_accepted_as_sent(client, session):
    for height, width in ((1, 1), (48, 64), (17, 301), (MAX_FRAME_SIDE, 2)):
        image = frame(height, width, seed=height)
        chunk = client.act(session, {"image": image}, STATE, step_index=2, encoding="png")
        np.testing.assert_array_equal(chunk.actions, expected_actions(Observation({"image": image}, STATE, "", 2),
                                                                      session.chunk_size, PUSHT))


def test_cameras_of_different_heights_pass_as_sent_unless_too_wide_beside_the_tallest(client):
    session = client.open_session("libero", "put the bowl on the plate")
    images = {"image": frame(48, 64, seed=1), "wrist": frame(24, 24, seed=2)}  # let through to the engine as sent
    chunk = client.act(session, images, np.zeros(8, np.float32), step_index=3, encoding="png")
    np.testing.assert_array_equal(chunk.actions, expected_actions(Observation(images, np.zeros(8, np.float32), "", 3),
                                                                  16, LIBERO))
    # 16 px wide at 8 px high is 4096 px wide at the scene camera's 2048: twice what a camera may send.
    images = {"image": frame(MAX_FRAME_SIDE, 8, seed=1), "wrist": frame(8, 16, seed=2)}
    with pytest.raises(PolicyServerError) as err:
        client.act(session, images, np.zeros(8, np.float32), encoding="png")
    assert (err.value.code, err.value.reason, err.value.field) == (INVALID, "SCHEMA_MISMATCH",
                                                                   "observation.images[wrist]")
    assert err.value.detail.expected == (f"a frame at most {MAX_FRAME_SIDE} px wide once scaled to the height of "
                                         f"camera 'image' ({MAX_FRAME_SIDE} px, aspect kept), which the model sees "
                                         "it beside")
    assert err.value.detail.got == "8x16 px, 4096 px wide at that height"
    client.close_session(session)


def test_metrics_count_errors_by_reason(server, client, session):
    before = server.metrics.errors.labels("NON_FINITE")._value.get()
    with pytest.raises(PolicyServerError):
        client.act_request(with_state(session, tensor_to_proto(np.array([np.nan, 0], np.float32))))
    assert server.metrics.errors.labels("NON_FINITE")._value.get() == before + 1


@dataclass
class BadObservation:
    name: str
    embodiment: str
    images: dict[str, np.ndarray]
    state: np.ndarray
    reason: str
    same_detail: bool = True  # expected / got read alike on every wire (False: each wire decodes frames its own way)
    instruction: str = "push"


BAD_OBSERVATIONS = [
    BadObservation("wrong_state_width", "pusht", {"image": frame()}, np.zeros(5, np.float32), "SCHEMA_MISMATCH"),
    BadObservation("nan_state", "pusht", {"image": frame()}, np.array([0.1, np.nan], np.float32), "NON_FINITE"),
    BadObservation("state_float32_cannot_hold", "pusht", {"image": frame()}, np.array([1e300, 0.0]), "OUT_OF_RANGE"),
    BadObservation("frame_wider_than_the_side_limit", "pusht", {"image": frame(1, MAX_FRAME_SIDE + 1)}, STATE,
                   "SCHEMA_MISMATCH", same_detail=False),
    BadObservation("camera_too_wide_beside_the_tallest", "libero",
                   {"image": frame(MAX_FRAME_SIDE, 8), "wrist": frame(8, 16)}, np.zeros(8, np.float32),
                   "SCHEMA_MISMATCH"),
    BadObservation("instruction_too_long", "pusht", {"image": frame()}, STATE, "TOO_LONG",
                   instruction="x" * (MAX_TEXT_BYTES + 1)),
]


@pytest.mark.parametrize("bad", BAD_OBSERVATIONS, ids=[b.name for b in BAD_OBSERVATIONS])
def test_act_control_and_websocket_refuse_a_bad_observation_alike(bad, server, client):
    session = client.open_session(bad.embodiment, "push")
    with pytest.raises(PolicyServerError) as err:
        client.act(session, bad.images, bad.state, instruction=bad.instruction, encoding="png")
    act = err.value
    with ControlStream(client, session) as stream:
        obs_id = stream.send(bad.images, bad.state, instruction=bad.instruction, encoding="png")
        event = stream.next_event()
    client.close_session(session)
    assert (event.kind, event.obs_id) == ("error", obs_id)
    streamed = event.error
    with websockets.sync.client.connect(f"ws://127.0.0.1:{server.websocket_port}?embodiment={bad.embodiment}",
                                        compression=None) as ws:
        ws.recv()  # the metadata frame
        images = {f"observation/{name}": image for name, image in bad.images.items()}
        ws.send(msgpack_numpy.packb({**images, "observation/state": bad.state, "prompt": bad.instruction}))
        websocket_error = ws.recv()

    assert act.code == streamed.code == INVALID
    assert act.reason == streamed.reason == bad.reason and websocket_error.startswith(f"{bad.reason}: ")
    assert streamed.field == f"observation.{act.field}"  # a Control frame nests the same Observation
    if bad.same_detail:
        assert (streamed.detail.expected, streamed.detail.got) == (act.detail.expected, act.detail.got)
        assert websocket_error.endswith(f": expected {act.detail.expected}, got {act.detail.got}")
