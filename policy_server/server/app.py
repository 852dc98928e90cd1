"""Assemble the gRPC server (policy service, health, reflection, auth, TLS, limits), the metrics
endpoint and the optional openpi WebSocket endpoint around one engine.

    server = build_server(config, engine).start()
    ...                      # server.grpc_port, server.metrics_port, server.websocket_port
    server.stop()
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from policy_server.config import ServerConfig
from policy_server.engine.api import Engine
from policy_server.limits import MAX_REASON_CALLS, MAX_REFLECTION_STREAMS, MAX_STARTING_STREAMS
from policy_server.server import listen
from policy_server.server.auth import TokenAuthInterceptor
from policy_server.server.errors import abort, lenient_parser, make_error
from policy_server.server.grpc_metrics import GrpcMetricsInterceptor
from policy_server.server.health import HEALTH_SERVICE, HealthService
from policy_server.server.metrics import LATENCY_BUCKETS_S, ServerMetrics
from policy_server.server.running_calls import RunningCalls
from policy_server.server.servicer import PolicyServicer
from policy_server.server.websocket import OpenpiWebsocketServer
from policy_server.v1 import policy_server_pb2 as pb

log = logging.getLogger(__name__)

POLICY_SERVICE = pb.DESCRIPTOR.services_by_name["PolicyService"].full_name
_READY_POLL_S = 0.05


def _keepalive_options() -> list[tuple[str, int]]:
    # A dead robot link should be noticed in seconds: ping every 10 s, give up after 5 s, and let
    # clients ping on idle connections (robots often sit idle between episodes).
    return [
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.ping_timeout_ms", 5_000),  # any ping's answer (60 s by default, the keepalive timeout aside)
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def _policy_service_handler(servicer: PolicyServicer, running: RunningCalls) -> grpc.GenericRpcHandler:
    """The PolicyService methods, with request deserializers that never raise (see ``lenient_parser``), each call
    counted in ``running`` (a shutdown waits for them)."""
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    service = pb.DESCRIPTOR.services_by_name["PolicyService"]
    handlers = {}
    for method in service.methods:
        request, response = (getattr(pb, m.name) for m in (method.input_type, method.output_type))
        make = kinds[(method.client_streaming, method.server_streaming)]
        behavior = running.counted(getattr(servicer, method.name), method.server_streaming)
        handlers[method.name] = make(behavior, request_deserializer=lenient_parser(request),
                                     response_serializer=response.SerializeToString)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def max_concurrent_calls(max_sessions: int, max_dynamics_calls: int, reflection: bool) -> int:
    """Calls served at once. Each call that may hold a thread for long is bounded, and has one: per session a
    Control stream and an Act; the streams waiting for their start, the Reason calls, the dynamics calls the engine
    takes at once and, served with ``reflection``, its streams; then 2 more for short unary calls (OpenSession,
    ...)."""
    return (2 * max_sessions + MAX_STARTING_STREAMS + MAX_REASON_CALLS + max_dynamics_calls
            + (MAX_REFLECTION_STREAMS if reflection else 0) + 2)


class _BoundedReflection(reflection.ReflectionServicer):
    """Server reflection, at most ``MAX_REFLECTION_STREAMS`` streams at once: a stream holds a server thread for as
    long as its client keeps it open, so unbounded, idle ones would take every thread."""

    def __init__(self, service_names: tuple[str, ...]) -> None:
        super().__init__(service_names)
        self._places = threading.BoundedSemaphore(MAX_REFLECTION_STREAMS)

    def ServerReflectionInfo(self, request_iterator, context):  # noqa: N802 - gRPC's method name
        if not self._places.acquire(blocking=False):
            abort(context, make_error(
                "TOO_MANY_REFLECTION_STREAMS", f"{MAX_REFLECTION_STREAMS} reflection streams are open already",
                expected="a reflection stream closed once its questions are answered", retry_after_ms=1000.0))
        try:
            yield from super().ServerReflectionInfo(request_iterator, context)
        finally:
            self._places.release()


def _beyond_this_machine(host: str) -> bool:
    """Whether a listener on ``host`` may be reached from other machines: any address but a loopback one."""
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name
        return host != "localhost"


def exposure_warnings(config: ServerConfig) -> list[str]:
    """What the log should say about an auth token or TLS key file other users of this machine may read, and about
    listeners that other machines may reach (``--host`` for gRPC and the openpi WebSocket, ``--metrics-host``)
    without a token, or with the token in the clear."""
    warnings = []
    for secret, path in (("auth token file", config.auth_token_file), ("TLS key file", config.tls_key)):
        if path is not None and (mode := path.stat().st_mode & 0o777) & 0o077:
            warnings.append(f"{secret} {path} may be read by other users of this machine (mode {mode:o}): chmod 600 it")
    exposed = [f"{what} on {host}" for what, host, on in (
        ("gRPC" + (" and the openpi WebSocket" if config.websocket_port is not None else ""), config.host, True),
        ("/metrics", config.metrics_host, config.metrics_port is not None)) if on and _beyond_this_machine(host)]
    listeners = " and ".join(exposed)
    if exposed and config.auth_token_file is None:
        can = ("may open sessions and get action chunks" if _beyond_this_machine(config.host)
               else "may read the server's metrics (its sessions, errors and the model's digest)")
        warnings.append(f"{listeners} may be reached from other machines, with no token asked: whoever reaches them "
                        f"{can}; set --auth-token-file (with --tls-cert/--tls-key), or bind 127.0.0.1")
    elif exposed and not config.tls:
        warnings.append(f"{listeners} may be reached from other machines in plaintext: the auth token crosses the "
                        "network in the clear with every call; set --tls-cert/--tls-key (or terminate TLS in front "
                        "and bind 127.0.0.1)")
    return warnings


def _answers(path: os.PathLike) -> bool:
    """Whether a program listens on the Unix socket at `path` (a running server). gRPC unlinks a socket file before it
    binds its path, which lets a restart bind over the file a crashed server left, and would as well take the path
    of a server still running."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(os.fspath(path))
        except OSError:  # no such file, or nothing listens on it
            return False
    return True


