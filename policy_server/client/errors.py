"""Errors as the client sees them: gRPC status plus the server's machine-readable reason."""

from __future__ import annotations

import re

import grpc

from policy_server.v1 import policy_server_pb2 as pb
from policy_server.v1.errors import error_detail

# gRPC core's message for a message over its receive limit: "Received message larger than max (SIZE vs. LIMIT)".
_GRPC_CUT = re.compile(r"larger than max \((\d+) vs\. (\d+)\)")


class PolicyServerError(Exception):
    """A failed call or a Control-stream error event.

    ``reason`` is the stable code (SCHEMA_MISMATCH, STALE_EPOCH, BUDGET_INFEASIBLE, ...); transport
    failures without a server-side reason use the status name (UNAVAILABLE, DEADLINE_EXCEEDED), and
    ``from_server`` is False for them.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        reason: str,
        message: str,
        detail: pb.ErrorDetail | None = None,
        obs_id: int = 0,
    ) -> None:
        super().__init__(f"{code.name}{'' if reason == code.name else ' ' + reason}: {message}")
        self.code, self.reason, self.message = code, reason, message
        self.from_server = detail is not None
        self.detail = (
            detail if detail is not None else pb.ErrorDetail(code=code.name, reason=reason, message=message)
        )
        self.obs_id = obs_id

    def __reduce__(self):
        # Rebuilt from the constructor's arguments, as Ray does with an error raised in one of its workers
        # (`policy-rollout --ray`); Exception's default passes only the message.
        return type(self), (self.code, self.reason, self.message, self.detail if self.from_server else None,
                            self.obs_id)

    @property
    def no_answer(self) -> bool:
        """The call's deadline passed with no answer from a server (down, unreachable, starting or busy), or before
        the call's work was done."""
        return self.code == grpc.StatusCode.DEADLINE_EXCEEDED and not self.from_server

    @property
    def connection_lost(self) -> bool:
        """The call lost its server rather than being refused by it: UNAVAILABLE (the connection, or a server
        shutting down or warming up), or INTERNAL with no server reason (Ray Serve's proxy ends a call so when its
        replica dies). Calling again, once the server serves, may work."""
        lost_replica = self.code == grpc.StatusCode.INTERNAL and not self.from_server
        refused = self.reason == "TOO_MANY_CALLS"  # by a server that serves, for the calls its connection holds
        return self.code == grpc.StatusCode.UNAVAILABLE and not refused or lost_replica

    @property
    def session_end(self) -> str:
        """SESSION_NOT_FOUND: how the session ended, where the server remembers it: "closed" (a CloseSession call
        closed it: never reopen it) or "expired" (no call for the server's idle time); "" for a session the server does
        not know (it restarted, or its replica went away)."""
        return self.detail.metadata.get("session_end", "")

    @property
    def session_closed(self) -> bool:
        """SESSION_NOT_FOUND of a session a CloseSession call closed (an operator, another client): one to end with,
        never to reopen, unlike one the server lost (restarted, expired)."""
        return self.reason == "SESSION_NOT_FOUND" and self.session_end == "closed"

    @property
    def field(self) -> str:
        return self.detail.field

    @property
    def best_achievable_ms(self) -> float:
        return self.detail.best_achievable_ms

    @property
    def retry_after_ms(self) -> float:
        return self.detail.retry_after_ms

    @property
    def sessions_fit(self) -> int | None:
        """OVERLOADED: how many sessions like the refused one an idle server takes (None with other reasons)."""
        value = self.detail.metadata.get("sessions_fit")
        return None if value is None else int(value)

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> PolicyServerError:
        """The error of a failed call: the server's ``ErrorDetail`` (``policy_server.v1.errors``), else the
        status alone (a failure of the transport, or of gRPC core before the servicer saw the call)."""
        detail = error_detail(error)
        if detail is not None:
            return cls(error.code(), detail.reason, detail.message, detail)
        message = error.details() or ""
        reason = error.code().name
        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in message:
            reason = "PAYLOAD_TOO_LARGE"  # cut by gRPC core before the servicer saw it
            if sizes := _GRPC_CUT.search(message):
                # gRPC's own message names its cut (twice the server's limit), not the limit a request must keep to.
                size, cut = sizes.groups()
                message = (f"request of {size} bytes refused by gRPC before the server read it (its transport takes "
                           f"at most {cut}); expected at most the server's message limit, "
                           "ServerInfo.limits.max_message_bytes")
        elif error.code() == grpc.StatusCode.UNAVAILABLE and "RST_STREAM with error code 7" in message:
            # HTTP/2's REFUSED_STREAM: gRPC core refused the call before the servicer saw it.
            reason = "TOO_MANY_CALLS"
            message = (f"the server refused the call: its connection held as many calls at once as the server "
                       f"serves for one connection; send fewer at once ({message})")
        return cls(error.code(), reason, message)

    @classmethod
    def from_detail(cls, detail: pb.ErrorDetail, obs_id: int = 0) -> PolicyServerError:
        code = (
            grpc.StatusCode[detail.code]
            if detail.code in grpc.StatusCode.__members__
            else grpc.StatusCode.UNKNOWN
        )
        return cls(code, detail.reason, detail.message, detail, obs_id=obs_id)


