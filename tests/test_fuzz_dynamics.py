"""Property-based fuzzing of ``ForwardDynamics`` and ``InverseDynamics`` against the real in-process server of
``test_fuzz`` (the real engine over the embedded pipeline, 3 sampler steps), with its strategies and its property:
every answer is a good one or an error whose status is neither INTERNAL nor UNKNOWN, none comes late, and the
server then serves a known-good request."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz import (  # noqa: F401 - served and closed_id are the fixtures these tests run on
    ACTION_DIM,
    CAMERA,
    CHUNK,
    DEADLINES,
    GOOD_JPEG,
    GOOD_PNG,
    GOOD_RAW,
    GOOD_STATE,
    OMIT,
    Failures,
    acts_then_closes,
    any_message,
    closed_id,
    describe,
    epochs,
    float_values,
    fuzz_settings,
    images,
    live_session,
    mutated,
    observations,
    optional,
    raw_tensors,
    served,
    session_ids,
    states,
    still_serving,
    texts,
    uint64s,
    unary,
    weighted,
)

from policy_server.v1 import policy_server_pb2 as pb
from policy_server.v1.wire import tensor_to_proto

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

GOOD_ACTIONS = np.zeros((CHUNK, ACTION_DIM), np.float32)


@st.composite
def float_actions(draw) -> pb.Tensor:
    """float32/float64 actions of a chunk-like shape, values from ordinary to extreme."""
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    rows = draw(st.sampled_from([CHUNK, CHUNK, CHUNK, 0, 1, CHUNK - 1, CHUNK + 1, 16]))
    cols = draw(st.sampled_from([ACTION_DIM, ACTION_DIM, ACTION_DIM, 1, 3]))
    values = draw(st.lists(float_values(32 if dtype is np.float32 else 64), min_size=rows * cols,
                           max_size=rows * cols))
    return tensor_to_proto(np.array(values, dtype).reshape(rows, cols))


actions = weighted(
    (4, st.just(tensor_to_proto(GOOD_ACTIONS))),
    (5, float_actions()),
    (2, raw_tensors()),
    (1, any_message(pb.Tensor)),
)


def _checked_frames(failures: Failures, rpc: str, frames, example: str) -> None:
    """Answer frames: JPEG, 8-bit RGB, one size."""
    sizes = {(f.encoding, f.height, f.width, f.channels) for f in frames}
    if len(frames) < 1 or len(sizes) != 1 or next(iter(sizes))[0] != pb.IMAGE_ENCODING_JPEG:
        failures.wrong(rpc, f"frames {sorted(sizes)} ({len(frames)})", example)


def test_fuzz_forward_dynamics(served, closed_id):  # noqa: F811 - the fixtures imported above
    failures = Failures(served, "ForwardDynamics")

    @fuzz_settings(60)
    @given(session_id=session_ids, epoch=epochs, observation=weighted((9, observations), (1, st.none())),
           actions=weighted((9, actions), (1, st.none())), seed=optional(uint64s), deadline_s=DEADLINES)
    def run(session_id, epoch, observation, actions, seed, deadline_s):
        if not failures.begin():
            return
        live = live_session(served, failures, closed_id)
        if live is None:
            return
        request = pb.ForwardDynamicsRequest(session_id=live.session(session_id), epoch=live.epoch_of(epoch))
        if observation is not None:
            request.observation.CopyFrom(observation)
        if actions is not None:
            request.actions.CopyFrom(actions)
        if seed is not OMIT:
            request.seed = seed
        example = describe(request) + (f" (client deadline {deadline_s * 1e3:g} ms)" if deadline_s else "")
        answer = unary(served, failures, "ForwardDynamics", request, example, timeout_s=deadline_s)
        if answer is not None:
            _checked_frames(failures, "ForwardDynamics", answer.frames, example)
        acts_then_closes(served, failures, live, example, "the same session, after the request above")
        still_serving(served, failures, example)

    run()
    failures.report()


def _videos(values: dict) -> pb.InverseDynamicsRequest:
    request = pb.InverseDynamicsRequest(**{k: v for k, v in values.items() if k not in ("videos", "state")})
    for name, frames in values.get("videos", {}).items():
        request.videos[name].frames.extend(frames)
    if "state" in values:
        request.state.CopyFrom(values["state"])
    return request


GOOD_VIDEO = [GOOD_JPEG] * (CHUNK + 1)
frame_lists = weighted(
    (3, st.sampled_from([GOOD_JPEG, GOOD_PNG, GOOD_RAW]).map(lambda image: [image] * (CHUNK + 1))),
    (3, st.lists(images, min_size=CHUNK + 1, max_size=CHUNK + 1)),
    (2, st.lists(st.sampled_from([GOOD_JPEG, GOOD_PNG, GOOD_RAW]), min_size=0, max_size=20)),
    (1, images.map(lambda image: [*GOOD_VIDEO[:3], image, *GOOD_VIDEO[4:]])),
)
video_maps = weighted(
    (6, frame_lists.map(lambda frames: {CAMERA: frames})),
    (1, st.just({})),
    (1, st.dictionaries(st.sampled_from([CAMERA, "", "wrist", "IMAGE"]), frame_lists, max_size=2)),
)
GOOD_FIELDS = {"videos": {CAMERA: GOOD_VIDEO}, "state": tensor_to_proto(GOOD_STATE), "step_index": 3}
inverse_requests = weighted(
    (1, st.just(GOOD_FIELDS)),
    (6, mutated(GOOD_FIELDS, {
        "videos": video_maps,
        "state": optional(states),
        "instruction": texts,
        "step_index": uint64s,
        "seed": optional(uint64s),
    })),
)


def test_fuzz_inverse_dynamics(served, closed_id):  # noqa: F811
    failures = Failures(served, "InverseDynamics")

    @fuzz_settings(60)
    @given(session_id=session_ids, epoch=epochs, fields=inverse_requests, deadline_s=DEADLINES)
    def run(session_id, epoch, fields, deadline_s):
        if not failures.begin():
            return
        live = live_session(served, failures, closed_id)
        if live is None:
            return
        request = _videos({**fields, "session_id": live.session(session_id), "epoch": live.epoch_of(epoch)})
        example = describe(request) + (f" (client deadline {deadline_s * 1e3:g} ms)" if deadline_s else "")
        chunk = unary(served, failures, "InverseDynamics", request, example, timeout_s=deadline_s)
        if chunk is not None:
            values = np.frombuffer(chunk.actions.data, np.float32)
            if list(chunk.actions.shape) != [CHUNK, ACTION_DIM] or not np.all(np.isfinite(values)):
                failures.wrong("InverseDynamics", f"actions {describe(chunk.actions)}", example)
        acts_then_closes(served, failures, live, example, "the same session, after the request above")
        still_serving(served, failures, example)

    run()
    failures.report()
