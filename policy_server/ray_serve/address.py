"""The Ray cluster address a command joins, checked before ``ray.init``: Ray itself retries an address where nothing
answers for minutes, printing its C++ warnings, where a command should end in one line."""

from __future__ import annotations

import os
import socket

CONNECT_TIMEOUT_S = 5.0


def gcs_address(address: str | None) -> str | None:
    """``address``, to give ``ray.init``, once checked: where it is unset or auto, the address Ray finds for it
    (``RAY_ADDRESS``, else the cluster the last ``ray start`` here recorded, else for auto a GCS process running
    here; a head that died leaves its record behind). Unset and auto are returned as they are, not as the address
    found: ``ray.init`` turns on token authentication, which ``ray start`` turns on where a token is in ~/.ray (as
    any local ``ray.init`` leaves one), only for those; given the address, it fails to join such a cluster.
    ConnectionError, naming it, where a GCS address is not HOST:PORT or takes no TCP connection within
    `CONNECT_TIMEOUT_S`. Unset with nothing found (a Ray started here), local and client (``ray://``) addresses pass
    unchecked: Ray ends those itself, as it does auto with nothing found (its own ConnectionError)."""
    given, source = address, "Ray address"
    if address in (None, "auto"):
        from ray._private.services import get_ray_address_from_environment  # what ray.init resolves them with

        found = get_ray_address_from_environment(address, None)
        if os.environ.get("RAY_ADDRESS") not in (None, "", "auto"):
            source = "RAY_ADDRESS"
        else:
            source = f"the Ray cluster found for {'--address auto' if address else 'no --address'}:"
        address = found
    if address in (None, "local") or "://" in address:
        return given
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConnectionError(f"{source} {address!r} is not HOST:PORT (a running cluster's GCS), auto or ray://...")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as error:  # refused, unreachable, unknown host, or no answer in time
        reason = error.strerror or f"no answer in {CONNECT_TIMEOUT_S:g} s"
        raise ConnectionError(f"nothing answers at {source} {address} ({reason}); expected the GCS address of a "
                              f"running Ray cluster (HOST:PORT, as `ray start --head` prints it)") from None
    return given
