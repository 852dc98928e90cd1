"""Client library pieces: the robot-side ActionQueue, backoff, error decoding (gRPC's standard rich status,
and the reason in the message alone), gRPC's own retries and health watch, the health probe, and the layering
rules: the client loads no server, engine, torch or cv2 module, the transport no torch."""

from __future__ import annotations

import pickle
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from fake_engine import FakeEngine, free_port, serve_fake
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from policy_server.client import ActionQueue, Backoff, PolicyClient, PolicyServerError
from policy_server.client.types import Session, build_inverse_dynamics, build_observation
from policy_server.config import build_config
from policy_server.server.app import build_server
from policy_server.server.errors import make_error
from policy_server.v1.errors import RETRY_PUSHBACK_KEY
from policy_server.v1.wire import WireError

REPO = Path(__file__).resolve().parents[1]


def chunk(values, dim=2) -> np.ndarray:
    return np.repeat(np.asarray(values, np.float32)[:, None], dim, axis=1)


# -- ActionQueue --------------------------------------------------------------------------------


def test_pop_walks_the_chunk_step_by_step():
    queue = ActionQueue(action_dim=2)
    assert queue.needs_refill() and queue.pop() is None and queue.next_step == 1
    queue.clear()
    queue.merge(chunk([0, 1, 2, 3]), first_step_index=0)
    assert len(queue) == 4
    assert [float(queue.pop()[0]) for _ in range(4)] == [0, 1, 2, 3]
    assert queue.pop() is None  # starved: hold
    actions = chunk([5, 6])
    queue.merge(actions, first_step_index=queue.next_step)
    actions[:] = 9.0  # the caller's array, reused
    assert float(queue.pop()[0]) == 5.0


def test_stale_prefix_is_dropped_by_step_index():
    queue = ActionQueue(action_dim=2)
    queue.merge(chunk([0, 1, 2, 3, 4, 5, 6, 7]), first_step_index=0)
    for _ in range(3):
        queue.pop()  # steps 0..2 executed while the next chunk was computed
    stale = queue.merge(chunk([10, 11, 12, 13, 14, 15, 16, 17]), first_step_index=1)
    assert stale == 2  # steps 1 and 2 are already in the past
    assert queue.next_step == 3 and float(queue.peek()[0]) == 12
    assert ActionQueue(2, start_step=20).merge(chunk([1, 2]), first_step_index=0) == 2  # all stale


def test_upcoming_is_what_pop_will_return_up_to_the_first_gap():
    queue = ActionQueue(action_dim=2, aggregation="average")
    assert queue.upcoming(3).shape == (0, 2)
    queue.merge(chunk([0, 1, 2, 3]), first_step_index=0)
    queue.merge(chunk([10, 11, 12, 13]), first_step_index=6)  # after a gap at step 5
    queue.merge(chunk([20, 21, 22, 23]), first_step_index=1)  # steps 1 to 3 averaged
    for _ in range(3):
        queue.pop()
    upcoming = queue.upcoming(3)
    assert upcoming.dtype == np.float32 and upcoming[:, 0].tolist() == [12.5, 23.0]
    assert [float(queue.pop()[0]) for _ in range(2)] == [12.5, 23.0] and queue.pop() is None
    with pytest.raises(ValueError, match="count must be >= 0"):
        queue.upcoming(-1)


def test_upcoming_of_a_chunk_or_more_is_refused_naming_the_chunk_size():
    # The server takes fewer committed actions than the session's chunk holds: d = 8 of a chunk of 8 came back
    # from the server as SCHEMA_MISMATCH, a frame later, rather than from the queue at once.
    queue = ActionQueue(action_dim=2)
    queue.merge(chunk(range(8)), first_step_index=0)
    assert queue.upcoming(7).shape == (7, 2)
    with pytest.raises(ValueError, match=r"count must be below the chunk size, 8 .*got 8"):
        queue.upcoming(8)


