"""Property-based fuzzing (hypothesis) of every request of ``policy_server.v1.PolicyService`` and of the
openpi WebSocket frames, against a real in-process server: the real ``ModelEngine`` over the embedded
pipeline on CPU (its sampler shortened to 3 steps so that ticks are cheap).

Property, for every generated request: the answer is a good answer or an error whose status is neither
INTERNAL nor UNKNOWN (WebSocket: a reply frame, or a text error frame whose reason is not INTERNAL, and
the connection is never closed with 1011); the server gives no answer late (a call the client gives up
on after 20 s is a hang); and the next known-good request succeeds.

Strategies mix arbitrary but type-correct values (built from the message descriptors, so fields added
to the proto later are fuzzed too) with valid ones (the session's real id and epoch, a correctly sized
64x64 frame, a good state) so that the deep paths behind the first validation check are reached.

Each test runs its examples without stopping at the first bad answer: it counts every INTERNAL/UNKNOWN
answer and hang, then fails listing each distinct one (RPC, status, reason, the server's logged
exception, and the smallest request that produced it). Runs are derandomized (reproducible in CI).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import math
import os
import re
import string
import struct
import threading
import time
import traceback
import urllib.parse
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cv2
import grpc
import msgpack
import numpy as np
import pytest
import torch
import websockets.sync.client
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from openpi_client import msgpack_numpy
from websockets.exceptions import ConnectionClosed, InvalidStatus

from policy_server.config import build_config
from policy_server.engine.engine import EngineSettings, ModelEngine
from policy_server.pipeline.policy import PolicyPipeline
from policy_server.server.app import build_server
from policy_server.v1 import policy_server_pb2 as pb
from policy_server.v1 import policy_server_pb2_grpc as pb_grpc
from policy_server.v1.errors import error_detail
from policy_server.v1.wire import encode_image, tensor_to_proto

# The embedded model serves one embodiment; the fixture checks these against the engine's own description.
EMBODIMENT, CAMERA, HEIGHT, WIDTH, STATE_DIM, ACTION_DIM, CHUNK = "pusht", "image", 64, 64, 2, 2, 8
INSTRUCTION = "push the T into the goal"
GOOD_STATE = np.array([0.25, 0.25], np.float32)  # inside the declared state range
FRAME = np.random.default_rng(7).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
MAX_MESSAGE_MB = 1.0
LIMIT = int(MAX_MESSAGE_MB * 1024 * 1024)
TIMEOUT_S = 20.0  # generous: a real tick takes ~20 ms here; a call still unanswered after this is a hang
SERVICE = "/policy_server.v1.PolicyService/"
BAD_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# FUZZ_SCALE=10 runs ten times the examples (a longer, deeper run than CI's).
SCALE = max(1, int(os.environ.get("FUZZ_SCALE", "1")))


def fuzz_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples * SCALE,
        derandomize=True,
        database=None,
        deadline=None,
        phases=(Phase.explicit, Phase.generate),  # no shrinking: the test collects, it does not raise
        suppress_health_check=(
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
            HealthCheck.filter_too_much,
        ),
    )


# ---------------------------------------------------------------------------------------------
# The server, its log, and the failure collector
# ---------------------------------------------------------------------------------------------


class ServerLog(logging.Handler):
    """Every ERROR record the server writes (``log.exception`` of an internal error, grpc's own
    deserialization failures, websockets' handler crashes), as one line each with the exception and
    the line that raised it."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.name}: {record.getMessage()}"
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            where = ""
            if exc.__traceback__ is not None:
                frame = traceback.extract_tb(exc.__traceback__)[-1]
                where = f" at {Path(frame.filename).name}:{frame.lineno}"
            text += f" [{type(exc).__name__}: {str(exc)[:200]}{where}]"
        self.lines.append(text)

    def mark(self) -> int:
        return len(self.lines)

    def since(self, mark: int) -> list[str]:
        return self.lines[mark:]


@dataclasses.dataclass
class Served:
    server: Any
    engine: ModelEngine
    channel: grpc.Channel
    stub: pb_grpc.PolicyServiceStub
    log: ServerLog
    websocket_url: str


@contextlib.contextmanager
def real_server() -> Iterator[Served]:
    """The real engine over the embedded pipeline behind the real gRPC + WebSocket server, on loopback."""
    torch.set_num_threads(1)
    pipeline = PolicyPipeline.from_pretrained(None)
    pipeline.config = pipeline.config.model_copy(update={"num_steps": 3})  # cheap real ticks
    engine = ModelEngine(pipeline, EngineSettings(warmup_ticks=1, max_sessions=16, default_budget_ms=60_000.0,
                                                   max_dynamics_calls=2))
    engine.start()
    assert engine.wait_ready(timeout_s=300)
    spec = engine.info().embodiment(EMBODIMENT)
    assert spec is not None and [c.name for c in spec.cameras] == [CAMERA]
    assert (spec.cameras[0].height, spec.cameras[0].width, spec.state_dim) == (HEIGHT, WIDTH, STATE_DIM)
    assert (spec.action.dim, spec.default_chunk_size) == (ACTION_DIM, CHUNK)
    low, high = getattr(spec, "state_low", ()) or (-np.inf,) * STATE_DIM, getattr(spec, "state_high", ()) or (
        np.inf,) * STATE_DIM
    assert np.all(np.asarray(low) <= GOOD_STATE) and np.all(GOOD_STATE <= np.asarray(high)), (low, high)
    config = build_config(
        overrides={
            "host": "127.0.0.1",
            "port": 0,
            "websocket_port": 0,
            "device": "cpu",
            "latency_budget_ms": 60_000.0,
            "max_sessions": 16,
            "max_message_mb": MAX_MESSAGE_MB,
        }
    )
    log = ServerLog()
    logging.getLogger().addHandler(log)
    server = build_server(config, engine).start()
    channel = grpc.insecure_channel(server.target)
    try:
        yield Served(
            server, engine, channel, pb_grpc.PolicyServiceStub(channel), log, f"ws://127.0.0.1:{server.websocket_port}"
        )
    finally:
        channel.close()
        stopping = threading.Thread(target=server.stop, kwargs={"grace_s": 0.5}, daemon=True)
        stopping.start()
        stopping.join(timeout=15)
        logging.getLogger().removeHandler(log)
        if stopping.is_alive():  # a finding too: leave the server behind rather than hang the run
            pytest.fail("PolicyServer.stop() did not return within 15 s after the requests of this test",
                        pytrace=False)
        engine.close()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with real_server() as running:
        yield running


class Failures:
    """Bad answers of one test, grouped by (RPC, status, reason, server exception); keeps the
    smallest request of each group."""

    def __init__(self, served: Served, test: str) -> None:
        self.served, self.test = served, test
        self.groups: dict[tuple, dict] = {}
        self.total = 0
        self.examples = 0
        self.fatal: str | None = None

    def record(self, rpc: str, status: str, reason: str, message: str, example: str, server_log: list[str]) -> None:
        self.total += 1
        logged = "; ".join(server_log[-3:])
        key = (rpc, status, reason, re.sub(r"\d+", "#", logged or message))
        group = self.groups.setdefault(key, {"count": 0, "example": example})
        group["count"] += 1
        if len(example) < len(group["example"]):
            group["example"] = example
        group.setdefault("message", message)
        group.setdefault("log", logged)

    def begin(self) -> bool:
        """Count one more example; False once a fatal failure has stopped the test."""
        if self.fatal:
            return False
        self.examples += 1
        return True

    def wrong(self, rpc: str, what: str, example: str) -> None:
        """A call that succeeded with an answer that is not a good one."""
        self.record(rpc, "OK but a bad answer", "", what, example, [])

    def check_status(self, rpc: str, error: grpc.RpcError, example: str, mark: int) -> None:
        code = error.code()
        if code in BAD_CODES or code == grpc.StatusCode.DEADLINE_EXCEEDED:
            hang = code == grpc.StatusCode.DEADLINE_EXCEEDED
            status = "HANG (no answer within the client's deadline)" if hang else code.name
            self.record(rpc, status, reason_of(error), error.details() or "", example, self.served.log.since(mark))

    def check_detail(self, rpc: str, detail: pb.ErrorDetail, example: str, mark: int) -> None:
        """A Control stream's error event: its ErrorDetail.code is the status name."""
        if detail.code in ("INTERNAL", "UNKNOWN") or detail.reason in ("INTERNAL", "ENGINE_ERROR"):
            self.record(rpc, detail.code, detail.reason, detail.message, example, self.served.log.since(mark))

    def report(self) -> None:
        lines = []
        for (rpc, status, reason, _), group in sorted(self.groups.items(), key=lambda kv: -kv[1]["count"]):
            lines.append(
                f"- {rpc} -> {status} / {reason or '(no reason)'}: {group['message']!r}  [{group['count']}x]\n"
                f"    server log: {group['log'] or '(nothing logged)'}\n"
                f"    smallest request: {group['example']}"
            )
        text = "\n".join(lines)
        if self.fatal is not None:
            pytest.fail(f"{self.test}: the server stopped serving good requests: {self.fatal}\n{text}", pytrace=False)
        assert self.examples > 0, "hypothesis ran no example"
        if self.total:
            pytest.fail(
                f"{self.test}: {self.total} bad answer{'s' if self.total != 1 else ''} (INTERNAL/UNKNOWN, hangs, "
                f"wrong answers) in "
                f"{self.examples} examples, {len(self.groups)} distinct (the count must be zero):\n{text}",
                pytrace=False,
            )


def reason_of(error: grpc.RpcError) -> str:
    detail = error_detail(error)
    return "" if detail is None else detail.reason


def describe(value: Any, limit: int = 900) -> str:
    """Short, readable text of a protobuf message or a WebSocket frame (long bytes abbreviated)."""
    text = _describe(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _bytes(data: bytes) -> str:
    return repr(data) if len(data) <= 24 else f"<{len(data)} bytes {data[:12]!r}...>"


def _describe(value: Any) -> str:
    if isinstance(value, Message):
        parts = []
        for field, item in value.ListFields():
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                inner = ", ".join(f"{k!r}: {_describe(v)}" for k, v in item.items())
                parts.append(f"{field.name}={{{inner}}}")
            elif field.is_repeated:
                parts.append(f"{field.name}=[{', '.join(_describe(v) for v in item)}]")
            elif field.type == FieldDescriptor.TYPE_ENUM and field.enum_type.values_by_number.get(item):
                parts.append(f"{field.name}={field.enum_type.values_by_number[item].name}")
            else:
                parts.append(f"{field.name}={_describe(item)}")
        return f"{type(value).__name__}({', '.join(parts)})"
    if isinstance(value, bytes | bytearray):
        return _bytes(bytes(value))
    if isinstance(value, str):
        return repr(value) if len(value) <= 60 else f"<{len(value)} chars {value[:20]!r}...>"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_describe(k)}: {_describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        inner = ", ".join(_describe(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, np.ndarray):
        values = f", {value.tolist()!r}" if value.size <= 4 else ""
        return f"ndarray({value.dtype.str}, {list(value.shape)}{values})"
    return repr(value)


# ---------------------------------------------------------------------------------------------
# Known-good requests
# ---------------------------------------------------------------------------------------------

GOOD_JPEG = encode_image(FRAME, "jpeg")
GOOD_PNG = encode_image(FRAME, "png")
GOOD_RAW = encode_image(FRAME, "raw")


def good_observation(step: int = 3) -> pb.Observation:
    observation = pb.Observation(state=tensor_to_proto(GOOD_STATE), step_index=step)
    observation.images[CAMERA].CopyFrom(GOOD_JPEG)
    return observation


def open_good(served: Served, **fields) -> pb.Session:
    request = pb.OpenSessionRequest(embodiment=EMBODIMENT, instruction=INSTRUCTION, **fields)
    return served.stub.OpenSession(request, timeout=TIMEOUT_S)


def close_quietly(served: Served, session_id: str) -> None:
    try:
        served.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=TIMEOUT_S)
    except grpc.RpcError:
        pass


def acts_then_closes(served: Served, failures: Failures, session: pb.Session | Live, example: str, after: str) -> None:
    """The session still acts on a good observation (recorded against ``example``), then is closed."""
    act = pb.ActRequest(session_id=session.session_id, epoch=session.epoch, observation=good_observation())
    unary(served, failures, "Act", act, example, f"Act (good, on {after})")
    close_quietly(served, session.session_id)


def good_act(served: Served, session_id: str, epoch: int) -> pb.ActionChunk:
    request = pb.ActRequest(session_id=session_id, epoch=epoch, observation=good_observation(7))
    chunk = served.stub.Act(request, timeout=TIMEOUT_S)
    assert chunk.first_step_index == 7 and len(chunk.actions.shape) == 2 and chunk.actions.shape[1] == ACTION_DIM
    return chunk


def still_serving(served: Served, failures: Failures, after: str) -> bool:
    """GetServerInfo, then a good OpenSession / Act / CloseSession. False (and the test stops) if any fails."""
    try:
        info = served.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT_S)
        assert info.ready and info.protocol_version == "policy_server.v1"
        session = open_good(served)
        good_act(served, session.session_id, session.epoch)
        served.stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id), timeout=TIMEOUT_S)
    except (grpc.RpcError, AssertionError) as exc:
        got = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else f"{exc!r}"
        failures.fatal = f"the good request after {after} failed with {got}"
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Strategies: scalars
# ---------------------------------------------------------------------------------------------


