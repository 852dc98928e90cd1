"""Bearer-token authentication for every gRPC method except the standard health ``Check``.

Clients send ``authorization: Bearer <token>`` call metadata. ``Check`` stays open so that orchestrators (docker, k8s
probes) can poll readiness without holding the secret; it reveals nothing but SERVING / NOT_SERVING. ``Watch`` takes
the token: each stream holds server memory (about 23 kB) for as long as its client keeps it open, so that anyone who
reached the port could open them until the server ran out of memory.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

import grpc

from policy_server.server.errors import ServiceError, abort, make_error

AUTH_HEADER = "authorization"
_OPEN_METHODS = ("/grpc.health.v1.Health/Check",)


def bearer_token_matches(header_value: str | None, token: str) -> bool:
    """Constant-time check of an ``Authorization`` value against the expected token."""
    if not header_value:
        return False
    scheme, _, presented = header_value.partition(" ")
    if scheme.lower() not in ("bearer", "api-key"):  # "Api-Key" is what openpi-client sends
        return False
    return hmac.compare_digest(presented.strip().encode(), token.encode())


def authentication_error(header_value: str | None, token: str) -> ServiceError | None:
    """The UNAUTHENTICATED error for a call whose ``authorization`` value does not carry ``token``; None if it
    does."""
    if bearer_token_matches(header_value, token):
        return None
    message = "missing authorization metadata" if not header_value else "invalid authorization token"
    return make_error("UNAUTHENTICATED", message, field=AUTH_HEADER, expected="Bearer <token>")


def _rejecting_handler(handler: grpc.RpcMethodHandler, error: ServiceError,
                       on_refused: Callable[[str], None]) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that fails with ``error``, telling ``on_refused`` its reason."""

    def reject(request_or_iterator, context):
        on_refused(error.reason)
        abort(context, error)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(reject)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(reject)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(reject)
    return grpc.unary_unary_rpc_method_handler(reject)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the token (health ``Check`` stays open; reflection needs the token too), telling
    ``on_refused`` each reason."""

    def __init__(self, token: str, on_refused: Callable[[str], None]) -> None:
        self._token, self._on_refused = token, on_refused

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method in _OPEN_METHODS:
            return handler
        header = dict(handler_call_details.invocation_metadata or ()).get(AUTH_HEADER)
        error = authentication_error(header, self._token)
        return handler if error is None else _rejecting_handler(handler, error, self._on_refused)
