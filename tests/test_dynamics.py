"""Forward / inverse dynamics, preview frames and camera-native frame sizes, through the real engine (an untrained
embedded-size pipeline) and the real gRPC server around it, driven with the client library."""

from __future__ import annotations

import json
import queue
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
from worker_hold import hold_worker

from policy_server.client import ControlStream, PolicyClient, PolicyServerError, build_observation
from policy_server.config import build_config
from policy_server.engine import api
from policy_server.engine.engine import EngineSettings, ModelEngine
from policy_server.engine.served import GRID_SAMPLES
from policy_server.limits import MAX_DYNAMICS_MS, MAX_FRAME_SIDE, MAX_STARTING_STREAMS
from policy_server.pipeline import policy
from policy_server.pipeline.conditioning import resize, side_by_side
from policy_server.pipeline.policy import PolicyPipeline, PolicyRequest
from policy_server.server import convert, validate
from policy_server.server.app import build_server
from policy_server.server.convert import FRAME_JPEG_QUALITY
from policy_server.v1 import policy_server_pb2 as pb
from policy_server.v1.wire import decode_image, encode_image, tensor_to_proto
from robots.bench import BenchPipeline
from robots.embedded import build_random_pipeline

INSTRUCTION = "reach the red circle"
STATE = np.array([0.2, 0.3], np.float32)
ACTIONS = np.linspace(-0.15, 0.15, 16, dtype=np.float32).reshape(8, 2)  # the session's chunk of 8, m/s
INVALID = grpc.StatusCode.INVALID_ARGUMENT
TWO_CAMERA_ARM = {"name": "two_camera_arm", "domain_id": 30, "raw_action_dim": 2, "state_dim": 2,
                  "cameras": ["scene", "wrist"], "default_chunk_size": 8, "max_chunk_size": 8}


def _as_sent(frames):
    """Frames after the wire's JPEG and the client's decode: what the answer must hold exactly."""
    return np.stack([decode_image(encode_image(frame, "jpeg", FRAME_JPEG_QUALITY), "frame") for frame in frames])


def _frame(seed=0, height=64, width=64):
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _video(seed=0, frames=9, height=64, width=64):
    return np.stack([_frame(seed + i, height, width) for i in range(frames)])


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """Serves pusht and a two-camera arm (a scene and a wrist camera)."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("dynamics-model")
    build_random_pipeline(folder, seed=1)
    served = json.loads((folder / "embodiments.json").read_text())["embodiments"]
    (folder / "embodiments.json").write_text(json.dumps({"embodiments": [*served, TWO_CAMERA_ARM]}))
    pipeline = BenchPipeline.over(PolicyPipeline.from_pretrained(folder))
    engine = ModelEngine(pipeline, EngineSettings(warmup_ticks=1, max_sessions=4, default_budget_ms=10_000.0,
                                                   max_dynamics_calls=2))
    engine.start()
    assert engine.wait_ready(timeout_s=300)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(engine):
    config = build_config(overrides={"host": "127.0.0.1", "port": 0, "device": "cpu", "max_sessions": 4,
                                     "latency_budget_ms": 10_000.0})
    server = build_server(config, engine).start()
    with PolicyClient(server.target, timeout_s=60) as c:
        yield c
    server.stop(grace_s=0.5)


@pytest.fixture
def session(client):
    opened = client.open_session("pusht", INSTRUCTION, seed=5, rate_hz=0)
    yield opened
    client.close_session(opened)


def _reference(engine, **fields):
    """What `PolicyPipeline` answers for the session's settings (chunk 8, seed 5, its instruction)."""
    request = dict(images={}, instruction=INSTRUCTION, embodiment="pusht", state=STATE, chunk_size=8, seed=5)
    return engine.served.pipeline(PolicyRequest(**{**request, **fields}))


# ---------------------------------------------------------------------------------------------- inverse dynamics


