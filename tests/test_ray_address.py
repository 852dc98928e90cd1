"""The Ray address `policy-server ray-serve --address` and `policy-rollout --ray-address` join, checked before
`ray.init` (`policy_server/ray_serve/address.py`): where nothing answers, each command ends in one line within
seconds instead of Ray's minutes of GCS retries. Every address dialled here is on the loopback."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from ray_cluster import namespace_prefix

from policy_server.ray_serve import address
from policy_server.ray_serve.address import gcs_address

pytest.importorskip("ray", reason="Ray is not installed (pip install 'policy-server[ray]')")

EXPECTED = "expected the GCS address of a running Ray cluster (HOST:PORT, as `ray start --head` prints it)"


@pytest.fixture
def closed_port():
    """A port on 127.0.0.1 that refuses connections: bound here, so that nothing else takes it, and not listening."""
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        yield bound.getsockname()[1]


@pytest.fixture
def no_ray_address(monkeypatch, tmp_path):
    """No RAY_ADDRESS, no cluster recorded by `ray start` (Ray's temp directory is `tmp_path`/ray) and no GCS process
    found on this machine (other Ray clusters may run here)."""
    from ray._private import services

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setattr(services, "find_gcs_addresses", frozenset)
    return tmp_path / "ray" / "ray_current_cluster"  # where `ray start --head` records its cluster


@pytest.mark.parametrize("value", [None, "local", "ray://127.0.0.1:1"])
def test_addresses_ray_resolves_itself_pass_without_a_connection(value, no_ray_address, monkeypatch):
    monkeypatch.setattr(address.socket, "create_connection", lambda *_, **__: pytest.fail("dialled"))
    assert gcs_address(value) == value


def test_auto_with_no_cluster_found_ends_with_rays_own_error(no_ray_address):
    with pytest.raises(ConnectionError, match="^Could not find any running Ray instance"):
        gcs_address("auto")


@pytest.mark.parametrize(("given", "source"), [(None, "no --address"), ("auto", "--address auto")])
def test_an_unset_or_auto_address_is_checked_where_ray_finds_it(given, source, closed_port, no_ray_address):
    # A head that died (kill -9, a lost container) leaves its record: ray.init would retry it for minutes.
    no_ray_address.parent.mkdir()
    no_ray_address.write_text(f"127.0.0.1:{closed_port}")
    with pytest.raises(ConnectionError) as refused:
        gcs_address(given)
    assert str(refused.value) == (f"nothing answers at the Ray cluster found for {source}: 127.0.0.1:{closed_port} "
                                  f"(Connection refused); {EXPECTED}")


def test_a_listening_gcs_address_passes(no_ray_address):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert gcs_address(f"127.0.0.1:{port}") == f"127.0.0.1:{port}"
        assert gcs_address(f"localhost:{port}") == f"localhost:{port}"
        no_ray_address.parent.mkdir()
        no_ray_address.write_text(f"127.0.0.1:{port}")  # checked, and left for ray.init to find again
        assert gcs_address("auto") == "auto"
        assert gcs_address(None) is None


def test_an_address_where_nothing_answers_is_named_with_the_reason(closed_port, no_ray_address):
    with pytest.raises(ConnectionError) as refused:
        gcs_address(f"127.0.0.1:{closed_port}")
    assert str(refused.value) == (f"nothing answers at Ray address 127.0.0.1:{closed_port} (Connection refused); "
                                  f"{EXPECTED}")


@pytest.mark.parametrize("given", [None, "auto"])
def test_ray_address_stands_in_for_an_unset_or_auto_address_as_in_ray_init(given, closed_port, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{closed_port}")
    with pytest.raises(ConnectionError, match=rf"^nothing answers at RAY_ADDRESS 127\.0\.0\.1:{closed_port} "):
        gcs_address(given)


@pytest.mark.parametrize("value", ["head", "head:", ":6379", "head:port", "head:70000"])
def test_an_address_that_is_not_host_port_is_refused(value, no_ray_address):
    with pytest.raises(ConnectionError) as refused:
        gcs_address(value)
    assert str(refused.value) == f"Ray address {value!r} is not HOST:PORT (a running cluster's GCS), auto or ray://..."


def _run(argv: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """`python -m ...argv` in a process of its own: one that hangs in Ray's retries fails the test, not the suite."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=60, env=env)
    return done, time.monotonic() - started


def test_ray_serve_ends_in_one_line_where_nothing_answers_at_the_address(closed_port):
    done, seconds = _run(["policy_server.ray_serve.command", "--address", f"127.0.0.1:{closed_port}"])
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"policy-server ray-serve: nothing answers at Ray address 127.0.0.1:{closed_port} "
                           f"(Connection refused); {EXPECTED}\n")
    assert seconds < 30