def weighted(*pairs: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """one_of with integer weights. (Repeating a branch inside st.one_of does not weight it: hypothesis
    seeks novel inputs and flattens the branches; an index drawn by sampled_from keeps the weights.)"""
    choices = [strategy for weight, strategy in pairs for _ in range(weight)]
    return st.sampled_from(range(len(choices))).flatmap(lambda index: choices[index])


OMIT = object()  # a fuzzed optional field left unset


@st.composite
def mutated(draw, base: dict, fuzz: dict[str, st.SearchStrategy], max_fields: int = 3) -> dict:
    """`base` (a valid request's fields) with up to `max_fields` of them replaced by fuzzed values (OMIT:
    unset). Most examples thus fail, if at all, on one or two fields, deep behind the other checks."""
    values = dict(base)
    count = min(draw(st.sampled_from([0, 1, 1, 1, 1, 2, 2, 3])), max_fields, len(fuzz))
    for name in draw(st.permutations(sorted(fuzz)))[:count]:
        value = draw(fuzz[name])
        if value is OMIT:
            values.pop(name, None)
        else:
            values[name] = value
    return values


def optional(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return weighted((3, strategy), (1, st.just(OMIT)))


F32_EDGES = [0.0, -0.0, 1.0, -1.0, 0.25, 3e38, -3e38, 3.4028234663852886e38, 1e-45, -1e-45, 1.1754943508222875e-38,
             65504.0, math.nan, math.inf, -math.inf]
F64_EDGES = [*F32_EDGES, 1e300, -1e300, 3.5e38, -3.5e38, 5e-324, -5e-324, 1e-300, 2.2250738585072014e-308,
             1.7976931348623157e308, -1.7976931348623157e308, 1e-320]

doubles = weighted(
    (2, st.sampled_from(F64_EDGES)),
    (1, st.floats(allow_nan=True, allow_infinity=True)),
    (1, st.floats(0.001, 1e6)),
    (1, st.sampled_from([1.0, 5.0, 50.0, 120.0, 1000.0, 60_000.0, 1e9, -1.0, -120.0])),
)
uint32s = weighted(
    (3, st.integers(0, 20)),
    (1, st.sampled_from([255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1])),
    (1, st.integers(0, 2**32 - 1)),
)
uint64s = weighted(
    (3, st.integers(0, 1000)),
    (1, st.sampled_from([2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 16, 2**64 - 1])),
    (1, st.integers(0, 2**64 - 1)),
)
int32s = st.one_of(st.integers(-5, 20), st.sampled_from([-(2**31), 2**31 - 1]), st.integers(-(2**31), 2**31 - 1))
int64s = st.one_of(st.integers(-5, 1000), st.sampled_from([-(2**63), 2**63 - 1]), st.integers(-(2**63), 2**63 - 1))

TEXT_EDGES = ["", " ", "\t\n ", "\x00", "push the T", "PUSHT", "pusht ", "\u202eTlupe", "\ufeff", "🤖" * 8,
              "é" * 50, "a" * 127, "a" * 128, "a" * 129, "a" * 2000, "word " * 300, "<|im_end|>",
              "<|endoftext|>" * 3, "\r\n" * 20, "\\x00%s%n", "a" * (16 * 1024 + 1)]
texts = weighted(
    (3, st.text(max_size=40)),
    (2, st.sampled_from(TEXT_EDGES)),
    (1, st.text(alphabet=string.printable, min_size=100, max_size=1200)),
)
instructions = weighted((3, st.just(INSTRUCTION)), (1, st.just("")), (3, texts))


def enums(enum_type) -> st.SearchStrategy[int]:
    known = sorted(enum_type.values_by_number)
    return weighted((3, st.sampled_from(known)), (1, st.sampled_from([-1, max(known) + 1, 99, 2**31 - 1, -(2**31)])),
                    (1, int32s))


# ---------------------------------------------------------------------------------------------
# Strategies: any message of a type, from its descriptor
# ---------------------------------------------------------------------------------------------

_SCALARS: dict[int, st.SearchStrategy] = {
    FieldDescriptor.TYPE_DOUBLE: doubles,
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32, allow_nan=True, allow_infinity=True),
    FieldDescriptor.TYPE_INT32: int32s,
    FieldDescriptor.TYPE_SINT32: int32s,
    FieldDescriptor.TYPE_SFIXED32: int32s,
    FieldDescriptor.TYPE_INT64: int64s,
    FieldDescriptor.TYPE_SINT64: int64s,
    FieldDescriptor.TYPE_SFIXED64: int64s,
    FieldDescriptor.TYPE_UINT32: uint32s,
    FieldDescriptor.TYPE_FIXED32: uint32s,
    FieldDescriptor.TYPE_UINT64: uint64s,
    FieldDescriptor.TYPE_FIXED64: uint64s,
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: texts,
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=64),
}


