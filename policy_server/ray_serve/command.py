"""``policy-server ray-serve``: the Serve application on a Ray cluster, until SIGINT / SIGTERM.

    policy-server ray-serve --num-replicas 2 --checkpoint /models/pusht            # a local Ray, CPU or GPU
    policy-server ray-serve --address auto --num-replicas 8 --grpc-port 9000       # a running cluster

It starts Serve with the ``policy_server.v1`` service on the gRPC proxy (``--grpc-port``; the proxy listens on
every interface) and its HTTP proxy on ``--http-host``, runs the application under ``--name``, and deletes it
on exit. Clients connect to the proxy with ``PolicyClient(target, serve_application=NAME)``. The server flags
are ``policy-server``'s (also from ``--config`` or ``POLICY_SERVER_*``), less the network ones.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable

from policy_server.cli import build_parser
from policy_server.config import ConfigError, chosen_config_file, read_config_file
from policy_server.ray_serve.address import gcs_address

# How long a stop waits for Serve to delete an application none of whose replicas ran, killing them meanwhile: past
# Serve's own forced end of a replica (its graceful shutdown timeout, 20 s), so a stuck controller cannot hold it.
_UNSTARTED_DELETE_S = 30.0


def _port(value: str) -> int:
    """argparse type: a TCP port to listen on."""
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65535, got {value!r}")
    return int(value)


def _application_name(value: str) -> str:
    """argparse type: a Serve application's name, its route prefix and the clients' `serve_application` header."""
    if not re.fullmatch(r"[A-Za-z0-9._-]+", value):
        raise argparse.ArgumentTypeError(f"expected a name of letters, digits, '.', '_' or '-', got {value!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = build_parser(network=False)
    parser.prog = "policy-server ray-serve"
    parser.description = __doc__.split("\n\n")[0]
    g = parser.add_argument_group("Ray Serve")
    g.add_argument("--address", help="Ray cluster to join (auto: the local node's; unset: RAY_ADDRESS, or start "
                   "a Ray instance here)")
    g.add_argument("--name", type=_application_name, help="application name, the clients' serve_application (policy)")
    g.add_argument("--grpc-port", type=_port, help="the gRPC proxy's port, on every interface (9000)")
    g.add_argument("--http-host", help="the HTTP proxy's address (127.0.0.1)")
    g.add_argument("--http-port", type=_port, help="the HTTP proxy's port (8000)")
    g.add_argument("--num-replicas", type=int, help="replicas, each with its own engine and sessions (1)")
    g.add_argument("--num-gpus", type=float, help="GPUs per replica (0 with --device cpu, else 1)")
    g.add_argument("--num-cpus", type=float, help="CPUs per replica (1)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(sys.argv[1:] if argv is None else argv))
    serve_keys = {key: args.pop(key) for key in ("address", "name", "grpc_port", "http_host", "http_port")
                  if key in args}
    try:
        import ray
        from ray import serve
        from ray.serve.config import HTTPOptions

        from policy_server.ray_serve.app import (
            APPLICATION,
            GRPC_PORT,
            application,
            gpus_per_replica,
            grpc_options,
            split_args,
        )
    except ImportError as exc:
        print(f"policy-server ray-serve: needs Ray Serve ({exc}); pip install 'policy-server[ray]'", file=sys.stderr)
        return 2
    config_file = chosen_config_file(args, os.environ)
    try:
        file_values = read_config_file(config_file) if config_file is not None else {}
        replicas, config = split_args(file_values, args, source=str(config_file or "config"))
    except ConfigError as exc:
        print(f"policy-server ray-serve: {exc}", file=sys.stderr)
        return 2

    name = serve_keys.get("name", APPLICATION)
    try:
        ray.init(address=gcs_address(serve_keys.get("address")))
    except ConnectionError as exc:  # --address (or RAY_ADDRESS) names no running Ray
        print(f"policy-server ray-serve: {exc}", file=sys.stderr)
        return 2
    # After ray.init, whose own handler would end the process at once; a signal during startup stops the
    # application as soon as it runs.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    gpus, cluster_gpus = gpus_per_replica(replicas, config), ray.cluster_resources().get("GPU", 0)
    if gpus and cluster_gpus < gpus:
        print(f"policy-server ray-serve: each replica asks for {gpus:g} GPU and the Ray cluster has "
              f"{cluster_gpus:g}; pass --device cpu (or --num-gpus 0) to serve on the CPU", file=sys.stderr)
        return 2
    options = grpc_options(serve_keys.get("grpc_port", GRPC_PORT))
    http = HTTPOptions(host=serve_keys.get("http_host", "127.0.0.1"), port=serve_keys.get("http_port", 8000))
    try:
        serve.start(http_options=http, grpc_options=options)
    except RuntimeError as exc:  # Serve's own proxies could not start, e.g. a port in use
        reason = str(exc).strip().splitlines()[-1]
        ray.shutdown()  # first: the controller's log lines about it stream until then, and ours comes last
        print(f"policy-server ray-serve: Serve's proxies (gRPC port {options.port}, HTTP {http.host}:{http.port}) "
              f"did not start: {reason}", file=sys.stderr)
        return 2
    # Not serve.run, which waits for the replicas' warmup deaf to signals (for ever where none can be scheduled) and
    # ends in Serve's traceback where they fail.
    try:
        serve.run_many([serve.RunTarget(application(replicas, config), name=name, route_prefix=f"/{name}")],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        print(f"policy-server ray-serve: deploying application {name!r} ({replicas.num_replicas} replica(s) loading "
              "and warming up)", flush=True)
        failure = _wait_until_running(serve.status, name, stop)
        if failure is None and not stop.is_set():
            print(f"policy-server ray-serve: application {name!r} on the gRPC proxy, port {options.port}", flush=True)
            while not stop.wait(timeout=1.0):  # timed, as cli.serve's: a signal another thread received still stops it
                pass
    finally:  # however this process ends, the application ends with it
        running = _replicas_running(serve.status(), name)
        if stop.is_set():
            after = " once its replicas' calls end" if running else ""
            print(f"policy-server ray-serve: stopping; deleting application {name!r}{after}", flush=True)
        if running:  # Serve waits for their calls to end, up to its graceful shutdown timeout (20 s)
            serve.delete(name)
        else:  # no replica took a call: nothing to wait for
            serve.delete(name, _blocking=False)
            # Until the delete reaches the deployment, Serve starts a replica in place of one killed.
            gone_by = time.monotonic() + _UNSTARTED_DELETE_S
            while name in serve.status().applications and time.monotonic() < gone_by:
                _kill_replicas(ray, name)
                time.sleep(0.1)
    if failure is not None:
        ray.shutdown()  # first: the controller's log lines about it stream until then, and ours comes last
        print(f"policy-server ray-serve: application {name!r} did not start: {failure}", file=sys.stderr)
        return 2
    return 0


def _replicas_running(status, name: str) -> bool:
    """Whether any replica of the application ``name`` runs (may have taken calls), in `serve.status()`."""
    application = status.applications.get(name)
    return application is not None and any(deployment.replica_states.get("RUNNING", 0)
                                           for deployment in application.deployments.values())


def _kill_replicas(ray, name: str) -> None:
    """Kill the replica actors of the application ``name``, none of which runs (none took a call). Else Serve's
    delete waits out its graceful shutdown timeout (20 s) on a replica Ray has not scheduled yet, whose shutdown call
    never runs (ray-project/ray#50426): Ctrl-C while deploying took 20 s to end."""
    prefix = f"SERVE_REPLICA::{name}#"  # Serve's replica actor names, in its namespace "serve"
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == "serve" and actor["name"].startswith(prefix):
            try:
                ray.kill(ray.get_actor(actor["name"], namespace="serve"), no_restart=True)
            except ValueError:  # it ended meanwhile
                pass


def _wait_until_running(status: Callable, name: str, stop: threading.Event) -> str | None:
    """Wait until the application ``name`` runs or ``stop`` is set (None), polling ``status`` (`serve.status`) each
    second; else why it failed: Serve's account and the last line of its replicas' error (their exception, where a
    constructor raised). An application that turns unhealthy on the way is said once: Serve may yet replace its
    replicas."""
    unhealthy = False
    while True:
        app = status().applications.get(name)
        if app is None:
            return "it was deleted while it deployed"
        if app.status == "RUNNING":
            return None
        if app.status == "DEPLOY_FAILED":
            lines = [line.strip() for deployment in app.deployments.values()
                     for line in deployment.message.splitlines() if line.strip()] or [app.message]
            summary = lines[0].split(". ")[0]  # "The deployment failed to start 3 times in a row"
            error = re.sub(r"^[\w.]+\.(\w+: )", r"\1", lines[-1])  # the exception, its class unqualified
            return summary if len(lines) == 1 else f"{summary}; the last error: {error}"
        if app.status == "UNHEALTHY" and not unhealthy:
            print(f"policy-server ray-serve: application {name!r} is unhealthy ({app.message}); waiting for Serve to "
                  "replace its replicas (Ctrl-C to stop)", file=sys.stderr, flush=True)
        unhealthy = app.status == "UNHEALTHY"
        if stop.wait(timeout=1.0):
            return None


if __name__ == "__main__":
    raise SystemExit(main())
