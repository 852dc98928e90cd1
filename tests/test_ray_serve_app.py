"""The Ray Serve application without a cluster: its arguments and deployment options, the shipped Serve and KubeRay
configs, what a replica makes of a call's metadata (`ServeCall`), the client's metadata behind Serve, and
`policy-server ray-serve`'s refusals of bad settings."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import yaml
from fake_engine import serve_fake
from google.rpc import status_pb2

from policy_server.client import PolicyClient
from policy_server.config import ConfigError
from policy_server.v1 import serve_metadata

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'policy-server[ray]')")

from ray.serve.schema import ServeDeploySchema  # noqa: E402

from policy_server.ray_serve.app import (  # noqa: E402
    APPLICATION,
    CONSISTENT_HASH_ROUTER,
    GRPC_SERVICER_FUNCTIONS,
    deployment_options,
    split_args,
)
from policy_server.ray_serve.call import CallAborted, ServeCall  # noqa: E402
from policy_server.ray_serve.command import _wait_until_running  # noqa: E402
from policy_server.ray_serve.command import main as ray_serve_main  # noqa: E402
from policy_server.server.app import max_concurrent_calls  # noqa: E402

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def test_application_args_split_into_replica_settings_and_the_server_config():
    replicas, config = split_args({"num-replicas": "3", "num_gpus": 0.5, "latency_budget_ms": "90", "max_sessions": 6,
                                 "max_dynamics_calls": 2})
    assert (replicas.num_replicas, replicas.num_gpus, replicas.num_cpus) == (3, 0.5, 1.0)
    assert (config.latency_budget_ms, config.max_sessions) == (90.0, 6)
    options = deployment_options(replicas, config)
    assert options["num_replicas"] == 3
    assert options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.5}
    # What a replica serves at once: 6 sessions, 2 dynamics calls; no reflection behind Serve.
    assert options["max_ongoing_requests"] == max_concurrent_calls(6, 2, reflection=False)
    router = options["request_router_config"]
    assert (router.request_router_class, router.request_router_kwargs) == (CONSISTENT_HASH_ROUTER,
                                                                          {"num_fallback_replicas": 0})


@pytest.mark.parametrize(("device", "gpus"), [("cpu", 0), ("auto", 1), ("cuda", 1)])
def test_a_replica_takes_one_gpu_unless_it_runs_on_the_cpu(device, gpus):
    assert deployment_options(*split_args({"device": device}))["ray_actor_options"]["num_gpus"] == gpus


@pytest.mark.parametrize(("args", "named"), [
    ({"port": 50051}, "port: not settings of a Serve application"),
    ({"tls_cert": "c.pem", "metrics_port": 9464}, "metrics_port, tls_cert: not settings"),
    ({"num_replicas": 0}, "num_replicas: Input should be greater than or equal to 1 (got 0)"),
    ({"num_cpus": "many"}, "num_cpus: Input should be a valid number"),
    ({"device": "cuda:1"}, "device 'cuda:1': under Ray each replica sees only the GPU Ray gave it"),
    ({"latency_budget_ms": -5}, "latency_budget_ms (from application args)"),
    ({"max_sesions": 4}, "max_sesions"),
    # Serve took these: an infinite count failed `serve run` in an OverflowError traceback, a YAML boolean (num_gpus:
    # off, num_replicas: yes) counted as 0 or 1.
    ({"num_gpus": math.inf}, "num_gpus: Input should be a finite number (got inf)"),
    ({"num_cpus": math.inf}, "num_cpus: Input should be a finite number (got inf)"),
    ({"num_gpus": False}, "num_gpus: expected a number, got False (YAML reads on / off / yes / no as booleans"),
    ({"num_replicas": True}, "num_replicas: expected a number, got True"),
])
def test_bad_application_args_are_refused_by_name(args, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        split_args(args)


def test_the_shipped_serve_config_and_rayservice_run_this_application():
    local = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    service, grpc_service = yaml.safe_load_all((DEPLOY / "rayservice.yaml").read_text())
    kuberay = yaml.safe_load(service["spec"]["serveConfigV2"])
    for config in (local, kuberay):
        schema = ServeDeploySchema.model_validate(config)
        assert schema.grpc_options.grpc_servicer_functions == GRPC_SERVICER_FUNCTIONS
        (app,) = schema.applications
        assert (app.name, app.route_prefix, app.import_path) == (APPLICATION, "/policy",
                                                                 "policy_server.ray_serve.app:build_app")
        split_args(app.args)
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert kuberay["applications"][0]["args"]["num_replicas"] == sum(group["replicas"] for group in workers)
    assert grpc_service["spec"]["ports"][0]["port"] == kuberay["grpc_options"]["port"]


class SeenContext:
    """What Serve's `RayServegRPCContext` offers a replica: the call's metadata, and a status to set."""

    def __init__(self, metadata: dict[str, str]) -> None:
        self.metadata = metadata
        self.code = self.details = None
        self.trailers: list = []

    def invocation_metadata(self):
        return list(self.metadata.items())

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details

    def set_trailing_metadata(self, trailers):
        self.trailers = list(trailers)


def test_a_call_keeps_the_callers_deadline_and_ends_once():
    context = SeenContext({serve_metadata.TIMEOUT_KEY: "60000"})
    call = ServeCall(context, "SERVE_REPLICA::policy#PolicyDeployment#a", received_s=time.monotonic())
    assert context.trailers == [("replica_id", "SERVE_REPLICA::policy#PolicyDeployment#a")]
    assert call.time_remaining() == math.inf and call.is_active()  # until admitted: no deadline read yet
    call.admit(token=None)
    assert 50 < call.time_remaining() <= 60 and call.is_active()
    late = ServeCall(SeenContext({serve_metadata.TIMEOUT_KEY: "250"}), "r", received_s=time.monotonic() - 1)
    late.admit(token=None)
    assert late.time_remaining() == 0 and not late.is_active()
    ended = []
    call.add_callback(lambda: ended.append(1))
    call.end()
    call.add_callback(lambda: ended.append(2))  # after the end: at once
    assert ended == [1, 2]


@pytest.mark.parametrize(("metadata", "code", "message"), [
    ({serve_metadata.TIMEOUT_KEY: "soon", "authorization": "Bearer sekrit"}, grpc.StatusCode.INVALID_ARGUMENT,
     "BAD_VALUE: policy-timeout-ms metadata: expected a positive number of ms, got 'soon'"),
    ({serve_metadata.TIMEOUT_KEY: "-1", "authorization": "Bearer sekrit"}, grpc.StatusCode.INVALID_ARGUMENT,
     "BAD_VALUE: policy-timeout-ms metadata: expected a positive number of ms, got '-1'"),
    ({}, grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED: missing authorization metadata"),
    # Without the token nothing else is read, as the direct server's interceptor does.
    ({serve_metadata.TIMEOUT_KEY: "soon"}, grpc.StatusCode.UNAUTHENTICATED,
     "UNAUTHENTICATED: missing authorization metadata"),
    ({"authorization": "Bearer nope"}, grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED: invalid authorization token"),
])
def test_a_call_the_replica_refuses_carries_the_status_and_rich_details(metadata, code, message):
    context = SeenContext(metadata)
    with pytest.raises(CallAborted):
        ServeCall(context, "r", received_s=0.0).admit(token="sekrit")
    assert (context.code, context.details) == (code, message)
    trailers = dict(context.trailers)
    assert trailers["replica_id"] == "r"
    assert status_pb2.Status.FromString(trailers["grpc-status-details-bin"]).message == message


def test_the_client_routes_each_session_by_its_own_key_behind_serve():
    with serve_fake() as server, PolicyClient(server.target, token="t", serve_application="policy") as client:
        client.wait_until_serving(timeout_s=10)  # by GetServerInfo: Serve's proxy passes no health service on
        first, second = (client.open_session("pusht", "reach the red circle") for _ in range(2))
        metadata = dict(client.call_metadata(first.session_id, timeout_s=2.5))
        assert metadata == {"authorization": "Bearer t", "application": "policy", "policy-timeout-ms": "2500",
                            "session_id": metadata["session_id"]}
        assert metadata["session_id"] != dict(client.call_metadata(second.session_id))["session_id"]
        # A direct server ignores the metadata Serve's proxy routes by.
        client.act(first, {"image": np.zeros((64, 64, 3), np.uint8)}, np.zeros(2, np.float32))
        client.close_session(first)
        assert "session_id" not in dict(client.call_metadata(first.session_id))
    with PolicyClient("127.0.0.1:1", token="t") as direct:
        assert direct.call_metadata("any", timeout_s=1.0) == (("authorization", "Bearer t"),)


@pytest.mark.parametrize(("argv", "message"), [
    (["--port", "50051"], "port: not settings of a Serve application"),
    (["--num-replicas", "0"], "num_replicas: Input should be greater than or equal to 1"),
    (["--latency-budget-ms", "0"], "latency_budget_ms (from command line)"),
])
def test_ray_serve_refuses_bad_settings_before_starting_ray(argv, message, capsys):
    assert ray_serve_main(argv) == 2
    assert message in capsys.readouterr().err


def test_ray_serve_reads_the_config_file_the_environment_names(tmp_path, monkeypatch, capsys):
    (tmp_path / "serve.yaml").write_text("max_sesions: 4\n")
    monkeypatch.setenv("POLICY_SERVER_CONFIG", str(tmp_path / "serve.yaml"))
    assert ray_serve_main([]) == 2
    assert "max_sesions" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["", "my app", "a/b"])
def test_ray_serve_refuses_an_application_name_clients_could_not_route_to(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        ray_serve_main(["--name", name])
    assert exit_.value.code == 2
    assert f"expected a name of letters, digits, '.', '_' or '-', got {name!r}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--grpc-port", "--http-port"])
def test_ray_serve_refuses_a_port_it_cannot_listen_on(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        ray_serve_main([flag, "70000"])
    assert exit_.value.code == 2 and "expected a port from 1 to 65535, got '70000'" in capsys.readouterr().err


def test_a_replica_whose_engine_did_not_build_is_destroyed_as_serve_does_without_an_error_of_its_own(tmp_path):
    # Serve calls __del__ of a replica whose constructor raised. Was: "Exception during graceful shutdown of replica:
    # 'PolicyDeployment' object has no attribute '_engine'" after the constructor's own error.
    from policy_server.pipeline.policy import CheckpointLoadError
    from policy_server.ray_serve.deployment import PolicyDeployment

    (tmp_path / "empty").mkdir()
    _, config = split_args({"checkpoint": str(tmp_path / "empty"), "device": "cpu"})
    replica = PolicyDeployment.__new__(PolicyDeployment)
    with pytest.raises(CheckpointLoadError, match="no model_index.json"):
        replica.__init__(config)
    replica.__del__()


_CONSTRUCTOR_FAILED = """The deployment failed to start 3 times in a row. This may be due to a problem with its \
constructor or initial health check failing. See controller logs for details. Error:
ray::ServeReplica:app:PolicyDeployment.initialize_and_get_metadata() (pid=4555, ip=127.0.0.1)
  File "ray/serve/_private/replica.py", line 1928, in initialize
    raise RuntimeError(traceback.format_exc()) from None
