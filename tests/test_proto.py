"""The wire contract: generated stubs are current, tensors and images round-trip, bad payloads are named."""

import pickle
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

from policy_server.v1 import gen_proto, wire
from policy_server.v1 import policy_server_pb2 as pb

REPO = Path(__file__).resolve().parents[1]


def test_checked_in_stubs_match_a_fresh_generation():
    stale = gen_proto.stale_files()
    assert stale == [], f"regenerate with `python -m policy_server.v1.gen_proto`; stale: {stale}"


def test_stale_check_detects_an_edited_stub(tmp_path):
    for name in gen_proto.GENERATED:
        (tmp_path / name).write_text((gen_proto.STUB_DIR / name).read_text())
    assert gen_proto.stale_files(tmp_path) == []
    grpc_stub = tmp_path / "policy_server_pb2_grpc.py"
    grpc_stub.write_text(grpc_stub.read_text() + "\n# edited by hand\n")
    assert gen_proto.stale_files(tmp_path) == ["policy_server_pb2_grpc.py"]


def test_package_is_versioned_and_descriptor_keeps_the_canonical_path():
    assert pb.DESCRIPTOR.package == "policy_server.v1"
    assert pb.DESCRIPTOR.name == "policy_server/v1/policy_server.proto"
    service = pb.DESCRIPTOR.services_by_name["PolicyService"]
    assert set(service.methods_by_name) == {
        "GetServerInfo", "OpenSession", "ResetSession", "CloseSession", "Act", "Control", "Reason", "SetBudget",
        "ForwardDynamics", "InverseDynamics",
    }
    control = service.methods_by_name["Control"]
    assert control.client_streaming and control.server_streaming
    reason = service.methods_by_name["Reason"]
    assert not reason.client_streaming and reason.server_streaming


def test_messages_pickle_under_the_module_path_the_proto_declares():
    msg = pb.ActRequest(session_id="s", epoch=2, observation=pb.Observation(
        images={"cam": wire.encode_image(_frame(), "raw")}, state=wire.tensor_to_proto(np.ones(3, np.float32))))
    assert type(msg).__module__ == "policy_server.v1.policy_server_pb2"
    assert pickle.loads(pickle.dumps(msg)) == msg


def test_the_check_command_exits_zero_when_current():
    result = subprocess.run([sys.executable, "-m", "policy_server.v1.gen_proto", "--check"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.bool_])
def test_tensor_round_trip(dtype):
    rng = np.random.default_rng(0)
    array = (rng.normal(size=(3, 4)) * 10).astype(dtype)
    decoded = wire.tensor_from_proto(wire.tensor_to_proto(array), "t")
    assert decoded.dtype == array.dtype and decoded.shape == (3, 4)
    np.testing.assert_array_equal(decoded, array)


def test_big_endian_arrays_are_sent_little_endian():
    array = np.arange(5, dtype=">f4")
    msg = wire.tensor_to_proto(array)
    assert msg.data == np.arange(5, dtype="<f4").tobytes()
    np.testing.assert_array_equal(wire.tensor_from_proto(msg, "t"), array)


def test_unsupported_dtype_is_refused():
    with pytest.raises(wire.WireError) as err:
        wire.tensor_to_proto(np.zeros(2, dtype=np.complex64))
    assert err.value.reason == "BAD_DTYPE"


@pytest.mark.parametrize(
    ("tensor", "reason", "field"),
    [
        (pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[2], data=bytes(8)), "BAD_DTYPE", "s.dtype"),
        (pb.Tensor(dtype=99, shape=[2], data=bytes(8)), "BAD_DTYPE", "s.dtype"),
        (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[3], data=bytes(8)), "BAD_TENSOR", "s.data"),
        (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-2], data=bytes(8)), "BAD_TENSOR", "s.shape"),
    ],
)
def test_malformed_tensors_name_the_field(tensor, reason, field):
    with pytest.raises(wire.WireError) as err:
        wire.tensor_from_proto(tensor, "s")
    assert (err.value.reason, err.value.field) == (reason, field)


def _frame(height=48, width=64):
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 4, y * 5, (x + y) * 2], axis=-1).astype(np.uint8)


@pytest.mark.parametrize("encoding", ["png", "raw"])
def test_lossless_image_round_trip_is_exact_rgb(encoding):
    frame = _frame()
    decoded = wire.decode_image(wire.encode_image(frame, encoding), "img")
    np.testing.assert_array_equal(decoded, frame)


