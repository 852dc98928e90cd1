"""`policy-soak` (or `python -m robots.soak`): many sessions on one real server for a long time; wrong answers, errors,
deadline misses and the server's memory.

    policy-soak --sessions 8 --ticks 1000 --out soak.json
    policy-soak --server 127.0.0.1:50051 --server-pid 1234 --sessions 4 --ticks 200

Without ``--server`` it starts ``policy-server`` as a child process on a free loopback port (its log
beside the report) and stops it at the end; given ``--tls-cert/--tls-key`` that server serves TLS, and the soak
trusts ``--tls-ca`` or else that certificate. Every session runs on its own thread with its own
connection and its own Reach simulator (``robots/envs/reach.py``): a tick sends the camera frame and
effector state, waits for the chunk, executes its first ``actions_per_chunk`` actions, and when the
episode ends starts a new one (ResetSession: epoch + 1). Even-numbered sessions use unary ``Act``,
odd-numbered ones the ``Control`` stream. Each session declares its request rate when it opens and
never sends faster: a tick starts no earlier than 1/rate after the previous one.

Every answer is checked against what was sent (session id, epoch, and on the stream obs_id). Failed
ticks are counted by gRPC status and reason; RESOURCE_EXHAUSTED / RATE_EXCEEDED refusals apart from
the errors. The server's resident memory (VmRSS) is sampled every ``--rss-every-s``; growth counts
from the first sample after every session has done ``--warmup-ticks`` ticks, when the allocator
pools and caches have been filled once, as the rise of the floor (the lowest sample) from the first
third of the samples since then to the last: a request in flight lifts single samples.

With ``--hostile-neighbour`` one more session floods the server beside them: ``Act``s of the largest frame
it takes, from several threads without pause, far over the rate it declared. The server should serve that
session at its rate and refuse the rest as documented, while the soak's sessions keep their deadlines.

The soak runs below the server's priority (nice 10, on Linux; the server it starts keeps its own), so that on
one machine its load costs the server what a client on another machine would: the requests, not the cores.

The JSON report goes to ``--out``, a PNG of RSS and latency over time beside it. Exit status: 0 when
every check passed (no errors, refusals or wrong answers, miss rate <= ``--max-miss-rate``, RSS
growth < ``--max-rss-growth-mb``), 1 when one failed, 3 when the server refused to open a session
(e.g. RESOURCE_EXHAUSTED / OVERLOADED: the load does not fit; try a lower ``--rate-hz``), 4 when the
server it started did not come up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import gymnasium
import numpy as np

import robots.envs  # noqa: F401  (registers the environments)
from policy_server import __version__
from policy_server.client import (
    ActionChunk,
    ControlStream,
    PolicyClient,
    PolicyServerError,
    Session,
    build_observation,
)
from policy_server.client.cli_flags import add_tls_flags, pem_file, seconds, server_address, tls_options, token_file
from policy_server.limits import MAX_RATE_HZ, MIN_RATE_HZ
from policy_server.output_file import report_file
from policy_server.v1 import policy_server_pb2 as pb
from robots.envs.reach import EMBODIMENT, HELDOUT_SEED_OFFSET

EXAMPLES = 5  # error and wrong-answer messages kept per session, for the report
FLOOD_THREADS = 6  # the hostile neighbour's senders
# What the hostile neighbour may be answered: a chunk, or a refusal for asking too soon or too often.
FLOOD_ANSWERS = {"OK", "RESOURCE_EXHAUSTED/RATE_EXCEEDED", "RESOURCE_EXHAUSTED/SESSION_BUSY"}
# The soak's threads run at this nice value, below a server on the same machine: the load it generates should cost
# the server what a client on another machine would, not the cores the server computes on.
LOAD_NICE = 10


# -- the server ----------------------------------------------------------------------------------


class ServerFailed(Exception):
    """The server this soak started exited or never became SERVING."""


LISTENERS_LINE = "policy-server: "  # the line a started server prints once its ports are bound (`policy_server.cli`)


def bound_listeners(log_path: Path, process: subprocess.Popen, timeout_s: float) -> dict[str, str]:
    """The addresses a ``policy-server`` process writing to ``log_path`` bound, by listener, from the line it prints
    once bound (``policy-server: gRPC on 127.0.0.1:50051, metrics on 127.0.0.1:9464``):
    ``{"gRPC": "127.0.0.1:50051", "metrics": "127.0.0.1:9464"}``. A server started with port 0 binds one the system
    picks, which no other program can take between a probe and the bind. ServerFailed if it exits first;
    TimeoutError after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        for line in log_path.read_text().splitlines():
            if line.startswith(LISTENERS_LINE + "gRPC on "):
                return listeners_of(line)
        if process.poll() is not None:
            raise ServerFailed(f"the server exited with status {process.returncode} while starting")
        if time.monotonic() > end:
            raise TimeoutError(f"the server bound no port within {timeout_s:g} s")
        time.sleep(0.1)


