"""Test helper (not a test module): a real gRPC server around a `FakeEngine` holding one health Watch whose client
reads nothing, which must hold up only itself: another Watch is answered and the server stops.

    python tests/stuck_watch_server.py

It prints each stage as it passes it, "stopped" last, and exits 0; raises (exit 1) if a stage goes wrong. A server
whose stop waits for good on the stuck stream never exits: tests/test_server.py kills it, so that nothing stuck is
left in pytest's own process.
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import closing

import grpc
from fake_engine import serve_fake
from grpc_health.v1 import health_pb2, health_pb2_grpc

WATCH = {"grpc_type": "server_stream", "grpc_service": "grpc.health.v1.Health", "grpc_method": "Watch"}


def watch_that_reads_nothing(port: int) -> socket.socket:
    """A health Watch from a raw HTTP/2 client that grants the server no flow-control window: the server's sends to it
    wait for good. Its connection, open (the caller closes it); a thread acknowledges the server's SETTINGS and PINGs,
    as a live client does."""
    def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload

    def header(name: str, value: str) -> bytes:  # HPACK, a literal never indexed
        return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()

    def acknowledge() -> None:
        with connection.makefile("rb") as frames:
            while len(head := frames.read(9)) == 9:
                kind, flags, payload = head[3], head[4], frames.read(int.from_bytes(head[:3], "big"))
                if kind in (4, 6) and not flags & 1:  # SETTINGS, PING
                    connection.sendall(frame(kind, 1, 0, b"" if kind == 4 else payload))

    connection = socket.create_connection(("127.0.0.1", port))
    no_window = (4).to_bytes(2, "big") + (0).to_bytes(4, "big")  # SETTINGS_INITIAL_WINDOW_SIZE = 0
    headers = b"".join(header(*pair) for pair in (
        (":method", "POST"), (":scheme", "http"), (":path", "/grpc.health.v1.Health/Watch"),
        (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"), ("te", "trailers")))
    connection.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, no_window))
    threading.Thread(target=acknowledge, daemon=True).start()
    connection.sendall(frame(1, 4, 1, headers) + frame(0, 1, 1, bytes(5)))  # an empty HealthCheckRequest
    return connection


def main() -> None:
    with serve_fake() as server, closing(watch_that_reads_nothing(server.grpc_port)):
        ends_s = time.monotonic() + 10
        while not server.metrics.registry.get_sample_value("grpc_server_started_total", WATCH):
            assert time.monotonic() < ends_s, "the server never took the raw client's Watch"
            time.sleep(0.01)
        print("the server took the Watch that reads nothing", flush=True)
        with grpc.insecure_channel(server.target) as channel:
            answer = next(health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=5))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, answer
        print("another Watch was answered SERVING; stopping", flush=True)
    print("stopped", flush=True)


if __name__ == "__main__":
    main()
