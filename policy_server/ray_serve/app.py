"""The Serve application: ``build_app(args)``, its arguments, and the proxy's gRPC options.

    serve run deploy/serve_config.yaml                       # what a Ray cluster (or KubeRay) runs
    build_app({"checkpoint": "/models/pusht", "num_replicas": 4, "latency_budget_ms": 100})

The arguments are ``ReplicaSettings`` (how many replicas, their GPUs and CPUs) and any ``ServerConfig`` key of
the model, budget, cache and limits (as in a ``policy-server --config`` file). The network keys do not apply:
Serve's proxy is the server (``grpc_options.port``), and its TLS is the cluster's ingress.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from ray import serve
from ray.serve.config import RequestRouterConfig, gRPCOptions

from policy_server.config import ConfigError, ServerConfig, build_config, environment_values, no_boolean
from policy_server.ray_serve.deployment import PolicyDeployment
from policy_server.server.app import max_concurrent_calls

APPLICATION = "policy"  # the default application name (the client's serve_application)
GRPC_PORT = 9000  # Serve's default gRPC proxy port
GRPC_SERVICER_FUNCTIONS = ["policy_server.v1.policy_server_pb2_grpc.add_PolicyServiceServicer_to_server"]
CONSISTENT_HASH_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
# ServerConfig keys of the direct server's own network, which the proxy replaces.
NOT_UNDER_SERVE = ("host", "port", "unix_socket", "websocket_port", "websocket_embodiment", "metrics_port",
                   "metrics_host", "reflection", "tls_cert", "tls_key")


class ReplicaSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_replicas: int = Field(1, ge=1, description="replicas; each holds its own sessions")
    # Finite: Serve's options took an infinite count and failed `serve run` in an OverflowError traceback.
    num_gpus: float | None = Field(None, ge=0, allow_inf_nan=False,
                                   description="GPUs per replica (unset: 0 with device cpu, else 1)")
    num_cpus: float = Field(1.0, ge=0, allow_inf_nan=False, description="CPUs per replica")

    _no_boolean = field_validator("*", mode="before")(no_boolean)


def grpc_options(port: int = GRPC_PORT) -> gRPCOptions:
    """The proxy's gRPC options: the ``policy_server.v1`` service on ``port``."""
    return gRPCOptions(port=port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS)


def split_args(args: dict[str, Any], overrides: dict[str, Any] | None = None,
               source: str = "application args") -> tuple[ReplicaSettings, ServerConfig]:
    """The application arguments (``args`` from ``source``, then the ``POLICY_SERVER_*`` environment, then
    ``overrides``, as for ``policy-server``) as replica settings and the replicas' server config;
    ``ConfigError`` naming every key that is wrong."""
    args = {key.replace("-", "_"): value for key, value in args.items()}
    overrides = {key.replace("-", "_"): value for key, value in (overrides or {}).items()}
    given = set(args) | set(overrides) | set(environment_values(os.environ))
    misplaced = sorted(given & set(NOT_UNDER_SERVE))
    if misplaced:
        raise ConfigError(f"{', '.join(misplaced)}: not settings of a Serve application (Serve's proxy serves "
                          "gRPC: grpc_options.port; TLS belongs to the cluster's ingress)")
    replica_args = {key: layer.pop(key) for layer in (args, overrides) for key in list(layer)
                    if key in ReplicaSettings.model_fields}
    try:
        replicas = ReplicaSettings(**replica_args)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg'].removeprefix('Value error, ')}"
                             + ("" if "got " in err["msg"] else f" (got {err['input']!r})") for err in exc.errors())
        raise ConfigError(f"invalid replica settings: {problems}") from None
    config = build_config(args, overrides, source=source, environment=os.environ)
    if config.device.startswith("cuda:"):
        raise ConfigError(f"device {config.device!r}: under Ray each replica sees only the GPU Ray gave it; "
                          "expected auto, cpu or cuda")
    return replicas, config


def build_app(args: dict[str, Any]) -> serve.Application:
    """The application for ``serve run`` / ``serve deploy``: ``import_path: policy_server.ray_serve.app:build_app``."""
    return application(*split_args(args))


def application(replicas: ReplicaSettings, config: ServerConfig) -> serve.Application:
    """``replicas`` replicas of the engine ``config`` describes, routed by session."""
    return serve.deployment(PolicyDeployment).options(**deployment_options(replicas, config)).bind(config)


def gpus_per_replica(replicas: ReplicaSettings, config: ServerConfig) -> float:
    """``num_gpus``, else 0 for a replica on the CPU and 1 otherwise."""
    return replicas.num_gpus if replicas.num_gpus is not None else (0 if config.device == "cpu" else 1)


def deployment_options(replicas: ReplicaSettings, config: ServerConfig) -> dict[str, Any]:
    """Serve's options of the deployment: strict session affinity, as many calls at once as ``policy-server``
    serves for ``config.max_sessions``, the replicas' resources."""
    return {
        "num_replicas": replicas.num_replicas,
        "ray_actor_options": {"num_cpus": replicas.num_cpus, "num_gpus": gpus_per_replica(replicas, config)},
        "max_ongoing_requests": max_concurrent_calls(config.max_sessions, config.max_dynamics_calls,
                                                     reflection=False),  # Serve's proxy serves none
        "request_router_config": RequestRouterConfig(request_router_class=CONSISTENT_HASH_ROUTER,
                                                     request_router_kwargs={"num_fallback_replicas": 0}),
    }