def listeners_of(line: str) -> dict[str, str]:
    """The addresses by listener of a server's ``policy-server: gRPC on ...`` line (``bound_listeners``)."""
    return dict(part.rsplit(" on ", 1) for part in line.removeprefix(LISTENERS_LINE).strip().split(", "))


class ServerProcess:
    """A real ``policy-server`` child process on a 127.0.0.1 port it picks, output in ``log_path``; ``wait_serving``
    before using it (``target`` is known then). ``client_options``: `PolicyClient`'s keywords for a server given
    ``--tls-cert`` (TLS) or ``--auth-token-file`` (``token_file``: its health Watch takes the token)."""

    def __init__(self, server_args: list[str], log_path: Path, client_options: dict | None = None) -> None:
        self.target: str | None = None
        self.log_path = log_path
        self.client_options = client_options or {}
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "policy_server.cli", "--host", "127.0.0.1", "--port", "0", *server_args],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.pid = self.process.pid

    def wait_serving(self, timeout_s: float) -> None:
        """Raises ``ServerFailed`` (and stops the server) if it exits or is not SERVING within ``timeout_s``."""
        try:
            self._wait_serving(timeout_s)
        except (ServerFailed, TimeoutError) as exc:
            self.stop()
            raise ServerFailed(f"{exc}\n--- {self.log_path} (end) ---\n{self.log_tail()}") from None

    def _wait_serving(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        self.target = bound_listeners(self.log_path, self.process, timeout_s)["gRPC"]
        with PolicyClient(self.target, **self.client_options) as client:
            while True:  # in 1 s steps, so that a server that crashed is noticed at once
                if self.process.poll() is not None:
                    raise ServerFailed(f"the server exited with status {self.process.returncode} while starting")
                try:
                    client.wait_until_serving(timeout_s=1.0)
                    return
                except TimeoutError:
                    if time.monotonic() > end:
                        raise

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])

    def stop(self) -> int:
        """SIGTERM (graceful shutdown), SIGKILL after 30 s; returns the exit status."""
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()
        return self.process.returncode


def read_rss_mb(pid: int) -> float | None:
    """Resident set size of a process in MB (MiB: /proc reports kB of 1024 bytes); None once it has
    exited (gone, or a zombie, which has no VmRSS line)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    lines = [line for line in status.splitlines() if line.startswith("VmRSS:")]
    return int(lines[0].split()[1]) / 1024 if lines else None


class RssSampler:
    """Samples a process's RSS every ``every_s`` on a background thread: ``series`` holds (s, MB)."""

    def __init__(self, pid: int, every_s: float, t0: float) -> None:
        self.pid, self.every_s, self.t0 = pid, every_s, t0
        self.series: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")
        self._thread.start()

    def sample(self) -> float | None:
        rss = read_rss_mb(self.pid)
        if rss is not None:
            self.series.append((time.monotonic() - self.t0, rss))
        return rss

    def _run(self) -> None:
        # Stops early if the server exits; the errors and server_process in the report say why.
        while self.sample() is not None and not self._stop.wait(self.every_s):
            pass

    def finish(self) -> None:
        """Stop sampling, with one last sample now if the process still exists."""
        self._stop.set()
        self._thread.join()
        self.sample()


# -- one session -----------------------------------------------------------------------------------


def episode_seed(args: argparse.Namespace, session: int, episode: int) -> int:
    """Held-out simulator scenes (never in the demonstrations), different for every session."""
    return HELDOUT_SEED_OFFSET + args.seed + 100_000 * session + episode


@dataclass
class Tick:
    """One answered tick; time in s since the soak started, latencies in ms."""

    t_s: float
    served_ms: float  # request received -> answer ready, inside the server
    total_ms: float  # the tick record's total: prepare, queue, encode, prefill, denoise, decode
    client_ms: float  # send -> answer, as this client saw it
    queue_ms: float  # waited in the server's queue before it started
    deadline_ms: float  # the tick record's deadline, from arrival: min(budget, caller deadline)
    deadline_met: bool


@dataclass
class SessionResult:
    index: int
    kind: str  # "unary" or "stream"
    session_id: str
    sent: int = 0
    ticks: list[Tick] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)  # "CODE/REASON" -> count
    error_examples: list[str] = field(default_factory=list)
    rate_refused: int = 0
    wrong: int = 0
    wrong_examples: list[str] = field(default_factory=list)
    superseded: int = 0
    resets: int = 0
    last_epoch: int = 1

    def error(self, exc: PolicyServerError, during: str = "") -> None:
        self.errors[f"{exc.code.name}/{exc.reason}"] += 1
        if len(self.error_examples) < EXAMPLES:
            self.error_examples.append(f"{during}{exc}")

    def summary(self) -> dict:
        return {
            "index": self.index, "kind": self.kind, "session_id": self.session_id, "sent": self.sent,
            "answered": len(self.ticks), "errors": dict(self.errors), "error_examples": self.error_examples,
            "rate_refused": self.rate_refused, "wrong_answers": self.wrong, "wrong_examples": self.wrong_examples,
            "superseded": self.superseded, "resets": self.resets, "last_epoch": self.last_epoch,
            "misses": sum(not t.deadline_met for t in self.ticks),
        }


