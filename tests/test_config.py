"""ServerConfig and the policy-server CLI: defaults, every flag also settable in a file and the environment, CLI
wins, unknown keys and bad values rejected by name and origin, --version, and the serve / bench dispatch."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
import yaml
from fake_engine import FakeEngine, self_signed_cert, serve_fake

import policy_server.engine
import policy_server.server.app as app
from policy_server import cli
from policy_server.budget.planner import MAX_CACHING
from policy_server.client import PolicyClient
from policy_server.client.__main__ import main as client_main
from policy_server.config import ConfigError, ServerConfig, build_config, read_config_file
from policy_server.engine.engine import resolve_dtype
from robots.rollout import main as rollout_main
from robots.soak import main as soak_main


def test_defaults():
    config = ServerConfig()
    assert config.latency_budget_ms == 120.0
    assert (config.host, config.port) == ("127.0.0.1", 50051)  # loopback unless asked otherwise
    assert config.diffusion_cache is True
    assert (config.diffusion_cache_thresh, config.diffusion_cache_residual_order,
            config.diffusion_cache_max_consecutive) == (0.25, 1, 2)
    assert config.checkpoint is None and config.reflection is False
    assert (config.device, config.dtype) == ("auto", "auto")
    assert config.metrics_port is None and config.websocket_port is None and config.auth_token_file is None
    assert config.max_message_bytes == 16 * 1024 * 1024
    assert config.session_idle_timeout_s == 300.0


def test_every_flag_is_a_config_field_and_every_field_a_flag():
    dests = {a.dest for a in cli.build_parser()._actions if a.dest not in ("help", "version", "config")}
    assert dests == set(ServerConfig.model_fields)


def test_flags_parse_into_the_config(tmp_path):
    token = tmp_path / "token"
    token.write_text("a-token-of-24-characters")
    config = cli.config_from_args([
        "--latency-budget-ms", "80", "--diffusion-cache", "--diffusion-cache-thresh", "0.4",
        "--diffusion-cache-residual-order", "0", "--diffusion-cache-max-consecutive", "0", "--port", "6000",
        "--host", "0.0.0.0", "--unix-socket", str(tmp_path / "s.sock"), "--device", "cuda:1", "--dtype", "fp16",
        "--max-sessions", "2", "--max-batch", "3", "--max-message-mb", "8", "--auth-token-file", str(token),
        "--reflection", "--quality-profile", "off", "--no-cuda-graphs", "--compile-gen-stack",
        "--metrics-port", "9100", "--websocket-port", "8000", "--websocket-embodiment", "libero",
        "--session-idle-timeout-s", "30",
    ])
    assert config.latency_budget_ms == 80 and config.diffusion_cache is True
    assert (config.diffusion_cache_thresh, config.diffusion_cache_residual_order) == (0.4, 0)
    assert (config.port, config.host, config.device, config.max_sessions) == (6000, "0.0.0.0", "cuda:1", 2)
    assert config.max_batch == 3 and config.dtype == "fp16" and config.quality_profile == "off"
    assert config.auth_token_file == token and config.reflection and config.cuda_graphs is False
    assert config.compile_gen_stack is True
    assert (config.metrics_port, config.websocket_port, config.websocket_embodiment) == (9100, 8000, "libero")
    assert config.session_idle_timeout_s == 30


def full_file_values(tmp_path) -> dict:
    (tmp_path / "token").write_text("a-token-of-24-characters")
    cert, key = self_signed_cert(tmp_path)
    (tmp_path / "ckpt").mkdir()
    return {
        "latency_budget_ms": 95, "checkpoint": str(tmp_path / "ckpt"), "device": "cpu", "dtype": "bf16",
        "cuda_graphs": False, "compile_gen_stack": False,
        "diffusion_cache": True, "diffusion_cache_thresh": 0.3, "diffusion_cache_residual_order": 2,
        "diffusion_cache_max_consecutive": 3, "host": "127.0.0.1", "port": 7000,
        "unix_socket": str(tmp_path / "p.sock"), "websocket_port": 8001, "websocket_embodiment": "pusht",
        "metrics_port": 9091, "metrics_host": "::1", "reflection": True, "max_sessions": 3, "max_batch": 2,
        "max_dynamics_calls": 1, "max_message_mb": 4, "session_idle_timeout_s": 60.0, "quality_profile": "off",
        "auth_token_file": str(tmp_path / "token"), "tls_cert": str(cert), "tls_key": str(key),
    }


def test_every_field_can_be_set_in_a_yaml_file_and_flags_override_it(tmp_path):
    values = full_file_values(tmp_path)
    assert set(values) == set(ServerConfig.model_fields)
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(values))
    config = cli.config_from_args(["--config", str(path)])
    for key, value in values.items():
        got = getattr(config, key)
        assert (str(got) if key in ("checkpoint", "unix_socket", "auth_token_file", "tls_cert", "tls_key")
                else got) == value, key
    overridden = cli.config_from_args(["--config", str(path), "--latency-budget-ms", "60", "--cuda-graphs",
                                       "--no-reflection"])
    assert (overridden.latency_budget_ms, overridden.cuda_graphs, overridden.reflection) == (60, True, False)
    assert overridden.port == 7000  # untouched by the command line


def test_every_field_can_be_set_in_the_environment_between_the_file_and_the_flags(tmp_path):
    values = full_file_values(tmp_path)
    environ = {f"POLICY_SERVER_{key.upper()}": str(value) for key, value in values.items()}
    environ["POLICY_SERVER_CACHE"] = str(tmp_path)  # the profile cache: a variable with the prefix, not a setting
    config = cli.config_from_args([], environ)
    assert config == build_config(values)
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({"port": 7100, "max_sessions": 5}))
    layered = cli.config_from_args(["--config", str(path), "--max-sessions", "7"],
                                   {"POLICY_SERVER_PORT": "7200", "POLICY_SERVER_MAX_SESSIONS": "6"})
    assert (layered.port, layered.max_sessions) == (7200, 7)
    from_env = cli.config_from_args([], {"POLICY_SERVER_CONFIG": str(path)})  # the file named in the environment
    assert (from_env.port, from_env.max_sessions) == (7100, 5)


def test_a_prefixed_variable_that_names_no_setting_is_refused():
    with pytest.raises(ConfigError, match=r"\$POLICY_SERVER_MAX_SESION is not a setting; did you mean "
                                          r"\$POLICY_SERVER_MAX_SESSIONS\?"):
        cli.config_from_args([], {"POLICY_SERVER_MAX_SESION": "4"})
    with pytest.raises(ConfigError, match=r"\$POLICY_SERVER_ZZZ is not a setting; expected"):
        cli.config_from_args([], {"POLICY_SERVER_ZZZ": "1"})


def test_a_bad_setting_is_named_with_where_it_came_from(tmp_path):
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({"max_batch": 0}))
    with pytest.raises(ConfigError) as err:
        cli.config_from_args(["--config", str(path), "--port", "70000"], {"POLICY_SERVER_LATENCY_BUDGET_MS": "fast"})
    message = str(err.value)
    assert f"max_batch (from {path})" in message and "port (from command line)" in message
    assert "latency_budget_ms (from $POLICY_SERVER_LATENCY_BUDGET_MS)" in message and "'fast'" in message


@pytest.mark.parametrize("main", [cli.main, client_main, rollout_main, soak_main])
def test_version(main, capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip().endswith(" " + importlib.metadata.version("policy-server"))


@pytest.mark.parametrize("module",
                         ["policy_server.cli", "policy_server.client.__main__", "robots.rollout", "robots.soak"])
def test_version_of_a_checkout_that_was_never_installed(module):
    """Run from a source tree on PYTHONPATH (as `.ci/device` runs it) there is no distribution to ask."""
    code = ("import importlib, importlib.metadata as metadata, sys\n"
            "def missing(name): raise metadata.PackageNotFoundError(name)\n"
            "metadata.version = missing\n"
            f"importlib.import_module({module!r}).main(['--version'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "source-tree"


def test_json_file_with_flag_spelling(tmp_path):
    path = tmp_path / "server.json"
    path.write_text(json.dumps({"latency-budget-ms": 70, "max-sessions": 6}))
    config = build_config(read_config_file(path))
    assert (config.latency_budget_ms, config.max_sessions) == (70, 6)


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"latency_budget_ms": -5}, "latency_budget_ms"),
        ({"latency_budget_ms": "fast"}, "latency_budget_ms"),
        ({"port": 70000}, "port"),
        ({"device": "gpu"}, "device"),
        ({"dtype": "bfloat16"}, "dtype"),
        ({"diffusion_cache_thresh": -0.1}, "diffusion_cache_thresh"),
        ({"diffusion_cache_residual_order": 7}, "diffusion_cache_residual_order"),
        ({"diffusion_cache_residual_order": 3}, "diffusion_cache_residual_order"),  # SeaCache's limit is 2
        ({"latency_budget_ms": 1e9}, "latency_budget_ms"),
        ({"max_sessions": 0}, "max_sessions"),
        ({"max_sessions": 1_000_000}, "max_sessions"),  # it sizes the gRPC thread pool
        ({"session_idle_timeout_s": 0}, "session_idle_timeout_s"),
        ({"session_idle_timeout_s": 1e6}, "session_idle_timeout_s"),
        ({"websocket_embodiment": ""}, "websocket_embodiment"),
        ({"max_message_mb": 0}, "max_message_mb"),
        ({"max_message_mb": 1024}, "max_message_mb"),  # gRPC receives up to twice it: 2 GiB is past its int32 option
        ({"auth_token_file": "/nonexistent/token"}, "auth_token_file"),
        ({"quality_profile": "sometimes"}, "quality_profile"),
        ({"latency_budgt_ms": 100}, "latency_budgt_ms"),
    ],
)
def test_bad_values_and_unknown_keys_are_rejected_by_name(tmp_path, values, key):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(values))
    with pytest.raises(ConfigError) as err:
        cli.config_from_args(["--config", str(path)])
    assert key in str(err.value)


def test_tls_needs_cert_and_key_together(tmp_path):
    (tmp_path / "cert.pem").write_text("x")
    with pytest.raises(ConfigError, match="tls_cert and tls_key"):
        build_config(overrides={"tls_cert": str(tmp_path / "cert.pem")})


def test_a_tls_pair_that_does_not_load_is_refused_with_the_settings(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    (tmp_path / "token").write_text("a token, not a key")
    for pair in ((cert, tmp_path / "token"), (tmp_path / "token", key), (key, cert)):
        with pytest.raises(ConfigError) as err:
            build_config(overrides={"tls_cert": str(pair[0]), "tls_key": str(pair[1])})
        assert f"tls_cert {str(pair[0])!r} and tls_key {str(pair[1])!r}: expected a PEM certificate chain and its " \
               "private key (" in str(err.value)


@pytest.mark.parametrize("content", ["- a\n- b\n", "port: [1, 2\n"])
def test_malformed_files_are_rejected(tmp_path, content):
    path = tmp_path / "c.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=str(path)):
        read_config_file(path)


def test_main_reports_config_errors_with_exit_code_2(capsys):
    assert cli.main(["--port", "-3"]) == 2
    assert "port" in capsys.readouterr().err


def test_a_bad_dtype_is_one_line_naming_the_allowed_values_and_exit_2(capsys):
    assert cli.main(["--dtype", "int8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "dtype" in err and "expected auto, bf16, fp16 or fp32, got 'int8'" in err, err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--dtype", "int8"])  # through the installed entry point, to robots.bench
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2
    assert err == "policy-server bench: --dtype: expected auto, bf16, fp16 or fp32, got 'int8'", err


@pytest.mark.parametrize(("name", "device", "expected"), [
    ("auto", "cpu", torch.float32), ("auto", "cuda", torch.bfloat16), ("auto", "cuda:1", torch.bfloat16),
    ("bf16", "cpu", torch.bfloat16), ("fp16", "cuda", torch.float16), ("fp32", "cuda", torch.float32)])
def test_dtype_resolves_on_the_device(name, device, expected):
    assert resolve_dtype(name, device) == expected


def test_the_engine_loads_the_pipeline_at_the_resolved_dtype_with_one_intra_op_thread(monkeypatch):
    from policy_server.pipeline.policy import PolicyPipeline

    calls = []

    def from_pretrained(path, **kwargs):
        calls.append(kwargs)
        raise RuntimeError("stop after the load")

    monkeypatch.setattr(PolicyPipeline, "from_pretrained", from_pretrained)
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)  # build_engine's setting stays in this test
    for name in ("auto", "fp16"):
        with pytest.raises(RuntimeError, match="stop after the load"):
            policy_server.engine.build_engine(build_config(overrides={"device": "cpu", "dtype": name}))
    assert calls == [{"device": "cpu", "dtype": torch.float32}, {"device": "cpu", "dtype": torch.float16}]
    assert threads == [1, 1]


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy: imported by earlier tests
def test_every_command_also_runs_as_a_module(monkeypatch, capsys):
    """`python -m robots.soak`, `python -m robots.bench`, ...: how a checkout that was never pip-installed (no
    console scripts, no entry points) runs them. Each module with a `main` prints its usage for --help, and says
    what each option does."""
    modules = modules_with_a_main()
    assert {"robots.bench", "robots.soak", "policy_server.engine.calibration"} <= set(modules)
    for module in modules:
        monkeypatch.setattr(sys, "argv", [module, "--help"])
        with pytest.raises(SystemExit) as done:
            runpy.run_module(module, run_name="__main__")
        usage = capsys.readouterr().out
        assert done.value.code == 0 and "usage:" in usage, module
        assert not options_without_help(usage), (module, options_without_help(usage))


def modules_with_a_main() -> list[str]:
    """The modules of the project's commands: those that define `main` (`robots.bench`, ...)."""
    root = Path(__file__).resolve().parents[1]
    return [".".join(path.relative_to(root).with_suffix("").parts)
            for package in ("policy_server", "robots") for path in sorted((root / package).rglob("*.py"))
            if re.search(r"^def main\(", path.read_text(), flags=re.M)]