def _field_values(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key = _field_values(field.message_type.fields_by_name["key"], depth)
        value = _field_values(field.message_type.fields_by_name["value"], depth + 1)
        return st.dictionaries(key, value, max_size=3)
    if field.message_type is not None:
        single = _message_values(field.message_type, depth + 1)
    elif field.type == FieldDescriptor.TYPE_ENUM:
        single = enums(field.enum_type)
    else:
        single = _SCALARS[field.type]
    return st.lists(single, max_size=4) if field.is_repeated else single


def _message_values(descriptor, depth: int) -> st.SearchStrategy[dict]:
    if depth > 4:
        return st.just({})
    return st.fixed_dictionaries({}, optional={f.name: _field_values(f, depth) for f in descriptor.fields})


def _fill(message: Message, values: dict) -> None:
    for name, value in values.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        target = getattr(message, name) if field.message_type is not None or field.is_repeated else None
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            nested = field.message_type.fields_by_name["value"].message_type is not None
            for key, item in value.items():
                if nested:
                    target[key].SetInParent()
                    _fill(target[key], item)
                else:
                    target[key] = item
        elif field.is_repeated:
            for item in value:
                if field.message_type is not None:
                    _fill(target.add(), item)
                else:
                    target.append(item)
        elif field.message_type is not None:
            target.SetInParent()
            _fill(target, value)
        else:
            setattr(message, name, value)


def any_message(cls: type[Message]) -> st.SearchStrategy[Message]:
    """An arbitrary, type-correct message of `cls`: every field (nested, repeated, map, oneof, optional)
    may be set to any value of its type, enums to unknown numbers too."""

    def build(values: dict) -> Message:
        message = cls()
        _fill(message, values)
        return message

    return _message_values(cls.DESCRIPTOR, 0).map(build)


# ---------------------------------------------------------------------------------------------
# Strategies: images, tensors, observations
# ---------------------------------------------------------------------------------------------


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def _png_header(width: int, height: int, rest: bytes = b"") -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + rest


def _jpeg_header(height: int, width: int, rest: bytes = b"") -> bytes:
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, height, width, 3) + b"\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    return b"\xff\xd8" + sof + rest


def _cv_encode(array: np.ndarray, ext: str) -> bytes:
    ok, buffer = cv2.imencode(ext, array)
    assert ok
    return buffer.tobytes()


