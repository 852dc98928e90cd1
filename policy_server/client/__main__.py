"""Command-line probe: ``python -m policy_server.client health|info --server HOST:PORT`` (``info --budget-ms MS
--rate-hz HZ``: how many such sessions fit).

``health`` exits 0 only when the server reports SERVING (used by the Docker HEALTHCHECK).
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":  # the command, not a test importing main: gRPC core reads this once, as grpc is imported
    # (below; the package imports none). It logs each failed TLS handshake on stderr, a line of its own beside ours.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from google.protobuf import json_format  # noqa: E402

from policy_server import __version__  # noqa: E402
from policy_server.client.cli_flags import add_tls_flags, seconds, server_address, tls_options, token_file  # noqa: E402
from policy_server.client.errors import PolicyServerError  # noqa: E402
from policy_server.client.sync_client import PolicyClient  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m policy_server.client")
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {__version__}")
    parser.add_argument("command", choices=("health", "info"))
    parser.add_argument("--server", type=server_address, default="127.0.0.1:50051", metavar="HOST:PORT",
                        help="the policy-server (127.0.0.1:50051)")
    parser.add_argument("--auth-token-file", type=token_file, help="file with the server's bearer token")
    add_tls_flags(parser)
    parser.add_argument("--timeout-s", type=seconds, default=3.0, help="wait for the answer this long (3)")
    parser.add_argument("--budget-ms", type=float,
                        help="info: the capacity at this latency budget (default: the server's)")
    parser.add_argument("--rate-hz", type=float,
                        help="info: the capacity at this request rate (default: each embodiment's; 0: closed loop)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    info_only = [flag for flag, value in (("--budget-ms", args.budget_ms), ("--rate-hz", args.rate_hz))
                 if value is not None]
    if args.command == "health" and info_only:
        parser.error(f"{' and '.join(info_only)}: only info takes them (the capacity at a budget and rate)")
    client = PolicyClient(
        args.server,
        token_file=args.auth_token_file,
        timeout_s=args.timeout_s,
        **tls_options(args),
    )
    try:
        if args.command == "health":
            status = client.health()
            print(status)
            return 0 if status == "SERVING" else 1
        info = client.server_info(budget_ms=args.budget_ms, rate_hz=args.rate_hz)
        print(json_format.MessageToJson(info, always_print_fields_with_no_presence=True), flush=True)  # 0 fit, too
        return 0
    except PolicyServerError as exc:
        print(exc, file=sys.stderr)
        return 2
    except BrokenPipeError:  # `info | head` read what it wanted: no traceback, and none at exit's flush either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