@pytest.mark.parametrize(
    ("actions", "first_step_index", "message"),
    [(chunk([0.0, np.nan, 0.1]), 0, r"finite, got NaN/Inf in rows \[1\]"),
     (chunk([0.0, np.inf]), 0, r"finite, got NaN/Inf in rows \[1\]"),
     (chunk([0.0, 0.1], dim=3), 0, r"actions must be \[K, 2\], got \[2, 3\]"),
     (chunk([0.0, 0.1]), 2.5, "first_step_index must be an integer, got 2.5")],
)
def test_a_chunk_a_robot_could_not_execute_is_refused_at_merge(actions, first_step_index, message):
    queue = ActionQueue(action_dim=2)
    with pytest.raises(ValueError, match=message):
        queue.merge(actions, first_step_index)
    assert len(queue) == 0 and queue.pop() is None  # nothing of it was queued


@pytest.mark.parametrize(
    ("aggregation", "kwargs", "overlap_value"),
    [
        ("replace", {}, 10.0),
        ("average", {}, 6.0),  # (2 + 10) / 2
        ("weighted", {"new_weight": 0.75}, 8.0),  # 0.25 * 2 + 0.75 * 10
        ("temporal_ensemble", {"ensemble_decay": 0.0}, 6.0),  # equal weights
    ],
)
def test_overlapping_steps_are_aggregated(aggregation, kwargs, overlap_value):
    queue = ActionQueue(action_dim=2, aggregation=aggregation, **kwargs)
    queue.merge(chunk([0, 1, 2, 3]), first_step_index=0)
    queue.merge(chunk([10, 11, 12, 13]), first_step_index=2)
    values = [float(queue.pop()[0]) for _ in range(6)]
    assert values[:2] == [0, 1]
    assert values[2] == pytest.approx(overlap_value)
    assert values[4:] == [12, 13]  # beyond the old chunk only the new one speaks


def test_temporal_ensemble_weights_older_predictions_more():
    queue = ActionQueue(action_dim=1, aggregation="temporal_ensemble", ensemble_decay=np.log(3.0))
    queue.merge(chunk([0.0], dim=1), first_step_index=0)  # weight 1
    queue.merge(chunk([4.0], dim=1), first_step_index=0)  # weight 1/3
    assert float(queue.pop()[0]) == pytest.approx((0.0 * 1 + 4.0 / 3) / (1 + 1 / 3))


def test_refill_threshold_is_a_fraction_of_the_chunk():
    queue = ActionQueue(action_dim=2, refill_threshold=0.5)
    queue.merge(chunk(range(8)), first_step_index=0)
    refills = []
    for _ in range(8):
        queue.pop()
        refills.append(queue.needs_refill())
    assert refills == [False, False, False, True, True, True, True, True]  # at 4 of 8 left


def test_pop_for_a_later_step_skips_ahead():
    queue = ActionQueue(action_dim=2)
    queue.merge(chunk(range(6)), first_step_index=10)
    assert float(queue.pop(13)[0]) == 3 and queue.next_step == 14 and len(queue) == 2
    with pytest.raises(ValueError, match="already executed"):
        queue.pop(12)


@pytest.mark.parametrize(
    "kwargs",
    [{"action_dim": 0}, {"action_dim": 2, "new_weight": 1.5}, {"action_dim": 2, "refill_threshold": -0.1},
     {"action_dim": 2, "aggregation": "median"}, {"action_dim": 2, "ensemble_decay": float("nan")},
     {"action_dim": 2, "ensemble_decay": float("inf")}, {"action_dim": 2, "new_weight": float("nan")}],
)
def test_bad_queue_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        ActionQueue(**kwargs)


def test_observation_arguments_protobuf_would_refuse_are_named():
    image = {"image": np.zeros((8, 8, 3), np.uint8)}
    for kwargs, error, words in (({"step_index": -1}, ValueError, "step_index must be an integer in [0, 2^64)"),
                                 ({"instruction": 5}, TypeError, "instruction must be a str (valid Unicode), got int"),
                                 ({"jpeg_quality": 500}, ValueError, "jpeg_quality: expected 0..100, got 500"),
                                 # numpy's own errors named no field, and a complex state lost its imaginary part
                                 ({"state": "abc"}, ValueError, "state: expected real numbers, got <U3 []"),
                                 ({"state": [0.1, 0.2j]}, ValueError, "expected real numbers, got complex128 [2]"),
                                 ({"committed_actions": [[0.1, 0.1], [0.1]]}, ValueError,
                                  "committed_actions: expected real numbers of one shape, got rows of different")):
        with pytest.raises(error) as err:
            build_observation(image, **kwargs)
        assert words in str(err.value)
    with pytest.raises(WireError, match=r"^images\[wrist\]: expected uint8 \[H, W, C\], got float32 \[8, 8, 3\]"):
        build_observation({**image, "wrist": np.zeros((8, 8, 3), np.float32)})