_gray = FRAME[:, :, 0]
_JPEG, _PNG, _RAW = pb.IMAGE_ENCODING_JPEG, pb.IMAGE_ENCODING_PNG, pb.IMAGE_ENCODING_RAW
IMAGE_VARIANTS = [
    pb.Image(encoding=_JPEG, data=GOOD_JPEG.data),  # good, size undeclared
    pb.Image(encoding=_PNG, data=_cv_encode(_gray, ".png")),  # 1 channel
    pb.Image(encoding=_JPEG, data=_cv_encode(_gray, ".jpg")),
    pb.Image(encoding=_PNG, data=_cv_encode(np.dstack([FRAME, _gray]), ".png")),  # RGBA
    pb.Image(encoding=_PNG, data=_cv_encode(FRAME.astype(np.uint16) * 257, ".png")),  # 16 bit
    pb.Image(encoding=_PNG, data=_cv_encode(FRAME[:, :63], ".png")),
    pb.Image(encoding=_JPEG, data=_cv_encode(FRAME[:32, :32], ".jpg")),
    pb.Image(encoding=_PNG, data=_cv_encode(FRAME[:1, :1], ".png")),
    pb.Image(encoding=_JPEG, data=_cv_encode(np.tile(FRAME, (2, 2, 1)), ".jpg")),
    pb.Image(encoding=_PNG, data=GOOD_JPEG.data),  # JPEG data declared PNG
    pb.Image(encoding=_JPEG, data=GOOD_PNG.data),
    pb.Image(encoding=_RAW, height=HEIGHT, width=WIDTH, channels=3, data=GOOD_JPEG.data),
    pb.Image(encoding=_PNG, data=_png_header(WIDTH, HEIGHT)),  # right size, no pixel data
    pb.Image(encoding=_PNG, data=_png_header(WIDTH, HEIGHT, _png_chunk(b"IDAT", b"\x78\x9c garbage"))),
    pb.Image(encoding=_PNG, data=_png_header(2**31 - 1, 2**31 - 1)),  # huge declared size
    pb.Image(encoding=_PNG, data=_png_header(0, 0)),
    pb.Image(encoding=_JPEG, data=_jpeg_header(65535, 65535)),
    pb.Image(encoding=_JPEG, data=_jpeg_header(HEIGHT, WIDTH)),  # right size, no scan
    pb.Image(encoding=_JPEG, data=_jpeg_header(HEIGHT, WIDTH, b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00" + b"U" * 64)),
    pb.Image(encoding=_JPEG, data=_jpeg_header(0, 0)),
    pb.Image(encoding=_JPEG, data=b"\xff\xd8\xff"),
    pb.Image(encoding=_PNG, data=b"\x89PNG\r\n\x1a\n"),
    pb.Image(encoding=_JPEG, data=b""),
    pb.Image(encoding=_RAW, height=HEIGHT, width=WIDTH, channels=3, data=b""),
    pb.Image(encoding=_RAW, height=HEIGHT, width=WIDTH, channels=4, data=b"\x00" * (HEIGHT * WIDTH * 4)),
    pb.Image(encoding=_RAW, height=2**32 - 1, width=2**32 - 1, channels=2**32 - 1, data=b"\x00" * 8),
    pb.Image(encoding=_RAW, height=HEIGHT, width=WIDTH, channels=3, data=b"\x00" * (LIMIT + 1000)),  # too large
    pb.Image(encoding=_JPEG, data=GOOD_JPEG.data + b"\x00" * (2 * LIMIT + 1000)),  # beyond gRPC's own cut
]
GOOD_IMAGE_BYTES = {_JPEG: GOOD_JPEG.data, _PNG: GOOD_PNG.data, _RAW: GOOD_RAW.data}


@st.composite
def mutated_images(draw) -> pb.Image:
    """A good frame's bytes truncated, with bytes flipped, or with garbage appended."""
    encoding = draw(st.sampled_from([_JPEG, _PNG, _RAW]))
    data = bytearray(GOOD_IMAGE_BYTES[encoding])
    how = draw(st.sampled_from(["truncate", "flip", "append"]))
    if how == "truncate":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif how == "flip":
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
    else:
        data += draw(st.binary(min_size=1, max_size=64))
    declared = draw(st.booleans()) or encoding == _RAW
    return pb.Image(encoding=encoding, height=HEIGHT if declared else 0, width=WIDTH if declared else 0,
                    channels=3 if declared else 0, data=bytes(data))


@st.composite
def declared_images(draw) -> pb.Image:
    """A good frame's bytes with arbitrary declared height / width / channels."""
    encoding = draw(st.sampled_from([_JPEG, _PNG, _RAW]))
    return pb.Image(encoding=encoding, height=draw(st.one_of(st.just(HEIGHT), uint32s)),
                    width=draw(st.one_of(st.just(WIDTH), uint32s)), channels=draw(st.one_of(st.just(3), uint32s)),
                    data=GOOD_IMAGE_BYTES[encoding], capture_time_ns=draw(int64s))


@st.composite
def raw_images(draw) -> pb.Image:
    height, width, channels = draw(uint32s), draw(uint32s), draw(uint32s)
    size = height * width * channels
    data = b"\x7f" * size if size <= 20_000 and draw(st.booleans()) else draw(st.binary(max_size=64))
    return pb.Image(encoding=draw(st.one_of(st.just(_RAW), enums(pb.ImageEncoding.DESCRIPTOR))), height=height,
                    width=width, channels=channels, data=data)


images = weighted(
    (6, st.sampled_from([GOOD_JPEG, GOOD_PNG, GOOD_RAW])),
    (3, st.sampled_from(IMAGE_VARIANTS)),
    (2, mutated_images()),
    (1, declared_images()),
    (1, raw_images()),
    (1, st.builds(pb.Image, encoding=enums(pb.ImageEncoding.DESCRIPTOR), data=st.binary(max_size=96))),
    (1, any_message(pb.Image)),
)
camera_names = st.one_of(st.just(CAMERA), st.sampled_from(["", "IMAGE", "image ", "wrist", "image/0"]),
                         st.text(max_size=12))
image_maps = weighted(
    (6, images.map(lambda image: {CAMERA: image})),
    (1, st.just({})),
    (1, st.dictionaries(camera_names, images, max_size=3)),
    (1, images.map(lambda image: {CAMERA: image, "wrist": GOOD_JPEG})),
)


def float_values(width: int) -> st.SearchStrategy[float]:
    edges = F32_EDGES if width == 32 else F64_EDGES
    return weighted((3, st.floats(0, 0.5, width=width)), (1, st.floats(-1, 1, width=width)),
                    (2, st.sampled_from(edges)), (1, st.floats(width=width, allow_nan=True, allow_infinity=True)))


@st.composite
def float_states(draw) -> pb.Tensor:
    """float32/float64 state of the right dimension, values from ordinary to extreme."""
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    values = draw(st.lists(float_values(32 if dtype is np.float32 else 64), min_size=STATE_DIM, max_size=STATE_DIM))
    return tensor_to_proto(np.array(values, dtype))


@st.composite
def other_states(draw) -> pb.Tensor:
    """Any supported dtype, any length."""
    dtype = draw(st.sampled_from([np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.bool_]))
    values = draw(st.lists(st.integers(-3, 3), max_size=6))
    with np.errstate(all="ignore"):
        return tensor_to_proto(np.array(values).astype(dtype))


SHAPE_EDGES = [[], [0], [STATE_DIM], [1, STATE_DIM], [STATE_DIM, 1], [-1], [-STATE_DIM], [2**31], [2**32, 2**32],
               [2**62, 4], [2**63 - 1], [2**63 - 1, 2], [0, 2**63 - 1], [-(2**63)], [1] * 40, [1] * 70, [3, -1, -2]]


@st.composite
def raw_tensors(draw) -> pb.Tensor:
    """Arbitrary dtype code (unknown ones too), shape and byte length, consistent or not."""
    dtype = draw(enums(pb.DType.DESCRIPTOR))
    shape = draw(st.one_of(st.sampled_from(SHAPE_EDGES), st.lists(st.integers(-3, 6), max_size=5)))
    itemsize = {pb.DTYPE_FLOAT64: 8, pb.DTYPE_INT64: 8, pb.DTYPE_FLOAT16: 2, pb.DTYPE_UINT8: 1, pb.DTYPE_BOOL: 1}
    size = int(np.prod(shape, dtype=np.int64)) * itemsize.get(dtype, 4) if shape else itemsize.get(dtype, 4)
    data = draw(st.binary(min_size=size, max_size=size)) if 0 <= size <= 256 and draw(st.booleans()) else draw(
        st.binary(max_size=40))
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


states = weighted(
    (5, st.just(tensor_to_proto(GOOD_STATE))),
    (5, float_states()),
    (2, other_states()),
    (2, raw_tensors()),
    (1, any_message(pb.Tensor)),
)


def build_observation(values: dict) -> pb.Observation:
    observation = pb.Observation(**{k: v for k, v in values.items() if k not in ("images", "state")})
    for name, image in values.get("images", {}).items():
        observation.images[name].CopyFrom(image)
    if "state" in values:
        observation.state.CopyFrom(values["state"])
    return observation


GOOD_OBSERVATION_FIELDS = {"images": {CAMERA: GOOD_JPEG}, "state": tensor_to_proto(GOOD_STATE), "step_index": 3}
targeted_observations = weighted(
    (1, st.sampled_from([GOOD_JPEG, GOOD_PNG, GOOD_RAW]).map(lambda image: {**GOOD_OBSERVATION_FIELDS,
                                                                             "images": {CAMERA: image}})),
    (3, images.map(lambda image: {**GOOD_OBSERVATION_FIELDS, "images": {CAMERA: image}})),
    (3, states.map(lambda state: {**GOOD_OBSERVATION_FIELDS, "state": state})),
    (4, mutated(GOOD_OBSERVATION_FIELDS, {
        "images": image_maps,
        "state": optional(states),
        "instruction": weighted((1, st.just(INSTRUCTION)), (2, texts)),
        "step_index": uint64s,
        "client_time_ns": int64s,
    })),
).map(build_observation)
observations = weighted((8, targeted_observations), (1, any_message(pb.Observation)))


# ---------------------------------------------------------------------------------------------
# References to the live session, resolved when the example runs
# ---------------------------------------------------------------------------------------------


class Ref(enum.Enum):
    REAL = "the session's id / current epoch"
    CLOSED = "the id of a closed session"
    NEXT = "current epoch + 1"
    PREV = "current epoch - 1"

    def __repr__(self) -> str:
        return f"<{self.name}>"


DEADLINES = st.sampled_from([None] * 6 + [0.001, 0.005, 0.02, 0.1])  # short client deadlines: cancelled work
session_ids = weighted((6, st.just(Ref.REAL)), (1, st.just(Ref.CLOSED)), (2, texts))
epochs = weighted((6, st.just(Ref.REAL)), (1, st.sampled_from([Ref.NEXT, Ref.PREV, 0])), (1, uint32s))


@dataclasses.dataclass
class Live:
    """The session an example runs against."""

    session_id: str
    epoch: int
    closed_id: str
    closed: bool = False

    def session(self, ref) -> str:
        return self.session_id if ref is Ref.REAL else self.closed_id if ref is Ref.CLOSED else ref

    def epoch_of(self, ref) -> int:
        value = {Ref.REAL: self.epoch, Ref.NEXT: self.epoch + 1, Ref.PREV: self.epoch - 1}.get(ref, ref)
        return value % 2**32


@pytest.fixture(scope="module")
def closed_id(served) -> str:
    session = open_good(served)
    served.stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id), timeout=TIMEOUT_S)
    return session.session_id


def live_session(served: Served, failures: Failures, closed: str, reset_first: bool = False) -> Live | None:
    """A fresh session for one example (reset once if asked); None, and the test stops, if that fails."""
    try:
        session = open_good(served)
        epoch = session.epoch
        if reset_first:
            reset = pb.ResetSessionRequest(session_id=session.session_id)
            epoch = served.stub.ResetSession(reset, timeout=TIMEOUT_S).epoch
    except grpc.RpcError as error:
        failures.fatal = f"opening a good session failed with {error.code().name}: {error.details()}"
        return None
    return Live(session.session_id, epoch, closed)


def unary(served: Served, failures: Failures, rpc: str, request: Message, example: str,
          label: str | None = None, timeout_s: float | None = None) -> Message | None:
    """Call one unary RPC; a bad status is recorded (under `label`). Returns the answer or None.
    `timeout_s`: a short client deadline of the example itself (then DEADLINE_EXCEEDED is a good answer)."""
    mark = served.log.mark()
    try:
        return getattr(served.stub, rpc)(request, timeout=timeout_s or TIMEOUT_S)
    except grpc.RpcError as error:
        if timeout_s is None or error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            failures.check_status(label or rpc, error, example, mark)
        return None