def options_without_help(usage: str) -> list[str]:
    """The options an argparse --help lists with nothing after them (`--out OUT` alone: no default, no purpose)."""
    lines = usage.splitlines()
    return [line.strip() for line, after in zip(lines, [*lines[1:], ""], strict=True)
            if re.match(r"  -", line) and not re.match(r"  \S.*?\S  +\S", line) and not re.match(r" {10,}\S", after)]


def test_subcommands_dispatch_through_the_entry_point_group(monkeypatch, capsys):
    calls = []
    fake = types.ModuleType("fake_bench")
    fake.main = lambda argv: calls.append(argv) or 0
    monkeypatch.setitem(sys.modules, "fake_bench", fake)
    entry = importlib.metadata.EntryPoint("bench", "fake_bench:main", cli.COMMANDS_GROUP)
    monkeypatch.setattr(cli, "subcommands", lambda: {"bench": entry})
    assert cli.main(["bench", "--out", "b.json"]) == 0
    assert calls == [["--out", "b.json"]]
    assert cli.main(["bnech"]) == 2
    assert "unknown subcommand 'bnech'; expected one of serve, bench" in capsys.readouterr().err


def test_a_subcommand_after_the_flags_is_named_with_where_it_goes(capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--port", "50051", "calibrate", "--out", "p.json"])
    assert stopped.value.code == 2
    assert ("unrecognized arguments: calibrate --out p.json; a subcommand comes first: policy-server calibrate [flags]"
            in capsys.readouterr().err)


def test_bench_is_installed_as_a_policy_server_command():
    assert cli.subcommands()["bench"].value == "robots.bench:main"


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_serve_builds_the_engine_serves_and_stops_on_sigterm(monkeypatch, stop):
    engine = FakeEngine()
    built = {}

    def build_engine(config):
        built["config"] = config
        return engine

    real_build_server = app.build_server

    def build_server(config, eng):
        built["server"] = real_build_server(config, eng)
        return built["server"]

    monkeypatch.setattr(policy_server.engine, "build_engine", build_engine, raising=False)
    monkeypatch.setattr(app, "build_server", build_server)

    def drive():
        while "server" not in built or built["server"].grpc_port is None:
            threading.Event().wait(0.01)
        with PolicyClient(built["server"].target) as client:
            client.wait_until_serving(timeout_s=10)
            built["session"] = client.open_session("pusht", "cli")
        os.kill(os.getpid(), stop)  # SIGHUP too: a terminal that closed, a supervisor's stop

    previous = signal.getsignal(stop)
    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    assert cli.main(["serve", "--port", "0", "--latency-budget-ms", "90"]) == 0
    driver.join(5)
    assert built["config"].latency_budget_ms == 90 and built["session"].epoch == 1
    assert engine.stats().sessions == 0  # engine.close() ran
    assert signal.getsignal(stop) is previous


def test_a_taken_port_ends_serve_before_the_warmup_begins(monkeypatch, capsys):
    engine = FakeEngine()
    warmups = []
    monkeypatch.setattr(engine, "start", lambda: warmups.append("started"))
    monkeypatch.setattr(policy_server.engine, "build_engine", lambda config: engine, raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
    assert capsys.readouterr().err.strip() == f"policy-server: could not bind gRPC to 127.0.0.1:{port} (Address " \
                                               "already in use)"
    # The OS's reason, which only gRPC core's own log line gave: "(in use or not permitted)" said neither.
    assert cli.main(["serve", "--host", "192.0.2.1", "--port", "50051"]) == 2  # TEST-NET-1: no machine's own
    assert capsys.readouterr().err.strip().endswith("could not bind gRPC to 192.0.2.1:50051 (Cannot assign requested "
                                                    "address)")
    assert cli.main(["serve", "--port", "0", "--unix-socket", "/no/such/folder/policy.sock"]) == 2  # the settings'
    assert capsys.readouterr().err.startswith("policy-server: invalid settings: unix_socket (from command line): "
                                              "folder '/no/such/folder' does not exist")
    with socket.socket() as taken:  # the WebSocket's port: it said only "[Errno 98] Address already in use (...)"
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--port", "0", "--websocket-port", str(port)]) == 2
    assert capsys.readouterr().err.strip() == f"policy-server: could not bind the openpi WebSocket to " \
                                               f"127.0.0.1:{port} (Address already in use)"
    # IPv6 in brackets, each listener's reason the OS's: the WebSocket said "::1:PORT (Unknown error -9)" for any
    # port, taken or not (it bound ::1 with an IPv4 socket), and "Unknown error -2" for a name that resolves nowhere.
    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flags, listener in ((["--websocket-port", str(port)], "the openpi WebSocket"),
                                (["--metrics-host", "::1", "--metrics-port", str(port)], "the metrics endpoint")):
            assert cli.main(["serve", "--host", "::1", "--port", "0", *flags]) == 2
            assert capsys.readouterr().err.strip() == f"policy-server: could not bind {listener} to [::1]:{port} " \
                                                       "(Address already in use)"
    assert cli.main(["serve", "--host", "no.such.host.invalid", "--port", "0", "--websocket-port", "0"]) == 2
    assert capsys.readouterr().err.startswith("policy-server: invalid settings: host (from command line): names no "
                                              "address (")  # the settings' check
    assert warmups == []


def test_a_host_name_one_of_whose_addresses_another_server_holds_is_taken():
    """gRPC binds every address of a host name and starts where any binds: `--host localhost` beside a server on
    127.0.0.1 took [::1] at the same port and said "gRPC on localhost:PORT", and a client of localhost reached one
    server or the other."""
    with socket.socket() as running:
        running.bind(("127.0.0.1", 0))
        running.listen()
        port = running.getsockname()[1]
        with pytest.raises(OSError) as taken, serve_fake(host="localhost", port=port):
            pass
    assert str(taken.value) == (f"could not bind gRPC to localhost:{port} (Address already in use: another program "
                                f"listens on 127.0.0.1:{port})")
    with serve_fake(host="localhost", port=port), PolicyClient(f"127.0.0.1:{port}") as client:  # free again
        assert client.health() == "SERVING"


def test_a_host_name_whose_lookup_fails_for_now_is_named_by_the_bind(monkeypatch):
    """The settings leave a lookup failing for now (EAI_AGAIN: no DNS server reachable) to the bind; the check for a
    taken address raised getaddrinfo's bare gaierror ("Temporary failure in name resolution"), naming no host."""
    lookup = socket.getaddrinfo

    def no_dns(host, *args, **kwargs):
        if host == "no.such.host.invalid":
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    with pytest.raises(OSError, match="^could not bind gRPC to no.such.host.invalid:50391 "), \
            serve_fake(host="no.such.host.invalid", port=50391):
        pass


def test_a_unix_socket_a_server_answers_on_is_taken_and_a_stale_one_is_not(tmp_path):
    """gRPC unlinks the socket at a --unix-socket path before it binds it: a second server took the path of a running
    one, and the running one's new clients reached the second. A socket file that nothing answers on (a crashed
    server's) is still bound over."""
    path = tmp_path / "policy.sock"
    with socket.socket(socket.AF_UNIX) as running:
        running.bind(str(path))
        running.listen()
        with pytest.raises(OSError) as taken, serve_fake(unix_socket=str(path)):
            pass
    assert str(taken.value) == f"could not bind gRPC to unix:{path} (Address already in use)"
    assert path.exists()  # left as a crashed server leaves it
    with serve_fake(unix_socket=str(path)), PolicyClient(f"unix:{path}") as client:
        assert client.health() == "SERVING"


def test_a_unix_socket_path_gRPC_cannot_bind_is_refused_with_the_settings(tmp_path, monkeypatch):
    """Each was found only at the bind, once the model had loaded (minutes for a Cosmos3 checkpoint), in the OS's
    words: a regular file at the path as "Address already in use", which sends its user looking for a server."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not a socket")
    (tmp_path / "folder").mkdir()
    too_long = str(tmp_path / ("s" * (108 - len(os.fsencode(tmp_path)) - 1)))
    for path, message in (
        ("missing/policy.sock", "folder 'missing' does not exist; expected the socket's path in a folder"),
        ("notes.txt", "'notes.txt' is a file, not a socket; expected a new path (or a socket a stopped server left)"),
        ("folder", "'folder' is a folder, not a socket"),
        (too_long, f"path {too_long!r} is 108 bytes; expected at most 107 (what an AF_UNIX address holds)"),
    ):
        with pytest.raises(ConfigError) as error:
            build_config(overrides={"unix_socket": path})
        assert f"unix_socket (from command line): {message}" in str(error.value)
    assert (tmp_path / "notes.txt").read_text() == "not a socket"
    assert build_config(overrides={"unix_socket": too_long[:-1]}).unix_socket == Path(too_long[:-1])


@pytest.mark.parametrize("flags", [["--host", " "], ["--host", "no.such.host.invalid"],
                                   ["--metrics-host", "1.2.3.4.5", "--metrics-port", "0"]])
def test_a_host_that_names_no_address_is_refused_with_the_settings(flags, monkeypatch, capsys):
    """Each was found only at the bind, once the model had loaded (minutes for a Cosmos3 checkpoint)."""
    monkeypatch.setattr(policy_server.engine, "build_engine", lambda config: pytest.fail("the model loaded"),
                        raising=False)
    with pytest.raises(socket.gaierror) as unresolved:  # the OS's own words, whatever its resolver
        socket.getaddrinfo(flags[1], None, type=socket.SOCK_STREAM)
    assert cli.main(["serve", "--port", "0", *flags]) == 2
    key = flags[0].removeprefix("--").replace("-", "_")
    assert capsys.readouterr().err.strip() == (
        f"policy-server: invalid settings: {key} (from command line): names no address "
        f"({unresolved.value.strerror}); expected an address of this machine (127.0.0.1, 0.0.0.0, ::1, ::) or a name "
        f"that resolves to one (got {flags[1]!r})")


def test_a_host_lookup_that_failed_for_now_is_left_to_the_bind(monkeypatch):
    """A resolver not reachable yet (a container starting) is no name that does not exist: the bind, minutes later,
    looks it up again."""
    def unreachable(*args, **kwargs):
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", unreachable)
    assert build_config(overrides={"host": "policy-server.internal"}).host == "policy-server.internal"


def test_the_log_names_the_settings_given(tmp_path, monkeypatch, caplog):
    """Nothing said which settings a server started with: a file, the environment and flags all set them."""
    monkeypatch.setattr(cli, "serve", lambda config: 0)
    path = tmp_path / "server.yaml"
    path.write_text("max_sessions: 2\nlatency_budget_ms: 90\n")
    monkeypatch.setenv("POLICY_SERVER_MAX_SESSIONS", "3")
    with caplog.at_level(logging.INFO, logger="policy_server"):
        assert cli.main(["--config", str(path), "--port", "0"]) == 0
    assert "settings: latency_budget_ms=90.0, port=0, max_sessions=3; the rest at their defaults" in caplog.text


def test_a_warmup_that_fails_stops_the_server_with_one_line_and_exit_1(monkeypatch, capsys):
    class FailsToWarmUp(FakeEngine):
        def wait_ready(self, timeout_s=None):
            raise RuntimeError("warmup failed") from ValueError("a canvas the VAE cannot encode")

    monkeypatch.setattr(policy_server.engine, "build_engine", lambda config: FailsToWarmUp(ready=False), raising=False)
    assert cli.main(["serve", "--port", "0"]) == 1  # rather than NOT_SERVING, and WARMING_UP to every client, forever
    assert "policy-server: warmup failed (ValueError('a canvas the VAE cannot encode'))" in capsys.readouterr().err


@pytest.mark.parametrize("given_in", ["flag", "config file"])
def test_a_device_torch_does_not_have_here_is_one_line_and_exit_2(given_in, tmp_path, capsys):
    import torch

    count = torch.cuda.device_count()
    path = tmp_path / "server.yaml"
    path.write_text(f"device: cuda:{count}\n")
    settings = ["--device", f"cuda:{count}"] if given_in == "flag" else ["--config", str(path)]
    assert cli.main(["serve", "--port", "0", *settings]) == 2  # one past the last, or none
    expected = f"torch sees {count} CUDA device(s)" if count else "sees no CUDA device here"
    err = capsys.readouterr().err
    assert f"policy-server: device cuda:{count}: " in err and expected in err  # the setting, not one way to give it


@pytest.mark.parametrize(("values", "message"), [
    ({"diffusion_cache": False, "diffusion_cache_thresh": 0.5, "quality_profile": "PROFILE"},
     "diffusion_cache_thresh, quality_profile set but diffusion_cache is off: every tick runs uncached and plans "
     "nothing"),
    ({"diffusion_cache": False, "diffusion_cache_max_consecutive": 0}, "diffusion_cache_max_consecutive set but"),
    ({"diffusion_cache_residual_order": 0, "quality_profile": "PROFILE"},
     "diffusion_cache_residual_order set but ticks plan on the quality profile PROFILE, whose configurations set "
     "their own threshold, cap and residual order; expected quality_profile off"),
])
def test_cache_settings_that_would_go_unused_are_refused_with_the_settings(values, message, tmp_path):
    """--no-diffusion-cache, or a quality profile, left the SeaCache ladder's settings (and a profile) unused
    without a word: a server given --diffusion-cache-thresh 3 --diffusion-cache-max-consecutive 0 ran the profile's
    t1-c3-o1 configurations."""
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    values = {key: str(profile) if value == "PROFILE" else value for key, value in values.items()}
    with pytest.raises(ConfigError) as error:
        build_config(values)
    assert message.replace("PROFILE", str(profile)) in str(error.value)


def test_cache_settings_that_take_effect_are_accepted(tmp_path):
    ladder = {"diffusion_cache_thresh": 0.5, "diffusion_cache_residual_order": 2, "diffusion_cache_max_consecutive": 3}
    assert build_config({**ladder, "quality_profile": "off"}).diffusion_cache_thresh == 0.5
    assert build_config(ladder).quality_profile == "auto"  # calibrated at warmup around them, where no profile is found
    assert not build_config({"diffusion_cache": False, "quality_profile": "off"}).diffusion_cache


def test_a_quality_profile_found_beside_the_model_refuses_the_ladders_settings():
    """With `--quality-profile auto` only the model's folder says whether a profile overrides them: the embedded
    model ships one. The server says it in one line, exit 2 (a `ProfileError`), before the warmup."""
    from policy_server.budget.profile import PROFILE_FILE, ProfileError
    from policy_server.pipeline.policy import default_model_path

    config = build_config(overrides={"device": "cpu", "diffusion_cache_thresh": 3.0})
    with pytest.raises(ProfileError) as error:
        policy_server.engine.build_engine(config)
    assert str(error.value) == (
        f"diffusion_cache_thresh set but ticks plan on the quality profile {default_model_path() / PROFILE_FILE}, "
        "whose configurations set their own threshold, cap and residual order; expected quality_profile off to plan "
        "on the SeaCache ladder these settings define")


def test_every_residual_order_the_config_accepts_is_one_seacache_accepts():
    from policy_server.cache.seacache import SeaCacheConfig

    accepted = [order for order in range(6) if _accepts(diffusion_cache_residual_order=order)]
    assert accepted == [0, 1, 2]
    for order in accepted:
        SeaCacheConfig(residual_order=order)


def test_every_cache_setting_the_config_takes_builds_an_engine_and_its_warmup_calibration():
    """--diffusion-cache-max-consecutive 0 (no cap, as --help says) or 1, and a threshold under 0.0125 or over
    250000, once ended the start in a traceback after the model loaded: the planner's ladder around them went back to
    a tighter cap, held two rungs of one name, or passed its maximal-caching rung."""
    from policy_server.engine.calibration import configurations
    from policy_server.engine.engine import ModelEngine, settings_from_config
    from policy_server.limits import MAX_CACHE_THRESHOLD
    from policy_server.pipeline.policy import PolicyPipeline

    pipeline = PolicyPipeline.from_pretrained(None, device="cpu", dtype=torch.float32)
    for threshold in (1e-6, 0.001, 0.01, 0.25, 3.0, MAX_CACHE_THRESHOLD):
        for cap in (0, 1, 2, 7):
            config = build_config({"diffusion_cache_thresh": threshold, "diffusion_cache_max_consecutive": cap,
                                   "compile_gen_stack": False})
            settings = settings_from_config(config)
            ladder = ModelEngine(pipeline, settings).served.budget.config.ladder
            assert ladder[-1].name == "max" and len({rung.name for rung in ladder}) == len(ladder) >= 5
            assert (threshold, cap) in {(rung.threshold, rung.cap) for rung in ladder}  # the configured rung
            coarse = {(c.threshold, c.cap) for c in configurations(pipeline, settings, coarse=True) if c.threshold}
            assert (threshold, cap) in coarse and (MAX_CACHING.threshold, MAX_CACHING.cap) in coarse
    for threshold in (0, MAX_CACHE_THRESHOLD * 1.01):
        assert not _accepts(diffusion_cache_thresh=threshold)


def test_a_yaml_boolean_is_no_number(tmp_path):
    """YAML 1.1 reads off / no / false as a boolean, which a number field took as 0: `websocket_port: off` served the
    WebSocket on a random port, `port: false` gRPC, and `max_sessions: true` meant 1."""
    path = tmp_path / "server.yaml"
    path.write_text("websocket_port: off\n")
    with pytest.raises(ConfigError) as err:
        cli.config_from_args(["--config", str(path)], environ={})
    assert str(err.value) == (f"invalid settings: websocket_port (from {path}): expected a number, got False (YAML "
                              "reads on / off / yes / no as booleans; leave a setting out for its default)")
    numbers = [name for name, field in ServerConfig.model_fields.items() if field.annotation in
               (int, float, int | None, float | None)]
    assert {"port", "websocket_port", "max_sessions", "latency_budget_ms"} <= set(numbers)
    for name in numbers:
        assert not _accepts(**{name: True}) and not _accepts(**{name: False}), name
    config = build_config({"diffusion_cache": "off", "reflection": True, "compile_gen_stack": False})
    assert (config.diffusion_cache, config.reflection, config.compile_gen_stack) == (False, True, False)


def test_quality_profile_off_in_yaml_is_off(tmp_path):
    """YAML reads the documented value `off` as False: it was refused, 'Input should be a valid string (got False)'."""
    path = tmp_path / "server.yaml"
    path.write_text("quality_profile: off\n")
    assert cli.config_from_args(["--config", str(path)], environ={}).quality_profile == "off"
    assert not _accepts(quality_profile=True)  # on / yes name no profile


@pytest.mark.parametrize(("line", "message"), [
    ("device: 0", "device (from server.yaml): expected auto, cpu, cuda or cuda:N, got 0"),
    ("dtype: 16", "dtype (from server.yaml): expected auto, bf16, fp16 or fp32, got 16"),
    ("quality_profile: on", "quality_profile (from server.yaml): expected off, auto or a profile file, got True (YAML "
     "reads on / yes / true as True; auto is the default)"),
])
def test_a_setting_of_known_values_given_another_type_says_which_values(line, message, tmp_path, monkeypatch):
    """pydantic's own check came first and said only 'Input should be a valid string' (`device: 0` for cuda:0)."""
    monkeypatch.chdir(tmp_path)
    Path("server.yaml").write_text(line + "\n")
    with pytest.raises(ConfigError) as error:
        cli.config_from_args(["--config", "server.yaml"], environ={})
    assert str(error.value) == f"invalid settings: {message}"


def test_a_misspelt_key_in_a_file_is_named_with_the_setting_it_is_close_to(tmp_path):
    """As a misspelt POLICY_SERVER_ variable is: the file said only `Extra inputs are not permitted`."""
    path = tmp_path / "server.yaml"
    path.write_text("max-sesions: 8\nlatency_budget_ms: 90\nwebsocket: 9000\n")
    with pytest.raises(ConfigError) as err:
        cli.config_from_args(["--config", str(path)], environ={})
    assert str(err.value) == (
        f"invalid settings: max_sesions (from {path}): not a setting; did you mean max_sessions? (got 8); "
        f"websocket (from {path}): not a setting; did you mean websocket_port? (got 9000)")
    path.write_text("colour: blue\n")
    with pytest.raises(ConfigError, match=r"colour \(from .*\): not a setting; expected the name of a flag of "
                                          r"`policy-server --help` \(got 'blue'\)"):
        cli.config_from_args(["--config", str(path)], environ={})


def test_an_empty_path_is_refused_by_name_not_read_as_the_working_folder():
    """Path("") is Path("."): `--checkpoint ''` (or an empty $POLICY_SERVER_CHECKPOINT) served the working folder,
    `--unix-socket ''` bound it, and `--config ''` said "config file . does not exist"."""
    expected = "expected a path, got '' (leave the setting out for none)"
    for field in ("checkpoint", "unix_socket", "auth_token_file", "tls_cert", "tls_key"):
        flag = "--" + field.replace("_", "-")
        with pytest.raises(ConfigError) as err:
            cli.config_from_args([flag, ""], environ={})
        assert f"{field} (from command line): {expected}" in str(err.value)
    with pytest.raises(ConfigError) as err:
        cli.config_from_args(["--config", ""], environ={})
    assert str(err.value) == "config file '': expected the path of a .yaml, .yml or .json file"


def test_an_empty_variable_is_unset_and_a_bad_one_is_refused_by_name(tmp_path):
    """docker compose's `${VAR:-}` passes a variable the host does not set as the empty string:
    POLICY_SERVER_WEBSOCKET_PORT="" was refused (`Input should be a valid integer ... (got '')`), an empty
    POLICY_SERVER_CHECKPOINT too, and an empty POLICY_SERVER_CONFIG as a config file named ''."""
    empty = {f"POLICY_SERVER_{key.upper()}": "" for key in ServerConfig.model_fields}
    empty |= {"POLICY_SERVER_CONFIG": "", "POLICY_SERVER_CACHE": ""}
    config = cli.config_from_args([], empty)
    assert config == cli.config_from_args([], {}) and not config.model_fields_set
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({"websocket_port": 8000}))
    layered = cli.config_from_args(["--config", str(path), "--port", "7300"], empty)  # nothing of the file unset
    assert (layered.websocket_port, layered.port) == (8000, 7300)
    with pytest.raises(ConfigError, match=r"\$POLICY_SERVER_WEBSOCKT_PORT is not a setting"):  # a typo, whatever value
        cli.config_from_args([], {"POLICY_SERVER_WEBSOCKT_PORT": ""})
    for name, value, takes in (("WEBSOCKET_PORT", "abc", "Input should be a valid integer"),
                               ("WEBSOCKET_PORT", " ", "Input should be a valid integer"),
                               ("REFLECTION", "maybe", "Input should be a valid boolean"),
                               ("CHECKPOINT", " ", "expected a path")):
        with pytest.raises(ConfigError) as err:
            cli.config_from_args([], {f"POLICY_SERVER_{name}": value})
        message = str(err.value)
        assert "\n" not in message and f"{name.lower()} (from $POLICY_SERVER_{name}): {takes}" in message, message


def test_a_config_file_that_is_a_folder_is_named_as_one(tmp_path):
    with pytest.raises(ConfigError) as err:
        read_config_file(tmp_path)
    assert str(err.value) == f"config file {tmp_path} is a folder; expected a .yaml, .yml or .json file"


def test_a_listener_setting_without_its_listener_is_refused():
    """--websocket-embodiment (even one the model does not serve) and --metrics-host were taken and ignored without
    --websocket-port / --metrics-port."""
    for flags, message in ((["--websocket-embodiment", "nope"], "websocket_embodiment is set but websocket_port is "
                                                                  "not: no WebSocket serves it"),
                           (["--metrics-host", "0.0.0.0"], "metrics_host is set but metrics_port is not: no "
                                                            "metrics endpoint listens on it")):
        with pytest.raises(ConfigError) as err:
            cli.config_from_args(flags, environ={})
        assert str(err.value) == f"invalid settings: config (from the settings together): {message}"
    config = cli.config_from_args(["--metrics-host", "0.0.0.0"], environ={"POLICY_SERVER_METRICS_PORT": "9464"})
    assert (config.metrics_host, config.metrics_port) == ("0.0.0.0", 9464)


def test_listeners_on_one_port_are_refused_before_the_model_loads():
    """They failed to bind once the model had loaded, 'Address already in use', as if another process held it."""
    for flags, message in ((["--port", "50600", "--websocket-port", "50600"], "websocket_port 50600 is port too"),
                           (["--metrics-port", "50051"], "metrics_port 50051 is port too"),
                           (["--websocket-port", "9464", "--metrics-port", "9464"], "metrics_port 9464 is "
                                                                                      "websocket_port too")):
        with pytest.raises(ConfigError) as err:
            cli.config_from_args(flags, environ={})
        assert str(err.value) == (f"invalid settings: config (from the settings together): {message}, on 127.0.0.1: "
                                  "expected a port of its own")
    # A listener on every interface holds its port on each address too, and a loopback name its addresses.
    for flags, hosts in ((["--host", "0.0.0.0", "--metrics-port", "50051"], "127.0.0.1 and 0.0.0.0"),
                         (["--metrics-port", "50051", "--metrics-host", "::"], ":: and 127.0.0.1"),
                         # localhost is 127.0.0.1 (and ::1): it failed to bind once the model had loaded
                         (["--metrics-port", "50051", "--metrics-host", "localhost"], "localhost and 127.0.0.1")):
        with pytest.raises(ConfigError) as err:
            cli.config_from_args(flags, environ={})
        assert str(err.value).endswith(f"metrics_port 50051 is port too, on {hosts}: expected a port of its own")
    for flags in (["--port", "0", "--websocket-port", "0", "--metrics-port", "0"],  # any free port, each its own
                  ["--metrics-port", "50051", "--metrics-host", "10.0.0.5"]):  # another address
        cli.config_from_args(flags, environ={})


def _accepts(**values) -> bool:
    try:
        build_config(values)
    except ConfigError:
        return False
    return True


def test_main_refuses_an_unusable_token_file_in_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys):
    def build_engine(config):
        raise AssertionError("the model loaded before the token file was checked")

    monkeypatch.setattr(policy_server.engine, "build_engine", build_engine, raising=False)
    cases = {"empty": b"", "blank": b" \n\t\n", "two_words": b"one two\n", "not_ascii": "t\u00f6ken".encode(),
             "huge": b"t" * 5000, "short": b"s3cret-token-15\n"}
    expected = {"empty": "is empty", "blank": "is empty", "two_words": "whitespace", "not_ascii": "printable ASCII",
                "huge": "over 4096 bytes", "short": "is 15 characters; expected at least 16 (a shorter one may be "
                "guessed by trying; e.g. openssl rand -hex 32 > token)"}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
    for name in [*cases, "."]:  # "." : a directory, not a file
        assert cli.main(["--auth-token-file", str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("policy-server: invalid settings: auth_token_file"), err
        assert expected.get(name, "cannot read auth token file") in err, err
    # A 1-character token was served. The file may be named in the environment or a config file too.
    (tmp_path / "server.yaml").write_text(f"auth_token_file: {tmp_path / 'short'}\n")
    assert cli.main(["--config", str(tmp_path / "server.yaml")]) == 2
    assert expected["short"] in capsys.readouterr().err
    monkeypatch.setenv("POLICY_SERVER_AUTH_TOKEN_FILE", str(tmp_path / "short"))
    assert cli.main([]) == 2
    assert expected["short"] in capsys.readouterr().err


def test_a_config_file_that_is_not_utf8_is_named_in_one_line(tmp_path, capsys):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe: 1\n")
    with pytest.raises(ConfigError, match=f"config file {path}: expected UTF-8 text, got a byte that is not UTF-8"):
        read_config_file(path)
    assert cli.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(path) in err and "UTF-8" in err, err


def test_an_oversized_config_file_is_refused(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# " + "x" * (1 << 20) + "\nport: 1\n")
    with pytest.raises(ConfigError, match="is over 1048576 bytes"):
        read_config_file(path)


@pytest.mark.parametrize(("name", "content"), [
    ("dup.yaml", "max_sessions: 4\nport: 1\nmax_sessions: 5\n"),
    ("dup.json", '{"max_sessions": 4, "port": 1, "max_sessions": 5}'),
])
def test_a_key_given_twice_in_a_file_is_refused_by_name(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ConfigError, match=f"config file {path} is not valid .*duplicate key 'max_sessions'"):
        read_config_file(path)


def test_a_websocket_embodiment_the_model_does_not_serve_is_one_line_and_exit_2(monkeypatch, capsys):
    engine, closed = FakeEngine(), []
    monkeypatch.setattr(engine, "close", lambda: closed.append(True) or True)
    monkeypatch.setattr(policy_server.engine, "build_engine", lambda config: engine, raising=False)
    assert cli.main(["--port", "0", "--websocket-port", "0", "--websocket-embodiment", "aloha"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "policy-server: websocket_embodiment: expected one of ['pusht', 'libero'], got 'aloha'", err
    assert closed == [True]