@pytest.mark.parametrize("encoding", ["jpeg", "png"])
@pytest.mark.parametrize("shape,hint", [((3, 32, 48), True), ((32, 48, 4), False), ((32, 48, 1), False)],
                         ids=["channels first", "rgba", "gray"])
def test_only_rgb_frames_are_encoded(encoding, shape, hint):
    with pytest.raises(wire.WireError) as err:
        wire.encode_image(np.zeros(shape, np.uint8), encoding)
    assert (err.value.field, err.value.reason) == ("image", "BAD_IMAGE")
    assert str(err.value) == (f"image: expected uint8 RGB [H, W, 3] to encode as {encoding}, got {list(shape)}"
                              + (" (channels first? the wire takes them last)" if hint else ""))


def test_jpeg_round_trip_keeps_channel_order():
    frame = np.zeros((48, 64, 3), np.uint8)
    frame[..., 0] = 200  # pure red: a BGR/RGB swap would move it to channel 2
    decoded = wire.decode_image(wire.encode_image(frame, "jpeg", jpeg_quality=95), "img")
    assert abs(float(decoded[..., 0].mean()) - 200) < 3 and decoded[..., 2].mean() < 3


def test_image_size_is_checked_from_the_header_before_decoding():
    # A PNG header claiming 40000 x 40000 px; decoding it would allocate ~4.8 GB.
    ok, buf = cv2.imencode(".png", np.zeros((2, 2, 3), np.uint8))
    data = bytearray(buf.tobytes())
    data[16:24] = (40000).to_bytes(4, "big") * 2
    msg = pb.Image(encoding=pb.IMAGE_ENCODING_PNG, data=bytes(data))
    with pytest.raises(wire.WireError) as err:
        wire.decode_image(msg, "img")
    assert err.value.reason == "SCHEMA_MISMATCH" and "40000" in err.value.got
    assert err.value.expected == f"uint8 [H, W, 3] with H and W in 1..{wire.MAX_FRAME_SIDE}"


def test_a_jpeg_without_opencv_is_a_wire_error_naming_what_to_install(monkeypatch):
    """A client that sends RAW frames may lack OpenCV; a JPEG reply (preview frames) raised ModuleNotFoundError."""
    jpeg = wire.encode_image(_frame(8, 8), "jpeg")
    monkeypatch.setitem(sys.modules, "cv2", None)  # `import cv2` fails as where it is not installed
    with pytest.raises(wire.WireError) as err:
        wire.decode_image(jpeg, "preview")
    assert str(err.value) == "preview: expected JPEG data and OpenCV to decode it (pip install " \
                             "opencv-python-headless), got no cv2 module on this machine"
    assert err.value.reason == "IMAGE_DECODE_FAILED"
    with pytest.raises(wire.WireError, match=r"image: expected RGB frames and OpenCV to encode them as png \(pip "):
        wire.encode_image(_frame(8, 8), "png")
    assert wire.decode_image(wire.encode_image(_frame(8, 8), "raw"), "raw").shape == (8, 8, 3)  # RAW needs none

@pytest.mark.parametrize("encoding", ["jpeg", "png", "raw"])
@pytest.mark.parametrize(("height", "width"), [(8, 8), (8, 2048), (2048, 8), (37, 91)])
def test_any_frame_size_within_the_bounds_decodes(encoding, height, width):
    frame = _frame(height, width)
    decoded = wire.decode_image(wire.encode_image(frame, encoding), "img", max_side=2048, min_side=8)
    assert decoded.shape == (height, width, 3) and decoded.dtype == np.uint8


@pytest.mark.parametrize("encoding", ["jpeg", "png", "raw"])
@pytest.mark.parametrize(("height", "width"), [(7, 64), (64, 7), (2049, 8), (8, 2049)])
def test_frames_outside_the_bounds_are_refused_naming_them(encoding, height, width):
    with pytest.raises(wire.WireError) as err:
        wire.decode_image(wire.encode_image(_frame(height, width), encoding), "cam", max_side=2048, min_side=8)
    assert (err.value.reason, err.value.field) == ("SCHEMA_MISMATCH", "cam")
    assert err.value.expected == "uint8 [H, W, 3] with H and W in 8..2048"
    assert f"[{height}, {width}, ...]" in err.value.got


def test_jpeg_header_size_parser_reads_sof():
    ok, buf = cv2.imencode(".jpg", np.zeros((37, 91, 3), np.uint8))
    assert wire._jpeg_size(buf.tobytes()) == (37, 91)