# ---------------------------------------------------------------------------------------------
# gRPC: server info and sessions
# ---------------------------------------------------------------------------------------------


def test_fuzz_get_server_info(served):
    failures = Failures(served, "GetServerInfo")
    fuzz = {name: optional(doubles) for name in ("budget_ms", "rate_hz")
            if name in pb.GetServerInfoRequest.DESCRIPTOR.fields_by_name}
    requests = weighted((3, mutated({}, fuzz).map(lambda values: pb.GetServerInfoRequest(**values))),
                        (1, any_message(pb.GetServerInfoRequest)))

    @fuzz_settings(30)
    @given(request=requests)
    def run(request):
        if not failures.begin():
            return
        example = describe(request)
        info = unary(served, failures, "GetServerInfo", request, example)
        if info is not None and not (info.protocol_version == "policy_server.v1" and info.embodiments):
            failures.wrong("GetServerInfo", describe(info, 300), example)
        still_serving(served, failures, example)

    run()
    failures.report()


def open_session_requests() -> st.SearchStrategy[pb.OpenSessionRequest]:
    fields = pb.OpenSessionRequest.DESCRIPTOR.fields_by_name
    fuzz = {
        "embodiment": weighted((1, st.just(EMBODIMENT)), (2, texts)),
        "instruction": texts,
        "budget_ms": optional(doubles),
        "chunk_size": optional(weighted((4, st.integers(0, 17)), (1, uint32s))),
        "seed": optional(uint64s),
        "client_name": texts,
        "rate_hz": optional(doubles),
        "actions_per_chunk": optional(weighted((3, st.integers(0, 17)), (1, uint32s))),
        "request_id": texts,
    }
    base = {"embodiment": EMBODIMENT, "instruction": INSTRUCTION}
    targeted = mutated(base, {name: strategy for name, strategy in fuzz.items() if name in fields}, 4)
    return weighted((6, targeted.map(lambda values: pb.OpenSessionRequest(**values))),
                    (1, any_message(pb.OpenSessionRequest)))


def test_fuzz_open_session(served):
    failures = Failures(served, "OpenSession")

    @fuzz_settings(70)
    @given(request=open_session_requests())
    @example(request=pb.OpenSessionRequest(embodiment=EMBODIMENT, instruction=INSTRUCTION, chunk_size=1))
    @example(request=pb.OpenSessionRequest(embodiment=EMBODIMENT, instruction=INSTRUCTION, chunk_size=5))
    @example(request=pb.OpenSessionRequest(embodiment=EMBODIMENT, instruction=INSTRUCTION, chunk_size=16))
    @example(request=pb.OpenSessionRequest(embodiment=EMBODIMENT, instruction=INSTRUCTION, budget_ms=1e-300))
    def run(request):
        if not failures.begin():
            return
        example = describe(request)
        session = unary(served, failures, "OpenSession", request, example)
        if session is not None:
            # Deep path: the session it opened must act.
            acts_then_closes(served, failures, session, example, "the session this OpenSession opened")
        still_serving(served, failures, example)

    run()
    failures.report()


session_ops = weighted(
    (2, st.tuples(st.just("ResetSession"), session_ids)),
    (2, st.tuples(st.just("SetBudget"), session_ids, doubles)),
    (1, st.tuples(st.just("CloseSession"), session_ids)),
    (1, st.one_of([any_message(cls).map(lambda m, rpc=rpc: ("generic", rpc, m))
                   for rpc, cls in (("ResetSession", pb.ResetSessionRequest), ("CloseSession", pb.CloseSessionRequest),
                                    ("SetBudget", pb.SetBudgetRequest))])),
)
_REQUEST_OF = {"ResetSession": pb.ResetSessionRequest, "CloseSession": pb.CloseSessionRequest,
               "SetBudget": pb.SetBudgetRequest}


def test_fuzz_reset_close_set_budget(served, closed_id):
    """Short sequences of ResetSession / SetBudget / CloseSession on a live session (or other ids); the
    session, if still open, must then act."""
    failures = Failures(served, "ResetSession/SetBudget/CloseSession")

    @fuzz_settings(60)
    @given(ops=st.lists(session_ops, min_size=1, max_size=4))
    @example(ops=[("SetBudget", Ref.REAL, 1e-300)])
    @example(ops=[("SetBudget", Ref.REAL, 1e300), ("ResetSession", Ref.REAL)])
    def run(ops):
        if not failures.begin():
            return
        live = live_session(served, failures, closed_id)
        if live is None:
            return
        requests = []
        for op in ops:
            if op[0] == "generic":
                requests.append((op[1], op[2]))
            elif op[0] == "SetBudget":
                requests.append(("SetBudget", pb.SetBudgetRequest(session_id=live.session(op[1]), budget_ms=op[2])))
            else:
                requests.append((op[0], _REQUEST_OF[op[0]](session_id=live.session(op[1]))))
        example = "; ".join(f"{rpc} {describe(request, 300)}" for rpc, request in requests)
        closed = False
        for rpc, request in requests:
            answer = unary(served, failures, rpc, request, example)
            if answer is not None and request.session_id == live.session_id:
                if rpc == "CloseSession":
                    closed = True
                elif rpc == "ResetSession":
                    live.epoch = answer.epoch
        if not closed:
            acts_then_closes(served, failures, live, example, "the session, after the requests above")
        still_serving(served, failures, example)

    run()
    failures.report()


# ---------------------------------------------------------------------------------------------
# gRPC: Act
# ---------------------------------------------------------------------------------------------


def _state(values, dtype) -> pb.Observation:
    observation = good_observation()
    observation.state.CopyFrom(tensor_to_proto(np.array(values, dtype)))
    return observation


def _tensor(dtype, shape, data=b"") -> pb.Observation:
    observation = good_observation()
    observation.state.CopyFrom(pb.Tensor(dtype=dtype, shape=shape, data=data))
    return observation


def act_example(observation: pb.Observation):
    """An explicit example: this observation on the live session, at its epoch."""
    return example(session_id=Ref.REAL, epoch=Ref.REAL, observation=observation, reset_first=False, deadline_s=None)


def test_fuzz_act(served, closed_id):
    failures = Failures(served, "Act")
    action = served.engine.info().embodiment(EMBODIMENT).action
    low, high = list(action.low), list(action.high)

    @fuzz_settings(120)
    @given(session_id=session_ids, epoch=epochs, observation=weighted((9, observations), (1, st.none())),
           reset_first=st.sampled_from([False, False, True]), deadline_s=DEADLINES)
    @act_example(_state([3e38, -3e38], np.float32))
    @act_example(_state([1e300, 0.0], np.float64))
    @act_example(_state([5e-324, 1e-45], np.float64))
    @act_example(_tensor(pb.DTYPE_FLOAT32, [2**32, 2**32]))
    @act_example(_tensor(pb.DTYPE_FLOAT32, [1] * 70, b"\0" * 4))
    @act_example(_tensor(pb.DTYPE_FLOAT32, [0, 2**63 - 1]))
    def run(session_id, epoch, observation, reset_first, deadline_s):
        if not failures.begin():
            return
        live = live_session(served, failures, closed_id, reset_first)
        if live is None:
            return
        request = pb.ActRequest(session_id=live.session(session_id), epoch=live.epoch_of(epoch))
        if observation is not None:
            request.observation.CopyFrom(observation)
        example = describe(request) + (" (after a ResetSession)" if reset_first else "") + (
            f" (client deadline {deadline_s * 1e3:g} ms)" if deadline_s else "")
        chunk = unary(served, failures, "Act", request, example, timeout_s=deadline_s)
        if chunk is not None:
            shape = list(chunk.actions.shape)
            if chunk.actions.dtype != pb.DTYPE_FLOAT32 or len(shape) != 2 or shape[1] != ACTION_DIM:
                failures.wrong("Act", f"actions {describe(chunk.actions)}", example)
            else:
                actions = np.frombuffer(chunk.actions.data, np.float32)
                if not np.all(np.isfinite(actions)):
                    failures.wrong("Act", "non-finite actions", example)
                elif low and not np.all((np.tile(low, shape[0]) - 1e-6 <= actions)
                                        & (actions <= np.tile(high, shape[0]) + 1e-6)):
                    failures.wrong("Act", f"actions outside the declared limits: {actions.tolist()}", example)
        # The fuzzed session itself keeps acting, and the server keeps serving.
        acts_then_closes(served, failures, live, example, "the same session, after the request above")
        still_serving(served, failures, example)

    run()
    failures.report()