RuntimeError: Traceback (most recent call last):
  File "policy_server/pipeline/policy.py", line 417, in from_pretrained
policy_server.pipeline.policy.CheckpointLoadError: cannot serve checkpoint /m: /m: no model_index.json"""


def _statuses(*apps):
    """A `serve.status` that answers `apps` in turn ((status, message[, its deployment's message]), or None: no such
    application), then the last for ever."""
    answers = list(apps)

    def status():
        app = answers.pop(0) if len(answers) > 1 else answers[0]
        found = {} if app is None else {"app": SimpleNamespace(status=app[0], message=app[1], deployments={
            "PolicyDeployment": SimpleNamespace(message=app[2] if len(app) > 2 else "")})}
        return SimpleNamespace(applications=found)
    return status


def test_ray_serve_waits_for_its_application_to_run_and_says_why_it_did_not(capsys):
    stop = threading.Event()
    assert _wait_until_running(_statuses(("DEPLOYING", ""), ("RUNNING", "")), "app", stop) is None
    failed = _statuses(("DEPLOYING", ""), ("DEPLOY_FAILED", "Failed to update the deployments.", _CONSTRUCTOR_FAILED))
    assert _wait_until_running(failed, "app", stop) == (
        "The deployment failed to start 3 times in a row; the last error: CheckpointLoadError: cannot serve "
        "checkpoint /m: /m: no model_index.json")
    assert _wait_until_running(_statuses(("DEPLOY_FAILED", "Failed to update the deployments.")), "app", stop) == \
        "Failed to update the deployments."
    assert _wait_until_running(_statuses(None), "app", stop) == "it was deleted while it deployed"
    # Unhealthy on the way (a replica lost, and replaced): said once, and waited through.
    healing = _statuses(("UNHEALTHY", "replica died"), ("UNHEALTHY", "replica died"), ("RUNNING", ""))
    assert _wait_until_running(healing, "app", stop) is None
    assert capsys.readouterr().err == ("policy-server ray-serve: application 'app' is unhealthy (replica died); "
                                       "waiting for Serve to replace its replicas (Ctrl-C to stop)\n")
    stop.set()  # a stop signal: no longer waited for
    assert _wait_until_running(_statuses(("DEPLOYING", "")), "app", stop) is None