def test_call_arguments_protobuf_would_refuse_are_named_before_anything_is_sent():
    session, frame = Session("s", 1, "pusht", "", 100.0, 8, 0), {"image": np.zeros((8, 8, 3), np.uint8)}
    video, actions = {"image": np.zeros((9, 8, 8, 3), np.uint8)}, np.zeros((8, 2), np.float32)
    uint32, uint64, text = "must be an integer in [0, 2^32)", "must be an integer in [0, 2^64)", "must be a str (valid"
    with PolicyClient("127.0.0.1:1", timeout_s=0.5) as c:  # nothing listens: each call here must fail before sending
        for call, error, words in (
            (lambda: c.reason("hi", -1), ValueError, f"max_new_tokens {uint32}, got -1"),
            (lambda: c.reason("hi", 2**33), ValueError, f"max_new_tokens {uint32}, got 8589934592"),
            (lambda: c.reason("hi", 4, seed=-1), ValueError, f"seed {uint64}, got -1"),
            (lambda: c.reason(5, 4), TypeError, f"prompt {text} Unicode), got int"),
            (lambda: c.reason("a\ud800", 4), ValueError, f"prompt {text} Unicode), got 'a\\ud800'"),
            (lambda: c.reason("hi", 4, temperature="0.5"), TypeError, "temperature must be a real number, got str"),
            (lambda: c.forward_dynamics(session, frame, actions, seed=-1), ValueError, f"seed {uint64}, got -1"),
            (lambda: c.forward_dynamics(session, frame, [["x"]]), ValueError, "actions: expected real numbers, got"),
            (lambda: c.inverse_dynamics(session, video, seed=1.5), TypeError, f"seed {uint64}, got float"),
            (lambda: c.open_session("pusht", "x", seed=-1), ValueError, f"seed {uint64}, got -1"),
            (lambda: c.open_session("pusht", "x", chunk_size=-1), ValueError, f"chunk_size {uint32}, got -1"),
            (lambda: c.open_session("pusht", "x", actions_per_chunk=-1), ValueError, f"actions_per_chunk {uint32}"),
            (lambda: c.open_session(5, "x"), TypeError, f"embodiment {text} Unicode), got int"),
            (lambda: c.open_session("pusht", "x", budget_ms="50"), TypeError, "budget_ms must be a real number"),
            (lambda: c.open_session("pusht", "x", preview="yes"), TypeError, "preview must be a bool, got str"),
            (lambda: c.set_budget(session, "50"), TypeError, "budget_ms must be a real number, got str"),
            (lambda: c.server_info(rate_hz="50"), TypeError, "rate_hz must be a real number, got str"),
            # A bare frame for the cameras' mapping raised AttributeError ('ndarray' has no 'items'), an int camera
            # name protobuf's "bad argument type for built-in operation".
            (lambda: c.act(session, frame["image"]), TypeError,
             "images must be a mapping of camera name -> uint8 [H, W, 3], got ndarray"),
            (lambda: c.act(session, {0: frame["image"]}), TypeError,
             "images must be keyed by camera name (str), got 0"),
            (lambda: c.forward_dynamics(session, [frame["image"]], actions), TypeError, "images must be a mapping"),
            (lambda: c.inverse_dynamics(session, video["image"]), TypeError,
             "videos must be a mapping of camera name -> uint8 [K + 1, H, W, 3], got ndarray"),
        ):
            with pytest.raises(error) as err:
                call()
            assert words in str(err.value)


