"""Test helper (not a test module): a local Ray cluster running the Serve application, in the network namespace this
process was started in, reachable from outside it through a Unix socket.

    unshare -n python tests/ray_cluster.py WORKDIR

`tests/test_ray_serve.py` starts it so, once it has built the model in WORKDIR/model (`build_model`, in its own
process, where torch is loaded already: this one does without): Serve's gRPC proxy listens on every interface, and
inside a namespace of its own every interface is this loopback. It refuses to run where the machine has any other
interface. It brings `lo` up, starts Ray on 127.0.0.1 and Serve with `REPLICAS` replicas of the model (uncached, so
that answers repeat exactly; auth token in WORKDIR/token), forwards the Unix socket WORKDIR/serve.sock to the gRPC
proxy, and prints one line: `READY {"gcs": ...}`. Then it answers each JSON line on stdin with one JSON line:
- `{"kill": name}`: kill the replica actor `name` (Serve starts another) -> `{"killed": name}`;
- `{"run": argv}`: run the command here, inside the namespace -> `{"rc": ..., "output": last 4000 characters}`;
- `{"applications": null}`: the Serve applications on the cluster -> `{"applications": sorted names}` (this
  driver asks the controller: a process of its own would spend seconds joining the cluster).
It exits when stdin closes, and Ray with it (Serve's replicas too: no graceful stop, which waits seconds on each).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

REPLICAS = 2
GRPC_PORT = 9000
SAMPLER_STEPS = 4
TOKEN = "ray-serve-test-token"


def namespace_prefix() -> list[str] | None:
    """The command that runs a program in a new network namespace here: as root, or as a user who may make user
    namespaces; None where neither works."""
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


def loopback_up() -> None:
    """`ip link set lo up`, without needing iproute2."""
    get_flags, set_flags, up = 0x8913, 0x8914, 0x1  # SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh", fcntl.ioctl(s, get_flags, struct.pack("16sh", b"lo", 0)))[1]
        fcntl.ioctl(s, set_flags, struct.pack("16sh", b"lo", flags | up))


def build_model(directory: Path) -> None:
    """A small random model (4 sampler steps) in `directory`."""
    from robots.embedded import build_random_pipeline

    build_random_pipeline(directory, seed=5)
    policy = directory / "policy.json"
    policy.write_text(json.dumps({**json.loads(policy.read_text()), "num_steps": SAMPLER_STEPS}))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def _bridge(path: Path, port: int, started: threading.Event) -> None:
    """Every connection to the Unix socket `path` forwarded to 127.0.0.1:`port`, byte for byte."""

    async def forward(reader, writer):
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))

    server = await asyncio.start_unix_server(forward, str(path))
    started.set()
    await server.serve_forever()


def main(workdir: Path) -> None:
    if [name for _, name in socket.if_nameindex()] != ["lo"]:
        raise SystemExit("ray_cluster.py: run me in a network namespace of my own (unshare -n)")
    loopback_up()
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    from policy_server.ray_serve.app import build_app, grpc_options

    model = workdir / "model"
    (workdir / "token").write_text(TOKEN)
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=4, log_to_driver=False)
    serve.start(http_options=HTTPOptions(host="127.0.0.1"), grpc_options=grpc_options(GRPC_PORT))
    serve.run(build_app({"checkpoint": str(model), "num_replicas": REPLICAS, "num_cpus": 0.5, "device": "cpu",
                         "quality_profile": "off", "diffusion_cache": False, "max_batch": 1,
                         "latency_budget_ms": 5000, "max_sessions": 8, "auth_token_file": str(workdir / "token")}),
              name="policy", route_prefix="/policy")
    bridged = threading.Event()
    threading.Thread(target=asyncio.run, args=(_bridge(workdir / "serve.sock", GRPC_PORT, bridged),),
                     daemon=True).start()
    bridged.wait()
    print("READY " + json.dumps({"gcs": ray.get_runtime_context().gcs_address}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if "kill" in command:
            ray.kill(ray.get_actor(command["kill"], namespace="serve"), no_restart=True)
            reply = {"killed": command["kill"]}
        elif "applications" in command:
            reply = {"applications": sorted(serve.status().applications)}
        else:
            done = subprocess.run(command["run"], capture_output=True, text=True)
            reply = {"rc": done.returncode, "output": (done.stdout + done.stderr)[-4000:]}
        print(json.dumps(reply), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