def test_inverse_dynamics_rpc_returns_what_the_pipeline_returns(engine, client, session):
    video = _video(3)
    chunk = client.inverse_dynamics(session, {"image": video}, STATE, step_index=7, encoding="png")
    reference = _reference(engine, mode="inverse_dynamics", video={"image": video})
    np.testing.assert_array_equal(chunk.actions, engine.served.pipeline.embodiments.get("pusht").clip_to_limits(
        reference.actions))
    assert chunk.actions.shape == (8, 2) and chunk.first_step_index == 7 and chunk.epoch == session.epoch
    steps = engine.served.pipeline.config.num_steps
    assert chunk.tick.setting == "none" and chunk.tick.skipped_calls == 0  # uncached, all steps
    assert chunk.tick.branches["cond"].sequence == "F" * steps and chunk.tick.knobs["num_steps"] == steps
    assert {"prepare", "queue", "prefill", "encode", "denoise", "decode", "total"} <= set(chunk.tick.actual_ms)
    assert chunk.tick.budget_ms == MAX_DYNAMICS_MS and chunk.tick.deadline_ms <= 60_000.0
    seeded = client.inverse_dynamics(session, {"image": video}, STATE, seed=11, encoding="png")
    np.testing.assert_array_equal(seeded.actions, engine.served.pipeline.embodiments.get("pusht").clip_to_limits(
        _reference(engine, mode="inverse_dynamics", video={"image": video}, seed=11).actions))


def test_inverse_dynamics_takes_frames_of_the_camera_s_own_size(engine, client, session):
    video = _video(4, height=48, width=80)
    chunk = client.inverse_dynamics(session, {"image": video}, STATE, instruction="reach the blue circle",
                                    encoding="raw")
    reference = _reference(engine, mode="inverse_dynamics", video={"image": video}, instruction="reach the blue circle")
    np.testing.assert_array_equal(chunk.actions, engine.served.pipeline.embodiments.get("pusht").clip_to_limits(
        reference.actions))
    assert client.reset_session(session).instruction == INSTRUCTION  # the call's instruction was for it only


def test_inverse_dynamics_refuses_a_chunk_whose_last_frames_the_vae_would_not_see(client):
    # A chunk of 5 took 6 frames and explained them from the first 5 (the VAE takes frame 0 and groups of 4).
    session = client.open_session("pusht", INSTRUCTION, chunk_size=5, rate_hz=0)
    corrupt = encode_image(_frame(), "png")
    corrupt.data = corrupt.data[:40]
    undecodable = pb.InverseDynamicsRequest(session_id=session.session_id, epoch=session.epoch,
                                            videos={"image": pb.Video(frames=[corrupt] * 6)})
    try:
        with pytest.raises(PolicyServerError) as refused:
            client.inverse_dynamics(session, {"image": _video(frames=6)}, STATE)
        assert (refused.value.code, refused.value.reason, refused.value.field) == (INVALID, "BAD_VALUE",
                                                                                   "session.chunk_size")
        assert refused.value.detail.expected == "a session whose chunk is a multiple of 4, so that the model sees " \
                                                "every frame"
        assert refused.value.detail.got == "chunks of 5: the model would see 5 of the 6 frames"
        # Before its frames are decoded or counted: a clip of another length, or frames that do not decode, get the
        # same answer, not an error whose fix the session would then refuse.
        with pytest.raises(PolicyServerError) as miscounted:
            client.inverse_dynamics(session, {"image": _video(frames=9)}, STATE)
        with pytest.raises(grpc.RpcError) as undecoded:
            client.stub.InverseDynamics(undecodable, timeout=60)
        for error in (miscounted.value, PolicyServerError.from_rpc_error(undecoded.value)):
            assert (error.code, error.reason, error.field) == (INVALID, "BAD_VALUE", "session.chunk_size")
    finally:
        client.close_session(session)


# ---------------------------------------------------------------------------------------------- forward dynamics


def test_forward_dynamics_frames_are_the_pipeline_s_decoded_frames(engine, client, session):
    image = _frame(1)
    observation = api.Observation({"image": image}, STATE)
    exact = engine.forward_dynamics(session.session_id, session.epoch, observation, ACTIONS)
    reference = _reference(engine, images={"image": image}, mode="forward_dynamics", actions=ACTIONS)
    expected = engine.served.pipeline.decode_video(reference.latents)
    np.testing.assert_array_equal(exact.frames, expected)
    assert exact.latents_shape == tuple(reference.latents.shape)
    assert exact.tick.actual_ms["video_decode"] > 0

    predicted = client.forward_dynamics(session, {"image": image}, ACTIONS, STATE, step_index=3, encoding="png")
    assert predicted.frames.shape == expected.shape == (9, 64, 64, 3)  # chunk + 1 frames
    np.testing.assert_array_equal(predicted.frames, _as_sent(expected))  # the pipeline's frames, JPEG-encoded
    assert predicted.latents_shape == exact.latents_shape and predicted.obs_step_index == 3
    assert predicted.served_ms < predicted.round_trip_ms < 60_000  # the observation's client_time_ns, echoed
    assert {"prepare", "queue", "prefill", "encode", "denoise", "decode", "video_decode", "total"} \
        <= set(predicted.tick.actual_ms)
    assert predicted.tick.setting == "none" and predicted.tick.skipped_calls == 0