class StreamEnded(Exception):
    """The Control stream closed or fell silent: the session cannot go on."""

    def __init__(self, error: PolicyServerError) -> None:
        super().__init__(str(error))
        self.error = error


class Unary:
    """A session driven with unary ``Act`` calls."""

    kind = "unary"
    obs_id = 0  # what Act answers carry

    def __init__(self, client: PolicyClient, session: Session, args: argparse.Namespace) -> None:
        self.client, self.session, self.timeout_s = client, session, args.timeout_s

    def act(self, obs: dict, step: int, instruction: str, result: SessionResult) -> ActionChunk | None:
        return self.client.act(self.session, {"image": obs["image"]}, obs["state"], instruction=instruction,
                               step_index=step, encoding="png", timeout_s=self.timeout_s)

    def reset(self) -> None:
        self.session = self.client.reset_session(self.session)

    def close(self) -> None:
        pass


class Stream:
    """A session driven over the ``Control`` stream, one frame in flight at a time."""

    kind = "stream"

    def __init__(self, client: PolicyClient, session: Session, args: argparse.Namespace) -> None:
        self.client, self.timeout_s = client, args.timeout_s
        self.stream = ControlStream(client, session).open()
        self.obs_id = 0

    @property
    def session(self) -> Session:
        return self.stream.session

    def act(self, obs: dict, step: int, instruction: str, result: SessionResult) -> ActionChunk | None:
        """The chunk answering this frame, or None if the server superseded it."""
        self.obs_id = self.stream.send({"image": obs["image"]}, obs["state"], instruction=instruction,
                                       step_index=step, encoding="png")
        while True:
            try:
                event = self.stream.next_event(self.timeout_s)
            except TimeoutError as exc:
                raise StreamEnded(PolicyServerError(grpc.StatusCode.DEADLINE_EXCEEDED, "NO_ANSWER", str(exc))) \
                    from None
            if event.kind == "chunk":
                return event.chunk
            if event.kind == "superseded":
                result.superseded += 1  # only one frame is ever in flight: the server should drop none
                if event.obs_id == self.obs_id:
                    return None
            elif event.kind == "error":
                if event.obs_id == self.obs_id:
                    raise event.error
                result.error(event.error, f"stream event for obs {event.obs_id}: ")
            elif event.kind == "closed":
                raise StreamEnded(event.error or PolicyServerError(
                    grpc.StatusCode.CANCELLED, "STREAM_CLOSED", "the control stream ended"))
            elif event.kind == "reconnected":  # the link dropped: on loopback that is a server failure
                result.error(PolicyServerError(grpc.StatusCode.UNAVAILABLE, "RECONNECTED",
                                               f"session replaced: {event.session_replaced}"))

    def reset(self) -> None:
        self.stream.reset()

    def close(self) -> None:
        self.stream.close()


