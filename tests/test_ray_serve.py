"""The Ray Serve application (`policy_server/ray_serve`) on a local Ray cluster that this module starts in a network
namespace of its own (`tests/ray_cluster.py`: Serve's gRPC proxy listens on every interface), called through the
proxy: strict session affinity over 2 replicas, errors with their reason and details, the caller's deadline and the
token checked in the replica, the Control stream, `policy-rollout --ray` equal to a local run, and last a replica
killed mid-run (its streams re-open their sessions; no answer reaches another session). One cluster for the module;
skipped, saying why, where Ray Serve is missing or no network namespace can be made."""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
from ray_cluster import GRPC_PORT, TOKEN, build_model, namespace_prefix

from policy_server.client import Backoff, ControlStream, PolicyClient, PolicyServerError, Session, build_observation
from policy_server.v1 import policy_server_pb2 as pb
from policy_server.v1.serve_metadata import REPLICA_KEY

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'policy-server[ray]')")

HELPER = Path(__file__).with_name("ray_cluster.py")
IMAGE = np.zeros((64, 64, 3), np.uint8)
STATE = np.zeros(2, np.float32)
READY_TIMEOUT_S = 240


class Cluster:
    """The helper process: its reply lines, read on a thread; `command` sends one command and waits for its reply."""

    def __init__(self, workdir: Path, prefix: list[str]) -> None:
        self.workdir = workdir
        self.target = f"unix:{workdir / 'serve.sock'}"
        self.log = open(workdir / "cluster.log", "w")
        self.process = subprocess.Popen([*prefix, sys.executable, str(HELPER), str(workdir)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.info: dict = {}

    def _read(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put("")  # it exited

    def _line(self, timeout_s: float) -> str:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            line = ""
        if not line:
            raise AssertionError(f"no answer from the cluster; its log: {self.workdir / 'cluster.log'}")
        return line

    def wait_ready(self) -> None:
        self.info = json.loads(self._line(READY_TIMEOUT_S).removeprefix("READY "))

    def command(self, timeout_s: float = 300, **command) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return json.loads(self._line(timeout_s))

    def client(self, token: str | None = TOKEN) -> PolicyClient:
        return PolicyClient(self.target, token=token, serve_application="policy", timeout_s=60)

    def close(self) -> None:
        self.process.stdin.close()  # it shuts Serve and Ray down and exits
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    prefix = namespace_prefix()
    if prefix is None:
        pytest.skip("cannot make a network namespace here (unshare -n / -rn); Serve's gRPC proxy listens on every "
                    "interface, so its cluster runs only inside one")
    workdir = tmp_path_factory.mktemp("ray")
    build_model(workdir / "model")
    cluster = Cluster(workdir, prefix)
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def client(cluster):
    with cluster.client() as client:
        client.wait_until_serving(timeout_s=120)
        yield client


def replica_of(client: PolicyClient, session: Session, routed_as: str | None = None) -> str:
    """The replica that answers an Act of `session` (routed as session `routed_as`'s calls, default its own)."""
    request = pb.ActRequest(session_id=session.session_id, epoch=session.epoch, observation=_observation())
    metadata = client.call_metadata(routed_as or session.session_id, timeout_s=60)
    response, call = client.stub.Act.with_call(request, metadata=metadata, timeout=60)
    assert response.session_id == session.session_id
    return dict(call.trailing_metadata())[REPLICA_KEY]


def _observation() -> pb.Observation:
    return build_observation({"image": IMAGE}, STATE, encoding="png")


def spread_sessions(client: PolicyClient, count: int) -> dict[str, tuple[Session, str]]:
    """Open `count` sessions that both replicas hold some of: session id -> (session, its replica). A session routed to
    the replica that already holds `count - 1` is closed again, so neither comes near its session limit (8) however
    the routing keys fall (CI: 8 sessions in a row on one replica, and the 9th refused TOO_MANY_SESSIONS)."""
    opened: dict[str, tuple[Session, str]] = {}
    for attempt in range(64):
        session = client.open_session("pusht", "reach the red circle", seed=attempt, rate_hz=0.0)
        replica = replica_of(client, session)
        if [held for _, held in opened.values()].count(replica) == count - 1:
            client.close_session(session)
        else:
            opened[session.session_id] = session, replica
            if len(opened) == count:
                return opened
    raise AssertionError(f"64 sessions opened, and {count} of them not spread over both replicas: {opened}")


def test_every_call_of_a_session_reaches_the_replica_that_opened_it(client):
    opened = spread_sessions(client, count=6)
    where = {session_id: replica for session_id, (_, replica) in opened.items()}
    for _ in range(2):
        assert {session_id: replica_of(client, session) for session_id, (session, _) in opened.items()} == where
    # Routed by another session's key, to the other replica, a session is unknown: affinity is what makes it work.
    session, replica = next(iter(opened.values()))
    elsewhere = next(session_id for session_id, other in where.items() if other != replica)
    with pytest.raises(grpc.RpcError) as refused:
        replica_of(client, session, routed_as=elsewhere)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert refused.value.details().startswith("SESSION_NOT_FOUND: ")
    for session_id in where:
        client.close_session(session_id)


def test_errors_keep_their_reason_and_unary_ones_their_rich_details(client):
    session = client.open_session("pusht", "reach the red circle", rate_hz=0.0)
    with pytest.raises(PolicyServerError) as unary:
        client.act(session, {"image": np.zeros((3, 3, 3), np.uint8)}, STATE)
    assert (unary.value.code, unary.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "SCHEMA_MISMATCH")
    assert unary.value.field == "observation.images[image]" and "8..2048" in unary.value.detail.expected
    # A stream that fails keeps its code and "REASON: message"; Serve drops the trailers of a streaming call.
    lost = Session("0" * 32, 0, "pusht", "reach the red circle", 5000.0, 8, 0)
    with pytest.raises(PolicyServerError) as stream:
        ControlStream(client, lost, reconnect=False).open()
    assert (stream.value.code, stream.value.reason) == (grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND")
    assert stream.value.from_server and stream.value.field == ""
    client.close_session(session)


def test_the_callers_deadline_reaches_the_replica(client):
    session = client.open_session("pusht", "reach the red circle", budget_ms=5000, rate_hz=0.0)
    assert client.act(session, {"image": IMAGE}, STATE, timeout_s=60).tick.deadline_ms == 5000
    tight = client.act(session, {"image": IMAGE}, STATE, timeout_s=2).tick.deadline_ms
    assert 0 < tight <= 2000
    client.close_session(session)


def test_the_replica_checks_the_token_and_serves_health_without_one(cluster):
    for token, message in ((None, "missing authorization metadata"), ("wrong", "invalid authorization token")):
        with cluster.client(token) as stranger, pytest.raises(PolicyServerError) as refused:
            stranger.server_info()
        assert (refused.value.code, refused.value.reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
        assert refused.value.message == message
    from ray.serve.generated import serve_pb2, serve_pb2_grpc

    with grpc.insecure_channel(cluster.target) as channel:
        assert serve_pb2_grpc.RayServeAPIServiceStub(channel).Healthz(serve_pb2.HealthzRequest(), timeout=30).message
        applications = serve_pb2_grpc.RayServeAPIServiceStub(channel).ListApplications(
            serve_pb2.ListApplicationsRequest(), timeout=30)
    assert list(applications.application_names) == ["policy"]


def test_the_control_stream_runs_through_the_proxy(client):
    session = client.open_session("pusht", "reach the red circle", rate_hz=0.0)
    with ControlStream(client, session) as stream:
        sent = [stream.send({"image": IMAGE}, STATE, step_index=i, must_answer=True, encoding="png") for i in range(3)]
        chunks = [stream.next_chunk(timeout_s=60) for _ in sent]
        assert [(c.obs_id, c.session_id, c.obs_step_index) for c in chunks] == [
            (obs_id, session.session_id, i) for i, obs_id in enumerate(sent)]
        bad = stream.send({"image": np.zeros((3, 3, 3), np.uint8)}, STATE, step_index=3)
        event = stream.next_event(timeout_s=60)
        assert (event.kind, event.obs_id, event.error.reason) == ("error", bad, "SCHEMA_MISMATCH")
        after = stream.send({"image": IMAGE}, STATE, step_index=4, encoding="png")
        assert stream.next_chunk(timeout_s=60).obs_id == after  # the stream lives on
    client.close_session(session)


class _Relay:
    """A Unix socket at `path` forwarding each connection to the one at `target`, byte for byte, whose link the test
    can cut: `cut()` ends every connection and refuses new ones (a link that went down) until `resume()`."""

    def __init__(self, path: Path, target: Path) -> None:
        self.path, self.target = path, target
        self.up = threading.Event()
        self.up.set()
        self.connections: list[socket.socket] = []
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(path))
        self.listener.listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:  # closed
                return
            if not self.up.is_set():
                near.close()
                continue
            far = socket.socket(socket.AF_UNIX)
            far.connect(str(self.target))
            self.connections += [near, far]
            for source, sink in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.up.clear()
        for connection in self.connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def resume(self) -> None:
        self.up.set()

    def close(self) -> None:
        self.cut()
        self.listener.close()


def test_a_control_stream_through_the_proxy_is_told_how_its_session_ended(cluster, client, tmp_path):
    """Serve's proxy kept a failed stream's code and message only, not its trailers, so not the `session_end` that
    tells a session a CloseSession call closed from one the server lost: a session closed while its stream was away
    was reopened through Ray (`reconnected`, `session_replaced`), where the direct server's stream ends `closed`. The
    stream's error now keeps its details through the proxy, and the client does as it does with the direct server."""
    relay = _Relay(tmp_path / "relay.sock", cluster.workdir / "serve.sock")
    backoff = Backoff(initial_s=0.1, max_s=0.5, max_attempts=200)
    try:
        with PolicyClient(f"unix:{relay.path}", token=TOKEN, serve_application="policy", timeout_s=60) as robot:
            for away in (False, True):
                # Another client (an operator's) closes it: behind Serve, it names the session's routing key
                key = uuid.uuid4().hex
                session = robot.open_session("pusht", "reach the red circle", rate_hz=0.0, request_id=key)
                with ControlStream(robot, session, backoff=backoff) as stream:
                    stream.send({"image": IMAGE}, STATE, step_index=0, must_answer=True, encoding="png")
                    stream.next_chunk(timeout_s=60)
                    if away:  # the robot's link drops, and the session is closed before it is back
                        relay.cut()
                        assert stream.next_event(timeout_s=60).kind == "disconnected"
                    client.close_session(session.session_id, routing_key=key)
                    relay.resume()
                    event = stream.next_event(timeout_s=60)
                    assert event.kind == "closed", event
                    assert (event.error.reason, event.error.session_end) == ("SESSION_NOT_FOUND", "closed")
                    assert event.error.message.startswith(f"session {session.session_id!r} was closed ")
                    assert event.error.message.endswith(" ago: a CloseSession call closed it")
                    assert event.error.detail.metadata["session_id"] == session.session_id
                    with pytest.raises(TimeoutError):  # once: nothing reopened
                        stream.next_event(timeout_s=1)
            # A stream that attaches to it is told so at once (its start's error keeps its details too).
            with pytest.raises(PolicyServerError) as refused:
                ControlStream(robot, session, reconnect=False).open()
            assert (refused.value.reason, refused.value.session_end) == ("SESSION_NOT_FOUND", "closed")
    finally:
        relay.close()


def _rollout(command, out: Path, *flags: str) -> dict:
    argv = ["--episodes", "4", "--execute", "8", "--out", str(out), *flags]
    if command is None:
        from robots.rollout import main

        assert main(argv) == 0
    else:
        done = command(run=[sys.executable, "-m", "robots.rollout", *argv])
        assert done["rc"] == 0, done["output"]
    return json.loads(out.read_text())


# Not the misses: the local run's uncached ticks have no budget, the served ones the server's.
SAME = ("episodes", "success_rate", "episode_length_mean", "ticks", "full_calls_per_tick", "skipped_calls_per_tick",
        "cache_settings")


def _decisions(report: dict) -> list[dict]:
    """Each episode's outcome and its ticks' cache decisions: not their latencies."""
    return [{**episode, "ticks": {key: episode["ticks"][key] for key in ("setting", "full_calls", "skipped_calls")}}
            for episode in report["per_episode"]]


def test_ray_rollouts_equal_a_local_run_in_process_and_through_serve(cluster, tmp_path):
    model, gcs = str(cluster.workdir / "model"), cluster.info["gcs"]
    in_process = ["--in-process", "--checkpoint", model, "--no-diffusion-cache"]
    local = _rollout(None, tmp_path / "local.json", *in_process)
    spread = _rollout(cluster.command, tmp_path / "ray.json", *in_process, "--ray", "2", "--ray-address", gcs)
    served = _rollout(cluster.command, tmp_path / "served.json", "--server", f"127.0.0.1:{GRPC_PORT}",
                      "--serve-application", "policy", "--auth-token-file", str(cluster.workdir / "token"),
                      "--ray", "2", "--ray-address", gcs)
    for report in (spread, served):
        assert {key: report[key] for key in SAME} == {key: local[key] for key in SAME}
        assert _decisions(report) == _decisions(local)
        assert report["config"]["ray_workers"] == 2


def _applications(cluster) -> list[str]:
    """The names of the Serve applications on the cluster."""
    return cluster.command(applications=None)["applications"]


def _ray_serve(cluster, name: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "policy_server.ray_serve.command", "--address", cluster.info["gcs"], "--name", name,
            "--device", "cpu", "--num-cpus", "0.5", "--quality-profile", "off", *flags]


def test_ray_serve_names_the_error_its_replicas_failed_with_and_deletes_the_application(cluster, tmp_path):
    # Was: Serve's traceback, 'RuntimeError: Deploying application broken failed: Failed to update the deployments
    # ['PolicyDeployment'].', exit 1, and the application left on the cluster, DEPLOY_FAILED.
    empty = tmp_path / "empty"
    empty.mkdir()
    done = cluster.command(run=_ray_serve(cluster, "broken", "--checkpoint", str(empty)))
    last = done["output"].strip().splitlines()[-1]
    assert done["rc"] == 2, done["output"]
    assert last.startswith("policy-server ray-serve: application 'broken' did not start: The deployment failed to "
                           f"start 3 times in a row; the last error: CheckpointLoadError: cannot serve checkpoint "
                           f"{empty}: {empty}: no model_index.json"), done["output"]
    assert _applications(cluster) == ["policy"]


_INTERRUPT_WHILE_DEPLOYING = """
import json, signal, subprocess, sys, time
process = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
lines, end = [], time.monotonic() + 60
while time.monotonic() < end and not any("deploying" in line for line in lines):
    lines.append(process.stdout.readline())
time.sleep(1)  # Serve has made the replica's actor by then (Ray cannot schedule it): the case its delete waited out
process.send_signal(signal.SIGINT)
try:
    rc = process.wait(10)  # half Serve's graceful shutdown timeout (20 s)
except subprocess.TimeoutExpired:
    process.kill()
    rc = "still running 10 s after SIGINT"
lines += process.stdout.readlines()
print("OUTCOME", json.dumps({"rc": rc, "ours": [line for line in lines if line.startswith("policy-server")]}))
"""


def test_ray_serve_stops_on_sigint_while_its_replicas_deploy(cluster):
    # A replica that asks for more CPUs than the cluster has waits to be scheduled for ever. Was: SIGINT ignored
    # until the application ran, that is for ever; then: the delete waited out Serve's graceful shutdown timeout
    # (20 s) on that replica, whose shutdown call never ran (ray-project/ray#50426).
    model = str(cluster.workdir / "model")
    done = cluster.command(run=[sys.executable, "-c", _INTERRUPT_WHILE_DEPLOYING,
                                *_ray_serve(cluster, "pending", "--checkpoint", model), "--num-cpus", "64"])
    assert done["rc"] == 0, done["output"]
    outcome = next(json.loads(line.removeprefix("OUTCOME")) for line in done["output"].splitlines()
                   if line.startswith("OUTCOME"))
    assert outcome == {"rc": 0, "ours": ["policy-server ray-serve: deploying application 'pending' (1 replica(s) "
                                         "loading and warming up)\n",
                                         "policy-server ray-serve: stopping; deleting application 'pending'\n"]}
    assert _applications(cluster) == ["policy"]


def test_a_killed_replicas_streams_reopen_their_sessions_and_no_answer_goes_astray(cluster, client):
    opened = spread_sessions(client, count=4)
    victim = next(iter(opened.values()))[1]
    streams = {session_id: ControlStream(client, session, backoff=Backoff(max_attempts=80)).open()
               for session_id, (session, _) in opened.items()}
    for stream in streams.values():
        stream.send({"image": IMAGE}, STATE, step_index=0, encoding="png")
        assert stream.next_chunk(timeout_s=60).session_id == stream.session.session_id
    cluster.command(kill=victim)
    astray, replaced = [], set()

    def drive(opened_id: str, stream: ControlStream) -> None:
        for step in range(1, 8):
            obs_id = stream.send({"image": IMAGE}, STATE, step_index=step, encoding="png")
            while (event := stream.next_event(timeout_s=120)).kind != "chunk":
                assert event.kind in ("disconnected", "reconnected"), event
                if event.kind == "reconnected":
                    if event.session_replaced:
                        replaced.add(opened_id)
                    obs_id = stream.send({"image": IMAGE}, STATE, step_index=step, encoding="png")  # the lost one
            if (event.chunk.session_id, event.chunk.obs_id) != (stream.session.session_id, obs_id):
                astray.append((opened_id, event.chunk.session_id, event.chunk.obs_id))

    threads = [threading.Thread(target=drive, args=item) for item in streams.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert astray == []
    assert replaced == {session_id for session_id, (_, replica) in opened.items() if replica == victim}
    # A lost session is unknown wherever its calls go now; its stream goes on with the session that replaced it.
    with pytest.raises(PolicyServerError) as unknown:
        client.act(opened[next(iter(replaced))][0], {"image": IMAGE}, STATE)
    assert unknown.value.reason == "SESSION_NOT_FOUND"
    for stream in streams.values():
        stream.close()
