"""``policy-server``: serve a policy (default action) or run an installed subcommand.

    policy-server [serve] --latency-budget-ms 120 --port 50051 [--config server.yaml] ...
    policy-server bench [bench options]          # robots.bench
    policy-server calibrate [--checkpoint DIR]   # policy_server.engine.calibration: the quality profile

Every flag is a ``ServerConfig`` field (``--max-sessions`` <-> ``max_sessions``) and may also be set
in the ``--config`` file (or ``$POLICY_SERVER_CONFIG``) or as ``POLICY_SERVER_MAX_SESSIONS``; flags given on the
command line win over the environment, which wins over the file.

Other subcommands are found through the ``policy_server.commands`` entry-point group (``bench``:
``robots.bench:main``, declared in pyproject.toml), so this package imports nothing of the packages that
build on it. Each entry point is a ``main(argv) -> int``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from policy_server import __version__
from policy_server.allocator import return_large_frees
from policy_server.config import ConfigError, ServerConfig, build_config, chosen_config_file, read_config_file

if TYPE_CHECKING:
    from policy_server.engine.api import Engine
    from policy_server.server.app import PolicyServer

log = logging.getLogger("policy_server")
SHUTDOWN_GRACE_S = 2.0  # running calls may finish within this after SIGTERM
SHUTDOWN_TIMEOUT_S = 8.0  # then the engine has this long to stop
COMMANDS_GROUP = "policy_server.commands"  # entry points: name -> main(argv) -> int
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def build_parser(network: bool = True) -> argparse.ArgumentParser:
    """The server's flags; without `network`, the listeners' and TLS flags are left out of the help."""
    # SUPPRESS: only flags actually given appear in the namespace, so they override the file and
    # nothing else does.
    p = argparse.ArgumentParser(
        prog="policy-server",
        argument_default=argparse.SUPPRESS,
        description="gRPC robot-policy server with a per-tick latency budget. Every flag may also be set in "
        "the environment: --max-sessions 8 as POLICY_SERVER_MAX_SESSIONS=8.",
        epilog="Subcommands: `serve` (default) and those installed in the `policy_server.commands` "
        "entry-point group: `bench`, `calibrate`, `ray-serve` (policy-server bench --help).",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--config",
                   help="YAML or JSON file with any of the settings below (default: $POLICY_SERVER_CONFIG)")

    g = p.add_argument_group("model and budget")
    g.add_argument("--latency-budget-ms", type=float, help="default per-tick latency budget in ms (120)")
    g.add_argument("--checkpoint", help="checkpoint to serve (default: the embedded model)")
    g.add_argument("--device", help="auto, cpu, cuda or cuda:N (auto)")
    g.add_argument("--dtype", help="weight dtype: auto, bf16, fp16 or fp32 (auto: bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction,
                   help="on CUDA, replay the GEN stack from CUDA graphs captured at warmup and OpenSession (on)")
    g.add_argument("--compile-gen-stack", action=argparse.BooleanOptionalAction,
                   help="run the GEN stack (and on a CPU the prefill and step work) compiled at warmup (default: "
                        "where a compiler for it is installed: a C one on CUDA, a C++ one on CPU; else eagerly, with "
                        "a warning)")
    g.add_argument("--quality-profile",
                   help="plan ticks on a quality profile (`policy-server calibrate`): off, auto (beside the "
                        "checkpoint, else the cache directory, else a bounded calibration at warmup) or a file (auto)")

    g = p.add_argument_group("diffusion step cache (SeaCache)",
                             "the threshold, order and cap set the ladder ticks plan on without a quality profile "
                             "(--quality-profile off, or auto where none is found)")
    g.add_argument(
        "--diffusion-cache",
        action=argparse.BooleanOptionalAction,
        help="enable the diffusion step cache (on); --no-diffusion-cache is bit-exact uncached",
    )
    g.add_argument("--diffusion-cache-thresh", type=float, help="SEA relative-L1 threshold, above 0 up to 1000 (0.25)")
    g.add_argument("--diffusion-cache-residual-order", type=int, help="residual extrapolation order (1)")
    g.add_argument(
        "--diffusion-cache-max-consecutive",
        type=int,
        help="max consecutive cached steps per CFG branch, 0 = no cap (2)",
    )

    # A Serve application's replicas have no listeners of their own: ray-serve takes these flags only to refuse them
    # by name, and does not list them.
    listener = (lambda text: text) if network else (lambda text: argparse.SUPPRESS)
    g = p.add_argument_group("network")
    g.add_argument("--host", help=listener("bind address (127.0.0.1)"))
    g.add_argument("--port", type=int, help=listener("gRPC port, 0 = any free port (50051)"))
    g.add_argument("--unix-socket", help=listener("also serve gRPC on this Unix domain socket"))
    g.add_argument("--websocket-port", type=int, help=listener("openpi-compatible WebSocket port (off)"))
    g.add_argument("--websocket-embodiment", help=listener("embodiment of WebSocket sessions (first declared)"))
    g.add_argument("--metrics-port", type=int, help=listener("Prometheus /metrics port (off)"))
    g.add_argument("--metrics-host", help=listener("/metrics bind address (127.0.0.1); it takes the auth token too"))
    g.add_argument("--reflection", action=argparse.BooleanOptionalAction, help=listener("gRPC server reflection (off)"))

    g = p.add_argument_group("limits and security")
    g.add_argument("--max-sessions", type=int, help="concurrent sessions (4)")
    g.add_argument("--max-batch", type=int,
                   help="queued ticks of one request shape that run as one micro-batch, 1 = off (4)")
    g.add_argument("--max-dynamics-calls", type=int,
                   help="forward / inverse dynamics calls at once; they cost every session capacity, 0 = off (0)")
    g.add_argument("--max-message-mb", type=float, help="largest accepted request in MiB (16)")
    g.add_argument("--session-idle-timeout-s", type=float,
                   help="close a session (or openpi WebSocket connection) with no call for this long, in s (300)")
    g.add_argument(
        "--auth-token-file", help="require `authorization: Bearer <token>` from this file"
    )
    g.add_argument("--tls-cert", help=listener("PEM certificate chain (with --tls-key)"))
    g.add_argument("--tls-key", help=listener("PEM private key (with --tls-cert)"))
    return p


def config_from_args(argv: list[str], environ: Mapping[str, str] = os.environ) -> ServerConfig:
    """Parse flags, read ``--config`` (else ``$POLICY_SERVER_CONFIG``) if given, and validate them merged with the
    ``POLICY_SERVER_*`` settings in ``environ``."""
    parser = build_parser()
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        misplaced = [word for word in unknown if word == "serve" or word in subcommands()]
        hint = f"; a subcommand comes first: policy-server {misplaced[0]} [flags]" if misplaced else ""
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    args: dict[str, Any] = vars(namespace)
    config_file = chosen_config_file(args, environ)
    file_values = read_config_file(config_file) if config_file is not None else {}
    return build_config(file_values, args, source=str(config_file) if config_file else "config", environment=environ)


def serve(config: ServerConfig) -> int:
    """Build the engine, bind the ports, warm up and serve until SIGINT/SIGTERM/SIGHUP, shut down gracefully."""
    from policy_server.budget.profile import ProfileError
    from policy_server.engine import build_engine  # lazy: imports torch and the model
    from policy_server.engine.api import UnknownEmbodiment
    from policy_server.engine.engine import DeviceUnavailable
    from policy_server.pipeline.compiled_stack import CompileUnavailableError
    from policy_server.pipeline.policy import CheckpointLoadError
    from policy_server.server.app import build_server

    return_large_frees()  # else the heaps keep what a large frame's buffers free
    try:
        engine = build_engine(config)
    except (CheckpointLoadError, ProfileError, CompileUnavailableError, DeviceUnavailable) as exc:
        print(f"policy-server: {exc}", file=sys.stderr)
        return 2
    server = build_server(config, engine)
    try:
        server.start()
    except OSError as exc:  # the port is taken, or the address is not this machine's
        return _give_up(str(exc), server, engine)
    except UnknownEmbodiment as exc:  # --websocket-embodiment: only the loaded model knows what it serves
        return _give_up(f"websocket_embodiment: expected {exc.expected}, got {exc.got}", server, engine)
    engine.start()  # once the ports are bound: a taken one ends the process before any warmup work
    print(
        f"policy-server: gRPC on {server.target}"
        + (f", unix:{config.unix_socket}" if config.unix_socket else "")
        + (f", metrics on {server.metrics_address}" if server.metrics_address is not None else "")
        + (f", openpi websocket on {server.websocket_address}" if server.websocket_address is not None else ""),
        flush=True,
    )
    stop = threading.Event()
    # SIGHUP too (`_stop_signals`): the terminal it ran in closed, or a supervisor stops it so. A second signal
    # during the drain finds the default action back (`_default_stop_signals`): it ends the process at once.
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in _stop_signals()}
    warmup_failure: list[BaseException] = []
    threading.Thread(target=_watch_warmup, args=(engine, warmup_failure, stop), daemon=True,
                     name="warmup-watch").start()
    try:
        # Woken each second: the kernel may deliver a signal to any thread, and Python runs its handler on the
        # main thread only once that thread runs again; an untimed wait would sleep through it.
        while not stop.wait(timeout=1.0):
            pass
        if warmup_failure:
            print(f"policy-server: warmup failed ({warmup_failure[0]!r}); the log above has its traceback",
                  file=sys.stderr, flush=True)
        log.info("shutting down")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # Running calls get the grace period, the engine stops within one step; should anything still
        # hang (a stuck device call), the process leaves anyway.
        watchdog = threading.Timer(SHUTDOWN_GRACE_S + SHUTDOWN_TIMEOUT_S, _exit_now)
        watchdog.daemon = True
        watchdog.start()
        status = _stop(server, engine, SHUTDOWN_GRACE_S, 1 if warmup_failure else 0)
        watchdog.cancel()
    return status


@contextlib.contextmanager
def _default_stop_signals() -> Iterator[None]:
    """The stop signals with their default action while `serve` loads the model and drains, and while a subcommand
    (bench, calibrate) runs (`_stop_signals`), the previous handlers back after. Ctrl-C so ends the process at once,
    as SIGTERM does; Python's KeyboardInterrupt printed a traceback of whatever was importing or loading, and during
    the drain came only once the main thread woke (the kernel may deliver the signal to any thread)."""
    previous = {sig: signal.signal(sig, signal.SIG_DFL) for sig in _stop_signals()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_signals() -> list[signal.Signals]:
    """The stop signals this process takes: SIGINT and SIGTERM always (a shell starts its background jobs ignoring
    SIGINT, which says nothing of how they are to be stopped), SIGHUP unless it was ignored from the start (`nohup`
    ignores it so that the server outlives its terminal)."""
    return [sig for sig in STOP_SIGNALS if sig != signal.SIGHUP or signal.getsignal(sig) != signal.SIG_IGN]


def _watch_warmup(engine: Engine, failure: list[BaseException], stop: threading.Event) -> None:
    """Stop the server when its warmup fails: it would never turn SERVING, and clients would wait on WARMING_UP."""
    try:
        engine.wait_ready()
    except RuntimeError as error:  # wait_ready's, raised from the warmup's own error
        failure.append(error.__cause__ or error)
        stop.set()


def _give_up(problem: str, server: PolicyServer, engine: Engine) -> int:
    """Report a setting the server could not start with, stop what had started (warmup among it), and exit 2."""
    print(f"policy-server: {problem}", file=sys.stderr, flush=True)
    return _stop(server, engine, 0.0, 2)


def _stop(server: PolicyServer, engine: Engine, grace_s: float, status: int) -> int:
    """Stop the server (running calls get `grace_s`), then the engine; returns exit `status`."""
    server.stop(grace_s=grace_s)
    if not engine.close():
        # Every caller has been answered; only the worker's device call (a long VAE pass) is left, and
        # interpreter teardown under a thread inside torch would abort the process: leave without it.
        log.info("leaving the model worker's device call unfinished")
        logging.shutdown()
        os._exit(status)
    return status


def _exit_now() -> None:
    print(f"policy-server: shutdown took over {SHUTDOWN_GRACE_S + SHUTDOWN_TIMEOUT_S:g} s; exiting now",
          file=sys.stderr, flush=True)
    os._exit(1)


def subcommands() -> dict[str, importlib.metadata.EntryPoint]:
    """The installed subcommands by name (`pip install -e .` registers the project's own)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=COMMANDS_GROUP)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        argv = argv[1:]
    elif argv and not argv[0].startswith("-"):
        command = subcommands().get(argv[0])
        if command is None:
            known = ", ".join(["serve", *sorted(subcommands())])
            print(f"policy-server: unknown subcommand {argv[0]!r}; expected one of {known} (entry points of "
                  f"{COMMANDS_GROUP!r}: reinstall the package, `pip install -e .`, if one is missing)",
                  file=sys.stderr)
            return 2
        with _default_stop_signals():  # Ctrl-C ends a bench or a calibration at once, without a traceback
            return command.load()(argv[1:])  # loaded only now: the bench needs torch
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # websockets logs every connection and /healthz probe at INFO, without its address: a probe every 10 s would be
    # most of the log (the server logs each session's opening and closing itself).
    logging.getLogger("websockets.server").setLevel(logging.WARNING)
    # gRPC core logs each failed TLS handshake (a plaintext client, a port scan) on stderr at INFO: a line per
    # connection that anyone who reaches the port can provoke. Its errors stay. Read when grpc is first imported, in
    # `serve`.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    try:
        config = config_from_args(argv)
    except ConfigError as exc:
        print(f"policy-server: {exc}", file=sys.stderr)
        return 2
    given = config.given()
    log.info("settings: %s", f"{given}; the rest at their defaults" if given else "the defaults")
    with _default_stop_signals():
        return serve(config)


if __name__ == "__main__":
    sys.exit(main())