def test_an_inverse_dynamics_video_that_is_not_uint8_frames_is_named_by_camera():
    session = Session("s", 1, "pusht", "", 100.0, 8, 0)
    for video, got in ((np.zeros((64, 64, 3), np.uint8), "uint8 [64, 64, 3]"),  # one frame, not a video
                       (np.zeros((9, 64, 64, 3), np.float32), "float32 [9, 64, 64, 3]")):
        with pytest.raises(WireError) as err:
            build_inverse_dynamics(session, {"wrist": video})
        assert str(err.value) == f"videos[wrist]: expected a video, uint8 [F, H, W, 3], got {got}"
    frames = [np.zeros((64, 64, 3), np.uint8)] * 9  # a list of frames is a video too
    assert len(build_inverse_dynamics(session, {"wrist": frames}).videos["wrist"].frames) == 9
    with pytest.raises(WireError) as err:  # numpy's own error ("inhomogeneous shape") named no camera
        build_inverse_dynamics(session, {"wrist": frames[:4] + [np.zeros((64, 48, 3), np.uint8)] * 5})
    assert str(err.value) == ("videos[wrist]: expected a video, uint8 [F, H, W, 3], got frames of different shapes: "
                              "[64, 64, 3] and [64, 48, 3]")


def test_an_error_survives_the_pickling_ray_carries_it_across_processes_with():
    error = PolicyServerError.from_detail(make_error("OVERLOADED", "full", field="budget_ms").detail, obs_id=3)
    again = pickle.loads(pickle.dumps(error))
    assert (again.code, again.reason, again.field, again.obs_id, again.from_server, str(again)) == (
        error.code, "OVERLOADED", "budget_ms", 3, True, str(error))


def test_a_client_timeout_is_a_time_above_0_up_to_a_day():
    for bad in (0, -1.0, float("nan"), float("inf"), 1e12):
        with pytest.raises(ValueError, match="timeout_s must be a time above 0 s, up to 86400 s"):
            PolicyClient("127.0.0.1:1", timeout_s=bad)


def test_a_call_timeout_grpc_would_not_wait_is_refused_before_the_call():
    """A call's own ``timeout_s`` went to gRPC unchecked: inf, 1e12 (past gRPC's deadline range), NaN, 0 or -1 failed
    the call at once as 'no answer from ... within inf s: the server is down, unreachable, starting or busy', blaming
    a server that was serving (GetServerInfo with 0 answered)."""
    frame, state = {"image": np.zeros((48, 64, 3), np.uint8)}, np.array([0.1, 0.2], np.float32)
    with serve_fake(FakeEngine()) as server, PolicyClient(server.target) as c:
        session = c.open_session("pusht", "push")
        calls = ((c.server_info, ()), (c.act, (session, frame, state)), (c.open_session, ("pusht", "push")),
                 (c.reason, ("hi", 2)), (c.wait_until_serving, ()))
        for bad in (0, -1.0, float("nan"), float("inf"), 1e12):
            for method, args in calls:
                with pytest.raises(ValueError, match=f"timeout_s must be a time above 0 s, up to 86400 s, got {bad}"):
                    method(*args, timeout_s=bad)
        assert c.act(session, frame, state, timeout_s=86400).actions.shape[1] == 2
        c.close_session(session)


def test_a_target_grpc_would_dial_otherwise_is_refused_at_once():
    # 127.0.0.1:99999 dialled port 34463; "" failed each call UNKNOWN, with gRPC core's log lines.
    for bad in ("127.0.0.1:99999", "127.0.0.1:0", "", " "):
        with pytest.raises(ValueError, match=f"target: expected HOST:PORT with a port from 1 to 65535, or unix:PATH; "
                                             f"got {bad!r}"):
            PolicyClient(bad)
    for good in ("127.0.0.1:65535", "[::1]:50051", "unix:/tmp/policy.sock", "dns:///localhost:50051"):
        PolicyClient(good).close()


def test_a_call_nothing_answers_says_where_it_waited_and_for_how_long():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{probe.getsockname()[1]}"
    with PolicyClient(target, timeout_s=0.3) as client, pytest.raises(PolicyServerError) as error:
        client.server_info()  # waits for a server to come up, then says only "Deadline Exceeded"
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and not error.value.from_server
    assert error.value.message == (f"no answer from {target} within 0.3 s: the server is down, unreachable, starting "
                                   "or busy, or the call needs longer")
    with PolicyClient(target) as client, pytest.raises(PolicyServerError) as error:
        client.open_session("pusht", "x", timeout_s=0.3)  # its call gets what is left of the 0.3 s, not 0.299...
    assert error.value.message.startswith(f"no answer from {target} within 0.3 s:")


