"""How a failed call describes itself, written by the server and read by the client.

A failed call carries trailing metadata
- ``policy-server-reason``: the stable reason code, e.g. ``SCHEMA_MISMATCH``;
- ``policy-server-field``: the offending request field, when there is one;
- ``policy-server-error-bin``: a serialized ``policy_server.v1.ErrorDetail`` with everything else
  (expected / got, best achievable latency, retry delay).
On the Control stream the same ``ErrorDetail`` arrives inside a ``ControlEvent.error``.
"""

from __future__ import annotations

from collections.abc import Mapping

from policy_server.v1 import policy_server_pb2 as pb

REASON_KEY = "policy-server-reason"
FIELD_KEY = "policy-server-field"
DETAIL_KEY = "policy-server-error-bin"


def error_metadata(detail: pb.ErrorDetail) -> tuple[tuple[str, str | bytes], ...]:
    """The trailing metadata of a call that failed with ``detail``."""
    items: list[tuple[str, str | bytes]] = [(REASON_KEY, detail.reason)]
    if detail.field:
        items.append((FIELD_KEY, detail.field))
    items.append((DETAIL_KEY, detail.SerializeToString()))
    return tuple(items)


def error_detail(trailing: Mapping[str, str | bytes]) -> pb.ErrorDetail | None:
    """The ErrorDetail in a failed call's trailing metadata; None when there is none (a failure that
    never reached the servicer)."""
    data = trailing.get(DETAIL_KEY)
    return None if data is None else pb.ErrorDetail.FromString(data)