class HostileNeighbour:
    """One more session whose `Act`s carry the largest frame the server takes on each of its `cameras` (a JPEG
    `max_side` px a side, with the session's first observation's state), sent from `FLOOD_THREADS` threads without
    pause until `stop()`; `answers` counts what came back, by "OK" or "CODE/REASON"."""

    def __init__(self, client: PolicyClient, session: Session, cameras: list[str], state: np.ndarray,
                 max_side: int):
        self.client, self.session = client, session
        ramp = np.linspace(0, 255, max_side, dtype=np.float32)
        frame = np.stack([np.add.outer(ramp, ramp) / 2, np.add.outer(ramp, 255 - ramp) / 2,
                          np.broadcast_to(ramp[:, None], (max_side, max_side))], axis=-1).astype(np.uint8)
        self.request = pb.ActRequest(session_id=session.session_id, epoch=session.epoch,
                                     observation=build_observation(dict.fromkeys(cameras, frame), state))
        self.answers: Counter = Counter()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._threads = [threading.Thread(target=self._send, name=f"soak-flood-{i}") for i in range(FLOOD_THREADS)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stopped.set()
        for thread in self._threads:
            thread.join()

    def _send(self) -> None:
        while not self._stopped.is_set():
            try:
                self.client.act_request(self.request)
                answer = "OK"
            except PolicyServerError as exc:
                answer = f"{exc.code.name}/{exc.reason}"
            with self._lock:
                self.answers[answer] += 1

    def summary(self) -> dict:
        return {"threads": FLOOD_THREADS, "session_id": self.session.session_id, "sent": sum(self.answers.values()),
                "answers": dict(self.answers)}


def run_session(driver: Unary | Stream, result: SessionResult, args: argparse.Namespace, pace_s: float,
                t0: float, stop: threading.Event) -> SessionResult:
    """``args.ticks`` ticks, each sent at least ``pace_s`` (s) after the previous one, the chunks driving
    the simulator; fewer once ``stop`` is set (Ctrl-C)."""
    env = gymnasium.make("PolicyServer/Reach-v0", max_episode_steps=args.episode_steps)
    episode, step = 0, 0
    obs, _ = env.reset(seed=episode_seed(args, result.index, episode))
    instruction = ""  # "" keeps the session's instruction; a new episode sends its own
    execute = args.actions_per_chunk or driver.session.chunk_size
    next_send = time.monotonic()
    for _ in range(args.ticks):
        if stop.wait(max(0.0, next_send - time.monotonic())):
            break
        sent = time.monotonic()
        next_send = sent + pace_s
        result.sent += 1
        session = driver.session
        try:
            chunk = driver.act(obs, step, instruction, result)
        except StreamEnded as exc:
            result.error(exc.error)
            break
        except PolicyServerError as exc:
            if exc.reason == "RATE_EXCEEDED":
                result.rate_refused += 1
            else:
                result.error(exc)
            continue
        if chunk is None:
            continue
        answered = time.monotonic()
        if (chunk.session_id, chunk.epoch, chunk.obs_id) != (session.session_id, session.epoch, driver.obs_id):
            result.wrong += 1
            if len(result.wrong_examples) < EXAMPLES:
                result.wrong_examples.append(
                    f"sent {session.session_id} epoch {session.epoch} obs {driver.obs_id}, "
                    f"got {chunk.session_id} epoch {chunk.epoch} obs {chunk.obs_id}")
        result.ticks.append(Tick(answered - t0, chunk.served_ms, chunk.tick.actual_ms["total"],
                                 (answered - sent) * 1e3, chunk.tick.actual_ms["queue"], chunk.tick.deadline_ms,
                                 chunk.tick.deadline_met))
        instruction = ""
        for action in chunk.actions[:execute]:
            obs, _, terminated, truncated, _ = env.step(action)
            step += 1
            if terminated or truncated:
                episode, step = episode + 1, 0
                obs, _ = env.reset(seed=episode_seed(args, result.index, episode))
                instruction = env.unwrapped.task_description
                try:
                    driver.reset()
                    result.resets += 1
                    result.last_epoch = driver.session.epoch
                except PolicyServerError as exc:
                    result.error(exc, "ResetSession: ")
                break
    env.close()
    return result


# -- the report ------------------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)),
            "max": float(np.max(values))}


def rss_summary(series: list[tuple[float, float]], warm_s: float, after_close_mb: float | None) -> dict:
    """RSS (MB) from warmup on (the samples at or after ``warm_s``) as the floor of each third of them, its
    lowest sample: a request in flight lifts single samples (a 2048 px frame on its canvas holds 50 MB for
    a moment), what the server keeps lifts the floor. Growth is the last third's floor over the first's;
    it levels off when the last third's floor rose less than half as much as the second's, or under 2 MB.
    With fewer than 3 samples after warmup, growth is the last sample over the first and whether it
    levels off cannot be told."""
    after = [(t, mb) for t, mb in series if t >= warm_s] or series[-1:]
    mbs = [mb for _, mb in after]
    floors = levels_off = None
    growth = mbs[-1] - mbs[0]
    if len(mbs) >= 3:
        floors = [float(min(third)) for third in np.array_split(mbs, 3)]
        growth = floors[2] - floors[0]
        levels_off = floors[2] - floors[1] < max(2.0, 0.5 * (floors[1] - floors[0]))
    return {"series": series, "after_warmup_at_s": after[0][0], "after_warmup_mb": mbs[0], "final_mb": mbs[-1],
            "floor_by_third_mb": floors, "growth_mb": growth, "levels_off": levels_off,
            "after_close_mb": after_close_mb}