_VERIFY_FAILED = re.compile(r"CERTIFICATE_VERIFY_FAILED: ([^:]+)")
# OpenSSL's reasons that say the certificate is not valid at this machine's time (where else the roots' trust fails).
_OUT_OF_DATE = ("certificate has expired", "certificate is not yet valid")


def explain_connection_failure(error: PolicyServerError, target: str, tls: bool, root_certificates: bytes | None,
                               server_name: str | None) -> PolicyServerError:
    """`error` on one line naming the likely cause where gRPC core's words for a connection that failed say little:
    a TLS channel to a plaintext server, a certificate the channel's roots do not trust, one not valid now or that
    does not hold the name checked (each a mismatch: waiting does not help), or a plaintext channel whose connection
    was closed before a word of gRPC (a TLS server, or a tunnel or proxy with nothing behind it yet: a guess); else
    `error`. gRPC's own words follow in parentheses."""
    if error.from_server or error.code != grpc.StatusCode.UNAVAILABLE:
        return error
    text = error.message
    roots = "the given CA (--tls-ca, root_certificates)" if root_certificates is not None else \
        "the system's root certificates; pass the server's CA or its certificate with --tls-ca FILE (root_certificates)"
    # Not a call whose connection dropped; reset where the close meets the client's first bytes.
    if not tls and "failed to connect" in text and ("Socket closed" in text or "Connection reset by peer" in text):
        cause = (f"the server at {target} closed the connection before a word of gRPC: a TLS server (connect with "
                 "--tls-ca FILE, its CA or certificate, or --tls, the system's roots; in Python, root_certificates= "
                 "or tls=True), or a tunnel or proxy with nothing behind it yet")
    elif tls and "WRONG_VERSION_NUMBER" in text:
        cause = (f"the server at {target} does not speak TLS (its answer to the TLS handshake is not TLS); connect "
                 "without --tls, --tls-ca and --tls-server-name (in Python: tls, root_certificates and server_name)")
    elif tls and (verify := _VERIFY_FAILED.search(text)):
        reason = verify.group(1).strip()
        if reason.lower() in _OUT_OF_DATE:
            cause = (f"TLS handshake with {target} failed: its certificate was refused ({reason}); check its validity "
                     "dates against this machine's clock")
        elif "self signed" in reason or "self-signed" in reason or "issuer" in reason:
            cause = f"TLS handshake with {target} failed: its certificate ({reason}) is not trusted by {roots}"
        else:
            cause = f"TLS handshake with {target} failed: its certificate was refused ({reason})"
    elif tls and "Hostname Verification Check failed" in text:
        address = re.sub(r"^dns:(//[^/]*/)?", "", target)  # dns:[//AUTHORITY/]HOST[:PORT]
        host = (address.rpartition(":")[0] if re.search(r":\d+$", address) else address).strip("[]")
        name = server_name or ("localhost" if target.startswith("unix:") else host)
        cause = (f"TLS handshake with {target} failed: its certificate does not hold the name {name!r}; pass the "
                 "name it holds with --tls-server-name NAME (server_name=)")
    else:
        return error
    return PolicyServerError(error.code, error.reason, f"{cause} (gRPC: {text})")