# ---------------------------------------------------------------------------------------------
# gRPC: Control (bidi stream)
# ---------------------------------------------------------------------------------------------

control_items = weighted(
    (6, st.tuples(st.just("observation"), epochs, uint64s, weighted((9, observations), (1, st.none())),
                  st.booleans())),
    (1, st.tuples(st.just("budget"), doubles)),
    (1, st.tuples(st.just("ping"), int64s)),
    (1, st.tuples(st.just("empty"))),
    (1, st.tuples(st.just("start"), session_ids)),
    (1, st.tuples(st.just("generic"), any_message(pb.ControlRequest))),
    (1, st.tuples(st.just("ResetSession"))),  # done by the client between two requests of the stream
    (1, st.tuples(st.just("CloseSession"))),
    (1, st.tuples(st.just("pause"), st.sampled_from([0.001, 0.01, 0.05]))),
)
first_items = weighted((6, st.tuples(st.just("start"), session_ids)), (2, control_items))


def control_request(item: tuple, live: Live) -> pb.ControlRequest:
    kind = item[0]
    if kind == "start":
        return pb.ControlRequest(start=pb.ControlStart(session_id=live.session(item[1])))
    if kind == "observation":
        _, epoch, obs_id, observation, must_answer = item
        frame = pb.ObservationFrame(epoch=live.epoch_of(epoch), obs_id=obs_id, must_answer=must_answer)
        if observation is not None:
            frame.observation.CopyFrom(observation)
        return pb.ControlRequest(observation=frame)
    if kind == "budget":
        return pb.ControlRequest(budget=pb.BudgetUpdate(budget_ms=item[1]))
    if kind == "ping":
        return pb.ControlRequest(ping=pb.Ping(client_time_ns=item[1]))
    if kind == "empty":
        return pb.ControlRequest()
    return item[1]


class ControlRequests:
    """The requests of `items`, built as they are sent (so that REAL means the epoch at that moment);
    ResetSession / CloseSession / pause items act between two requests. gRPC pulls requests on its own
    thread, possibly after the call ended: `stop()` makes sure no side effect happens after it returns."""

    def __init__(self, served: Served, items: list, live: Live) -> None:
        self.served, self.items, self.live = served, items, live
        self._lock = threading.Lock()
        self._stopped = False

    def stop(self) -> None:
        with self._lock:
            self._stopped = True

    def __iter__(self) -> Iterator[pb.ControlRequest]:
        for item in self.items:
            with self._lock:
                if self._stopped:
                    return
                if item[0] in ("ResetSession", "CloseSession"):
                    self._session_call(item[0])
                    continue
            if item[0] == "pause":
                time.sleep(item[1])
            else:
                yield control_request(item, self.live)

    def _session_call(self, rpc: str) -> None:
        try:
            answer = getattr(self.served.stub, rpc)(_REQUEST_OF[rpc](session_id=self.live.session_id),
                                                    timeout=TIMEOUT_S)
        except grpc.RpcError:
            return
        if rpc == "ResetSession":
            self.live.epoch = answer.epoch
        else:
            self.live.closed = True


def describe_items(items: list, live: Live) -> str:
    parts = [f"<{item[0]}{' ' + str(item[1]) if len(item) > 1 else ''}>"
             if item[0] in ("ResetSession", "CloseSession", "pause") else describe(control_request(item, live), 400)
             for item in items]
    return "[" + ", ".join(parts) + "]"


def run_control(served: Served, failures: Failures, rpc: str, requests, example: str) -> list | None:
    """One Control call with these requests (then the client half-closes); every event and the final
    status are checked. Returns the events, or None if the call failed."""
    mark = served.log.mark()
    events = []
    try:
        for event in served.stub.Control(iter(requests), timeout=TIMEOUT_S):  # iter: a list or a generator
            events.append(event)
            if event.WhichOneof("kind") == "error":
                failures.check_detail(rpc, event.error.error, example, mark)
    except grpc.RpcError as error:
        failures.check_status(rpc, error, example, mark)
        return None
    return events


def test_fuzz_control(served, closed_id):
    failures = Failures(served, "Control")

    @fuzz_settings(70)
    @given(first=first_items, rest=st.lists(control_items, max_size=5),
           reset_first=st.sampled_from([False, False, True]))
    @example(first=("start", Ref.REAL), rest=[("observation", Ref.REAL, 1, _state([3e38, -3e38], np.float32), True)],
             reset_first=False)
    @example(first=("ping", 5), rest=[], reset_first=False)
    def run(first, rest, reset_first):
        if not failures.begin():
            return
        live = live_session(served, failures, closed_id, reset_first)
        if live is None:
            return
        items = [first, *rest]
        example = describe_items(items, live) + (" (after a ResetSession)" if reset_first else "")
        requests = ControlRequests(served, items, live)
        run_control(served, failures, "Control", requests, example)
        requests.stop()
        if live.closed:
            live = live_session(served, failures, closed_id)
            if live is None:
                return
        # The same session streams again: start plus one good frame gets its chunk.
        good = [pb.ControlRequest(start=pb.ControlStart(session_id=live.session_id)),
                pb.ControlRequest(observation=pb.ObservationFrame(epoch=live.epoch, obs_id=99, must_answer=True,
                                                                   observation=good_observation()))]
        events = run_control(served, failures, "Control (good, on the same session, after the stream above)",
                             good, example)
        if events is not None and not any(e.WhichOneof("kind") == "chunk" and e.chunk.obs_id == 99 for e in events):
            failures.record("Control (good, after the stream above)", "NO CHUNK", "", describe(events), example, [])
        close_quietly(served, live.session_id)
        still_serving(served, failures, example)

    run()
    failures.report()


# ---------------------------------------------------------------------------------------------
# gRPC: Reason (server stream)
# ---------------------------------------------------------------------------------------------


def reason_requests() -> st.SearchStrategy[pb.ReasonRequest]:
    fuzz = {
        "prompt": texts,
        "max_new_tokens": weighted((4, st.integers(0, 12)), (1, st.sampled_from([255, 256, 257, 4096])), (1, uint32s)),
        "temperature": weighted((1, st.sampled_from([0.0, 0.7, 1.0])), (3, doubles)),
        "seed": optional(uint64s),
    }
    base = {"prompt": "what is on the table?", "max_new_tokens": 4, "temperature": 0.0}
    targeted = mutated(base, fuzz).map(lambda values: pb.ReasonRequest(**values))
    return weighted((6, targeted), (1, any_message(pb.ReasonRequest)))


def test_fuzz_reason(served):
    failures = Failures(served, "Reason")

    @fuzz_settings(60)
    @given(request=reason_requests())
    @example(request=pb.ReasonRequest(prompt="hi", max_new_tokens=4, temperature=1e-300, seed=1))
    @example(request=pb.ReasonRequest(prompt="hi", max_new_tokens=4, temperature=5e-324))
    @example(request=pb.ReasonRequest(prompt="hi", max_new_tokens=4, temperature=1e300))
    def run(request):
        if not failures.begin():
            return
        example = describe(request)
        mark = served.log.mark()
        try:
            chunks = list(served.stub.Reason(request, timeout=TIMEOUT_S))
        except grpc.RpcError as error:
            failures.check_status("Reason", error, example, mark)
        else:
            if not (chunks and chunks[-1].done):
                failures.wrong("Reason", f"a stream without its done message: {describe(chunks)}", example)
        try:
            good = list(served.stub.Reason(pb.ReasonRequest(prompt="hi", max_new_tokens=3, seed=1), timeout=TIMEOUT_S))
            assert good and good[-1].done
        except (grpc.RpcError, AssertionError) as exc:
            failures.fatal = f"the good Reason after {example} failed: {exc!r}"
            return
        still_serving(served, failures, example)

    run()
    failures.report()


# ---------------------------------------------------------------------------------------------
# gRPC: undecodable request bytes, to every method
# ---------------------------------------------------------------------------------------------

