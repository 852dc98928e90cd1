"""`policy-soak` at toy size, as its own process (it lowers its priority): against a real server process every
answer matches its session and epoch and the report holds the documented keys; a session the server refuses is
reported, not a crash."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent import futures

import grpc
import pytest
from fake_engine import FakeEngine, self_signed_cert, serve_fake
from grpc_health.v1 import health_pb2, health_pb2_grpc

from policy_server.server.health import HealthService
from policy_server.v1 import policy_server_pb2 as pb
from policy_server.v1 import policy_server_pb2_grpc as pb_grpc
from robots.soak import parse_args, rss_summary


def soak(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "robots.soak", *args], capture_output=True, text=True, timeout=600)


def test_soak_against_a_real_server(tmp_path):
    out = tmp_path / "soak.json"
    token = tmp_path / "token"
    token.write_text("soak-server-token\n")
    cert, key = self_signed_cert(tmp_path)
    # 16-step episodes: every session resets (a new epoch) every two ticks. Three sessions' cheapest
    # ticks must fit one budget side by side; 400 ms leaves room for a slow CI machine's floor. The server
    # serves TLS and wants a token, as a deployment's would. A hostile neighbour floods it meanwhile.
    done = soak("--sessions", "2", "--ticks", "6", "--episode-steps", "16", "--warmup-ticks", "2",
                "--rss-every-s", "0.5", "--latency-budget-ms", "400", "--auth-token-file", str(token),
                "--tls-cert", str(cert), "--tls-key", str(key), "--hostile-neighbour", "--out", str(out))
    assert out.is_file(), done.stderr[-4000:]  # a soak that ends before its report says why there
    report = json.loads(out.read_text())
    assert done.returncode == (0 if report["passed"] else 1), done.stderr
    assert {"config", "wall_s", "errors", "wrong_answers", "misses", "miss_rate", "latency_ms", "latency_by_tenth",
            "rss", "sessions", "checks", "server_process"} <= set(report)
    assert (report["sent"], report["answered"]) == (12, 12)
    assert report["errors"] == {} and report["rate_refused"] == 0 and report["superseded"] == 0
    assert report["wrong_answers"] == 0
    assert [s["kind"] for s in report["sessions"]] == ["unary", "stream"]
    for session in report["sessions"]:
        assert session["answered"] == 6 and session["resets"] >= 2
        assert session["last_epoch"] == session["resets"] + 1
    for name in ("served", "tick_total", "client"):
        assert report["latency_ms"][name]["p50"] <= report["latency_ms"][name]["p99"]
    rss = report["rss"]
    assert rss["pid"] == report["server_process"]["pid"] and len(rss["series"]) >= 2
    assert rss["after_warmup_mb"] > 0
    assert report["server_process"]["exited_during_soak"] is None  # the server lived through it
    assert {"--auth-token-file", "--tls-cert", "--tls-key"} <= set(report["config"]["server_flags"])
    assert report["config"]["server_flags"][:2] == ["--max-sessions", "3"]  # room for the neighbour
    assert report["config"]["load_nice"] == 10
    hostile = report["hostile_neighbour"]
    assert hostile["threads"] == 6 and hostile["answers"]["OK"] >= 1  # served at its rate ...
    assert hostile["sent"] > hostile["answers"]["OK"]  # ... and refused beyond it, as RATE_EXCEEDED or SESSION_BUSY
    assert report["checks"]["hostile_answers"] is True and report["close_failures"] == []
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_soaks_tls_flags(tmp_path, capsys):
    cert, key = self_signed_cert(tmp_path)
    args = parse_args(["--tls-cert", str(cert), "--tls-key", str(key)])
    assert args.tls_ca == cert.read_bytes()  # a self-signed server certificate is its own root
    for argv, why in ((["--tls-cert", str(cert)], "--tls-cert and --tls-key go together"),
                      (["--tls-cert", str(key), "--tls-key", str(key)], "is not a PEM certificate file"),
                      (["--server", "127.0.0.1:1", "--tls-cert", str(cert), "--tls-key", str(key)],
                       "only to a server the soak starts"),
                      (["--tls-ca", str(cert)], "need --server, or --tls-cert and --tls-key")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2 and why in capsys.readouterr().err


def test_a_number_the_soak_cannot_run_with_is_one_usage_line(capsys):
    """--sessions 0 and --episode-steps 0 ended in a traceback (the latter after opening sessions it left open on the
    server), --ticks 0 ran and failed its miss rate, and a bad --rate-hz was found only once a session opened."""
    for argv, why in ((["--sessions", "0"], "--sessions: expected a whole number of at least 1, got 0"),
                      (["--ticks", "-1"], "--ticks: expected a whole number of at least 1, got -1"),
                      (["--episode-steps", "0"], "--episode-steps: expected a whole number of at least 1, got 0"),
                      (["--actions-per-chunk", "0"], "--actions-per-chunk: expected a whole number of at least 1"),
                      (["--max-sessions", "0"], "--max-sessions: expected a whole number of at least 1, got 0"),
                      (["--server", "127.0.0.1:1", "--server-pid", "0"], "--server-pid: expected a whole number of "
                                                                          "at least 1, got 0"),
                      (["--seed", "-1"], "--seed: expected a whole number of at least 0, got -1"),
                      (["--warmup-ticks", "-1"], "--warmup-ticks: expected a whole number of at least 0, got -1"),
                      (["--rate-hz", "nan"], "--rate-hz: expected 0 (a closed loop) or 0.01 to 1000 Hz, got nan"),
                      (["--rate-hz", "0.001"], "--rate-hz: expected 0 (a closed loop) or 0.01 to 1000 Hz"),
                      (["--max-miss-rate", "2"], "--max-miss-rate: expected a fraction from 0 to 1, got 2"),
                      (["--max-rss-growth-mb", "nan"], "--max-rss-growth-mb: expected MB from 0, got nan"),
                      # The PNG summary, written to --out with .png, overwrote the report.
                      (["--out", f"{tempfile.gettempdir()}/s.png"], f"argument --out: {tempfile.gettempdir()}/s.png: "
                                                                     "the JSON report's path, whose PNG summary goes"),
                      # Started a server, warmed it up, and was refused TOO_MANY_SESSIONS, told the load did not fit.
                      (["--sessions", "4", "--max-sessions", "2"], "--max-sessions 2 is fewer than the 4 sessions"),
                      (["--sessions", "4", "--max-sessions", "4", "--hostile-neighbour"],
                       "--max-sessions 4 is fewer than the 5 sessions the soak opens")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and why in err, (argv, err)
    assert parse_args(["--rate-hz", "0", "--max-miss-rate", "0", "--warmup-ticks", "0"]).rate_hz == 0


def test_rss_growth_is_the_rise_of_the_floor_not_of_a_sample_with_a_request_in_flight():
    flat = [(t, 500.0 + 60.0 * (t % 4 == 3)) for t in range(12)]  # a 2048 px frame in flight now and then
    summary = rss_summary(flat, warm_s=0.0, after_close_mb=None)
    assert (summary["growth_mb"], summary["floor_by_third_mb"], summary["levels_off"]) == (0.0, [500.0] * 3, True)
    assert (summary["after_warmup_mb"], summary["final_mb"]) == (500.0, 560.0)
    leak = [(t, 500.0 + 5.0 * t) for t in range(12)]
    summary = rss_summary(leak, warm_s=3.0, after_close_mb=None)  # samples from t = 3 on: 3, 6, 9 begin the thirds
    assert (summary["growth_mb"], summary["levels_off"]) == (30.0, False)
    assert summary["after_warmup_at_s"] == 3.0
    summary = rss_summary(leak[:2], warm_s=0.0, after_close_mb=None)
    assert (summary["growth_mb"], summary["floor_by_third_mb"], summary["levels_off"]) == (5.0, None, None)


class _AdmitsOne(pb_grpc.PolicyServiceServicer):
    """Opens the first session and refuses the next (as OVERLOADED, like a server at capacity, unless told)."""

    def __init__(self, refusal=(grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED: 1 session of pusht fits at 1.25 Hz")):
        self.opened, self.closed, self.refusal = [], [], refusal

    def GetServerInfo(self, request, context):
        spec = pb.EmbodimentSpec(name="pusht", control_hz=10.0, default_chunk_size=8, max_chunk_size=8)
        return pb.ServerInfo(embodiments=[spec], default_budget_ms=120.0, ready=True,
                             limits=pb.Limits(max_sessions=8), model=pb.ModelInfo(name="fake", device="cpu"))

    def OpenSession(self, request, context):
        if self.opened:
            # The reason in the message alone, as a proxy that keeps only the code and the message passes it on.
            context.abort(*self.refusal)
        self.opened.append(request)
        return pb.Session(session_id="s0", epoch=1, embodiment="pusht", chunk_size=8, rate_hz=1.25)

    def CloseSession(self, request, context):
        self.closed.append(request.session_id)
        return pb.CloseSessionResponse()


def _soak_refused(tmp_path, servicer: _AdmitsOne) -> subprocess.CompletedProcess:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_PolicyServiceServicer_to_server(servicer, server)
    health_servicer = HealthService()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        out = tmp_path / "soak.json"
        done = soak("--server", f"127.0.0.1:{port}", "--sessions", "2", "--ticks", "3", "--rate-hz", "2",
                    "--out", str(out))
    finally:
        server.stop(grace=None)
    return done


def test_soak_reports_a_refused_session(tmp_path):
    servicer = _AdmitsOne()
    done = _soak_refused(tmp_path, servicer)
    assert done.returncode == 3
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["refused_open"] == {"session": 1, "kind": "stream", "code": "RESOURCE_EXHAUSTED",
                                      "reason": "OVERLOADED", "message": "1 session of pusht fits at 1.25 Hz"}
    assert servicer.opened[0].rate_hz == 2.0  # the declared rate went out on the wire
    assert servicer.closed == ["s0"]  # the session it did get was closed again
    assert "refused session 1 (stream): RESOURCE_EXHAUSTED OVERLOADED" in done.stderr
    assert "the load does not fit; try a lower --rate-hz" in done.stderr


def test_a_refusal_other_than_overload_is_not_called_a_load_that_does_not_fit(tmp_path):
    """`--actions-per-chunk 99` on a server whose chunks are 8 is refused BAD_VALUE; the soak said the load did not
    fit and to lower --rate-hz."""
    done = _soak_refused(tmp_path, _AdmitsOne((grpc.StatusCode.INVALID_ARGUMENT, "BAD_VALUE: actions_per_chunk: "
                                                                                "expected 1..8, got 99")))
    assert done.returncode == 3
    assert "refused session 1 (stream): INVALID_ARGUMENT BAD_VALUE: actions_per_chunk" in done.stderr
    assert "does not fit" not in done.stderr and "--rate-hz" not in done.stderr


def test_ctrl_c_ends_the_soak_at_once_and_closes_its_sessions(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the process group) ends a --server soak after the ticks in flight, not after
    all its ticks, and closes its sessions rather than leaving them to hold the server's places until they expire."""
    engine = FakeEngine()
    out = tmp_path / "soak.json"
    with serve_fake(engine) as server:
        soak_process = subprocess.Popen(
            [sys.executable, "-m", "robots.soak", "--server", server.target, "--sessions", "2", "--ticks", "100000",
             "--rate-hz", "50", "--out", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while len(engine.acts) < 10 and time.monotonic() < deadline:
                time.sleep(0.05)
            os.killpg(soak_process.pid, signal.SIGINT)
            _, error = soak_process.communicate(timeout=30)
        finally:
            soak_process.kill()  # not left running where it did not end
        assert engine.stats().sessions == 0
    assert soak_process.returncode == 130 and not out.exists()
    assert error == f"policy-soak: interrupted (Ctrl-C), no report written to {out}\n"
