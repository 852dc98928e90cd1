"""Prometheus metrics, exposed on their own HTTP port (``--metrics-port``, on ``--metrics-host``).

Each server owns its registry, so several servers in one process (tests) never collide. Names follow
Prometheus' conventions: base units (durations in seconds), ``_total`` on counters, an ``_info`` gauge
for the build. The latency buckets run from 1 ms to 10 s and bracket the default 120 ms budget
finely. When the server requires a token, so does ``/metrics`` (``Authorization: Bearer <token>``, as
Prometheus' ``authorization`` scrape setting sends it): session counts and error reasons are not for everyone.
"""

from __future__ import annotations

import contextlib
import http
import io
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    make_wsgi_app,
)

from policy_server import __version__
from policy_server.engine.api import ActResult, Engine
from policy_server.server import listen
from policy_server.server.auth import bearer_token_matches

MAX_SCRAPES = 8  # scrapes served at once; a Prometheus server sends one at a time
SCRAPE_TIMEOUT_S = 10.0  # a scrape connection is closed this long after it was taken (Prometheus' default timeout)
# prometheus-client adds a `<name>_created` gauge (the series' creation time) beside every counter and histogram series:
# in Prometheus' text format a series of its own, a sixth of the scrape's, which no query needs.
disable_created_metrics()
LATENCY_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.11, 0.12, 0.13, 0.15, 0.2, 0.3,
                     0.5, 1, 2, 5, 10)