def build_report(args: argparse.Namespace, config: dict, results: list[SessionResult], wall_s: float,
                 rss: dict | None, hostile: HostileNeighbour | None) -> dict:
    ticks = [t for r in results for t in r.ticks]
    after_warmup = [t for r in results for t in r.ticks[args.warmup_ticks:]]
    errors = sum((r.errors for r in results), Counter())
    missed = [t for t in ticks if not t.deadline_met]
    misses = len(missed)
    tenth = wall_s / 10
    by_tenth = []
    for k in range(10):  # does latency drift as the run goes on?
        window = [t for t in ticks if k * tenth <= t.t_s < (k + 1) * tenth]
        by_tenth.append({"from_s": k * tenth, "ticks": len(window), "misses": sum(not t.deadline_met for t in window),
                         "served_ms": percentiles([t.served_ms for t in window])})
    report = {
        "config": config,
        "wall_s": wall_s,
        "sent": sum(r.sent for r in results),
        "answered": len(ticks),
        "errors": dict(errors),
        "rate_refused": sum(r.rate_refused for r in results),
        "wrong_answers": sum(r.wrong for r in results),
        "superseded": sum(r.superseded for r in results),
        "resets": sum(r.resets for r in results),
        "misses": misses,
        "miss_rate": misses / len(ticks) if ticks else None,
        "miss_rate_after_warmup": sum(not t.deadline_met for t in after_warmup) / len(after_warmup)
        if after_warmup else None,
        "latency_ms": {"served": percentiles([t.served_ms for t in ticks]),
                       "tick_total": percentiles([t.total_ms for t in ticks]),
                       "client": percentiles([t.client_ms for t in ticks]),
                       "queue": percentiles([t.queue_ms for t in ticks]),
                       "deadline": percentiles([t.deadline_ms for t in ticks])},
        # What the missed ticks looked like: over the budget, or a short deadline after a long queue?
        "missed_ms": {"tick_total": percentiles([t.total_ms for t in missed]),
                      "queue": percentiles([t.queue_ms for t in missed]),
                      "deadline": percentiles([t.deadline_ms for t in missed])},
        "latency_by_tenth": by_tenth,
        "rss": rss,
        "sessions": [r.summary() for r in results],
        "hostile_neighbour": None if hostile is None else hostile.summary(),
    }
    checks = {
        "errors": not errors,
        "rate_refused": report["rate_refused"] == 0,
        "wrong_answers": report["wrong_answers"] == 0,
        "all_answered": len(ticks) == args.sessions * args.ticks,
        "miss_rate": bool(ticks) and report["miss_rate"] <= args.max_miss_rate,
        "rss_growth": None if rss is None else rss["growth_mb"] < args.max_rss_growth_mb,  # None: not measured
        "hostile_answers": None if hostile is None else set(hostile.answers) <= FLOOD_ANSWERS,
    }
    report["checks"] = checks
    report["passed"] = all(ok is not False for ok in checks.values())
    return report


