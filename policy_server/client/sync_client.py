"""Blocking client for ``policy_server.v1.PolicyService``.

    with PolicyClient("127.0.0.1:50051", token=...) as client:
        client.wait_until_serving()                # up to 10 min: a first start compiles
        session = client.open_session("pusht", "push the T into the target")
        chunk = client.act(session, {"image": frame}, state=q, step_index=t, timeout_s=0.2)
        frames = client.forward_dynamics(session, {"image": frame}, actions, state=q)  # predicted frames
        chunk = client.inverse_dynamics(session, {"image": video}, state=q)           # actions of a video

Every call has a deadline (``timeout_s``, else the client default). Server info and session calls wait for the
connection and are retried while the server answers UNAVAILABLE (warming up, restarting), after the delay it asks
for: by gRPC (the channel's service config, ``RETRY_SERVICE_CONFIG``), and ``open_session`` by the client itself, until
its deadline, so that a call whose deadline ends in a warmup raises the server's WARMING_UP. ``act``, dynamics and
reasoner calls are never retried: a late chunk is stale, and the others would repeat long work.
The channel itself reconnects on its own after a drop; ``wait_until_serving`` watches the standard health
service until the server is SERVING.

Behind Ray Serve's gRPC proxy (``serve_application=``, see ``policy_server.ray_serve``) each call also names the
application, each session's calls carry the routing key the client picked when it opened the session (so they
all reach the replica that holds it), and each call carries its deadline as ``policy-timeout-ms`` metadata
(``policy_server.v1.serve_metadata``). A session whose replica went away answers SESSION_NOT_FOUND;
``ControlStream`` re-opens it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from policy_server.client.backoff import Backoff
from policy_server.client.errors import PolicyServerError, explain_connection_failure
from policy_server.client.types import (
    ActionChunk,
    PredictedFrames,
    Session,
    build_inverse_dynamics,
    build_observation,
    check_args,
    floats_to_proto,
)
from policy_server.v1 import policy_server_pb2 as pb
from policy_server.v1 import policy_server_pb2_grpc as pb_grpc
from policy_server.v1 import serve_metadata
from policy_server.v1.auth_token import check_token, read_token_file

T = TypeVar("T")
_RETRY_PAUSE_S = 0.1  # between watching or asking again while a server comes up
# For a Check that does not wait for a connection: a channel whose connection failed fails it at once, with why;
# one trying again (after gRPC's backoff) fails it once that try has, within a few ms on a LAN, a second on a busy one.
_PROBE_S = 1.0
# `wait_until_serving`'s default: a server's first start compiles for a minute or more (57 s of warmup on 2 cores
# for the embedded model), a Cosmos3 folder's on a CPU for minutes. policy-rollout waits as long.
SERVING_WAIT_S = 600.0

# Calls safe to repeat when they failed UNAVAILABLE (refused unserved, or the answer lost with the connection): reading
# the server, and session changes. gRPC caps maxAttempts at 5; a server that is warming up sends its retry delay as
# pushback (`policy_server.v1.errors`). OpenSession (whose request_id makes a repeat answer the session the first
# opened) waits for the connection but is retried by `open_session`: gRPC ends a call whose deadline passes in its
# pushback DEADLINE_EXCEEDED, and the server's WARMING_UP, which says why and when to come back, would be lost.
_RETRIED_METHODS = ("GetServerInfo", "ResetSession", "SetBudget", "CloseSession")
_SERVICE = "policy_server.v1.PolicyService"
RETRY_SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [{"service": _SERVICE, "method": method} for method in _RETRIED_METHODS],
            "waitForReady": True,
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.1s",
                "maxBackoff": "2s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        },
        {"name": [{"service": _SERVICE, "method": "OpenSession"}], "waitForReady": True},
    ],
}
# `open_session`'s pauses after an UNAVAILABLE that names no retry delay (an answer lost with its connection, a
# server shutting down), as gRPC's retry policy above.
_OPEN_BACKOFF = Backoff(initial_s=0.1, max_s=2.0, max_attempts=None)


TARGET_FORM = "HOST:PORT with a port from 1 to 65535, or unix:PATH"
MAX_TIMEOUT_S = 86400.0  # a day; far longer overflows gRPC's deadline, which then expires at once


def check_timeout(timeout_s: float) -> None:
    """ValueError for a call timeout gRPC would not wait (0, negative, NaN, inf, beyond `MAX_TIMEOUT_S`): such a call
    failed at once as DEADLINE_EXCEEDED, 'no answer from ... within inf s: the server is down ...', which blames the
    server."""
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s must be a time above 0 s, up to {MAX_TIMEOUT_S:g} s, got {timeout_s}")


def check_target(target: str) -> None:
    """ValueError for a target gRPC would not dial as written: empty, or a port outside 1..65535 (gRPC dialled
    127.0.0.1:99999 as port 34463). Other gRPC target names (dns:///HOST:PORT, a host alone) pass."""
    port = target.rpartition(":")[2]
    if not target.strip() or (not target.startswith("unix:") and port.isdigit() and not 1 <= int(port) <= 65535):
        raise ValueError(f"target: expected {TARGET_FORM}; got {target!r}")


def uses_tls(tls: bool, root_certificates: bytes | None, server_name: str | None) -> bool:
    """Whether a channel is TLS: asked for, or implied by root certificates or a name to check the server's
    certificate against (each of them asks for TLS: never plaintext)."""
    return tls or root_certificates is not None or server_name is not None


def make_channel(
    target: str,
    *,
    tls: bool = False,
    root_certificates: bytes | None = None,
    server_name: str | None = None,
    max_receive_mb: float = 64.0,
) -> grpc.Channel:
    """A channel with robot-friendly keepalive (dead links noticed in ~15 s), fast reconnects and gRPC's retries
    of the calls that are safe to repeat (``RETRY_SERVICE_CONFIG``; OpenSession only waits for the connection)."""
    options: list[tuple[str, int | str]] = [
        ("grpc.service_config", json.dumps(RETRY_SERVICE_CONFIG)),
        ("grpc.max_receive_message_length", int(max_receive_mb * 1024 * 1024)),
        ("grpc.max_send_message_length", -1),  # the server enforces its own limit, with a reason
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        # gRPC waits this long for any ping's answer (60 s by default, whatever the keepalive timeout says): a ping in
        # flight when the link died would keep the dead link a minute.
        ("grpc.http2.ping_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        # A connection of its own: gRPC shares one between a process's channels of the same options, and a server
        # bounds the calls one connection holds at once, which would then bound all the clients of the process.
        ("grpc.use_local_subchannel_pool", 1),
    ]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    if uses_tls(tls, root_certificates, server_name):
        return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates), options)
    return grpc.insecure_channel(target, options)


