"""`python -m robots.serve_overhead`: what Ray Serve's gRPC proxy adds to a tick, against a direct connection.

    unshare -rn sh -c 'ip link set lo up && python -m robots.serve_overhead --ticks 300 --out serve_overhead.json'

It serves one model twice on this machine, with the same settings: a `policy-server` child process on 127.0.0.1, and
a Serve application of one replica on a local Ray (`policy_server.ray_serve`). Serve's proxy listens on every
interface, hence the network namespace above (`unshare -rn`: no root needed where user namespaces are allowed). One
session on each, the same observation; the ticks alternate between the two, over unary `Act` and then over the
`Control` stream, so that both see the same machine. A tick's overhead is its round trip at the client less the time
the servicer spent on it (the answer's `served_ms`): the network, gRPC and, behind Serve, the proxy, Ray's call to
the replica and the replica's thread hop. The report gives p50 / p99 of each and their difference.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from policy_server.client import ControlStream, PolicyClient
from policy_server.output_file import output_file
from robots.soak import ServerProcess

IMAGE = np.zeros((64, 64, 3), np.uint8)
STATE = np.zeros(2, np.float32)


def _unary(client: PolicyClient, session, step: int) -> tuple[float, float]:
    started = time.perf_counter()
    chunk = client.act(session, {"image": IMAGE}, STATE, step_index=step, encoding="png")
    return (time.perf_counter() - started) * 1e3, chunk.served_ms


def _streamed(stream: ControlStream, step: int) -> tuple[float, float]:
    started = time.perf_counter()
    stream.send({"image": IMAGE}, STATE, step_index=step, encoding="png")
    chunk = stream.next_chunk(timeout_s=60)
    return (time.perf_counter() - started) * 1e3, chunk.served_ms


def _stats(samples: list[tuple[float, float]]) -> dict:
    round_trip = np.array([rt for rt, _ in samples])
    served = np.array([s for _, s in samples])
    overhead = round_trip - served
    return {name: {"p50": round(float(np.percentile(v, 50)), 3), "p99": round(float(np.percentile(v, 99)), 3)}
            for name, v in (("round_trip_ms", round_trip), ("served_ms", served), ("overhead_ms", overhead))}


def measure(clients: dict[str, PolicyClient], ticks: int) -> dict:
    """Per path ("direct", "serve") and call kind: round trip, served and overhead ms, the ticks interleaved."""
    sessions = {name: c.open_session("pusht", "reach the red circle", rate_hz=0.0) for name, c in clients.items()}
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for step in range(ticks):
        for name, client in clients.items():
            samples.setdefault((name, "act"), []).append(_unary(client, sessions[name], step))
    streams = {name: ControlStream(c, sessions[name]).open() for name, c in clients.items()}
    for step in range(ticks):
        for name, stream in streams.items():
            samples.setdefault((name, "control"), []).append(_streamed(stream, step))
    for name, stream in streams.items():
        stream.close()
        clients[name].close_session(sessions[name])
    return {f"{name}_{kind}": _stats(values) for (name, kind), values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m robots.serve_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ticks", type=int, default=300, help="ticks per path and call kind (300)")
    parser.add_argument("--checkpoint", default=None, help="model to serve (default: the embedded one)")
    parser.add_argument("--latency-budget-ms", type=float, default=120.0, help="per-tick budget, ms (120)")
    parser.add_argument("--grpc-port", type=int, default=9000, help="Serve's gRPC proxy port (9000)")
    parser.add_argument("--out", type=output_file, default="serve_overhead.json",
                        help="JSON report (serve_overhead.json)")
    args = parser.parse_args(argv)
    if args.ticks < 1:
        parser.error(f"--ticks must be a positive integer, got {args.ticks}")

    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    from policy_server.ray_serve.app import build_app, grpc_options

    settings = {"latency_budget_ms": args.latency_budget_ms, "device": "cpu", "max_sessions": 2}
    if args.checkpoint:
        settings["checkpoint"] = args.checkpoint
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in settings.items()]
    direct = ServerProcess(flags, Path(tempfile.mkdtemp()) / "server.log")
    try:
        direct.wait_serving(timeout_s=300)
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
        serve.start(http_options=HTTPOptions(host="127.0.0.1"), grpc_options=grpc_options(args.grpc_port))
        serve.run(build_app({**settings, "num_replicas": 1}), name="policy", route_prefix="/policy")
        clients = {"direct": PolicyClient(direct.target, timeout_s=60),
                   "serve": PolicyClient(f"127.0.0.1:{args.grpc_port}", serve_application="policy", timeout_s=60)}
        for client in clients.values():
            client.wait_until_serving(timeout_s=300)
        paths = measure(clients, args.ticks)
    finally:
        direct.stop()
    report = {"ticks": args.ticks, "settings": settings, **paths,
              "proxy_overhead_ms": {kind: {q: round(paths[f"serve_{kind}"]["overhead_ms"][q]
                                                    - paths[f"direct_{kind}"]["overhead_ms"][q], 3)
                                           for q in ("p50", "p99")} for kind in ("act", "control")}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["proxy_overhead_ms"], indent=2))
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
