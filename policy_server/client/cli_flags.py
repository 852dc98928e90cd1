"""What the command-line tools that connect to a server (``python -m policy_server.client``, ``policy-rollout``,
``policy-soak``) share: the types of ``--server``, ``--timeout-s`` and ``--auth-token-file``, and the TLS flags
``--tls`` (the system's root certificates), ``--tls-ca FILE`` and ``--tls-server-name NAME``, either of which implies
``--tls``."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from policy_server.client.sync_client import MAX_TIMEOUT_S, TARGET_FORM, check_target, uses_tls
from policy_server.v1.auth_token import read_token_file

MAX_CA_FILE_BYTES = 1 << 20  # a CA bundle is tens of kB


def server_address(value: str) -> str:
    """argparse type: a target `PolicyClient` takes (`check_target`) written as ``HOST:PORT`` (``[v6]:PORT``) or a
    ``unix:`` path."""
    host, _, port = value.rpartition(":")
    written = value.removeprefix("unix:").strip() if value.startswith("unix:") else host and port.isdigit()
    try:
        check_target(value)
    except ValueError:
        written = False
    if not written:
        raise argparse.ArgumentTypeError(f"expected {TARGET_FORM}; got {value!r}")
    return value


def seconds(value: str) -> float:
    """argparse type: a time above 0 s, up to `MAX_TIMEOUT_S` (a call's bound)."""
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0 < number <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"expected seconds above 0, up to {MAX_TIMEOUT_S:g}, got {value!r}")
    return number


def token_file(value: str) -> Path:
    """argparse type: a file holding a bearer token as the server reads one (`PolicyClient` reads it again)."""
    try:
        read_token_file(Path(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return Path(value)


def pem_file(value: str) -> bytes:
    """argparse type: the contents of a PEM certificate file."""
    path = Path(value)
    try:
        with path.open("rb") as f:
            pem = f.read(MAX_CA_FILE_BYTES + 1)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror}") from None
    if len(pem) > MAX_CA_FILE_BYTES or b"-----BEGIN CERTIFICATE-----" not in pem:
        raise argparse.ArgumentTypeError(f"{path} is not a PEM certificate file of at most {MAX_CA_FILE_BYTES} "
                                         "bytes; expected one or more '-----BEGIN CERTIFICATE-----' blocks")
    return pem


def add_tls_flags(parser) -> None:
    """Add the TLS flags to an `argparse` parser or argument group."""
    parser.add_argument("--tls", action="store_true",
                        help="connect with TLS, verifying the server against the system's root certificates")
    parser.add_argument("--tls-ca", type=pem_file, metavar="FILE",
                        help="PEM root certificate(s) to verify the server with instead; implies --tls")
    parser.add_argument("--tls-server-name", metavar="NAME",
                        help="the name the server's certificate must hold (default: the host of the address; "
                             "localhost for a unix: socket); implies --tls")


def tls_options(args: argparse.Namespace) -> dict:
    """`PolicyClient`'s keyword arguments for the parsed TLS flags."""
    return {"tls": uses_tls(args.tls, args.tls_ca, args.tls_server_name), "root_certificates": args.tls_ca,
            "server_name": args.tls_server_name}