def test_a_token_an_authorization_header_cannot_carry_is_refused_at_once_without_echoing_it():
    for bad in ("s3cret\n", "s3cret token", "sécret", " "):
        with pytest.raises(ValueError, match="token") as error:
            PolicyClient("127.0.0.1:1", token=bad)
        assert "s3cret" not in str(error.value) and "sécret" not in str(error.value)


def test_chunk_shape_is_checked():
    with pytest.raises(ValueError, match=r"\[K, 2\]"):
        ActionQueue(action_dim=2).merge(np.zeros((4, 3)), 0)


# -- backoff and errors --------------------------------------------------------------------------


def test_backoff_grows_and_caps():
    delays = list(Backoff(initial_s=0.1, max_s=0.5, multiplier=2.0, jitter=0.0, max_attempts=5).delays())
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    jittered = list(Backoff(initial_s=1.0, jitter=0.2, max_attempts=50).delays())
    assert all(0.8 <= d <= 2.4 for d in jittered)


class _FailedCall(grpc.RpcError, grpc.Call):
    """What a stub raises for a call that ended with ``status`` (a ``grpc.Status``)."""

    def __init__(self, status: grpc.Status) -> None:
        self.status = status

    def code(self):
        return self.status.code

    def details(self):
        return self.status.details

    def trailing_metadata(self):
        return self.status.trailing_metadata

    def initial_metadata(self):
        return ()

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def cancel(self):
        return False

    def add_callback(self, callback):
        return False


def _details(status: grpc.Status) -> dict[str, object]:
    """The standard error details of a failed call, by message type."""
    found = {}
    for packed in rpc_status.from_call(_FailedCall(status)).details:
        for kind in (error_details_pb2.ErrorInfo, error_details_pb2.BadRequest, error_details_pb2.RetryInfo):
            if packed.Is(kind.DESCRIPTOR):
                found[kind.__name__] = kind()
                packed.Unpack(found[kind.__name__])
    return found


def test_an_error_travels_as_the_standard_rich_status_and_round_trips():
    error = make_error("BUDGET_INFEASIBLE", "too tight", best_achievable_ms=42.5)
    status = error.status()
    assert status.code == grpc.StatusCode.FAILED_PRECONDITION
    assert status.details == "BUDGET_INFEASIBLE: too tight"  # proxies that keep only the message keep the reason
    details = _details(status)
    assert set(details) == {"ErrorInfo"}
    info = details["ErrorInfo"]
    assert (info.reason, info.domain, dict(info.metadata)) == (
        "BUDGET_INFEASIBLE", "policy_server.v1", {"best_achievable_ms": "42.5"})
    decoded = PolicyServerError.from_rpc_error(_FailedCall(status))
    assert (decoded.code, decoded.reason, decoded.message, decoded.best_achievable_ms) == (
        grpc.StatusCode.FAILED_PRECONDITION, "BUDGET_INFEASIBLE", "too tight", 42.5)


def test_input_errors_carry_a_field_violation_and_warmup_a_retry_delay():
    bad = _details(make_error("SCHEMA_MISMATCH", "observation.state: expected shape [2], got shape [5]",
                              field="observation.state", expected="shape [2]", got="shape [5]").status())
    violation, = bad["BadRequest"].field_violations
    assert (violation.field, violation.reason, violation.description) == (
        "observation.state", "SCHEMA_MISMATCH", "expected shape [2], got shape [5]")
    assert dict(bad["ErrorInfo"].metadata) == {"field": "observation.state", "expected": "shape [2]",
                                               "got": "shape [5]"}
    warming = make_error("WARMING_UP", "the server is warming up (40% done)", retry_after_ms=1500.0).status()
    assert warming.code == grpc.StatusCode.UNAVAILABLE
    assert _details(warming)["RetryInfo"].retry_delay.ToMilliseconds() == 1500
    assert dict(warming.trailing_metadata)[RETRY_PUSHBACK_KEY] == "1500"  # what gRPC's own retries wait
    assert "BadRequest" not in _details(warming)