_GOOD_BYTES = {
    "GetServerInfo": pb.GetServerInfoRequest().SerializeToString(),
    "OpenSession": pb.OpenSessionRequest(embodiment=EMBODIMENT, instruction=INSTRUCTION).SerializeToString(),
    "ResetSession": pb.ResetSessionRequest(session_id="x").SerializeToString(),
    "CloseSession": pb.CloseSessionRequest(session_id="x").SerializeToString(),
    "SetBudget": pb.SetBudgetRequest(session_id="x", budget_ms=100.0).SerializeToString(),
    "Act": pb.ActRequest(session_id="x", epoch=1, observation=good_observation()).SerializeToString(),
    "Reason": pb.ReasonRequest(prompt="hi", max_new_tokens=2).SerializeToString(),
    "Control": pb.ControlRequest(start=pb.ControlStart(session_id="x")).SerializeToString(),
}
UNARY_METHODS = ["GetServerInfo", "OpenSession", "ResetSession", "CloseSession", "SetBudget", "Act"]
WIRE_EDGES = [
    b"\x0a\x02\xff\xfe",  # field 1, a string that is not UTF-8
    b"\x0a\x05pus\xc3",  # truncated UTF-8 sequence
    b"\x08\xff",  # truncated varint
    b"\x08" + b"\xff" * 10 + b"\x01",  # varint longer than 10 bytes
    b"\x0a\x7f",  # length beyond the end
    b"\x0a\xff\xff\xff\xff\x0f",  # 4 GiB length
    b"\x0b",  # start group, never ended
    b"\x0c",  # end group without start
    b"\x0f",  # wire type 7
    b"\x00",  # field number 0
    b"\x1a\x03\x0a\x01\xff",  # nested message (observation) with a bad string inside
    b"\x1a\x0b\x0a\x09\x0a\x05image\x12\x00",  # Act: images map entry, truncated
    b"\x0b" * 200 + b"\x0c" * 200,  # deep group nesting
    b"\x1a\x02" * 1 + b"\x1a\x00",  # odd nesting
    b"\x12\x04\xed\xa0\x80x",  # a UTF-8 encoded surrogate in field 2
]


@st.composite
def wire_bytes(draw, method: str) -> bytes:
    good = _GOOD_BYTES[method]
    how = draw(weighted((2, st.just("edge")), (2, st.just("random")), (1, st.just("truncate")), (1, st.just("flip")),
                        (1, st.just("append"))))
    if how == "edge":
        return draw(st.sampled_from(WIRE_EDGES))
    if how == "random":
        return draw(st.binary(max_size=64))
    data = bytearray(good)
    if how == "truncate" and data:
        return bytes(data[: draw(st.integers(0, len(data) - 1))])
    if how == "flip" and data:
        data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
        return bytes(data)
    return bytes(data) + draw(st.sampled_from(WIRE_EDGES))


@pytest.fixture
def served_alone() -> Iterator[Served]:
    """A server of its own, so that a server the test leaves unable to shut down is blamed on it."""
    with real_server() as running:
        yield running


def test_fuzz_undecodable_request_bytes(served_alone):
    """Raw bytes (random, malformed protobuf, good requests truncated or corrupted) sent to every method
    with a generic call, bypassing the client's serializer; the server must still shut down afterwards."""
    served = served_alone
    failures = Failures(served, "raw request bytes")
    methods = [*UNARY_METHODS, "Reason", "Control"]

    @fuzz_settings(80)
    @given(method=st.sampled_from(methods), data=st.data())
    def run(method, data):
        payload = data.draw(wire_bytes(method), label="payload")  # before any early return: same draws each run
        if not failures.begin():
            return
        example = f"{method} <- {payload!r}" if len(payload) <= 80 else f"{method} <- {_bytes(payload)}"
        mark = served.log.mark()
        path = SERVICE + method
        try:
            if method == "Reason":
                list(served.channel.unary_stream(path)(payload, timeout=TIMEOUT_S))
            elif method == "Control":
                list(served.channel.stream_stream(path)(iter([payload]), timeout=TIMEOUT_S))
            else:
                answer = served.channel.unary_unary(path)(payload, timeout=TIMEOUT_S)
                if method == "OpenSession":
                    close_quietly(served, pb.Session.FromString(answer).session_id)
        except grpc.RpcError as error:
            failures.check_status(method, error, example, mark)
        still_serving(served, failures, example)

    run()
    failures.report()


# ---------------------------------------------------------------------------------------------
# WebSocket (openpi msgpack-numpy frames)
# ---------------------------------------------------------------------------------------------


def nd(dtype: str, shape: list, data: bytes) -> dict:
    """An array the way openpi's msgpack-numpy sends it (not necessarily consistent)."""
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


def arr(array: np.ndarray) -> dict:
    return nd(array.dtype.str, list(array.shape), np.ascontiguousarray(array).tobytes())


WS_DTYPES = ["|u1", "<f4", "<f8", ">f8", "<f2", "<i8", "|i1", "|b1", "<c8", "|O", "<U2", "|S3", "|V4", "<M8[s]",
             "zz", "", "<f16", "float32"]


@st.composite
def ws_raw_arrays(draw) -> dict:
    dtype = draw(st.sampled_from(WS_DTYPES))
    shape = draw(st.one_of(st.sampled_from(SHAPE_EDGES + [[HEIGHT, WIDTH, 3], [3, HEIGHT, WIDTH], [0, 5, 3]]),
                           st.lists(st.integers(-2, 6), max_size=4)))
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:
        itemsize = 4
    size = int(np.prod(shape, dtype=np.int64)) * max(itemsize, 1)
    consistent = 0 <= size <= 40_000 and draw(weighted((3, st.just(True)), (1, st.just(False))))
    return nd(dtype, shape, b"\x01" * size if consistent else draw(st.binary(max_size=32)))


_ws_frames_uint8 = [FRAME, np.transpose(FRAME, (2, 0, 1)), FRAME[:48], np.tile(FRAME, (3, 1, 1)), FRAME[:1, :1],
                    FRAME[:3, :3], np.zeros((4096, 1, 3), np.uint8), np.zeros((0, WIDTH, 3), np.uint8),
                    np.zeros((HEIGHT, 0, 3), np.uint8),
                    np.zeros((3, 0, 0), np.uint8), np.zeros((3, 1, 3), np.uint8), FRAME[:, :, :1],
                    np.dstack([FRAME, FRAME[:, :, :1]]), np.zeros((1, 20000, 3), np.uint8), FRAME[:, :, 0]]
ws_images = weighted(
    (6, st.just(arr(FRAME))),
    (5, st.sampled_from([arr(a) for a in _ws_frames_uint8])),
    (1, st.sampled_from([arr(FRAME.astype(np.float32)), arr(FRAME.astype(np.int64)), arr(FRAME.astype(bool))])),
    (1, ws_raw_arrays()),
    (1, st.one_of(int64s, st.text(max_size=5), st.lists(st.integers(0, 255), max_size=4), st.none(),
                  st.binary(max_size=8))),
)


@st.composite
def ws_float_states(draw) -> dict:
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    values = draw(st.lists(float_values(32 if dtype is np.float32 else 64), min_size=STATE_DIM, max_size=STATE_DIM))
    return arr(np.array(values, dtype).astype(draw(st.sampled_from(["<", ">"])) + np.dtype(dtype).str[1:]))


ws_states = weighted(
    (6, st.just(arr(GOOD_STATE))),
    (4, ws_float_states()),
    (1, st.sampled_from([arr(np.array([1, 2], np.int64)), arr(np.array([True, False])), arr(np.zeros(7, np.float32)),
                         arr(np.zeros((1, 2), np.float32)), arr(np.array(0.5, np.float32)),
                         arr(np.array([2**64 - 1, 0], np.uint64))])),
    (1, ws_raw_arrays()),
    (1, st.one_of(st.lists(st.floats(allow_nan=True), max_size=3), st.text(max_size=4), int64s,
                  st.lists(st.text(max_size=2), max_size=2), st.dictionaries(st.text(max_size=2), int64s,
                                                                               max_size=2))),
)
ws_step_indices = st.one_of(st.integers(0, 100), st.sampled_from([-1, 2**63 - 1, 2**63, 2**64 - 20, 2**64 - 1]),
                            st.integers(-(2**63), 2**64 - 1), st.floats(), st.booleans(), st.text(max_size=3),
                            st.none(), st.just({b"__npgeneric__": True, b"data": 5, b"dtype": "<i8"}),
                            st.just({b"__npgeneric__": True, b"data": 5, b"dtype": "|O"}))
