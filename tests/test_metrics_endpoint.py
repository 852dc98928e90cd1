"""The /metrics HTTP endpoint answers on /metrics only, and keeps asking for the token where the server does."""

from __future__ import annotations

import http.client
import socket
import ssl
import time
import urllib.error
import urllib.request

import pytest
import websockets.sync.client
from fake_engine import FakeEngine, self_signed_cert, serve_fake

from policy_server.client import PolicyClient
from policy_server.config import build_config
from policy_server.server import metrics
from policy_server.server.app import build_server

TOKEN = "s3cret-of-16-chr"  # the server's shortest


def status(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as err:
        err.close()
        return err.code


def test_paths_other_than_metrics_are_not_found():
    with serve_fake(metrics_port=0) as server:
        base = f"http://127.0.0.1:{server.metrics_port}"
        assert status(base + "/metrics") == 200
        for path in ("/", "/favicon.ico", "/metrics/", "/metricsx", "/admin"):
            assert status(base + path) == 404, path


def test_the_scrape_holds_the_documented_series_and_no_created_ones():
    """prometheus-client wrote a `_created` gauge beside each counter and histogram series (69 of a real server's 394
    lines), which the README's table does not list."""
    with serve_fake(metrics_port=0) as server:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5) as response:
            samples = [line.split("{")[0].split(" ")[0] for line in response.read().decode().splitlines()
                       if not line.startswith("#")]
    assert "policy_server_deadline_misses_total" in samples and "grpc_server_started_total" in samples
    assert [name for name in samples if name.endswith("_created")] == []


def test_with_a_token_every_path_needs_it_first(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    with serve_fake(metrics_port=0, auth_token_file=token) as server:
        base = f"http://127.0.0.1:{server.metrics_port}"
        assert (status(base + "/metrics"), status(base + "/other")) == (401, 401)
        assert (status(base + "/metrics", TOKEN), status(base + "/other", TOKEN)) == (200, 404)


def test_with_tls_the_metrics_are_https_only(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    with serve_fake(metrics_port=0, auth_token_file=token, tls_cert=cert, tls_key=key) as server:
        trusted = ssl.create_default_context(cafile=str(cert))
        request = urllib.request.Request(f"https://127.0.0.1:{server.metrics_port}/metrics",
                                         headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=5, context=trusted) as response:
            assert response.status == 200 and b"policy_server_ticks_total" in response.read()
        with pytest.raises((urllib.error.URLError, http.client.RemoteDisconnected, ConnectionResetError)):
            status(f"http://127.0.0.1:{server.metrics_port}/metrics", TOKEN)  # the token never goes in the clear


def test_every_listener_serves_the_tls_pair_the_settings_check_loaded(tmp_path):
    """The check loaded the pair and the start read the files again: a pair renewed (or half written) between the
    two was served unchecked, and a broken one ended the start with 'could not bind gRPC ... (in use or not
    permitted)'."""
    cert, key = self_signed_cert(tmp_path)
    config = build_config(overrides={"port": 0, "metrics_port": 0, "websocket_port": 0, "tls_cert": str(cert),
                                     "tls_key": str(key)})
    trusted = cert.read_text()
    cert.write_text("")
    key.write_text("half written")
    with build_server(config, FakeEngine()) as server:
        with PolicyClient(server.target, root_certificates=trusted.encode(), server_name="localhost") as client:
            assert client.health() == "SERVING"
        context = ssl.create_default_context(cadata=trusted)
        with urllib.request.urlopen(f"https://127.0.0.1:{server.metrics_port}/metrics", timeout=5,
                                    context=context) as response:
            assert response.status == 200
        with websockets.sync.client.connect(f"wss://127.0.0.1:{server.websocket_port}", ssl=context) as ws:
            assert ws.recv(timeout=5)  # the metadata frame

def test_connections_that_send_nothing_hold_no_thread_for_long_and_cannot_crowd_out_a_scrape(monkeypatch):
    monkeypatch.setattr(metrics, "SCRAPE_TIMEOUT_S", 2.0)
    with serve_fake(metrics_port=0) as server:
        base = f"http://127.0.0.1:{server.metrics_port}"
        silent = [socket.create_connection(("127.0.0.1", server.metrics_port)) for _ in range(metrics.MAX_SCRAPES)]
        for connection in silent:  # each has a thread: the first byte the request never sends is waited for
            connection.settimeout(5)
        with pytest.raises((urllib.error.URLError, http.client.RemoteDisconnected, ConnectionResetError)):
            status(base + "/metrics")  # every place taken: closed unanswered
        for connection in silent:
            assert connection.recv(1) == b""  # closed by the server after its timeout
            connection.close()
        assert status(base + "/metrics") == 200


def test_a_request_sent_a_byte_at_a_time_is_cut_off_too(monkeypatch):
    """A per-read timeout let a header byte every few seconds hold a place for ever: 8 such connections, no token
    needed, kept every scrape out for as long as they trickled."""
    monkeypatch.setattr(metrics, "SCRAPE_TIMEOUT_S", 1.0)
    with serve_fake(metrics_port=0) as server:
        trickle = socket.create_connection(("127.0.0.1", server.metrics_port))
        trickle.sendall(b"GET /metrics HTTP/1.1\r\n")
        with pytest.raises(OSError):  # reset or broken pipe: the server closed it while it was still sending
            for _ in range(40):  # 10 s of bytes, each well within the timeout of the one before
                time.sleep(0.25)
                trickle.sendall(b"X")
        trickle.close()


def test_connections_that_time_out_write_no_traceback(monkeypatch, capfd):
    """socketserver printed a traceback for each connection that sent its request too slowly: about 20 lines of log
    per connection, for anyone who can reach the port."""
    monkeypatch.setattr(metrics, "SCRAPE_TIMEOUT_S", 0.5)
    with serve_fake(metrics_port=0) as server:
        slow = [socket.create_connection(("127.0.0.1", server.metrics_port)) for _ in range(3)]
        for connection, partial in zip(slow, (b"", b"GET /metr", b"GET /metrics HTTP/1.1\r\nHost: x"), strict=True):
            connection.sendall(partial)
        for connection in slow:
            connection.settimeout(15)
            assert connection.recv(1) == b""  # closed once its time was up, after any line it wrote
            connection.close()
    assert "Traceback" not in capfd.readouterr().err


def test_a_scrape_whose_time_runs_out_is_a_client_gone_to_wsgiref():
    """A request that came just before the deadline had its answer's write time out inside wsgiref, which logged a
    traceback for it (TimeoutError): a client that timed its last byte so brought the log lines back. wsgiref takes
    ConnectionAbortedError for a client gone, without a word. Here on a socket pair: reading, writing after the
    deadline, and a write a reader that reads nothing holds past it (more than the pair's buffers hold)."""
    for timed_out in ("read", "write", "blocked write"):
        ours, theirs = socket.socketpair()
        with ours, theirs:
            connection = metrics._BeforeDeadline(ours, time.monotonic() + (0.2 if timed_out == "blocked write" else 0))
            with pytest.raises(ConnectionAbortedError, match="the scrape's time is up"):
                if timed_out == "read":
                    connection.readinto(bytearray(10))
                else:
                    connection.write(b"x" * (16 << 20 if timed_out == "blocked write" else 1))


def test_a_metrics_port_in_use_is_named():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = build_server(build_config(overrides={"port": 0, "metrics_port": port}), FakeEngine())
        try:
            with pytest.raises(OSError, match=f"could not bind the metrics endpoint to 127.0.0.1:{port} .Address alr"):
                server.start()
        finally:
            server.stop(grace_s=0.1)