def test_a_reason_survives_a_proxy_that_keeps_only_the_code_and_the_message():
    error = make_error("OVERLOADED", "1 session of pusht fits at 1.25 Hz")
    stripped = grpc.StatusCode.RESOURCE_EXHAUSTED, error.status().details, ()
    decoded = PolicyServerError.from_rpc_error(_FailedCall(rpc_status._Status(*stripped)))
    assert (decoded.reason, decoded.message) == ("OVERLOADED", "1 session of pusht fits at 1.25 Hz")
    plain = PolicyServerError.from_rpc_error(
        _FailedCall(rpc_status._Status(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", ())))
    assert (plain.reason, plain.message) == ("UNAVAILABLE", "failed to connect to all addresses")
    refused = PolicyServerError.from_rpc_error(_FailedCall(rpc_status._Status(
        grpc.StatusCode.UNAVAILABLE, "Stream removed (RST_STREAM (Received RST_STREAM with error code 7))", ())))
    assert refused.reason == "TOO_MANY_CALLS"  # what a client that floods one connection gets for its calls beyond
    assert refused.message.startswith("the server refused the call: its connection held as many calls at once")
    assert plain.connection_lost and not refused.connection_lost  # a refusal: no reconnect, no episode restarted


def test_unreachable_server_is_unavailable_at_once_for_act():
    with PolicyClient("127.0.0.1:1", timeout_s=0.5) as client:
        with pytest.raises(PolicyServerError) as err:
            client.act(Session("s", 1, "pusht", "", 100.0, 8, 0), {"image": np.zeros((4, 4, 3), np.uint8)})
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.reason == "UNAVAILABLE"


def test_open_session_waits_through_warmup_within_its_timeout():
    engine = FakeEngine(ready=False)
    with serve_fake(engine) as server, PolicyClient(server.target, timeout_s=20) as client:
        # Tries 1 s apart, as the warming server asks, until it serves.
        threading.Timer(1.5, engine.set_ready, (True,)).start()
        started = time.monotonic()
        session = client.open_session("pusht", "reach the red circle")  # WARMING_UP twice, then served
        assert session.epoch == 1
        assert time.monotonic() - started >= 1.5
        with pytest.raises(PolicyServerError) as err:  # Act is never retried: a late chunk is stale
            engine.set_ready(False)
            client.act(session, {"image": np.zeros((96, 96, 3), np.uint8)}, np.zeros(2, np.float32))
        assert err.value.reason == "WARMING_UP" and err.value.retry_after_ms > 0


def test_open_session_whose_timeout_ends_in_a_warmup_raises_the_servers_warming_up():
    # gRPC's retries waited out the server's retry delay past the deadline, and the call raised DEADLINE_EXCEEDED, "no
    # answer ... the server is down, unreachable, starting or busy", for any timeout under 5 s.
    engine = FakeEngine(ready=False)
    with serve_fake(engine) as server, PolicyClient(server.target) as client:
        client.health()  # connected: the timeouts below are the server's to fill, not the connection's
        for timeout_s in (0.8, 1.8):  # the server asks for a try 1 s on: raised at once, or after a second try
            with pytest.raises(PolicyServerError) as err:
                client.open_session("pusht", "too early", timeout_s=timeout_s)
            assert (err.value.code, err.value.reason, err.value.message, err.value.retry_after_ms) == (
                grpc.StatusCode.UNAVAILABLE, "WARMING_UP", f"no session from {server.target} within {timeout_s:g} s; "
                "its last answer: the server is warming up (50% done)", 1000.0)


class HangingOpens(FakeEngine):
    """Answers its first `answered` open_session calls, then holds the others until `released` (a server that hangs,
    or goes away: the client's tries get no answer); `hung` is set once one is held."""

    def __init__(self, answered: int):
        super().__init__()
        self.answered, self.hung, self.released = answered, threading.Event(), threading.Event()

    def open_session(self, *args, **kwargs):
        if len(self.request_ids) >= self.answered:  # each call it answered appended its id
            self.hung.set()
            self.released.wait(30)
        return super().open_session(*args, **kwargs)


def test_open_session_that_a_server_answered_and_then_did_not_names_the_answer_and_the_whole_wait():
    """A server that answered SHUTTING_DOWN and then nothing (it went away): the call raised that answer as it had
    come, after the whole timeout, saying neither how long it had asked nor that nothing had answered since."""
    engine = HangingOpens(answered=1)
    engine.refuse_opens(1)
    with serve_fake(engine) as server, PolicyClient(server.target) as client:
        client.health()
        try:
            with pytest.raises(PolicyServerError) as err:
                client.open_session("pusht", "x", timeout_s=2)
        finally:
            engine.released.set()
    assert (err.value.code, err.value.reason, err.value.from_server) == (
        grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN", True)
    assert re.fullmatch(rf"no session from {re.escape(server.target)} within 2 s; its last answer, [0-9.]+ s in: the "
                        "server is shutting down; nothing answered after it", err.value.message), err.value.message


def test_open_session_that_no_server_answered_names_the_whole_wait_not_its_last_tries():
    """The call failed (UNAVAILABLE: the server stopped under it), and its next try got no answer: the message said
    "no answer ... within" what was left of the timeout for that try (54.854 s of a rollout's 60 s)."""
    engine = HangingOpens(answered=0)
    with serve_fake(engine) as server, PolicyClient(server.target) as client:

        def stop_once_held():
            if engine.hung.wait(10):
                server.stop(grace_s=0)  # the try in flight ends UNAVAILABLE; the next finds nothing listening

        stopper = threading.Thread(target=stop_once_held)
        stopper.start()
        try:
            with pytest.raises(PolicyServerError) as err:
                client.open_session("pusht", "x", timeout_s=2)
        finally:
            engine.released.set()
            stopper.join()
    assert (err.value.code, err.value.from_server) == (grpc.StatusCode.DEADLINE_EXCEEDED, False)
    assert err.value.message == (f"no answer from {server.target} within 2 s: the server is down, unreachable, "
                                 "starting or busy, or the call needs longer")



def test_wait_until_serving_watches_health_from_before_the_server_starts():
    port = free_port()
    engine = FakeEngine(ready=False)
    waited: list[BaseException | None] = []
    with PolicyClient(f"127.0.0.1:{port}") as client:
        waiter = threading.Thread(target=lambda: waited.append(_outcome(client.wait_until_serving, 30)))
        waiter.start()
        time.sleep(0.3)  # nothing listens yet
        server = build_server(build_config(overrides={"port": port}), engine).start()
        try:
            time.sleep(0.3)
            assert waiter.is_alive()  # up, but NOT_SERVING
            engine.set_ready(True)
            waiter.join(20)
            assert waited == [None]
            assert client.server_info().ready
        finally:
            server.stop(grace_s=0.1)
        with pytest.raises(TimeoutError, match="not SERVING after 0.5 s"):
            client.wait_until_serving(timeout_s=0.5)


def _outcome(function, *args) -> BaseException | None:
    try:
        function(*args)
    except BaseException as exc:  # noqa: BLE001 - the test reads what happened
        return exc
    return None


# -- command-line probe and layering -------------------------------------------------------------


def test_health_probe_command():
    engine = FakeEngine(ready=False)
    with serve_fake(engine) as server:
        probe = [sys.executable, "-m", "policy_server.client", "health", "--server", server.target]
        not_ready = subprocess.run(probe, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert (not_ready.returncode, not_ready.stdout.strip()) == (1, "NOT_SERVING")
        engine.set_ready(True)
        with PolicyClient(server.target) as client:
            client.wait_until_serving(timeout_s=10)
        ready = subprocess.run(probe, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert (ready.returncode, ready.stdout.strip()) == (0, "SERVING")


def test_info_piped_into_a_reader_that_stops_early_ends_without_a_traceback():
    with serve_fake(FakeEngine()) as server:
        # `true` has exited long before the client has its answer to print (its imports alone take longer)
        probe = f"{shlex.quote(sys.executable)} -m policy_server.client info --server {server.target} | true"
        done = subprocess.run(["bash", "-c", f"set -o pipefail; {probe}"], cwd=REPO, capture_output=True, text=True,
                              timeout=60)
    assert (done.returncode, done.stderr) == (1, "")  # was BrokenPipeError's traceback


def test_client_loads_no_server_engine_torch_or_cv2():
    code = (
        "import sys\n"
        "import policy_server.client\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'cv2')\n"
        "             or m.startswith(('policy_server.server', 'policy_server.engine')))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_client_and_transport_do_not_import_torch():
    code = (
        "import sys\n"
        "import policy_server.client, policy_server.server.app, policy_server.cli, policy_server.config\n"
        "import policy_server.server.websocket\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
