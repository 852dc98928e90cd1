"""The Ray cluster address a command joins, checked before ``ray.init``: Ray itself retries an address where nothing
answers for minutes, printing its C++ warnings, where a command should end in one line."""

from __future__ import annotations

import os
import socket

CONNECT_TIMEOUT_S = 5.0


def check_gcs_address(address: str | None) -> None:
    """Raise ConnectionError, naming the address, where the GCS address that ``ray.init(address=address)`` joins
    (``address``, or ``RAY_ADDRESS`` where that is unset or auto) is not HOST:PORT or takes no TCP connection within
    `CONNECT_TIMEOUT_S`. Unset, auto, local and client (``ray://``) addresses pass unchecked: Ray ends those itself."""
    source = "Ray address"
    if address in (None, "auto") and os.environ.get("RAY_ADDRESS"):  # as ray.init reads it
        address, source = os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    if address in (None, "auto", "local") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConnectionError(f"{source} {address!r} is not HOST:PORT (a running cluster's GCS), auto or ray://...")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as error:  # refused, unreachable, unknown host, or no answer in time
        reason = error.strerror or f"no answer in {CONNECT_TIMEOUT_S:g} s"
        raise ConnectionError(f"nothing answers at {source} {address} ({reason}); expected the GCS address of a "
                              f"running Ray cluster (HOST:PORT, as `ray start --head` prints it)") from None
