"""Test double for the ``Engine`` protocol, plus helpers to run a server on it.

``FakeEngine`` is deterministic numpy, not a model: the chunk is a closed-form function of the
observation (``expected_actions``), so transport tests can check that images, state and step
indices arrive intact. It implements the engine-side rules the transport relies on (epochs,
session limit, budget feasibility, warmup, abort polling) and lets a test hold ``act`` at a gate
to make stream timing deterministic. The real engine lives in ``policy_server/engine/``.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import itertools
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import numpy as np

from policy_server.config import ServerConfig, build_config
from policy_server.engine.api import (
    CLOSED_BY_CLIENT,
    ActionSpec,
    ActResult,
    BranchRecord,
    BudgetInfeasible,
    CameraSpec,
    Cancelled,
    DeadlineExpired,
    EmbodimentSpec,
    EngineStats,
    Observation,
    ProfilePoint,
    ReasonEnd,
    ServerInfo,
    SessionHandle,
    ShuttingDown,
    StaleEpoch,
    TickRecord,
    TooManySessions,
    UnknownSession,
    WarmingUp,
)
from policy_server.server.app import PolicyServer, build_server

# Session ids unique across engines and processes, as a real server's uuid4 ids are: a restarted server never gives a
# lost session's id to another (`fake_server_process.py` restarted gave "s1" again, so a rollout's close of a session it
# had lost closed another episode's new one).
_SESSION_NUMBERS = itertools.count(1)
_PROCESS = uuid.uuid4().hex[:6]

PUSHT = EmbodimentSpec(
    name="pusht",
    cameras=(CameraSpec("image", height=48, width=64),),
    state_dim=2,
    state_names=("agent_x", "agent_y"),
    state_units=("px", "px"),
    action=ActionSpec(dim=2, names=("target_x", "target_y"), units=("px", "px"), low=(-1.0, -1.0), high=(1.0, 1.0),
                      given_low=(-1.0, -1.0), given_high=(1.0, 1.0)),
    default_chunk_size=8,
    min_chunk_size=1,
    max_chunk_size=16,
    control_hz=10.0,
)
LIBERO = EmbodimentSpec(
    name="libero",
    cameras=(CameraSpec("image", height=32, width=32), CameraSpec("wrist", height=32, width=32)),
    state_dim=8,
    action=ActionSpec(dim=7, units=("m", "m", "m", "rad", "rad", "rad", "1")),
    default_chunk_size=16,
    min_chunk_size=1,
    max_chunk_size=16,
    control_hz=20.0,
)
BEST_ACHIEVABLE_MS = 5.0
ACTUAL_TOTAL_MS = 3.0


def expected_actions(observation: Observation, chunk_size: int, spec: EmbodimentSpec) -> np.ndarray:
    """float32 [chunk_size, action_dim]: what FakeEngine answers for ``observation``."""
    base = sum(float(observation.images[c.name].mean()) / 255.0 for c in spec.cameras)
    if observation.state is not None:
        base += float(np.sum(observation.state))
    k = np.arange(chunk_size, dtype=np.float64)[:, None]
    d = np.arange(spec.action.dim, dtype=np.float64)[None, :]
    actions = np.tanh(0.1 * base + 0.01 * (observation.step_index + k) + 0.1 * d).astype(np.float32)
    if observation.committed_actions is not None:  # as the real engine: the chunk starts with them
        actions[: len(observation.committed_actions)] = observation.committed_actions
    return actions


class FakeEngine:
    def __init__(
        self,
        *,
        max_sessions: int = 4,
        default_budget_ms: float = 120.0,
        ready: bool = True,
        max_reason_tokens: int = 32,
        embodiments: tuple[EmbodimentSpec, ...] = (PUSHT, LIBERO),
    ) -> None:
        self._info = ServerInfo(
            model_name="fake-policy",
            embodiments=embodiments,
            default_budget_ms=default_budget_ms,
            max_sessions=max_sessions,
            model_digest="sha256:fake",
            device="cpu",
            max_reason_tokens=max_reason_tokens,
            warmup_profile=(
                ProfilePoint("uncached", 4.0, 4.5, 20, 0),
                ProfilePoint("seacache", 2.5, 3.0, 12, 8),
            ),
            num_steps=10,
            diffusion_cache=True,
        )
        self._warm = threading.Event()  # set when ready
        if ready:
            self._warm.set()
        self._lock = threading.Lock()
        self._sessions: dict[str, SessionHandle] = {}
        self._ended: dict[str, UnknownSession] = {}  # what a call naming a closed or expired session gets
        self._on_close: dict[str, Callable[[UnknownSession], None]] = {}  # of the sessions a stream is attached to
        self._gate: threading.Event | None = None
        self._entered = threading.Semaphore(0)
        self.acts: list[tuple[str, int, int]] = []  # (session_id, epoch, step_index) of completed acts
        self.instructions: dict[str, str] = {}
        self.deadlines: list[float | None] = []
        self.aborted = 0
        self.request_ids: list[str] = []  # the request_id of every open_session call, in order
        self._opens_to_refuse = 0

    # -- test controls -------------------------------------------------------------------------

    def set_ready(self, ready: bool) -> None:
        if ready:
            self._warm.set()
        else:
            self._warm.clear()

    def start(self) -> None:
        pass  # ready as constructed, or when set_ready() says

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        return self._warm.wait(timeout_s)  # a fake never warms up by itself: set_ready(True) does

    def hold(self) -> None:
        """Make every act() wait at a gate until release(); wait_entered() counts from now."""
        self._entered = threading.Semaphore(0)
        self._gate = threading.Event()

    def release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.set()

    def refuse_opens(self, count: int) -> None:
        """The next ``count`` open_session calls answer UNAVAILABLE (SHUTTING_DOWN) unserved: to the client, what an
        answer lost with its connection looks like (the real engine's request_id matching is tested on it)."""
        self._opens_to_refuse = count

    def expire(self, session_id: str) -> None:
        """Close the session as the real engine closes one left without a call for its idle time."""
        self._end(session_id, UnknownSession(session_id, "expired", "expired 0 s ago: no call for 300 s (a session "
                                             "with no call for 300 s closes)"))

    def wait_entered(self, timeout_s: float = 5.0) -> None:
        """Block until one more act() call has started (and passed validation)."""
        if not self._entered.acquire(timeout=timeout_s):
            raise TimeoutError("act() was not entered")

    # -- Engine protocol -----------------------------------------------------------------------

    def info(self) -> ServerInfo:
        return self._info

    def ready(self) -> bool:
        return self._warm.is_set()

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(sessions=len(self._sessions), queue_depth=0,
                               warmup_progress=1.0 if self._warm.is_set() else 0.5)

    def close(self) -> bool:
        with self._lock:
            self._sessions.clear()
        return True

    def _check_budget(self, budget_ms: float) -> None:
        if budget_ms < BEST_ACHIEVABLE_MS:
            raise BudgetInfeasible(budget_ms, BEST_ACHIEVABLE_MS)

    def capacity(self, budget_ms=None, rate_hz=None) -> tuple:
        return ()

    def open_session(self, embodiment, instruction, budget_ms=None, chunk_size=None, seed=None, rate_hz=None,
                     actions_per_chunk=None, preview=False, client_name="", request_id="") -> SessionHandle:
        if not self._warm.is_set():
            raise WarmingUp(0.5)
        self.request_ids.append(request_id)
        if self._opens_to_refuse:
            self._opens_to_refuse -= 1
            raise ShuttingDown()
        spec = self._info.embodiment(embodiment)
        budget = self._info.default_budget_ms if budget_ms is None else budget_ms
        self._check_budget(budget)
        with self._lock:
            if len(self._sessions) >= self._info.max_sessions:
                raise TooManySessions(self._info.max_sessions, "the fake engine closes no session unused")
            handle = SessionHandle(
                f"s{next(_SESSION_NUMBERS)}-{_PROCESS}",
                1,
                embodiment,
                instruction,
                budget,
                chunk_size or spec.default_chunk_size,
                seed or 0,
                preview=preview,
                client_name=client_name,
            )
            self._sessions[handle.session_id] = handle
            self.instructions[handle.session_id] = instruction
        return handle

    def _unknown(self, session_id: str) -> UnknownSession:
        """Under the lock: what a call naming a session not open gets (how it ended, as the real engine says)."""
        return self._ended.get(session_id) or UnknownSession(session_id)

    def session(self, session_id: str) -> SessionHandle:
        with self._lock:
            if session_id not in self._sessions:
                raise self._unknown(session_id)
            return self._sessions[session_id]

    def _replace(self, session_id: str, **changes) -> SessionHandle:
        with self._lock:
            if session_id not in self._sessions:
                raise self._unknown(session_id)
            old = self._sessions[session_id]
            new = SessionHandle(**{**old.__dict__, **changes})
            self._sessions[session_id] = new
            return new

    def reset_session(self, session_id: str) -> SessionHandle:
        return self._replace(session_id, epoch=self.session(session_id).epoch + 1)

    def close_session(self, session_id: str, why: str = CLOSED_BY_CLIENT) -> None:
        self._end(session_id, UnknownSession(session_id, "closed", f"was closed 0 s ago: {why}"))

    def _end(self, session_id: str, ended: UnknownSession) -> None:
        with self._lock:
            if self._sessions.pop(session_id, None) is None:
                raise self._unknown(session_id)
            self._ended[session_id] = ended
            on_close = self._on_close.pop(session_id, None)
        if on_close is not None:
            on_close(ended)

    def set_budget(self, session_id: str, budget_ms: float) -> SessionHandle:
        self.session(session_id)
        self._check_budget(budget_ms)
        return self._replace(session_id, budget_ms=budget_ms)

    def reserve_tick(self, session_id: str) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext(self.session(session_id))

    @contextlib.contextmanager
    def attach(self, session_id: str, on_close: Callable[[UnknownSession], None] | None = None
               ) -> Iterator[SessionHandle]:
        with self._lock:
            if session_id not in self._sessions:
                raise self._unknown(session_id)
            handle = self._sessions[session_id]
            if on_close is not None:
                self._on_close[session_id] = on_close
        try:
            yield handle
        finally:
            with self._lock:
                if on_close is not None and self._on_close.get(session_id) == on_close:
                    del self._on_close[session_id]

    def act(
        self,
        session_id: str,
        epoch: int,
        observation: Observation,
        deadline_s: float | None = None,
        should_abort: Callable[[], bool] | None = None,
        reservation: object | None = None,
    ) -> ActResult:
        if not self._warm.is_set():
            raise WarmingUp(0.5)
        handle = self.session(session_id)
        if epoch != handle.epoch:
            raise StaleEpoch(session_id, handle.epoch, epoch)
        self._entered.release()
        self.deadlines.append(deadline_s)
        gate = self._gate
        while gate is not None and not gate.wait(0.01):
            if should_abort is not None and should_abort():
                self.aborted += 1
                raise Cancelled("the caller cancelled")
            if deadline_s is not None and time.monotonic() > deadline_s:
                self.aborted += 1
                raise DeadlineExpired("the caller's deadline passed")
        handle = self.session(session_id)  # a reset may have happened while we waited
        if epoch != handle.epoch:
            raise StaleEpoch(session_id, handle.epoch, epoch)
        if observation.instruction:
            self.instructions[session_id] = observation.instruction
        spec = self._info.embodiment(handle.embodiment)
        actions = expected_actions(observation, handle.chunk_size, spec)
        deadline_ms = handle.budget_ms
        if deadline_s is not None:
            deadline_ms = min(deadline_ms, (deadline_s - time.monotonic()) * 1e3)
        tick = TickRecord(
            budget_ms=handle.budget_ms,
            deadline_ms=deadline_ms,
            predicted_ms={"denoise": 2.0, "total": 2.5},
            actual_ms={"denoise": 2.5, "total": ACTUAL_TOTAL_MS},
            knobs={"threshold": 0.25, "cap": 2, "num_steps": 10, "batch_size": 1},
            branches={"cond": BranchRecord(full=7, skipped=3, forced_skip=1, fail_open=2, sequence="FFSFFSFFSF"),
                      "uncond": BranchRecord(full=5, skipped=5, forced_skip=0, fail_open=0, sequence="FSFSFSFSFF")},
            setting="t0.25-c2",
            fallbacks=("drop_cfg_late",) if handle.budget_ms < 10 else (),
        )
        self.acts.append((session_id, epoch, observation.step_index))
        return ActResult(actions=actions, first_step_index=observation.step_index, tick=tick)

    def reason(
        self,
        prompt: str,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        should_abort: Callable[[], bool] | None = None,
        deadline_s: float | None = None,
    ) -> Generator[str, None, ReasonEnd]:
        words = f"To {prompt.strip()}: first approach the object, then grasp it, then place it.".split(" ")
        for index, word in enumerate(words[:max_new_tokens]):
            if should_abort is not None and should_abort():
                return ReasonEnd("length", index)
            yield word if index == 0 else " " + word
        return ReasonEnd("length" if max_new_tokens < len(words) else "stop", min(max_new_tokens, len(words)))


def free_port() -> int:
    """A loopback TCP port nothing listens on now (for a server a test starts, stops and starts again on it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serve_fake(engine: FakeEngine | None = None, **config) -> Iterator[PolicyServer]:
    """Run a real gRPC server (free loopback port) around ``engine``; stops on exit."""
    engine = engine or FakeEngine()
    cfg: ServerConfig = build_config(overrides={"port": 0, **config})
    server = build_server(cfg, engine).start()
    try:
        yield server
    finally:
        server.stop(grace_s=0.2)


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A throw-away certificate for localhost / 127.0.0.1; returns (cert.pem, key.pem) paths.
    Uses the ``cryptography`` package when installed, else the openssl command."""
    try:
        from cryptography import x509
    except ImportError:
        return _self_signed_cert_openssl(directory)
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "server.crt", directory / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)  # as a private key should be: the server warns of one that others may read
    return cert_path, key_path


def _self_signed_cert_openssl(directory: Path) -> tuple[Path, Path]:
    cert_path, key_path = directory / "server.crt", directory / "server.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key_path),
            "-out",
            str(cert_path),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
        ],
        check=True,
        capture_output=True,
    )
    key_path.chmod(0o600)
    return cert_path, key_path