ws_keys = st.one_of(st.sampled_from(["observation/image", "observation/images/image", "images", "observation/state",
                                     "state", "prompt", "step_index", "reset", "actions"]), st.text(max_size=12))
msgpack_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
              st.text(max_size=12), st.binary(max_size=12)),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.one_of(st.text(max_size=6), st.binary(max_size=6)), children,
                                               max_size=3)),
    max_leaves=12,
)


IMAGE_KEYS = ["observation/image", "observation/images/image", "images", "observation/wrist", "image"]
STATE_KEYS = ["observation/state", "state", "observation/State"]


def build_ws_observation(fields: dict) -> dict:
    message: dict = {}
    if "image" in fields:
        key = fields.get("image_key", IMAGE_KEYS[0])
        message[key] = {CAMERA: fields["image"]} if key == "images" else fields["image"]
    if "state" in fields:
        message[fields.get("state_key", STATE_KEYS[0])] = fields["state"]
    for key in ("prompt", "step_index"):
        if key in fields:
            message[key] = fields[key]
    for key, value in fields.get("extra", {}).items():
        message.setdefault(key, value)
    return message


ws_observations = mutated(
    {"image": arr(FRAME), "state": arr(GOOD_STATE), "prompt": INSTRUCTION},
    {
        "image": optional(ws_images),
        "image_key": st.sampled_from(IMAGE_KEYS),
        "state": optional(ws_states),
        "state_key": st.sampled_from(STATE_KEYS),
        "prompt": weighted((3, optional(texts)), (1, st.one_of(int64s, st.binary(max_size=4), st.none(),
                                                               st.lists(st.text(max_size=3), max_size=2)))),
        "step_index": ws_step_indices,
        "extra": st.dictionaries(ws_keys, msgpack_values, min_size=1, max_size=3),
    },
).map(build_ws_observation)


ws_frames = weighted(
    (16, ws_observations.map(lambda m: ("binary", m))),
    (1, st.sampled_from([{"reset": True}, {"reset": 1}, {"reset": "yes"}, {"reset": False}, {b"reset": True}])
     .map(lambda m: ("binary", m))),
    (1, st.dictionaries(ws_keys, msgpack_values, max_size=4).map(lambda m: ("binary", m))),
    (1, msgpack_values.filter(lambda v: not isinstance(v, dict)).map(lambda v: ("binary", v))),
    (1, st.binary(max_size=48).map(lambda b: ("bytes", b))),
    (1, st.text(max_size=48).map(lambda t: ("text", t))),
    (1, st.sampled_from([b"\xc1", b"\x81\xa5reset", b"\xdf\xff\xff\xff\xff", b"\x81\xc0\xc0", b"\x81\x91\x01\x01",
                         b"\xc7\x05\x01abc", b"\xd4\x00\x00", b"\x81\xa1a" * 1, b"\x80" * 3])
     .map(lambda b: ("bytes", b))),
    (1, st.just(("bytes", b"\x80" + b"\x00" * (LIMIT + 16)))),  # beyond the frame limit
)
ws_paths = weighted((8, st.just("")), (1, st.just("?embodiment=pusht")),
                    (1, st.text(max_size=12).map(lambda t: "?embodiment=" + urllib.parse.quote(t))))


def good_ws_observation(step: int = 7) -> dict:
    return {"observation/image": FRAME, "observation/state": GOOD_STATE, "prompt": INSTRUCTION, "step_index": step}


def ws_pack(kind: str, value: Any) -> bytes | str:
    if kind in ("text", "bytes"):
        return value
    return msgpack.packb(value, default=msgpack_numpy.pack_array)


def test_fuzz_websocket(served):
    """Random frames on a real openpi WebSocket connection: every frame gets a reply frame or a text
    error frame whose reason is not INTERNAL, the connection is never closed with 1011, and a good
    observation then works on the same connection."""
    failures = Failures(served, "WebSocket")

    def check_reply(reply, example: str, mark: int, what: str) -> bool:
        """Record a bad reply; False if the server answered INTERNAL (it then closes the connection, 1011)."""
        if isinstance(reply, str):
            reason = reply.split(":", 1)[0]
            if reason in ("INTERNAL", "ENGINE_ERROR", "UNKNOWN") or not re.fullmatch(r"[A-Z][A-Z_]*", reason):
                failures.record(what, "text error frame", reason, reply[:200], example, served.log.since(mark))
                return False
            return True
        decoded = msgpack_numpy.unpackb(reply)
        if not (isinstance(decoded, dict) and ("actions" in decoded or decoded.get("reset") is True)):
            failures.record(what, "reply frame", "", describe(decoded), example, served.log.since(mark))
        return True

    @fuzz_settings(70)
    @given(path=ws_paths, frames=st.lists(ws_frames, min_size=1, max_size=4))
    @example(path="", frames=[("binary", {**good_ws_observation(), "observation/state": arr(np.array([1e300, 0.0]))})])
    @example(path="", frames=[("binary", {**good_ws_observation(), "observation/image": arr(np.zeros((0, 64, 3),
                                                                                               np.uint8))})])
    @example(path="", frames=[("binary", {**good_ws_observation(), "step_index": 2**64 - 1}),
                              ("binary", {"observation/image": FRAME, "observation/state": GOOD_STATE})])
    def run(path, frames):
        if not failures.begin():
            return
        example = f"path={path!r} frames=" + describe([value for _, value in frames], 1200)
        mark = served.log.mark()
        try:
            connection = websockets.sync.client.connect(served.websocket_url + "/" + path, compression=None,
                                                        max_size=None, open_timeout=TIMEOUT_S, proxy=None)
        except InvalidStatus as refused:
            if refused.response.status_code >= 500:
                failures.record("WebSocket handshake", f"HTTP {refused.response.status_code}", "",
                                refused.response.body.decode(errors="replace")[:200], example, served.log.since(mark))
            return
        with connection:
            connection.recv(timeout=TIMEOUT_S)  # metadata
            alive = True
            for kind, value in frames:
                mark = served.log.mark()
                try:
                    connection.send(ws_pack(kind, value))
                    if not check_reply(connection.recv(timeout=TIMEOUT_S), example, mark, "WebSocket frame"):
                        alive = False  # counted once: the 1011 close that follows is part of the same answer
                        break
                except TimeoutError:
                    failures.record("WebSocket frame", "HANG (no reply within 20 s)", "", "", example,
                                    served.log.since(mark))
                    alive = False
                    break
                except ConnectionClosed as closed:
                    code = closed.rcvd.code if closed.rcvd is not None else None
                    time.sleep(0.1)  # websockets logs a crashed handler after closing
                    if code is None or code == 1011:
                        failures.record("WebSocket frame", f"connection closed ({code})", "",
                                        closed.rcvd.reason if closed.rcvd else "", example, served.log.since(mark))
                    alive = False
                    break
            if alive:
                mark = served.log.mark()
                try:
                    connection.send(msgpack_numpy.packb(good_ws_observation()))
                    reply = connection.recv(timeout=TIMEOUT_S)
                except (TimeoutError, ConnectionClosed) as exc:
                    failures.fatal = f"the good WebSocket frame after {example} got {exc!r}"
                    return
                if isinstance(reply, str):
                    # A session opened by a fuzzed frame keeps its instruction; the good frame must still act.
                    failures.record("WebSocket (good frame after the frames above)", "text error frame",
                                    reply.split(":", 1)[0], reply[:200], example, served.log.since(mark))
                else:
                    decoded = msgpack_numpy.unpackb(reply)
                    if decoded.get("first_step_index") != 7 or decoded["actions"].shape[1:] != (ACTION_DIM,):
                        failures.wrong("WebSocket (good frame after the frames above)", describe(decoded), example)
        # A new connection works too.
        with websockets.sync.client.connect(served.websocket_url, open_timeout=TIMEOUT_S, proxy=None) as fresh:
            fresh.recv(timeout=TIMEOUT_S)
            fresh.send(msgpack_numpy.packb(good_ws_observation()))
            reply = fresh.recv(timeout=TIMEOUT_S)
            if isinstance(reply, str):
                failures.fatal = f"a good WebSocket frame on a new connection after {example} got {reply!r}"
                return
        still_serving(served, failures, example)

    run()
    failures.report()