def test_a_ray_rollout_ends_in_one_line_where_nothing_answers_at_the_address(closed_port, tmp_path):
    done, seconds = _run(["robots.rollout", "--server", "127.0.0.1:1", "--episodes", "1", "--ray", "1",
                          "--ray-address", f"127.0.0.1:{closed_port}", "--out", str(tmp_path / "rollout.json")])
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"policy-rollout: nothing answers at Ray address 127.0.0.1:{closed_port} "
                           f"(Connection refused); {EXPECTED}\n")
    assert seconds < 30 and not (tmp_path / "rollout.json").exists()


# Inside a network namespace of its own: `ray start --head` recording its cluster in $RAY_TMPDIR, with token
# authentication on (Ray 2.60's `ray start` turns it on where $HOME/.ray holds a token: any local `ray.init`, such as
# `policy-server ray-serve` without --address, leaves one there), then `policy-server ray-serve` joining it as the
# README says, each up to its check of the cluster's GPUs, after `ray.init`: a replica asks for 1, the cluster has 0.
_JOIN_STARTED_HEAD = """
{python} -c 'import sys; sys.path.insert(0, "{tests}"); from ray_cluster import loopback_up; loopback_up()'
ray start --head --block --num-cpus 1 --include-dashboard false --disable-usage-stats > "$RAY_TMPDIR/head.log" 2>&1 &
head=$!
for _ in $(seq 120); do [ -s "$RAY_TMPDIR/ray/ray_current_cluster" ] && break; sleep 0.5; done
for address in "--address auto" ""; do
    {python} -m policy_server.ray_serve.command $address --device cpu --num-gpus 1 2>&1 | tail -n 1
done
kill $head && wait $head
"""


def test_ray_serve_joins_the_token_authenticated_cluster_ray_start_recorded(tmp_path):
    # Was: auto (or no --address) became the address found, and ray.init, given an address, turns on no token
    # authentication, so that it retried for 20 s and ended 'Failed to connect to Ray cluster at 127.0.0.1:6379'.
    prefix = namespace_prefix()
    if prefix is None:
        pytest.skip("cannot make a network namespace here (unshare -n / -rn) for a Ray head of its own")
    ray_tmpdir = tempfile.mkdtemp(prefix="rayhead", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text(secrets.token_hex(32))  # as a local ray.init leaves it
    try:
        env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
        env.update(HOME=str(tmp_path), RAY_TMPDIR=ray_tmpdir,  # the head's token and record, no other cluster's
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")  # its `ray`
        script = _JOIN_STARTED_HEAD.format(python=sys.executable, tests=Path(__file__).parent)
        done = subprocess.run([*prefix, "sh", "-c", script], capture_output=True, text=True, timeout=240, env=env)
    finally:
        shutil.rmtree(ray_tmpdir, ignore_errors=True)
    joined = ("policy-server ray-serve: each replica asks for 1 GPU and the Ray cluster has 0; pass --device cpu "
              "(or --num-gpus 0) to serve on the CPU")
    assert done.stdout.splitlines() == [joined, joined], done.stdout + done.stderr
