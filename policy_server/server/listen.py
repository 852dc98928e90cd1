"""The server's listening addresses (gRPC, /metrics, the openpi WebSocket): how one prints, the socket family
and bound socket for a host, and the one error for an address that cannot be bound, with the OS's reason.

    address("::1", 50051)                  # "[::1]:50051"
    sock = tcp_socket("::1", 0)            # bound, not yet listening
    raise bind_failed("the metrics endpoint", "127.0.0.1:9090", error)
"""

from __future__ import annotations

import socket


def address(host: str, port: int) -> str:
    """``host:port``; an IPv6 host in brackets (``[::1]:50051``), so that its port reads apart from it."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def family(host: str) -> socket.AddressFamily:
    """The socket family that binds ``host`` (an IPv6 address, bracketed or not, or anything IPv4 resolves)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def tcp_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (``port`` 0 picks a free one), not yet listening. Raises the OS's
    ``OSError`` (``socket.gaierror`` for a host that names no address)."""
    sock = socket.socket(family(host))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart binds while old connections linger
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    return sock


def bind_failed(listener: str, where: str, error: OSError) -> OSError:
    """The error a listener that could not bind ``where`` (``address()``, or ``unix:PATH``) ends the start with:
    ``could not bind <listener> to <where> (<the OS's reason>)``."""
    return OSError(f"could not bind {listener} to {where} ({error.strerror or error})")