def plot(report: dict, results: list[SessionResult], out: Path) -> None:
    """Server RSS (MB) and the served latency of every tick (ms) over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    rss = report["rss"]
    if rss is not None:
        top.plot(*zip(*rss["series"], strict=True), "k.-", markersize=3)
        top.axvline(rss["after_warmup_at_s"], color="tab:orange", linestyle="--", label="after warmup")
        top.legend(loc="lower right")
    top.set_ylabel("server RSS (MB)")
    top.set_title(f"soak: {len(results)} sessions x {report['config']['ticks']} ticks "
                  f"at {report['config']['rate_hz']:g} Hz")
    for kind, color in (("unary", "tab:blue"), ("stream", "tab:green")):
        ticks = [t for r in results if r.kind == kind for t in r.ticks]
        bottom.scatter([t.t_s for t in ticks], [t.served_ms for t in ticks], s=2, color=color, label=kind)
    budget = report["config"]["budget_ms"]
    bottom.axhline(budget, color="tab:red", linestyle="--", label=f"budget {budget:g} ms")
    bottom.set_xlabel("time since start (s)")
    bottom.set_ylabel("served latency (ms)")
    bottom.legend(loc="upper right", markerscale=4)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def print_summary(report: dict, out: Path) -> None:
    c, latency, rss = report["config"], report["latency_ms"], report["rss"]
    print(f"soak: {c['sessions']} sessions x {c['ticks']} ticks at {c['rate_hz']:g} Hz each "
          f"({c['actions_per_chunk']} actions per chunk, budget {c['budget_ms']:g} ms), {report['wall_s']:.0f} s")
    print(f"  answered {report['answered']}/{report['sent']}; errors {report['errors'] or 0}; "
          f"rate refused {report['rate_refused']}; wrong answers {report['wrong_answers']}; "
          f"superseded {report['superseded']}; resets {report['resets']}")
    if report["answered"]:
        served, total = latency["served"], latency["tick_total"]
        print(f"  deadline misses {report['misses']} ({report['miss_rate']:.2%}); served p50 {served['p50']:.1f} ms "
              f"p99 {served['p99']:.1f} ms; tick total p50 {total['p50']:.1f} ms p99 {total['p99']:.1f} ms")
    hostile = report["hostile_neighbour"]
    if hostile is not None:
        answers = ", ".join(f"{answer} {count}" for answer, count in sorted(hostile["answers"].items()))
        print(f"  hostile neighbour: {hostile['sent']} Acts from {hostile['threads']} threads, answered {answers}")
    if rss is not None:
        floors = rss["floor_by_third_mb"]
        shape = ("too few samples to tell whether it levels off" if floors is None else
                 "floor by third " + " / ".join(f"{mb:.1f}" for mb in floors) + " MB: "
                 + ("levels off" if rss["levels_off"] else "still growing"))
        print(f"  server RSS after warmup {rss['after_warmup_mb']:.1f} MB, final {rss['final_mb']:.1f} MB, "
              f"growth {rss['growth_mb']:+.1f} MB ({shape})")
        if rss["after_close_mb"] is not None:
            print(f"  server RSS after closing the sessions {rss['after_close_mb']:.1f} MB")
    failed = [name for name, ok in report["checks"].items() if ok is False]
    print(f"  {'PASS' if report['passed'] else 'FAIL: ' + ', '.join(failed)} (report {out})")


# -- the command -----------------------------------------------------------------------------------


# What a refused OpenSession asks of the soak's flags, by reason; another reason's message says what was wrong (a bad
# --actions-per-chunk, BAD_VALUE, was told the load did not fit).
_REFUSAL_ADVICE = {
    "OVERLOADED": "the load does not fit; try a lower --rate-hz or a larger --latency-budget-ms",
    "BUDGET_INFEASIBLE": "the budget is below the server's cheapest tick; try a larger --latency-budget-ms",
    "TOO_MANY_SESSIONS": "the server has no place for another session; try fewer --sessions",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="policy-soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--sessions", type=_whole(1), default=8, help="concurrent sessions, half unary, half stream (8)")
    p.add_argument("--ticks", type=_whole(1), default=1000, help="ticks per session (1000)")
    p.add_argument("--rate-hz", type=_rate_hz,
                   help="chunk requests per second each session declares and keeps to (unset: the server's "
                   "default, control_hz / actions per chunk)")
    p.add_argument("--actions-per-chunk", type=_whole(1),
                   help="actions executed from each chunk (unset: the chunk size)")
    p.add_argument("--episode-steps", type=_whole(1), default=80, help="control steps before an episode is cut (80)")
    p.add_argument("--warmup-ticks", type=_whole(0), default=50, help="ticks per session before RSS growth counts (50)")
    p.add_argument("--rss-every-s", type=seconds, default=2.0, help="RSS sampling period in s (2)")
    p.add_argument("--timeout-s", type=seconds, default=30.0, help="longest wait for one answer in s (30)")
    p.add_argument("--max-miss-rate", type=_fraction, default=0.01, help="deadline misses allowed, fraction (0.01)")
    p.add_argument("--max-rss-growth-mb", type=_megabytes, default=50.0, help="RSS growth allowed after warmup (50 MB)")
    p.add_argument("--seed", type=_whole(0), default=0, help="offset of the simulator seeds (0)")
    p.add_argument("--hostile-neighbour", action="store_true",
                   help=f"one more session floods Acts of the largest frame the server takes from {FLOOD_THREADS} "
                   "threads; the checks apply to the other sessions, and its answers must be chunks or "
                   "RATE_EXCEEDED / SESSION_BUSY refusals")
    p.add_argument("--out", type=report_file, default="soak.json",
                   help="JSON report; PNG and server log beside it")
    p.add_argument("--startup-timeout-s", type=seconds, default=300.0, help="wait for the server to serve, s (300)")
    g = p.add_argument_group("a server already running (instead of starting one)")
    g.add_argument("--server", type=server_address, metavar="HOST:PORT", help="soak this server")
    g.add_argument("--server-pid", type=_whole(1), help="its process id, to sample its RSS (same machine)")
    add_tls_flags(g)
    p.add_argument("--auth-token-file", type=token_file,
                   help="the server's bearer token (a server the soak starts is given it too)")
    g = p.add_argument_group("the server the soak starts (policy-server flags)")
    g.add_argument("--latency-budget-ms", type=float, help="default per-tick budget, ms (server default)")
    g.add_argument("--max-sessions", type=_whole(1),
                   help="session limit (default: --sessions, one more with --hostile-neighbour)")
    g.add_argument("--max-batch", type=int, help="micro-batch size (server default)")
    g.add_argument("--diffusion-cache", action=argparse.BooleanOptionalAction, help="SeaCache (server default)")
    g.add_argument("--tls-cert", type=Path, metavar="FILE",
                   help="serve TLS with this PEM certificate (with --tls-key); the soak trusts --tls-ca, else it")
    g.add_argument("--tls-key", type=Path, metavar="FILE", help="the certificate's PEM private key")
    args = p.parse_args(argv)
    server_flags = (args.latency_budget_ms, args.max_sessions, args.max_batch, args.diffusion_cache, args.tls_cert,
                    args.tls_key)
    if args.server and any(v is not None for v in server_flags):
        p.error("--latency-budget-ms, --max-sessions, --max-batch, --diffusion-cache, --tls-cert and --tls-key apply "
                "only to a server the soak starts, not with --server")
    if args.server_pid is not None and not args.server:
        p.error("--server-pid needs --server")
    opened = args.sessions + args.hostile_neighbour
    if args.max_sessions is not None and args.max_sessions < opened:
        p.error(f"--max-sessions {args.max_sessions} is fewer than the {opened} sessions the soak opens")
    if (args.tls_cert is None) != (args.tls_key is None):
        p.error("--tls-cert and --tls-key go together")
    if args.tls_cert is not None and args.tls_ca is None:
        try:
            args.tls_ca = pem_file(str(args.tls_cert))
        except argparse.ArgumentTypeError as exc:
            p.error(f"argument --tls-cert: {exc}")
    if tls_options(args)["tls"] and not (args.server or args.tls_cert):
        p.error("--tls, --tls-ca and --tls-server-name need --server, or --tls-cert and --tls-key for the server the "
                "soak starts")
    return args


def _whole(minimum: int):
    """argparse type: a whole number of at least `minimum`."""
    def whole(text: str) -> int:
        if not text.strip().lstrip("-").isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number of at least {minimum}, got {text}")
        return int(text)
    return whole


def _number(text: str, low: float, high: float, expected: str) -> float:
    """`text` as a finite number from `low` to `high`, else an argparse error saying `expected`."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (low <= value <= high and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def _rate_hz(text: str) -> float:
    """argparse type: a rate a session may declare, as the server takes it."""
    expected = f"0 (a closed loop) or {MIN_RATE_HZ:g} to {MAX_RATE_HZ:g} Hz"
    value = _number(text, 0.0, MAX_RATE_HZ, expected)
    if 0 < value < MIN_RATE_HZ:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def _fraction(text: str) -> float:
    return _number(text, 0.0, 1.0, "a fraction from 0 to 1")


