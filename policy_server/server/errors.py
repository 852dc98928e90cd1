"""Every error a client can see: a precise gRPC status plus a machine-readable reason.

How it travels (gRPC's rich status, or a ``ControlEvent.error`` on the Control stream) is protocol:
``policy_server.v1.errors``.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import grpc

from policy_server.engine.api import (
    BudgetInfeasible,
    EngineError,
    InvalidArgument,
    RateExceeded,
    StreamAttached,
    WarmingUp,
)
from policy_server.throttled_log import ThrottledLog
from policy_server.v1 import policy_server_pb2 as pb
from policy_server.v1.errors import rich_status, status_for
from policy_server.v1.wire import WireError

log = logging.getLogger(__name__)

# Every text an error carries is clipped: trailing metadata is small, and a client's own input
# (a session id, a camera name) must not make the error about it too large to send. The message holds the longest
# the server writes whole (a refusal for want of room naming a client_name at its limit: about 570), and an
# error with every text at its clip stays within gRPC's 8 KiB of metadata (about 7.2 KiB).
_MAX_TEXT = 400
_MAX_MESSAGE = 640


def _clip(text: str, limit: int = _MAX_TEXT) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ServiceError(Exception):
    """An error ready to be sent: status code plus ErrorDetail."""

    def __init__(self, detail: pb.ErrorDetail) -> None:
        super().__init__(detail.message)
        self.detail = detail

    @property
    def code(self) -> grpc.StatusCode:
        return status_for(self.detail.reason)

    @property
    def reason(self) -> str:
        return self.detail.reason

    def status(self) -> grpc.Status:
        """The status to end the call with: code, message and the standard error details."""
        return rich_status(self.detail)


def make_error(
    reason: str, message: str, field: str = "", expected: str = "", got: str = "", **extra: float
) -> ServiceError:
    """Build a ServiceError; ``extra`` may set best_achievable_ms / retry_after_ms."""
    detail = pb.ErrorDetail(
        code=status_for(reason).name,
        reason=reason,
        message=_clip(message, _MAX_MESSAGE),
        field=_clip(field),
        expected=_clip(expected),
        got=_clip(got),
        **extra,
    )
    return ServiceError(detail)


def from_exception(exc: BaseException) -> ServiceError:
    """Translate engine, wire and unexpected errors; unexpected ones are logged with traceback."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, WireError):
        return make_error(exc.reason, str(exc), exc.field, exc.expected, exc.got)
    if isinstance(exc, EngineError):
        details = exc.details()
        extra: dict[str, float] = {}
        if isinstance(exc, BudgetInfeasible):
            extra["best_achievable_ms"] = exc.best_achievable_ms
        if isinstance(exc, WarmingUp | RateExceeded | StreamAttached):
            extra["retry_after_ms"] = exc.retry_after_ms
        err = make_error(
            exc.reason,
            exc.message,
            details.get("field", ""),
            details.get("expected", ""),
            details.get("got", ""),
            **extra,
        )
        for key, value in details.items():
            if key not in ("field", "expected", "got"):
                err.detail.metadata[key] = _clip(value)
        return err
    log.exception("internal error while serving a request", exc_info=exc)
    return make_error("INTERNAL", f"internal server error ({type(exc).__name__}); see the server log")


def renamed(exc: BaseException, fields: tuple[str, ...], field: str) -> BaseException:
    """`exc`, naming `field` where the engine's InvalidArgument names one of `fields`: the engine names the values of
    an ActRequest, which another message (a Control frame, an openpi observation) carries under other names."""
    if isinstance(exc, InvalidArgument) and exc.field in fields:
        return InvalidArgument(field, exc.expected, exc.got, reason=exc.reason)
    return exc


def abort(context: grpc.ServicerContext, error: ServiceError) -> None:
    """End the call with the error's status, message and details (raises)."""
    context.abort_with_status(error.status())


@dataclass(frozen=True)
class Undecodable:
    """What the server's request deserializer returns for bytes that do not parse as ``message``."""

    message: str  # the expected message type's full name
    size: int  # bytes received
    problem: str

    def error(self, field: str = "request") -> InvalidArgument:
        return InvalidArgument(field, f"a serialized {self.message}",
                               f"{self.size} bytes that do not parse ({self.problem})", reason="BAD_REQUEST")


def lenient_parser(message_class):
    """A request deserializer that never raises: bytes that do not parse become ``Undecodable``, which
    the servicer answers with INVALID_ARGUMENT (gRPC's own would answer INTERNAL with a traceback)."""
    name = message_class.DESCRIPTOR.full_name

    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError, and others for some inputs
            return Undecodable(name, len(data), str(exc) or type(exc).__name__)

    return parse


# One line per message type each 10 s.
_log_undecodable = ThrottledLog(log, logging.WARNING, period_s=10.0)


def check_decoded(request, context: grpc.ServicerContext) -> None:
    """Raise the INVALID_ARGUMENT error for a request that did not parse (logged in one line with the peer that
    sent it, `_log_undecodable`)."""
    if isinstance(request, Undecodable):
        _log_undecodable(request.message, "undecodable %s request of %d bytes from %s: %s", request.message,
                         request.size, context.peer(), request.problem)
        raise request.error()


def rpc_errors(method):
    """Decorator for servicer methods (unary or server-streaming): any exception ends the call with
    its precise status, and a request that did not parse is answered INVALID_ARGUMENT before the method
    runs. The servicer's ``on_error(ServiceError)`` sees each error first (metrics)."""

    def fail(servicer, context, exc: Exception) -> None:
        # Wrapped methods raise and never call context.abort themselves, so exc is never grpc's own
        # abort signal.
        error = from_exception(exc)
        servicer.on_error(error)
        abort(context, error)

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(self, request, context):
            try:
                check_decoded(request, context)
                yield from method(self, request, context)
            except Exception as exc:  # noqa: BLE001 - every failure must become a status
                fail(self, context, exc)

        return stream_wrapper

    @functools.wraps(method)
    def unary_wrapper(self, request, context):
        try:
            check_decoded(request, context)
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001
            fail(self, context, exc)

    return unary_wrapper