class ServerMetrics:
    """Counters and histograms the servicers update, gauges read from the engine at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        PlatformCollector(registry=r)  # python_info
        info = engine.info()
        Info("policy_server_build", "The server's version and the model it serves", registry=r).info({
            "version": __version__,
            "model": info.model_name,
            "model_digest": info.model_digest,
        })
        # A tick's time, three ways: the engine's stages (they add up to about the tick's total), the
        # total (queue wait included), and what the transport saw (request in to answer ready).
        self.stage_seconds = Histogram(
            "policy_server_stage_duration_seconds",
            "Time one tick spent in each stage (prepare, queue, encode, prefill, denoise, decode, preview)",
            ["stage"], buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.tick_seconds = Histogram(
            "policy_server_tick_duration_seconds", "Engine time of one tick, queue wait included",
            ["transport"], buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.served_seconds = Histogram(
            "policy_server_tick_served_duration_seconds",
            "Request received to answer ready inside the server, per tick",
            ["transport"], buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.ticks = Counter("policy_server_ticks", "Action chunks served", ["transport"], registry=r)
        self.deadline_misses = Counter(
            "policy_server_deadline_misses", "Ticks that finished after their deadline", registry=r
        )
        self.cache_decisions = Counter(
            "policy_server_cache_decisions",
            "GEN-stack calls by diffusion-cache decision, each call under one: full (the cache computed it), "
            "fail_open (the cache could not skip it), skipped (the cache reused it), forced_skip (the guard did)",
            ["decision"],
            registry=r,
        )
        self.fallbacks = Counter(
            "policy_server_fallbacks", "Budget fallbacks applied, by kind (e.g. late_finish_at_step)", ["fallback"],
            registry=r,
        )
        self.batch_size = Histogram(
            "policy_server_batch_size", "Ticks in the micro-batch each tick ran in (1 = alone)",
            buckets=(1, 2, 3, 4, 6, 8, 16, 32, 64), registry=r,
        )
        self.errors = Counter(
            "policy_server_errors", "Requests answered with an error", ["reason"], registry=r
        )
        self.superseded = Counter(
            "policy_server_superseded_observations",
            "Control-stream observations dropped for a newer one",
            registry=r,
        )
        self.reason_pieces = Counter(
            "policy_server_reason_pieces", "Reasoner text pieces streamed", registry=r
        )
        Gauge("policy_server_sessions", "Open sessions", registry=r).set_function(
            lambda: engine.stats().sessions
        )
        Gauge("policy_server_queue_depth", "Requests waiting for the model worker", registry=r).set_function(
            lambda: engine.stats().queue_depth
        )
        Gauge("policy_server_ready", "1 once warmup is done and health is SERVING", registry=r).set_function(
            lambda: 1.0 if engine.ready() else 0.0
        )
        self._http: WSGIServer | None = None

    def observe_tick(self, result: ActResult, served_ms: float, transport: str) -> None:
        tick = result.tick
        self.ticks.labels(transport).inc()
        for stage, ms in tick.actual_ms.items():
            if stage != "total":
                self.stage_seconds.labels(stage).observe(ms / 1e3)
        self.tick_seconds.labels(transport).observe(tick.actual_ms["total"] / 1e3)
        self.served_seconds.labels(transport).observe(served_ms / 1e3)
        if not tick.deadline_met:
            self.deadline_misses.inc()
        # Each call under one decision, so that they add up to the calls: a record's full calls include the
        # fail-open ones, and its skipped calls the forced ones.
        for decision, count in (
            ("full", tick.full_calls - tick.fail_open),
            ("skipped", tick.skipped_calls - tick.forced_skips),
            ("forced_skip", tick.forced_skips),
            ("fail_open", tick.fail_open),
        ):
            if count:
                self.cache_decisions.labels(decision).inc(count)
        for kind in tick.fallback_kinds:  # the kind only: steps in the label would explode the series
            self.fallbacks.labels(kind).inc()
        self.batch_size.observe(tick.knobs["batch_size"])

    def observe_error(self, reason: str) -> None:
        self.errors.labels(reason).inc()

    def serve(self, host: str, port: int, token: str | None = None, ssl_context: ssl.SSLContext | None = None) -> int:
        """Start the /metrics HTTP endpoint; returns the bound port (``port`` 0 picks a free one). Other paths
        get 404; with ``token``, a request without ``Authorization: Bearer <token>`` gets 401; with ``ssl_context``
        it is HTTPS (the server's TLS: a token must not cross the network in the clear)."""
        app = _only_metrics_path(make_wsgi_app(self.registry))
        if token is not None:
            app = _require_token(app, token)
        server_class = _Server6 if listen.family(host) == socket.AF_INET6 else _Server
        try:
            self._http = make_server(host.strip("[]"), port, app, server_class=server_class,
                                     handler_class=_ScrapeHandler)
        except OSError as error:  # in use, or not an address of this machine
            raise listen.bind_failed("the metrics endpoint", listen.address(host, port), error) from None
        self._http.ssl_context = ssl_context
        threading.Thread(target=self._http.serve_forever, daemon=True, name="metrics").start()
        return int(self._http.server_port)

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _Server(ThreadingMixIn, WSGIServer):
    """A thread per scrape, at most `MAX_SCRAPES` at once (more are closed unanswered), each closed `SCRAPE_TIMEOUT_S`
    after it was taken, its TLS handshake included (`ssl_context`, on the scrape's own thread), however it sends:
    a timeout per read let a byte every few seconds hold a place for ever, so that a few such connections kept
    every scrape out. A connection that fails (timed out, reset, not TLS) is closed without a word: socketserver
    printed a traceback for each, a flood of log lines for whoever reaches the port."""

    daemon_threads = True
    ssl_context: ssl.SSLContext | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._scrapes = threading.BoundedSemaphore(MAX_SCRAPES)

    def get_request(self):
        connection, address = super().get_request()
        if self.ssl_context is not None:
            connection = self.ssl_context.wrap_socket(connection, server_side=True, do_handshake_on_connect=False)
        return connection, address

    def process_request(self, request, client_address) -> None:
        if not self._scrapes.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        deadline_s = time.monotonic() + SCRAPE_TIMEOUT_S
        try:
            if isinstance(request, ssl.SSLSocket):
                request.settimeout(SCRAPE_TIMEOUT_S)  # the handshake's whole time, not each read's
                request.do_handshake()
            self.RequestHandlerClass(request, client_address, self, deadline_s)  # serves the scrape
        except OSError:  # timed out, went away, or plain HTTP or a bad handshake on TLS (ssl.SSLError)
            pass
        except Exception:  # noqa: BLE001 - socketserver's own rule for what a request raises
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._scrapes.release()


class _Server6(_Server):
    address_family = socket.AF_INET6


class _BeforeDeadline(io.RawIOBase):
    """A socket whose reads and writes each wait only for the time left until ``deadline_s`` (monotonic s), then
    raise ConnectionAbortedError: the one error wsgiref takes for a client gone without a traceback in the log."""

    def __init__(self, sock: socket.socket, deadline_s: float) -> None:
        super().__init__()
        self._sock, self._deadline_s = sock, deadline_s

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        with self._until_deadline():
            return self._sock.recv_into(buffer)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        while view:  # a send at a time: a TLS socket's sendall gives each of its records the whole timeout
            with self._until_deadline():
                view = view[self._sock.send(view):]
        return len(data)

    @contextlib.contextmanager
    def _until_deadline(self) -> Iterator[None]:
        left_s = self._deadline_s - time.monotonic()
        if left_s <= 0:
            raise ConnectionAbortedError("the scrape's time is up")
        self._sock.settimeout(left_s)
        try:
            yield
        except TimeoutError:
            raise ConnectionAbortedError("the scrape's time is up") from None


class _ScrapeHandler(WSGIRequestHandler):
    """One scrape: reads its request and writes its answer before ``deadline_s``, and logs nothing (scrapes are not
    news)."""

    def __init__(self, request, client_address, server, deadline_s: float) -> None:
        self._deadline_s = deadline_s
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        self.connection = self.request
        connection = _BeforeDeadline(self.connection, self._deadline_s)
        self.rfile, self.wfile = io.BufferedReader(connection), connection

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


def _only_metrics_path(app):
    """WSGI middleware: 404 for any path but /metrics (prometheus-client's app answers on every path)."""
    def metrics_only(environ, start_response):
        if environ.get("PATH_INFO") == "/metrics":
            return app(environ, start_response)
        status = http.HTTPStatus.NOT_FOUND
        start_response(f"{status.value} {status.phrase}", [("Content-Type", "text/plain")])
        return [b"NOT_FOUND: the metrics are at /metrics\n"]

    return metrics_only


def _require_token(app, token: str):
    """WSGI middleware: 401 unless the request carries the bearer token."""
    def guarded(environ, start_response):
        if bearer_token_matches(environ.get("HTTP_AUTHORIZATION"), token):
            return app(environ, start_response)
        status = http.HTTPStatus.UNAUTHORIZED
        start_response(f"{status.value} {status.phrase}", [("Content-Type", "text/plain"),
                                                           ("WWW-Authenticate", "Bearer")])
        return [b"UNAUTHENTICATED: /metrics needs the server's token (Authorization: Bearer <token>)\n"]

    return guarded