def test_forward_dynamics_takes_the_servers_own_chunk_at_its_limits(client, session):
    image = _frame(3)
    chunk = client.act(session, {"image": image}, STATE)
    at_limits = np.clip(ACTIONS * 4, -0.2, 0.2).astype(np.float32)  # as the server clips its chunks
    for actions in (chunk.actions, at_limits):
        assert client.forward_dynamics(session, {"image": image}, actions, STATE).frames.shape == (9, 64, 64, 3)


def test_forward_dynamics_accepts_float64_actions_and_checks_them_at_the_boundary(engine, client, session):
    image = _frame(2)
    wide = client.forward_dynamics(session, {"image": image}, ACTIONS.astype(np.float64), STATE, encoding="png")
    narrow = client.forward_dynamics(session, {"image": image}, ACTIONS, STATE, encoding="png")
    np.testing.assert_array_equal(wide.frames, narrow.frames)


# ---------------------------------------------------------------------------------------------- bad input


def _fd(session, actions=ACTIONS, image=None, state=STATE, **fields):
    observation = build_observation({"image": _frame()}, state, encoding="png")
    if image is not None:
        observation.images["image"].CopyFrom(image)
    request = pb.ForwardDynamicsRequest(session_id=session.session_id, epoch=session.epoch, observation=observation,
                                        **fields)
    if actions is not None:
        request.actions.CopyFrom(actions if isinstance(actions, pb.Tensor) else tensor_to_proto(actions))
    return request


def _id(session, frames=9, size=(64, 64), sizes=None, camera="image", state=STATE):
    request = pb.InverseDynamicsRequest(session_id=session.session_id, epoch=session.epoch,
                                        state=tensor_to_proto(state))
    for i in range(frames):
        height, width = sizes[i] if sizes else size
        request.videos[camera].frames.append(encode_image(_frame(i, height, width), "png"))
    return request


def _call_fd(request_of):
    return lambda client, session: client.stub.ForwardDynamics(request_of(session), timeout=60)


def _call_id(request_of):
    return lambda client, session: client.stub.InverseDynamics(request_of(session), timeout=60)


def _stale(client, session):
    client.reset_session(session)
    return client.stub.ForwardDynamics(_fd(session), timeout=60)


