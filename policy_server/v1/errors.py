"""How a failed call describes itself, written by the server and read by the client.

A failed call's status message starts with its stable reason code (``"SCHEMA_MISMATCH: observation..."``), so
a proxy that keeps only the code and the message (Ray Serve's does) keeps the reason too. Its trailing
metadata carries gRPC's standard rich status, ``grpc-status-details-bin``: a ``google.rpc.Status`` whose
details are
- ``google.rpc.ErrorInfo``: the reason, domain ``policy_server.v1``, and as metadata the offending field,
  what was expected and what came, and the error's other facts (``session_id``, ``best_achievable_ms``, ...);
- ``google.rpc.BadRequest``: the field violation, for INVALID_ARGUMENT errors about a request field;
- ``google.rpc.RetryInfo``: when to retry, where the server knows (WARMING_UP, RATE_EXCEEDED);
- ``policy_server.v1.ErrorDetail``: all of the above in one message, what this project's client reads.
Where a retry delay is known, ``grpc-retry-pushback-ms`` also tells gRPC's own retries (a client's service
config ``retryPolicy``) to wait that long.

On the Control stream the same ``ErrorDetail`` arrives inside a ``ControlEvent.error``.
"""

from __future__ import annotations

import re

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from policy_server.v1 import policy_server_pb2 as pb

DOMAIN = "policy_server.v1"
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"  # read by gRPC's retries (gRFC A6)
_REASON_PREFIX = re.compile(r"^([A-Z][A-Z0-9_]*): (.*)$", re.DOTALL)

# Reason code -> gRPC status. Anything not listed is a request-content problem (INVALID_ARGUMENT).
_STATUS_BY_REASON: dict[str, grpc.StatusCode] = {
    "SESSION_NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "SERVICE_NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "STALE_EPOCH": grpc.StatusCode.FAILED_PRECONDITION,
    "BUDGET_INFEASIBLE": grpc.StatusCode.FAILED_PRECONDITION,
    "STREAM_NOT_STARTED": grpc.StatusCode.FAILED_PRECONDITION,
    "WARMING_UP": grpc.StatusCode.UNAVAILABLE,
    "SHUTTING_DOWN": grpc.StatusCode.UNAVAILABLE,
    "TOO_MANY_SESSIONS": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "OVERLOADED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "RATE_EXCEEDED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "SESSION_BUSY": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "STREAM_ATTACHED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "TOO_MANY_REASON_CALLS": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "TOO_MANY_DYNAMICS_CALLS": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "TOO_MANY_STARTING_STREAMS": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "TOO_MANY_REFLECTION_STREAMS": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "TOO_MANY_HEALTH_WATCHES": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "TOO_MANY_PENDING_FRAMES": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "DYNAMICS_OFF": grpc.StatusCode.FAILED_PRECONDITION,
    "PAYLOAD_TOO_LARGE": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "CANCELLED": grpc.StatusCode.CANCELLED,
    "DEADLINE_EXCEEDED": grpc.StatusCode.DEADLINE_EXCEEDED,
    "NON_FINITE_OUTPUT": grpc.StatusCode.INTERNAL,
    "ENGINE_ERROR": grpc.StatusCode.INTERNAL,
    "INTERNAL": grpc.StatusCode.INTERNAL,
    "UNAUTHENTICATED": grpc.StatusCode.UNAUTHENTICATED,
}


def status_for(reason: str) -> grpc.StatusCode:
    """The gRPC status of an error with this reason code."""
    return _STATUS_BY_REASON.get(reason, grpc.StatusCode.INVALID_ARGUMENT)


def status_message(detail: pb.ErrorDetail) -> str:
    """The gRPC status message of a call that failed with ``detail``: its reason, then its message."""
    return f"{detail.reason}: {detail.message}"


def rich_status(detail: pb.ErrorDetail) -> grpc.Status:
    """The ``grpc.Status`` (code, message, trailing metadata) to end a call that failed with ``detail``."""
    code = grpc.StatusCode[detail.code]
    status = status_pb2.Status(code=code.value[0], message=status_message(detail))
    facts = {"field": detail.field, "expected": detail.expected, "got": detail.got, **detail.metadata}
    if detail.best_achievable_ms:
        facts["best_achievable_ms"] = f"{detail.best_achievable_ms:g}"
    if detail.retry_after_ms:
        facts["retry_after_ms"] = f"{detail.retry_after_ms:g}"
    status.details.add().Pack(error_details_pb2.ErrorInfo(
        reason=detail.reason, domain=DOMAIN, metadata={key: value for key, value in facts.items() if value}))
    if detail.field and status.code == code_pb2.INVALID_ARGUMENT:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=detail.field, reason=detail.reason,
            description=f"expected {detail.expected}, got {detail.got}" if detail.expected else detail.message)
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    pushback: tuple[tuple[str, str], ...] = ()
    if detail.retry_after_ms:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(round(detail.retry_after_ms))
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        pushback = ((RETRY_PUSHBACK_KEY, str(round(detail.retry_after_ms))),)
    status.details.add().Pack(detail)
    standard = rpc_status.to_status(status)
    return standard._replace(trailing_metadata=standard.trailing_metadata + pushback)


def error_detail(call: grpc.Call) -> pb.ErrorDetail | None:
    """The ``ErrorDetail`` of a failed call: from its rich status, else from a status message that starts
    with a reason code (a proxy dropped the trailers); None for a failure that never reached the servicer."""
    try:
        status = rpc_status.from_call(call)
    except ValueError:  # trailers inconsistent with the code or message: a proxy rewrote one of them
        status = None
    for packed in status.details if status is not None else ():
        if packed.Is(pb.ErrorDetail.DESCRIPTOR):
            detail = pb.ErrorDetail()
            packed.Unpack(detail)
            return detail
    match = _REASON_PREFIX.match(call.details() or "")
    if match is None or status_for(match[1]) != call.code():  # e.g. gRPC core's own "SERVER: Received ..."
        return None
    return pb.ErrorDetail(code=call.code().name, reason=match[1], message=match[2])