def _taken_address(host: str, port: int) -> str | None:
    """The first address gRPC would bind for the host name `host` that another program holds at `port`. gRPC binds
    every address a name has ("localhost": 127.0.0.1 and ::1) and starts where any one binds: a second server on
    localhost took ::1 beside the first's 127.0.0.1, so a client of localhost reached either. A literal address (or
    port 0) gRPC's own bind judges."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return None
    except ValueError:
        pass
    if port == 0:
        return None
    addresses = {"127.0.0.1", "::1"} if host == "localhost" else set()  # gRPC's resolver makes localhost both
    try:
        addresses |= {str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except socket.gaierror:  # a name that resolves to nothing (now): gRPC's bind fails, naming the host
        return None
    for candidate in sorted(addresses):
        try:
            listen.tcp_socket(candidate, port).close()  # bound as gRPC binds it, SO_REUSEADDR included
        except OSError as error:
            if error.errno == errno.EADDRINUSE:  # not EADDRNOTAVAIL: an address this machine lacks, gRPC skips too
                return listen.address(candidate, port)
    return None


def _bind_error(address: str) -> OSError:
    """Why gRPC could not bind `address` (`HOST:PORT` or `unix:PATH`), as the OS says when a socket of ours tries:
    gRPC core says it only in its own log line."""
    try:
        if address.startswith("unix:"):
            path = address.removeprefix("unix:")
            with socket.socket(socket.AF_UNIX) as probe:
                probe.bind(path)
            os.unlink(path)
        else:
            host, _, port = address.rpartition(":")
            listen.tcp_socket(host, int(port)).close()
    except OSError as error:  # socket.gaierror too: a host that names no address
        return error
    return OSError("in use or not permitted")


class PolicyServer:
    """The running server. Not started until ``start()``; usable as a context manager."""

    def __init__(self, config: ServerConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.metrics = ServerMetrics(engine)
        self._token = config.auth_token()
        self._grpc: grpc.Server | None = None
        self._running = RunningCalls()
        self._health = HealthService()
        self._websocket: OpenpiWebsocketServer | None = None
        self._stop_polling = threading.Event()
        self._poller: threading.Thread | None = None
        self.grpc_port: int | None = None
        self.metrics_port: int | None = None
        self.websocket_port: int | None = None

    @property
    def target(self) -> str:
        """``host:port`` a client on this machine can dial."""
        return listen.address(self.config.host, self.grpc_port)

    @property
    def metrics_address(self) -> str | None:
        """``host:port`` of the /metrics endpoint, once bound (None: off)."""
        return None if self.metrics_port is None else listen.address(self.config.metrics_host, self.metrics_port)

    @property
    def websocket_address(self) -> str | None:
        """``host:port`` of the openpi WebSocket, once bound (None: off); it listens on the gRPC host."""
        return None if self.websocket_port is None else listen.address(self.config.host, self.websocket_port)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> PolicyServer:
        cfg = self.config
        services = [pb.DESCRIPTOR.services_by_name["PolicyService"], health_pb2.DESCRIPTOR.services_by_name["Health"]]
        if cfg.reflection:
            services.append(reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"])
        # Metrics first, so that the calls authentication refuses are counted too.
        interceptors = [GrpcMetricsInterceptor(self.metrics.registry, services, LATENCY_BUCKETS_S)]
        if self._token:
            interceptors.append(TokenAuthInterceptor(self._token, self.metrics.observe_error))
        # One connection holds at most the pool's count of calls (HTTP/2 MAX_CONCURRENT_STREAMS; its calls beyond
        # wait on that connection, or gRPC refuses them REFUSED_STREAM), so a client flooding the server with calls
        # holds up itself, not the others. The calls of all connections beyond the pool wait for a thread, up to a
        # second pool's worth, then gRPC refuses them (RESOURCE_EXHAUSTED). The calls that may hold a thread for
        # long are bounded below the pool (`max_concurrent_calls`), so two threads at least take the waiting calls.
        workers = max_concurrent_calls(cfg.max_sessions, cfg.max_dynamics_calls, cfg.reflection)
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
            interceptors=interceptors,
            maximum_concurrent_rpcs=2 * workers,
            options=[
                # Frames up to 2x the limit reach the servicer, which answers PAYLOAD_TOO_LARGE with
                # a reason; gRPC core cuts anything larger with plain RESOURCE_EXHAUSTED.
                ("grpc.max_receive_message_length", 2 * cfg.max_message_bytes),
                # The limit is the requests': answers are the server's own, bounded by the model (predicted frames
                # at most max_chunk_size + 1 JPEGs of its canvas), and one cut here would be lost after its work.
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 0),
                ("grpc.max_concurrent_streams", workers),
                *_keepalive_options(),
            ],
        )
        servicer = PolicyServicer(self.engine, self.metrics, cfg.max_message_bytes, self._running)
        self._grpc.add_generic_rpc_handlers((_policy_service_handler(servicer, self._running),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        if cfg.reflection:
            reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
                _BoundedReflection((POLICY_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME)), self._grpc
            )

        credentials = None
        if cfg.tls:
            credentials = grpc.ssl_server_credentials([(cfg.tls.key_pem, cfg.tls.cert_chain_pem)])
        if taken := _taken_address(cfg.host, cfg.port):
            raise listen.bind_failed("gRPC", listen.address(cfg.host, cfg.port), OSError(
                errno.EADDRINUSE, f"{os.strerror(errno.EADDRINUSE)}: another program listens on {taken}"))
        self.grpc_port = self._add_port(listen.address(cfg.host, cfg.port), credentials)
        if cfg.unix_socket is not None:
            if _answers(cfg.unix_socket):  # gRPC would unlink it and bind the path: its clients would reach this server
                raise listen.bind_failed("gRPC", f"unix:{cfg.unix_socket}", OSError(errno.EADDRINUSE,
                                                                                    os.strerror(errno.EADDRINUSE)))
            self._add_port(f"unix:{cfg.unix_socket}", credentials)

        self._set_health(self.engine.ready())
        self._grpc.start()
        self._poller = threading.Thread(target=self._poll_readiness, daemon=True, name="health-poll")
        self._poller.start()

        ssl_context = cfg.tls.context if cfg.tls else None  # the metrics endpoint's and the WebSocket's TLS
        if cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve(cfg.metrics_host, cfg.metrics_port, token=self._token,
                                                   ssl_context=ssl_context)
        if cfg.websocket_port is not None:
            self._websocket = OpenpiWebsocketServer(
                self.engine,
                self.metrics,
                cfg.host,
                cfg.websocket_port,
                cfg.max_message_bytes,
                cfg.session_idle_timeout_s,
                token=self._token,
                embodiment=cfg.websocket_embodiment,
                ssl_context=ssl_context,
            )
            self.websocket_port = self._websocket.start()
        log.info(
            "policy-server listening on %s (grpc%s)%s%s%s",
            self.target,
            "+tls" if cfg.tls else "",
            f", unix:{cfg.unix_socket}" if cfg.unix_socket is not None else "",
            f", metrics {self.metrics_address}" if self.metrics_address is not None else "",
            f", openpi websocket {self.websocket_address}" if self.websocket_address is not None else "",
        )
        for warning in exposure_warnings(cfg):
            log.warning(warning)
        return self

    def _add_port(self, address: str, credentials: grpc.ServerCredentials | None) -> int:
        try:
            port = (
                self._grpc.add_secure_port(address, credentials)
                if credentials
                else self._grpc.add_insecure_port(address)
            )
        except RuntimeError:  # grpcio's way of saying the bind failed
            port = 0
        if port == 0:
            raise listen.bind_failed("gRPC", address, _bind_error(address))
        return port

    def stop(self, grace_s: float = 2.0) -> None:
        """Flip health to NOT_SERVING, stop accepting calls, let running calls finish for at most ``grace_s``: each
        Control stream answers the frame it is serving and ends (`RunningCalls`), then the streams left (health
        Watch, reflection) are cancelled."""
        ends_s = time.monotonic() + grace_s
        self._stop_polling.set()
        self._health.enter_graceful_shutdown()
        grpc_stopped = None
        if self._grpc is not None:
            grpc_stopped = self._grpc.stop(grace_s)  # its grace runs meanwhile
            self._running.drain()
        if self._websocket is not None:
            self._websocket.stop(grace_s)
            self._websocket = None
        self.metrics.stop()
        if grpc_stopped is not None:
            self._running.wait_ended(max(0.0, ends_s - time.monotonic()))
            self._grpc.stop(0)  # what is left (health Watch, reflection streams) has nothing to finish
            grpc_stopped.wait()
            self._grpc = None
            self._health.close()

    def __enter__(self) -> PolicyServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(grace_s=0.5)

    # -- health -------------------------------------------------------------------------------

    def _set_health(self, ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", POLICY_SERVICE):
            self._health.set(service, status)

    def _poll_readiness(self) -> None:
        # The engine only exposes ready(); poll it so health follows loading, warmup and any later
        # re-warm without the engine knowing about gRPC.
        last, served = None, False
        while not self._stop_polling.wait(_READY_POLL_S):
            ready = bool(self.engine.ready())
            if ready != last:
                self._set_health(ready)
                if ready or last is not None:
                    log.info("health: %s", "SERVING" if ready else "NOT_SERVING")
                if ready and not served:
                    self._check_default_budget()
                    served = True
                last = ready

    def _check_default_budget(self) -> None:
        """Warn when a session opened without a budget fits nowhere: `--latency-budget-ms` below what the model
        can do here (known only once warm), which every OpenSession without `budget_ms` would be refused for."""
        capacity = self.engine.capacity()
        if capacity and not any(c.sessions_alone for c in capacity):
            log.warning("the default budget of %g ms fits no session on this device: an OpenSession without "
                        "budget_ms will be refused; raise --latency-budget-ms (GetServerInfo's warmup profile "
                        "gives the tick latencies)", self.config.latency_budget_ms)


def build_server(config: ServerConfig, engine: Engine) -> PolicyServer:
    """The server for ``engine`` configured by ``config``; call ``.start()`` (or use ``with``)."""
    return PolicyServer(config, engine)
