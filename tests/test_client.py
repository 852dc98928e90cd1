"""Client library pieces: the robot-side ActionQueue, backoff, error decoding, the health probe,
and the layering rules: the client loads no server, engine, torch or cv2 module, the transport no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from fake_engine import FakeEngine, serve_fake

from policy_server.client import ActionQueue, Backoff, PolicyClient, PolicyServerError
from policy_server.server.errors import make_error

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


def test_stale_prefix_is_dropped_by_step_index():
    queue = ActionQueue(action_dim=2)
    queue.merge(chunk([0, 1, 2, 3, 4, 5, 6, 7]), first_step_index=0)
    for _ in range(3):
        queue.pop()  # steps 0..2 executed while the next chunk was computed
    stale = queue.merge(chunk([10, 11, 12, 13, 14, 15, 16, 17]), first_step_index=1)
    assert stale == 2  # steps 1 and 2 are already in the past
    assert queue.next_step == 3 and float(queue.peek()[0]) == 12
    assert ActionQueue(2, start_step=20).merge(chunk([1, 2]), first_step_index=0) == 2  # all stale


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
     {"action_dim": 2, "aggregation": "median"}],
)
def test_bad_queue_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        ActionQueue(**kwargs)


def test_chunk_shape_is_checked():
    with pytest.raises(ValueError, match=r"\[K, 2\]"):
        ActionQueue(action_dim=2).merge(np.zeros((4, 3)), 0)


# -- backoff and errors --------------------------------------------------------------------------


def test_backoff_grows_and_caps():
    delays = list(Backoff(initial_s=0.1, max_s=0.5, multiplier=2.0, jitter=0.0, max_attempts=5).delays())
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    jittered = list(Backoff(initial_s=1.0, jitter=0.2, max_attempts=50).delays())
    assert all(0.8 <= d <= 2.4 for d in jittered)


def test_error_detail_round_trips_through_trailing_metadata():
    error = make_error("BUDGET_INFEASIBLE", "too tight", best_achievable_ms=42.5)

    class FakeRpcError(grpc.RpcError):
        def code(self):
            return error.code

        def details(self):
            return error.detail.message

        def trailing_metadata(self):
            return error.trailing_metadata()

    decoded = PolicyServerError.from_rpc_error(FakeRpcError())
    assert (decoded.code, decoded.reason, decoded.best_achievable_ms) == (
        grpc.StatusCode.FAILED_PRECONDITION, "BUDGET_INFEASIBLE", 42.5)


def test_unreachable_server_is_unavailable():
    with PolicyClient("127.0.0.1:1", timeout_s=0.5, backoff=Backoff(max_attempts=1, initial_s=0.01)) as client:
        with pytest.raises(PolicyServerError) as err:
            client.server_info()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.reason == "UNAVAILABLE"


# -- command-line probe and layering -------------------------------------------------------------


def test_health_probe_command():
    engine = FakeEngine(ready=False)
    with serve_fake(engine) as server:
        probe = [sys.executable, "-m", "policy_server.client", "health", "--target", server.target]
        not_ready = subprocess.run(probe, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert (not_ready.returncode, not_ready.stdout.strip()) == (1, "NOT_SERVING")
        engine.set_ready(True)
        with PolicyClient(server.target) as client:
            client.wait_until_serving(timeout_s=10)
        ready = subprocess.run(probe, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert (ready.returncode, ready.stdout.strip()) == (0, "SERVING")


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