def _megabytes(text: str) -> float:
    return _number(text, 0.0, math.inf, "MB from 0")


def server_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--max-sessions", str(args.max_sessions or args.sessions + args.hostile_neighbour)]
    if args.latency_budget_ms is not None:
        flags += ["--latency-budget-ms", str(args.latency_budget_ms)]
    if args.max_batch is not None:
        flags += ["--max-batch", str(args.max_batch)]
    if args.diffusion_cache is not None:
        flags.append("--diffusion-cache" if args.diffusion_cache else "--no-diffusion-cache")
    if args.auth_token_file is not None:
        flags += ["--auth-token-file", str(args.auth_token_file)]
    if args.tls_cert is not None:
        flags += ["--tls-cert", str(args.tls_cert), "--tls-key", str(args.tls_key)]
    return flags


def open_drivers(args: argparse.Namespace, target: str) -> tuple[list[Unary | Stream], dict | None]:
    """Open every session (even index: unary, odd: stream), one connection each. On a refusal, close
    those already open and return what was refused instead."""
    drivers: list[Unary | Stream] = []
    for index in range(args.sessions):
        kind = Unary if index % 2 == 0 else Stream
        env = gymnasium.make("PolicyServer/Reach-v0")
        env.reset(seed=episode_seed(args, index, 0))
        instruction = env.unwrapped.task_description
        env.close()
        client = PolicyClient(target, timeout_s=args.timeout_s, token_file=args.auth_token_file,
                              **tls_options(args))
        try:
            session = client.open_session(EMBODIMENT, instruction, seed=index, client_name=f"soak-{index}",
                                          rate_hz=args.rate_hz, actions_per_chunk=args.actions_per_chunk)
            drivers.append(kind(client, session, args))
        except PolicyServerError as exc:
            client.close()
            close_drivers(drivers)
            return [], {"session": index, "kind": kind.kind, "code": exc.code.name, "reason": exc.reason,
                        "message": exc.message}
        except KeyboardInterrupt:  # Ctrl-C while opening: the sessions opened so far close too
            client.close()
            close_drivers(drivers)
            raise
    return drivers, None


def open_hostile_neighbour(args: argparse.Namespace, target: str, spec, max_side: int
                           ) -> tuple[HostileNeighbour | None, dict | None]:
    """The hostile neighbour's session (at the rate the others declare), or what refused it."""
    env = gymnasium.make("PolicyServer/Reach-v0")
    obs, _ = env.reset(seed=episode_seed(args, args.sessions, 0))
    instruction = env.unwrapped.task_description
    env.close()
    client = PolicyClient(target, timeout_s=args.timeout_s, token_file=args.auth_token_file, **tls_options(args))
    try:
        session = client.open_session(EMBODIMENT, instruction, seed=args.sessions, client_name="soak-hostile",
                                      rate_hz=args.rate_hz, actions_per_chunk=args.actions_per_chunk)
    except PolicyServerError as exc:
        client.close()
        return None, {"session": args.sessions, "kind": "hostile", "code": exc.code.name, "reason": exc.reason,
                      "message": exc.message}
    return HostileNeighbour(client, session, [camera.name for camera in spec.cameras], obs["state"], max_side), None


def close_drivers(drivers: list[Unary | Stream]) -> list[str]:
    """Close streams, sessions and connections; returns what failed (a server that died mid-soak)."""
    failures = []
    for driver in drivers:
        driver.close()
        try:
            driver.client.close_session(driver.session)
        except PolicyServerError as exc:
            failures.append(f"CloseSession {driver.session.session_id}: {exc}")
        driver.client.close()
    return failures