BAD = {
    "fd_actions_of_the_wrong_shape": (_call_fd(lambda s: _fd(s, ACTIONS[:5])), INVALID, "SCHEMA_MISMATCH", "actions"),
    "fd_actions_nan": (_call_fd(lambda s: _fd(s, np.where(ACTIONS > 0.1, np.nan, ACTIONS))), INVALID, "NON_FINITE",
                       "actions"),
    "fd_actions_beyond_the_limits": (_call_fd(lambda s: _fd(s, ACTIONS * 2)), INVALID, "OUT_OF_RANGE", "actions"),
    "fd_integer_actions": (_call_fd(lambda s: _fd(s, ACTIONS.astype(np.int32))), INVALID, "BAD_DTYPE",
                           "actions.dtype"),
    "fd_actions_bytes_short": (_call_fd(lambda s: _fd(s, pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[8, 2],
                                                                   data=bytes(8)))),
                               INVALID, "BAD_TENSOR", "actions.data"),
    "fd_without_actions": (_call_fd(lambda s: _fd(s, None)), INVALID, "MISSING_FIELD", "actions"),
    "fd_without_observation": (_call_fd(lambda s: pb.ForwardDynamicsRequest(session_id=s.session_id, epoch=s.epoch)),
                               INVALID, "MISSING_FIELD", "observation"),
    "fd_frame_below_the_smallest_side": (_call_fd(lambda s: _fd(s, image=encode_image(_frame(0, 4, 64), "png"))),
                                         INVALID, "SCHEMA_MISMATCH", "observation.images[image]"),
    "fd_frame_beyond_the_longest_side": (_call_fd(lambda s: _fd(s, image=encode_image(
        _frame(0, 8, MAX_FRAME_SIDE + 1), "jpeg"))), INVALID, "SCHEMA_MISMATCH", "observation.images[image]"),
    "fd_rgba_frame": (_call_fd(lambda s: _fd(s, image=pb.Image(encoding=pb.IMAGE_ENCODING_RAW, height=8, width=8,
                                                              channels=4, data=bytes(256)))),
                      INVALID, "SCHEMA_MISMATCH", "observation.images[image]"),
    "id_unknown_session": (_call_id(lambda s: pb.InverseDynamicsRequest(session_id="nope", epoch=1)),
                           grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND", ""),
    "fd_stale_epoch": (_stale, grpc.StatusCode.FAILED_PRECONDITION, "STALE_EPOCH", ""),
    "id_one_frame_too_few": (_call_id(lambda s: _id(s, frames=8)), INVALID, "SCHEMA_MISMATCH", "videos[image].frames"),
    "id_frames_of_two_sizes": (_call_id(lambda s: _id(s, sizes=[(64, 64)] * 3 + [(64, 48)] * 6)), INVALID,
                               "SCHEMA_MISMATCH", "videos[image].frames[3]"),
    "id_unknown_camera": (_call_id(lambda s: _id(s, camera="wrist")), INVALID, "SCHEMA_MISMATCH", "videos"),
    "id_state_off_the_table": (_call_id(lambda s: _id(s, state=np.array([0.9, 0.1], np.float32))), INVALID,
                               "OUT_OF_RANGE", "state"),
    "id_frame_below_the_smallest_side": (_call_id(lambda s: _id(s, size=(64, 7))), INVALID, "SCHEMA_MISMATCH",
                                         "videos[image].frames[0]"),
    "id_instruction_over_the_token_limit": (_call_id(lambda s: pb.InverseDynamicsRequest(
        **{**{f.name: v for f, v in _id(s).ListFields()}, "instruction": "reach the red circle " * 40})),
        INVALID, "TOO_LONG", "instruction"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_dynamics_input_gets_its_precise_status_and_the_next_call_is_served(client, session, name):
    call, code, reason, field = BAD[name]
    with pytest.raises(grpc.RpcError) as raised:
        call(client, session)
    error = PolicyServerError.from_rpc_error(raised.value)
    assert (error.code, error.reason, error.field) == (code, reason, field), error
    current = client.reset_session(session) if reason == "STALE_EPOCH" else session
    assert client.inverse_dynamics(current, {"image": _video()}, STATE).actions.shape == (8, 2)


def test_frame_bounds_are_named_in_the_error_and_published_in_server_info(client, session):
    with pytest.raises(grpc.RpcError) as raised:
        client.stub.ForwardDynamics(_fd(session, image=encode_image(_frame(0, 4, 64), "png")), timeout=60)
    detail = PolicyServerError.from_rpc_error(raised.value).detail
    assert (detail.expected, detail.got) == (f"uint8 [H, W, 3] with H and W in 8..{MAX_FRAME_SIDE}", "PNG [4, 64, ...]")
    info = client.server_info()
    (camera,) = info.embodiments[0].cameras
    assert (camera.height, camera.width, camera.min_side, camera.max_side) == (64, 64, 8, MAX_FRAME_SIDE)
    assert (info.limits.max_frame_side, info.limits.max_dynamics_ms, info.limits.max_dynamics_calls) == (
        MAX_FRAME_SIDE, MAX_DYNAMICS_MS, 2)


# ---------------------------------------------------------------------------------------------- bounded work


def _clip():
    return api.VideoClip({"image": _video()}, STATE)


def test_dynamics_calls_beyond_the_limit_are_refused_and_each_deadline_is_kept(engine, client, session):
    sid, epoch = session.session_id, session.epoch
    gate = hold_worker(engine)
    with ThreadPoolExecutor(2) as pool:
        queued = [pool.submit(engine.inverse_dynamics, sid, epoch, _clip(), deadline_s=time.monotonic() + 2.0)
                  for _ in range(2)]
        while engine.stats().queue_depth < 3:  # the gate and both calls
            time.sleep(0.005)
        with pytest.raises(api.TooManyDynamicsCalls):
            engine.inverse_dynamics(sid, epoch, _clip())
        with pytest.raises(grpc.RpcError) as refused:  # and over the wire
            client.stub.InverseDynamics(_id(session), timeout=60)
        assert PolicyServerError.from_rpc_error(refused.value).reason == "TOO_MANY_DYNAMICS_CALLS"
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        corrupt = encode_image(_frame(), "png")
        corrupt.data = corrupt.data[:40]
        video = _id(session)
        video.videos["image"].frames[0].CopyFrom(corrupt)
        for call, request in ((client.stub.ForwardDynamics, _fd(session, image=corrupt)),
                              (client.stub.InverseDynamics, video)):
            with pytest.raises(grpc.RpcError) as undecoded:  # refused before its frames are decoded: not BAD_IMAGE
                call(request, timeout=60)
            assert PolicyServerError.from_rpc_error(undecoded.value).reason == "TOO_MANY_DYNAMICS_CALLS"
        for call in queued:  # answered at their deadline although the worker is still held
            with pytest.raises(api.DeadlineExpired):
                call.result(timeout=30)
    gate.set()
    assert engine.inverse_dynamics(sid, epoch, _clip()).actions.shape == (8, 2)  # both slots were given back
    with pytest.raises(PolicyServerError) as late:
        client.inverse_dynamics(session, {"image": _video()}, STATE, timeout_s=0.02)
    assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_dynamics_call_ends_at_its_deadline_or_when_its_caller_goes_away_on_an_idle_worker(engine, session,
                                                                                             monkeypatch):
    """With nothing else queued the worker steps the call back to back, so the caller never finds it between two
    pieces: the call itself stops there, rather than running to its end for nobody while it holds its place. It stops
    before its frames go onto the canvas, too: 17 frames of 2048x2048 took 1.5 s there after their caller had given
    up at 50 ms."""
    placed = []

    def counted_side_by_side(cameras):
        placed.append(cameras)
        return side_by_side(cameras)

    monkeypatch.setattr(policy, "side_by_side", counted_side_by_side)
    sid, epoch = session.session_id, session.epoch
    with pytest.raises(api.Cancelled):
        engine.inverse_dynamics(sid, epoch, _clip(), should_abort=lambda: True)
    with pytest.raises(api.DeadlineExpired):
        engine.forward_dynamics(sid, epoch, api.Observation({"image": _frame()}, STATE), ACTIONS,
                                deadline_s=time.monotonic())
    assert placed == []
    # the places were given back
    assert engine.inverse_dynamics(sid, epoch, _clip()).actions.shape == (8, 2) and len(placed) == 1


def test_an_inverse_dynamics_call_stops_decoding_its_frames_once_its_caller_is_gone(engine, client, session,
                                                                                   monkeypatch):
    """17 frames of 2048x2048 took 0.7 s to decode after their caller had given up at 50 ms, its dynamics place held
    all along: the transport stops between two frames."""
    decoded = []
    decode = validate._frame

    def slow_frame(image, camera, field):
        decoded.append(field)
        time.sleep(0.1)
        return decode(image, camera, field)

    monkeypatch.setattr(validate, "_frame", slow_frame)
    with pytest.raises(PolicyServerError) as late:
        client.inverse_dynamics(session, {"image": _video()}, STATE, timeout_s=0.15)
    assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    end = time.monotonic() + 30
    while True:  # both places free: the call has ended on the server
        try:
            with engine.reserve_dynamics(session.session_id), engine.reserve_dynamics(session.session_id):
                break
        except api.TooManyDynamicsCalls:
            assert time.monotonic() < end, "the call kept its place"
            time.sleep(0.01)
    assert 1 <= len(decoded) < 9


def test_scaling_an_inverse_dynamics_calls_cameras_counts_against_its_time(engine, session, monkeypatch):
    """Its cameras go side by side (a shorter one scaled) on the caller's thread, within the call's time: in its
    `prepare` stage, as a tick's frames are."""
    def slow_side_by_side(cameras):
        time.sleep(0.2)
        return side_by_side(cameras)

    monkeypatch.setattr(policy, "side_by_side", slow_side_by_side)
    assert engine.inverse_dynamics(session.session_id, session.epoch, _clip()).tick.actual_ms["prepare"] >= 200


def test_a_running_dynamics_call_keeps_its_session_open(engine, session):
    """A session whose only call is a dynamics call still waiting for the worker is not idle (it was closed under
    the call when the idle timeout was shorter than the call)."""
    gate = hold_worker(engine)
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(engine.inverse_dynamics, session.session_id, session.epoch, _clip())
        while engine.stats().queue_depth < 2:  # the gate and the call
            time.sleep(0.005)
        swept = engine.sessions.close_idle(time.monotonic() + 3600, idle_s=1800)  # as if an hour had passed
        gate.set()
        assert session.session_id not in [s.session_id for s in swept]
        assert call.result(timeout=60).actions.shape == (8, 2)
    assert engine.session(session.session_id).epoch == session.epoch


def test_with_every_call_that_holds_a_thread_at_its_limit_a_short_call_is_still_served(engine):
    # Each holds a server thread while it lasts: per session a Control stream and an Act, the streams waiting for
    # their start, the Reason calls and the dynamics calls. All at once, within every limit, must leave room.
    config = build_config(overrides={"host": "127.0.0.1", "port": 0, "device": "cpu", "max_sessions": 1,
                                     "max_dynamics_calls": 2, "latency_budget_ms": 10_000.0})
    server = build_server(config, engine).start()
    gate = hold_worker(engine)  # everything below waits for the model
    silent = queue.Queue()
    with PolicyClient(server.target, timeout_s=60) as client, ThreadPoolExecutor(4 + MAX_STARTING_STREAMS) as pool:
        session = client.open_session("pusht", INSTRUCTION, rate_hz=0)
        stream = ControlStream(client, session).open()
        held = [pool.submit(client.act, session, {"image": _frame()}, STATE),
                *[pool.submit(client.forward_dynamics, session, {"image": _frame()}, ACTIONS, STATE) for _ in range(2)],
                *[pool.submit(lambda: list(client.reason("describe the scene", 4))) for _ in range(2)]]
        starting = [client.stub.Control(iter(silent.get, None)) for _ in range(MAX_STARTING_STREAMS)]
        while engine.stats().queue_depth < 6:  # the gate, the tick, both dynamics calls and both Reason calls
            time.sleep(0.01)
        time.sleep(0.3)  # the silent streams reach the server
        assert client.server_info(timeout_s=10).embodiments  # not RESOURCE_EXHAUSTED: "Concurrent RPC limit"
        gate.set()
        for call in held:
            call.result(timeout=60)
        for call in starting:
            call.cancel()
        stream.close()
        client.close_session(session)
    server.stop(grace_s=0.5)


def test_ticks_go_first_a_dynamics_call_runs_between_them(engine):
    """A tick that arrives while a forward-dynamics call runs is served after one of the call's sampler steps,
    not after the whole call: the call finishes last and its record counts the tick as its wait."""
    ticking = engine.open_session("pusht", INSTRUCTION, rate_hz=0)
    other = engine.open_session("pusht", INSTRUCTION, rate_hz=0)
    finished = []
    with ThreadPoolExecutor(1) as pool:
        def predict():
            result = engine.forward_dynamics(other.session_id, 1, api.Observation({"image": _frame()}, STATE), ACTIONS)
            finished.append("dynamics")
            return result

        dynamics = pool.submit(predict)
        while engine.stats().queue_depth < 1:
            time.sleep(0.001)
        tick = engine.act(ticking.session_id, 1, api.Observation({"image": _frame(1)}, STATE))
        finished.append("tick")
        predicted = dynamics.result(timeout=60)
    assert finished == ["tick", "dynamics"]
    assert predicted.tick.actual_ms["queue"] >= tick.tick.actual_ms["denoise"]
    engine.close_session(ticking.session_id)
    engine.close_session(other.session_id)


# ---------------------------------------------------------------------------------------------- preview frames


def test_a_preview_session_gets_its_predicted_frames_and_their_decode_is_in_the_tick(engine, client):
    preview = client.open_session("pusht", INSTRUCTION, rate_hz=0, preview=True)
    plain = client.open_session("pusht", INSTRUCTION, rate_hz=0)
    assert preview.preview and not plain.preview
    chunk = client.act(preview, {"image": _frame(1)}, STATE, encoding="png")
    expected = engine.served.pipeline.decode_video(engine.served.pipeline.last.latents)
    assert chunk.preview_frames.shape == expected.shape == (9, 64, 64, 3)
    np.testing.assert_array_equal(chunk.preview_frames, _as_sent(expected))
    assert chunk.tick.actual_ms["preview"] > 0 and chunk.tick.predicted_ms["preview"] > 0
    assert chunk.tick.actual_ms["total"] >= sum(v for k, v in chunk.tick.actual_ms.items() if k != "total")
    without = client.act(plain, {"image": _frame(1)}, STATE, encoding="png")
    assert without.preview_frames is None
    assert "preview" not in without.tick.actual_ms and "preview" not in without.tick.predicted_ms
    # Admission reserves the decode too: the preview session's uncached tick costs that much more.
    key = engine.served.cost_key("pusht", 8, 128)
    margin = engine.served.budget.config.cost_margin_devs
    decode_ms = engine.served.cost_model.costs(key).cautious(margin).fixed_ms["preview"]
    demands = [engine.sessions.get(s.session_id).demand for s in (preview, plain)]
    assert demands[0].ceiling_ms == pytest.approx(demands[1].ceiling_ms + decode_ms)
    client.close_session(preview)
    client.close_session(plain)


def test_max_message_mb_bounds_requests_not_the_predicted_frames_a_server_answers_with(engine):
    """A limit that takes the requests (a flat frame: about 1 kB) took none of the answers carrying predicted frames
    (9 frames of the untrained model's noise: several kB), each refused by gRPC after its work was done."""
    limit_mb = 4 / 1024
    config = build_config(overrides={"host": "127.0.0.1", "port": 0, "device": "cpu", "max_sessions": 1,
                                     "max_dynamics_calls": 1, "latency_budget_ms": 10_000.0,
                                     "max_message_mb": limit_mb})
    server = build_server(config, engine).start()
    flat = np.zeros((64, 64, 3), np.uint8)
    with PolicyClient(server.target, timeout_s=60) as client:
        session = client.open_session("pusht", INSTRUCTION, rate_hz=0, preview=True)
        predicted = client.forward_dynamics(session, {"image": flat}, ACTIONS, STATE)
        chunk = client.act(session, {"image": flat}, STATE)
        assert predicted.frames.shape == chunk.preview_frames.shape == (9, 64, 64, 3)
        answer = pb.PredictedFrames(frames=[encode_image(frame, "jpeg", FRAME_JPEG_QUALITY)
                                            for frame in predicted.frames])
        assert answer.ByteSize() > limit_mb * 2**20  # the answer is over the request limit indeed
        client.close_session(session)
    server.stop(grace_s=0.5)


def test_engine_preview_frames_are_the_decoded_latents_of_the_tick(engine):
    session = engine.open_session("pusht", INSTRUCTION, rate_hz=0, preview=True)
    result = engine.act(session.session_id, 1, api.Observation({"image": _frame(2)}, STATE))
    pipeline = engine.served.pipeline
    np.testing.assert_array_equal(result.preview_frames, pipeline.decode_video(pipeline.last.latents))
    engine.close_session(session.session_id)


# ---------------------------------------------------------------------------------------------- camera-native sizes


def test_cameras_of_different_heights_are_served_as_if_the_robot_had_scaled_them(engine, client):
    """A 64x80 scene camera beside a 32x32 wrist camera: the server scales the wrist's frames to 64x64."""
    session = client.open_session("two_camera_arm", INSTRUCTION, seed=5, rate_hz=0)
    scene, wrist = _video(1, height=64, width=80), _video(20, height=32, width=32)
    chunk = client.act(session, {"scene": scene[0], "wrist": wrist[0]}, STATE, encoding="png")
    assert chunk.actions.shape == (8, 2) and np.all(np.isfinite(chunk.actions))
    mixed = client.inverse_dynamics(session, {"scene": scene, "wrist": wrist}, STATE, encoding="png")
    scaled = client.inverse_dynamics(session, {"scene": scene, "wrist": resize(wrist, (64, 64))}, STATE,
                                     encoding="png")
    np.testing.assert_array_equal(mixed.actions, scaled.actions)
    # 32 px wide at 8 px high is 4096 px wide beside a 1024 px high scene camera, twice what a camera may send.
    with pytest.raises(PolicyServerError) as err:
        client.inverse_dynamics(session, {"scene": _video(1, height=1024, width=8), "wrist": _video(2, 9, 8, 32)},
                                STATE, encoding="png")
    assert (err.value.code, err.value.reason, err.value.field) == (INVALID, "SCHEMA_MISMATCH", "videos[wrist].frames")
    assert err.value.detail.got == "8x32 px, 4096 px wide at that height"
    client.close_session(session)


@pytest.mark.parametrize(("height", "width"), [(8, 8), (48, 64), (120, 200), (640, 480)])
def test_ticks_take_frames_of_any_size_within_the_bounds(engine, client, session, height, width):
    image = _frame(height, height, width)
    before = engine.served.cost_model.samples(engine.sessions.get(session.session_id).cost_key)
    chunk = client.act(session, {"image": image}, STATE, encoding="png")
    assert chunk.actions.shape == (8, 2) and np.all(np.isfinite(chunk.actions))
    after = engine.served.cost_model.samples(engine.sessions.get(session.session_id).cost_key)
    # A frame that fills the canvas teaches the full grid's costs; a smaller latent grid teaches its own.
    grid = tuple(engine.served.pipeline.last.latents.shape[-2:])
    assert (after != before) == (grid == (8, 8))


def test_a_smaller_latent_grid_is_planned_at_its_own_costs_once_seen(engine, client, session):
    """48x64 frames sit on the 64x64 canvas unscaled: 6x8 latent cells, cheaper than the full 8x8."""
    key = engine.sessions.get(session.session_id).cost_key
    grid_key = (*key, (6, 8))
    # A served tick runs both CFG branches' full calls as one batch: pairs are what it teaches.
    full_before = engine.served.cost_model.samples(key)["pair"]
    seen = engine.served.cost_model.samples(grid_key)["pair"]
    for step in range(max(GRID_SAMPLES - seen, 0)):
        client.act(session, {"image": _frame(step, 48, 64)}, STATE, encoding="png", step_index=step)
    assert engine.served.cost_model.samples(grid_key)["pair"] >= GRID_SAMPLES
    assert engine.served.cost_model.samples(key)["pair"] == full_before  # the full grid's costs are untouched
    steps, passes = engine.served.pipeline.config.num_steps, 2

    def predicted_encode(cost_key):
        return engine.served.budget.plan(cost_key, 1e4, steps, passes, None, prefill=False).predicted_stage_ms["encode"]

    expected = predicted_encode(grid_key)
    chunk = client.act(session, {"image": _frame(99, 48, 64)}, STATE, encoding="png", step_index=99)
    assert chunk.tick.predicted_ms["encode"] == expected != predicted_encode(key)


def test_the_control_stream_carries_preview_frames_too(client):
    session = client.open_session("pusht", INSTRUCTION, rate_hz=0, preview=True)
    with ControlStream(client, session) as stream:
        stream.send({"image": _frame(3)}, STATE, step_index=1, must_answer=True, encoding="png")
        chunk = stream.next_chunk(timeout_s=60)
    assert chunk.preview_frames.shape == (9, 64, 64, 3) and chunk.tick.actual_ms["preview"] > 0
    client.close_session(session)


def test_served_ms_counts_the_jpeg_encode_of_the_predicted_frames(client, session, monkeypatch):
    """An answer is ready once its frames are JPEG-encoded after the tick (17 frames of a 480x832 canvas take
    14 to 43 ms on this CPU): served_ms, from the request's arrival, ends there, on every call that carries them."""
    encode = convert.frames_to_proto

    def slow_encode(frames):
        time.sleep(0.2)
        return encode(frames)

    monkeypatch.setattr(convert, "frames_to_proto", slow_encode)
    preview = client.open_session("pusht", INSTRUCTION, rate_hz=0, preview=True)
    try:
        chunk = client.act(preview, {"image": _frame(1)}, STATE)
        with ControlStream(client, preview) as stream:
            stream.send({"image": _frame(2)}, STATE, step_index=1, must_answer=True)
            streamed = stream.next_chunk(timeout_s=60)
        predicted = client.forward_dynamics(session, {"image": _frame(1)}, ACTIONS, STATE)
    finally:
        client.close_session(preview)
    for answer in (chunk, streamed, predicted):
        assert answer.served_ms >= answer.tick.actual_ms["total"] + 200


@pytest.mark.parametrize("method", ["ForwardDynamics", "InverseDynamics"])
def test_request_bytes_that_do_not_parse_are_invalid_argument(client, method):
    call = client.channel.unary_unary(f"/policy_server.v1.PolicyService/{method}")
    with pytest.raises(grpc.RpcError) as raised:
        call(b"\xff\xff\xff\xff", timeout=30)
    assert raised.value.code() == INVALID
    assert PolicyServerError.from_rpc_error(raised.value).reason == "BAD_REQUEST"