class PolicyClient:
    """One channel to a server; its calls may be made from any number of threads (a session takes one tick at a
    time: a second `act` on it meanwhile is refused SESSION_BUSY). ``timeout_s`` (10 s) is every call's deadline
    unless the call names its own, `act`'s included: a robot gives `act` one near its budget. Calls raise
    `PolicyServerError` for a failed call; arguments that cannot be encoded raise ValueError (`WireError` for a
    frame) or TypeError before anything is sent; after `close()` gRPC raises ValueError."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        token_file: str | Path | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        server_name: str | None = None,
        timeout_s: float = 10.0,
        serve_application: str | None = None,
    ) -> None:
        """``serve_application``: the target is Ray Serve's gRPC proxy and this the application to route to."""
        if token_file is not None:
            token = read_token_file(Path(token_file))  # ValueError naming what is wrong with the file
        elif token is not None:
            check_token(token, "token")  # gRPC would refuse every call's metadata (INTERNAL) instead
        check_timeout(timeout_s)
        check_target(target)
        self.target = target
        self.timeout_s = timeout_s
        self.serve_application = serve_application
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        if serve_application is not None:
            self._metadata += ((serve_metadata.APPLICATION_KEY, serve_application),)
        self._routing_keys: dict[str, str] = {}  # session id -> its routing key, behind Serve
        self.channel = make_channel(target, tls=tls, root_certificates=root_certificates, server_name=server_name)
        self._tls = (uses_tls(tls, root_certificates, server_name), root_certificates, server_name)
        self.stub = pb_grpc.PolicyServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    # -- plumbing ------------------------------------------------------------------------------

    def call_metadata(self, session_id: str | None = None, timeout_s: float | None = None,
                      routing_key: str | None = None) -> tuple[tuple[str, str], ...]:
        """The metadata of one call: the token, and behind Serve the routing key of the session it is about
        (``routing_key``, else the one of ``session_id``) and the call's timeout."""
        if self.serve_application is None:
            return self._metadata
        extra: tuple[tuple[str, str], ...] = ()
        routing_key = routing_key or self._routing_keys.get(session_id or "")
        if routing_key:
            extra += ((serve_metadata.ROUTING_KEY, routing_key),)
        if timeout_s is not None:
            extra += ((serve_metadata.TIMEOUT_KEY, f"{timeout_s * 1e3:.0f}"),)
        return self._metadata + extra

    def rpc_error(self, exc: grpc.RpcError) -> PolicyServerError:
        """The `PolicyServerError` of a failed call on this client's channel, a TLS mismatch named as one."""
        return explain_connection_failure(PolicyServerError.from_rpc_error(exc), self.target, *self._tls)

    def _call(self, method: Callable[..., T], request, timeout_s: float | None, session_id: str | None = None,
              routing_key: str | None = None, **kwargs) -> T:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        check_timeout(timeout_s)
        metadata = self.call_metadata(session_id, timeout_s, routing_key)
        try:
            return method(request, timeout=timeout_s, metadata=metadata, **kwargs)
        except grpc.RpcError as exc:
            error = self.rpc_error(exc)
            # gRPC says only "Deadline Exceeded", and the calls that wait for a server (GetServerInfo, OpenSession,
            # ...) say so too where nothing ever answered.
            raise self._no_answer(timeout_s) if error.no_answer else error from None

    def _no_answer(self, waited_s: float) -> PolicyServerError:
        """DEADLINE_EXCEEDED where no server answered in ``waited_s``."""
        return PolicyServerError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED.name,
                                 f"no answer from {self.target} within {round(waited_s, 3):g} s: the server is down, "
                                 "unreachable, starting or busy, or the call needs longer")

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- server --------------------------------------------------------------------------------

    def server_info(self, timeout_s: float | None = None, *, budget_ms: float | None = None,
                    rate_hz: float | None = None) -> pb.ServerInfo:
        """What the server serves, its limits, and per embodiment how many sessions of ``budget_ms`` (ms) and
        ``rate_hz`` fit (``capacity``; None: the server's default budget, the embodiment's default rate)."""
        check_args(pb.GetServerInfoRequest, budget_ms=budget_ms, rate_hz=rate_hz)
        request = pb.GetServerInfoRequest(budget_ms=budget_ms, rate_hz=rate_hz)
        try:
            return self._call(self.stub.GetServerInfo, request, timeout_s)
        except PolicyServerError as error:  # it waits for a connection (RETRY_SERVICE_CONFIG): say why none was made
            raise (self._connection_failure() if error.no_answer else None) or error from None

    def health(self, service: str = "", timeout_s: float | None = None) -> str:
        """SERVING, NOT_SERVING or SERVICE_UNKNOWN (standard grpc.health.v1)."""
        response = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_until_serving(self, timeout_s: float = SERVING_WAIT_S) -> None:
        """Block until health is SERVING (model loaded and warm), at most ``timeout_s`` (10 min, a first start's
        compile included); TimeoutError otherwise (naming why no connection was made, where gRPC says), but
        `PolicyServerError` where a TLS channel's handshake failed (a plaintext server, a certificate its roots do not
        trust or not valid now, another name): waiting longer does not mend those. Watches the standard
        health service (``Health.Watch``), waiting for the server to come up and watching again if it restarts.
        Behind Serve, whose proxy does not pass the health service on, it asks ``GetServerInfo`` until a replica
        answers ready (a TLS mismatch there ends in TimeoutError too)."""
        check_timeout(timeout_s)
        if self.serve_application is not None:
            self._wait_until_replica_serves(timeout_s)
            return
        end = time.monotonic() + timeout_s
        last = "no answer"
        while (left_s := end - time.monotonic()) > 0:
            updates = self._health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=left_s,
                                         metadata=self._metadata, wait_for_ready=True)  # Watch takes the token
            try:
                for update in updates:
                    last = health_pb2.HealthCheckResponse.ServingStatus.Name(update.status)
                    if update.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    break
                error = PolicyServerError.from_rpc_error(exc)
                if exc.code() != grpc.StatusCode.UNAVAILABLE and error.reason != "TOO_MANY_HEALTH_WATCHES":
                    raise error from None
                # The server went away: watch it come back. A server in its shutdown grace period refuses new
                # calls at once, hence the pause; so does one watched by as many clients as it takes at once.
                last = error.reason
                time.sleep(min(max(_RETRY_PAUSE_S, error.retry_after_ms / 1e3), max(0.0, end - time.monotonic())))
            finally:
                updates.cancel()
        if last == "no answer" and (failure := self._connection_failure()) is not None:  # the Watch waited for one
            if self._tls[0]:
                raise failure
            last = failure.message
        raise TimeoutError(f"{self.target} not SERVING after {timeout_s:g} s (last: {last})")

    def _connection_failure(self) -> PolicyServerError | None:
        """Why calls that wait for a connection got none, where one health Check that does not wait says more than
        "no answer" (`explain_connection_failure`: a TLS mismatch, a connection closed before a word of gRPC); else
        None. For the calls that set up, after they waited, not a tick's."""
        try:
            self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=_PROBE_S)
        except grpc.RpcError as exc:
            error = PolicyServerError.from_rpc_error(exc)
            mismatch = explain_connection_failure(error, self.target, *self._tls)
            return None if mismatch is error else mismatch
        return None

    def _wait_until_replica_serves(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        last = "no answer"
        while (left_s := end - time.monotonic()) > 0:
            try:
                if self.server_info(timeout_s=min(left_s, self.timeout_s)).ready:
                    return
                last = "not ready"
            except PolicyServerError as exc:
                # UNAVAILABLE: Serve, the proxy or a replica is starting; NOT_FOUND without a reason of ours: the
                # proxy does not route the application yet ("Application ... not found"); DEADLINE_EXCEEDED: the
                # call waited for a replica that is still warming up.
                waiting = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED)
                if exc.code != grpc.StatusCode.UNAVAILABLE and not (exc.code in waiting and not exc.from_server):
                    raise
                last = f"{exc.code.name}: {exc.message}"
            time.sleep(min(_RETRY_PAUSE_S, max(0.0, end - time.monotonic())))
        raise TimeoutError(f"{self.target} (Serve application {self.serve_application!r}) not serving after "
                           f"{timeout_s:g} s (last: {last})")

    # -- sessions ------------------------------------------------------------------------------

    def open_session(
        self,
        embodiment: str,
        instruction: str,
        *,
        budget_ms: float | None = None,
        chunk_size: int | None = None,
        seed: int | None = None,
        client_name: str = "",
        rate_hz: float | None = None,
        actions_per_chunk: int | None = None,
        preview: bool = False,
        timeout_s: float | None = None,
        request_id: str | None = None,
    ) -> Session:
        """``rate_hz``: chunk requests per second this client will send (unset: the server's default,
        control_hz / actions_per_chunk); ``actions_per_chunk``: actions executed from each chunk before
        asking again (unset: the chunk size); ``preview``: every chunk carries the predicted frames
        (``ActionChunk.preview_frames``; their decode counts against the tick's budget). The server admits
        the session only if its ticks at that rate fit beside the others: RESOURCE_EXHAUSTED / OVERLOADED
        otherwise. A server that answers UNAVAILABLE (warming up, restarting, shutting down, or the answer lost with its
        connection) is asked again, after the delay it asks for (WARMING_UP: ``retry_after_ms``), until ``timeout_s``:
        a draining server takes no session, but its restart, or another replica behind the same address, may (a
        draining gRPC server refuses the call before answering, and it waits for a connection, as through a
        restart). Where the next try would come too late the call raises at once the server's last answer
        (UNAVAILABLE / WARMING_UP with its progress and ``retry_after_ms``, SHUTTING_DOWN), its message naming the
        whole wait and whether the server answered after it; DEADLINE_EXCEEDED only where no server answered. Not
        to wait for a server that is going away, pass a shorter ``timeout_s``.

        Every try sends one ``request_id`` (None or empty: a fresh uuid4 hex), so a try whose answer was lost leaves
        no second session: the server answers the session the id opened. Pass the id again to retry a call that failed
        (16 to 64 characters of A-Z a-z 0-9 '-' '_'; keep it secret, like a session id). Behind Ray Serve it is also
        the session's routing key, so a retry reaches the same replica."""
        request_id = request_id or uuid.uuid4().hex
        check_args(pb.OpenSessionRequest, embodiment=embodiment, instruction=instruction, budget_ms=budget_ms,
                   chunk_size=chunk_size, seed=seed, client_name=client_name, rate_hz=rate_hz,
                   actions_per_chunk=actions_per_chunk, preview=preview, request_id=request_id)
        request = pb.OpenSessionRequest(
            embodiment=embodiment, instruction=instruction, client_name=client_name, preview=preview,
            request_id=request_id,
        )
        if budget_ms is not None:
            request.budget_ms = budget_ms
        if chunk_size is not None:
            request.chunk_size = chunk_size
        if seed is not None:
            request.seed = seed
        if rate_hz is not None:
            request.rate_hz = rate_hz
        if actions_per_chunk is not None:
            request.actions_per_chunk = actions_per_chunk
        routing_key = request_id if self.serve_application is not None else None
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        check_timeout(timeout_s)
        began = time.monotonic()
        delays = _OPEN_BACKOFF.delays()
        answer: PolicyServerError | None = None  # the server's last UNAVAILABLE answer (warming up, shutting down)
        answered_s = 0.0  # when it came, s into the call
        while True:
            try:
                # What is left of the wait, at least a millisecond (a pause may overshoot it): gRPC then says no answer.
                left_s = max(began + timeout_s - time.monotonic(), 1e-3)
                opened = self._call(self.stub.OpenSession, request, left_s,
                                    routing_key=routing_key)
                break
            except PolicyServerError as exc:
                if exc.code != grpc.StatusCode.UNAVAILABLE and not exc.no_answer:
                    raise  # a refusal, or a failure that asking again would not change
                if exc.from_server:
                    answer, answered_s = exc, time.monotonic() - began
                pause_s = exc.retry_after_ms / 1e3 or next(delays)
                if exc.no_answer or time.monotonic() + pause_s >= began + timeout_s:
                    raise self._no_session(timeout_s, exc, answer, answered_s) from None
                time.sleep(pause_s)
        session = Session.from_proto(opened)
        if routing_key is not None:
            self._routing_keys[session.session_id] = routing_key
        return session

    def _no_session(self, timeout_s: float, last: PolicyServerError, answer: PolicyServerError | None,
                    answered_s: float) -> PolicyServerError:
        """What `open_session` raises where its tries opened no session within ``timeout_s``: the server's last answer
        (``answer``, ``answered_s`` into the call: its code, reason and detail), else the last try's failure, with a
        message that names the whole wait."""
        if answer is None:
            if last.no_answer:  # OpenSession waits for a connection: say why none was made, where gRPC says
                return self._connection_failure() or self._no_answer(timeout_s)
            return PolicyServerError(last.code, last.reason, f"no session from {self.target} within "
                                                             f"{round(timeout_s, 3):g} s; the last try: {last.message}")
        message = f"no session from {self.target} within {round(timeout_s, 3):g} s; its last answer"
        if answer is last:
            message += f": {answer.message}"
        else:  # it went away after it (a restart, a crash, a link down)
            message += f", {answered_s:.1f} s in: {answer.message}; nothing answered after it"
        return PolicyServerError(answer.code, answer.reason, message, answer.detail)

    def reset_session(self, session: Session | str, timeout_s: float | None = None) -> Session:
        session_id = _session_id(session)
        request = pb.ResetSessionRequest(session_id=session_id)
        return Session.from_proto(self._call(self.stub.ResetSession, request, timeout_s, session_id))

    def close_session(self, session: Session | str, timeout_s: float | None = None, *,
                      routing_key: str | None = None) -> None:
        """``routing_key``: behind Ray Serve, the routing key of a session another client opened (its opening's
        ``request_id``); one this client opened goes by its own."""
        session_id = _session_id(session)
        try:
            self._call(self.stub.CloseSession, pb.CloseSessionRequest(session_id=session_id), timeout_s, session_id,
                       routing_key)
        finally:
            self._routing_keys.pop(session_id, None)

    def set_budget(self, session: Session | str, budget_ms: float, timeout_s: float | None = None) -> Session:
        session_id = _session_id(session)
        check_args(pb.SetBudgetRequest, budget_ms=budget_ms)
        request = pb.SetBudgetRequest(session_id=session_id, budget_ms=budget_ms)
        return Session.from_proto(self._call(self.stub.SetBudget, request, timeout_s, session_id))

    # -- acting --------------------------------------------------------------------------------

    def act(
        self,
        session: Session,
        images: Mapping[str, np.ndarray],
        state: np.ndarray | None = None,
        *,
        instruction: str = "",
        step_index: int = 0,
        committed_actions: np.ndarray | None = None,
        encoding: str = "jpeg",
        jpeg_quality: int = 90,
        timeout_s: float | None = None,
    ) -> ActionChunk:
        """One observation -> one chunk. ``timeout_s`` is the gRPC deadline; the server plans the
        tick against min(session budget, deadline) and abandons the work once it passes. ``committed_actions``:
        float [d, action_dim], the actions the robot executes from ``step_index`` on while it waits (e.g.
        ``ActionQueue.upcoming``), which the chunk then starts with and continues."""
        observation = build_observation(images, state, instruction, step_index, encoding, jpeg_quality,
                                        committed_actions)
        return self.act_request(
            pb.ActRequest(session_id=session.session_id, epoch=session.epoch, observation=observation),
            timeout_s,
        )

    def act_request(self, request: pb.ActRequest, timeout_s: float | None = None) -> ActionChunk:
        """Send a hand-built ActRequest (for callers that encode observations themselves)."""
        return ActionChunk.from_proto(self._call(self.stub.Act, request, timeout_s, request.session_id))

    def forward_dynamics(
        self,
        session: Session,
        images: Mapping[str, np.ndarray],
        actions: np.ndarray,
        state: np.ndarray | None = None,
        *,
        instruction: str = "",
        step_index: int = 0,
        seed: int | None = None,
        encoding: str = "jpeg",
        jpeg_quality: int = 90,
        timeout_s: float | None = None,
    ) -> PredictedFrames:
        """The frames ``actions`` (float [chunk_size, action_dim], physical units) lead to from this
        observation. Not a control tick: uncached at the model's step count, between ticks, bounded by
        ``timeout_s`` (and the server's ``Limits.max_dynamics_ms``). ``instruction`` "" uses the session's."""
        check_args(pb.ForwardDynamicsRequest, seed=seed)
        request = pb.ForwardDynamicsRequest(
            session_id=session.session_id, epoch=session.epoch,
            observation=build_observation(images, state, instruction, step_index, encoding, jpeg_quality),
            actions=floats_to_proto(actions, "actions"),
        )
        if seed is not None:
            request.seed = seed
        return PredictedFrames.from_proto(self._call(self.stub.ForwardDynamics, request, timeout_s,
                                                     session.session_id))

    def inverse_dynamics(
        self,
        session: Session,
        videos: Mapping[str, np.ndarray],
        state: np.ndarray | None = None,
        *,
        instruction: str = "",
        step_index: int = 0,
        seed: int | None = None,
        encoding: str = "jpeg",
        jpeg_quality: int = 90,
        timeout_s: float | None = None,
    ) -> ActionChunk:
        """The action chunk that explains ``videos`` (camera -> uint8 RGB [chunk_size + 1, H, W, 3];
        ``state`` at frame 0): ``actions[i]`` takes frame i to frame i + 1, for control step
        ``step_index + i``. Runs as ``forward_dynamics``."""
        request = build_inverse_dynamics(session, videos, state, instruction, step_index, seed, encoding,
                                         jpeg_quality)
        return ActionChunk.from_proto(self._call(self.stub.InverseDynamics, request, timeout_s, session.session_id))

    def reason(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        seed: int | None = None,
        timeout_s: float | None = None,
    ) -> ReasonStream:
        """Stream reasoner text pieces as they are generated: greedy at ``temperature`` 0, else sampled from
        ``seed`` (None: the server's 0, so a repeated call gets the same text). The call starts at the first
        piece asked for; once the pieces end, the stream says why (`ReasonStream.finish_reason`)."""
        check_args(pb.ReasonRequest, prompt=prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        request = pb.ReasonRequest(prompt=prompt, max_new_tokens=max_new_tokens, temperature=temperature)
        if seed is not None:
            request.seed = seed
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        check_timeout(timeout_s)
        return ReasonStream(lambda: self.stub.Reason(request, timeout=timeout_s,
                                                     metadata=self.call_metadata(timeout_s=timeout_s)),
                            self.rpc_error)


class ReasonStream(Iterator[str]):
    """A `Reason` call's text pieces, in order. After the last: `finish_reason` "stop" (the model's end-of-text
    token) or "length" (max_new_tokens), and `tokens`, the tokens generated. `close()` (or breaking off and
    dropping the stream) cancels the call."""

    def __init__(self, call: Callable[[], Iterator[pb.ReasonChunk]],
                 error: Callable[[grpc.RpcError], PolicyServerError] = PolicyServerError.from_rpc_error):
        """``error``: the `PolicyServerError` of the call's failure (its client's `PolicyClient.rpc_error`)."""
        self.finish_reason: str | None = None
        self.tokens = 0
        self._error = error
        self._pieces = self._read(call)

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        self._pieces.close()

    def _read(self, call: Callable[[], Iterator[pb.ReasonChunk]]) -> Iterator[str]:
        responses = call()
        try:
            for piece in responses:
                if piece.done:
                    self.finish_reason, self.tokens = piece.finish_reason, piece.tokens
                    return
                yield piece.text
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        finally:
            responses.cancel()  # no-op once finished; stops generation if the caller breaks off


def _session_id(session: Session | str) -> str:
    return session if isinstance(session, str) else session.session_id