def soak(args: argparse.Namespace, target: str, pid: int | None) -> tuple[dict, list[SessionResult]]:
    with PolicyClient(target, timeout_s=args.timeout_s, token_file=args.auth_token_file,
                      **tls_options(args)) as client:
        client.wait_until_serving(timeout_s=args.startup_timeout_s)
        info = client.server_info()
    spec = next(e for e in info.embodiments if e.name == EMBODIMENT)
    execute = args.actions_per_chunk or spec.default_chunk_size
    # What the server assumes for an undeclared rate (the proto's rule), so the pacing matches it.
    rate_hz = args.rate_hz or spec.control_hz / execute
    config = {
        "sessions": args.sessions, "ticks": args.ticks, "rate_hz": rate_hz, "rate_declared": args.rate_hz is not None,
        "actions_per_chunk": execute, "chunk_size": spec.default_chunk_size, "control_hz": spec.control_hz,
        "episode_steps": args.episode_steps, "warmup_ticks": args.warmup_ticks, "timeout_s": args.timeout_s,
        "budget_ms": info.default_budget_ms, "max_sessions": info.limits.max_sessions,
        "server": target, "server_flags": None if args.server else server_flags(args),
        "model": {"name": info.model.name, "device": info.model.device, "num_steps": info.model.num_steps,
                  "diffusion_cache": info.model.diffusion_cache},
        "max_miss_rate": args.max_miss_rate, "max_rss_growth_mb": args.max_rss_growth_mb,
        "hostile_neighbour": args.hostile_neighbour, "load_nice": LOAD_NICE if sys.platform == "linux" else None,
    }
    t0 = time.monotonic()
    sampler = RssSampler(pid, args.rss_every_s, t0) if pid is not None else None
    drivers, refused = open_drivers(args, target)
    hostile = None
    if refused is None and args.hostile_neighbour:
        hostile, refused = open_hostile_neighbour(args, target, spec, info.limits.max_frame_side)
        if refused is not None:
            close_drivers(drivers)
    if refused is not None:
        if sampler is not None:
            sampler.finish()
        return {"config": config, "refused_open": refused, "passed": False}, []
    if hostile is not None:
        hostile.start()
    stop = threading.Event()
    interrupted = False
    with ThreadPoolExecutor(max_workers=len(drivers), thread_name_prefix="soak-session") as pool:
        futures = [pool.submit(run_session, d, SessionResult(i, d.kind, d.session.session_id), args,
                               1.0 / rate_hz, t0, stop) for i, d in enumerate(drivers)]
        try:
            results = [f.result() for f in futures]
        except KeyboardInterrupt:  # the sessions end after their tick in flight, and close below
            stop.set()
            results, interrupted = [f.result() for f in futures], True
    if hostile is not None:
        hostile.stop()
    wall_s = time.monotonic() - t0
    rss = None
    if sampler is not None:
        sampler.finish()
        # Warmup ends when the slowest session has done its warmup ticks.
        warm_s = max((r.ticks[min(args.warmup_ticks, len(r.ticks)) - 1].t_s if r.ticks else 0.0) for r in results)
    close_failures = close_drivers(drivers)
    if hostile is not None:
        with hostile.client as client:
            try:
                client.close_session(hostile.session)
            except PolicyServerError as exc:
                close_failures.append(f"CloseSession {hostile.session.session_id}: {exc}")
    if interrupted:  # its checks are of the whole soak: a cut one gets no report
        raise KeyboardInterrupt
    if sampler is not None:
        rss = {"pid": pid, "every_s": args.rss_every_s, **rss_summary(sampler.series, warm_s, read_rss_mb(pid))}
    report = build_report(args, config, results, wall_s, rss, hostile)
    report["close_failures"] = close_failures
    return report, results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    server = None
    if args.server is None:
        server = ServerProcess(server_flags(args), args.out.with_suffix(".server.log"),
                               {**tls_options(args), "token_file": args.auth_token_file})
    if sys.platform == "linux":  # a thread's own there, and inherited by the threads it starts: gRPC's, the soak's
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOAD_NICE)
    try:
        if server is not None:
            try:
                server.wait_serving(args.startup_timeout_s)
            except ServerFailed as exc:
                print(f"policy-soak: the server did not start: {exc}", file=sys.stderr)
                return 4
        report, results = soak(args, args.server or server.target, server.pid if server else args.server_pid)
    except TimeoutError as exc:  # only a --server can still be not SERVING here
        print(f"policy-soak: {exc}", file=sys.stderr)
        return 4
    except KeyboardInterrupt:  # its checks are of the whole soak: a cut one passes or fails none of them
        print(f"policy-soak: interrupted (Ctrl-C), no report written to {args.out}", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            died = server.process.poll()  # None while it runs: the soak should not have killed it
            status = server.stop()
    if server is not None:
        report["server_process"] = {"pid": server.pid, "log": str(server.log_path),
                                    "exited_during_soak": died, "exit_status": status}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    refused = report.get("refused_open")
    if refused is not None:
        print(f"policy-soak: the server refused session {refused['session']} ({refused['kind']}): "
              f"{refused['code']} {refused['reason']}: {refused['message']}", file=sys.stderr)
        advice = _REFUSAL_ADVICE.get(refused["reason"])
        print(f"  {advice} (report {args.out})" if advice else f"  report {args.out}", file=sys.stderr)
        return 3
    plot(report, results, args.out.with_suffix(".png"))
    print_summary(report, args.out)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
