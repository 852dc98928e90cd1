"""numpy <-> protobuf conversion for tensors and images, shared by the server and the client.

Decoding is strict: every malformed payload raises ``WireError`` naming the field, what was
expected and what arrived. Nothing here unpickles or evaluates anything: tensors are raw
little-endian bytes with an explicit dtype and shape, images are JPEG/PNG decoded by OpenCV (after
their header size has been checked, so a tiny file cannot claim a huge frame) or raw RGB bytes.
OpenCV is imported by the functions that code JPEG / PNG, so a client that sends RAW frames never loads it.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from policy_server.limits import MAX_FRAME_SIDE
from policy_server.v1 import policy_server_pb2 as pb

# Wire dtype <-> numpy dtype (explicitly little-endian).
DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT64: np.dtype("<f8"),
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_UINT8: np.dtype("u1"),
    pb.DTYPE_BOOL: np.dtype("?"),
}
_DTYPE_BY_NUMPY = {dt: code for code, dt in DTYPES.items()}

MAX_TENSOR_DIMS = 32  # numpy's own limit is 64
MAX_TENSOR_BYTES = 1 << 31  # far above any message; below what numpy refuses to shape

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_JPEG_MAGIC = b"\xff\xd8\xff"


class WireError(ValueError):
    """A payload that cannot be decoded. ``reason`` is the machine-readable code."""

    def __init__(self, field: str, expected: str, got: str, reason: str) -> None:
        super().__init__(f"{field}: expected {expected}, got {got}")
        self.field, self.expected, self.got, self.reason = field, expected, got, reason


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------


def tensor_to_proto(array: np.ndarray) -> pb.Tensor:
    """Encode an array of a supported dtype (C order, little-endian on the wire)."""
    array = np.asarray(array)
    little = array.dtype.newbyteorder("<") if array.dtype.itemsize > 1 else array.dtype
    code = _DTYPE_BY_NUMPY.get(little)
    if code is None:
        raise WireError(
            "tensor.dtype", f"one of {sorted(str(d) for d in DTYPES.values())}", str(array.dtype), "BAD_DTYPE"
        )
    data = np.ascontiguousarray(array, dtype=DTYPES[code]).tobytes()
    return pb.Tensor(dtype=code, shape=list(array.shape), data=data)


def tensor_from_proto(tensor: pb.Tensor, field: str) -> np.ndarray:
    """Decode a Tensor; checks the dtype code, the shape and the byte length. Returns a
    read-only native-endian array."""
    dtype = DTYPES.get(tensor.dtype)
    if dtype is None:
        name = pb.DType.Name(tensor.dtype) if tensor.dtype in pb.DType.values() else str(tensor.dtype)
        raise WireError(f"{field}.dtype", f"one of {[pb.DType.Name(c) for c in DTYPES]}", name, "BAD_DTYPE")
    shape = tuple(int(s) for s in tensor.shape)
    # Even an empty tensor's other dimensions must fit: numpy refuses shapes it could never hold.
    extent = math.prod(max(s, 1) for s in shape) * dtype.itemsize
    if any(s < 0 for s in shape) or len(shape) > MAX_TENSOR_DIMS or extent > MAX_TENSOR_BYTES:
        shown = f"{len(shape)} dimensions" if len(shape) > MAX_TENSOR_DIMS else str(list(shape))
        raise WireError(f"{field}.shape", f"at most {MAX_TENSOR_DIMS} non-negative dimensions spanning at most "
                        f"{MAX_TENSOR_BYTES} bytes", shown, "BAD_TENSOR")
    expected_bytes = math.prod(shape) * dtype.itemsize  # exact: a numpy product can overflow to a match
    if len(tensor.data) != expected_bytes:
        raise WireError(
            f"{field}.data",
            f"{expected_bytes} bytes for shape {list(shape)} {dtype}",
            f"{len(tensor.data)} bytes",
            "BAD_TENSOR",
        )
    return np.frombuffer(tensor.data, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="), copy=False)


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------


def encode_image(image: np.ndarray, encoding: str = "jpeg", jpeg_quality: int = 90, field: str = "image") -> pb.Image:
    """Encode uint8 RGB [H, W, 3] as JPEG, PNG or RAW; an error names the frame as `field`."""
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3:
        raise WireError(field, "uint8 [H, W, C]", f"{image.dtype} {list(image.shape)}", "BAD_IMAGE")
    height, width, channels = image.shape
    kind = encoding.lower()
    if kind == "raw":
        return pb.Image(
            encoding=pb.IMAGE_ENCODING_RAW,
            height=height,
            width=width,
            channels=channels,
            data=np.ascontiguousarray(image).tobytes(),
        )
    if channels != 3:  # what the codecs carry and every camera sends
        hint = " (channels first? the wire takes them last)" if image.shape[0] in (1, 3, 4) else ""
        raise WireError(field, f"uint8 RGB [H, W, 3] to encode as {kind}", f"{list(image.shape)}{hint}", "BAD_IMAGE")
    cv2 = _opencv(field, f"RGB frames and OpenCV to encode them as {kind}", "BAD_IMAGE")
    # OpenCV encodes BGR; the wire is RGB.
    bgr = cv2.cvtColor(image, cv2.COLOR_RGB2BGR)
    if kind == "jpeg":
        if not 0 <= jpeg_quality <= 100:
            raise WireError("jpeg_quality", "0..100", repr(jpeg_quality), "BAD_VALUE")
        ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, int(jpeg_quality)])
        code = pb.IMAGE_ENCODING_JPEG
    elif kind == "png":
        ok, buf = cv2.imencode(".png", bgr)
        code = pb.IMAGE_ENCODING_PNG
    else:
        raise WireError("encoding", "jpeg, png or raw", repr(encoding), "UNKNOWN_ENCODING")
    if not ok:
        raise WireError("image", f"an image OpenCV can encode as {kind}", f"{image.shape}", "BAD_IMAGE")
    return pb.Image(encoding=code, height=height, width=width, channels=channels, data=buf.tobytes())


def _png_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from the IHDR chunk, or None if the header is malformed."""
    if len(data) < 24 or data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", data[16:24])
    return height, width


# JPEG start-of-frame markers carry the frame size; C4 (DHT), C8 (JPG) and CC (DAC) share the range.
_SOF_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from the first SOF segment, or None if no well-formed SOF is found."""
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # markers without a length
            pos += 2
            continue
        (length,) = struct.unpack(">H", data[pos + 2 : pos + 4])
        if marker in _SOF_MARKERS:
            if pos + 9 > len(data):
                return None
            height, width = struct.unpack(">HH", data[pos + 5 : pos + 9])
            return height, width
        pos += 2 + length
    return None


def _opencv(field: str, expected: str, reason: str):
    """The cv2 module; WireError without it (a client that sends RAW frames may go without OpenCV, until it encodes a
    JPEG or a reply carries one)."""
    try:
        import cv2
    except ImportError:
        raise WireError(field, f"{expected} (pip install opencv-python-headless)", "no cv2 module on this machine",
                        reason) from None
    return cv2


def decode_image(image: pb.Image, field: str, max_side: int = MAX_FRAME_SIDE, min_side: int = 1,
                 channels: int = 3) -> np.ndarray:
    """Decode one camera frame and check it is uint8 RGB [H, W, channels] with H and W in ``min_side..max_side``.

    Raises WireError with reason UNKNOWN_ENCODING, IMAGE_DECODE_FAILED (also for a JPEG / PNG without OpenCV),
    BAD_IMAGE or SCHEMA_MISMATCH (a side outside the bounds, or the wrong channel count).
    """
    expected = f"uint8 [H, W, {channels}] with H and W in {min_side}..{max_side}"

    def check_size(height: int, width: int, kind: str) -> None:
        if not (min_side <= height <= max_side and min_side <= width <= max_side):
            raise WireError(field, expected, f"{kind} [{height}, {width}, ...]", "SCHEMA_MISMATCH")

    if image.encoding == pb.IMAGE_ENCODING_RAW:
        got_shape = (image.height, image.width, image.channels)
        if 0 in got_shape:
            raise WireError(
                f"{field}",
                f"RAW images to set height and width (in {min_side}..{max_side}) and channels ({channels})",
                f"[{image.height}, {image.width}, {image.channels}]",
                "MISSING_FIELD",
            )
        check_size(image.height, image.width, "RAW")
        if image.channels != channels:
            raise WireError(field, expected, f"RAW {list(got_shape)}", "SCHEMA_MISMATCH")
        height, width = image.height, image.width
        if len(image.data) != height * width * channels:
            raise WireError(
                f"{field}.data",
                f"{height * width * channels} bytes for RAW {list(got_shape)}",
                f"{len(image.data)} bytes",
                "BAD_IMAGE",
            )
        return np.frombuffer(image.data, dtype=np.uint8).reshape(got_shape)

    if image.encoding not in (pb.IMAGE_ENCODING_JPEG, pb.IMAGE_ENCODING_PNG):
        name = (
            pb.ImageEncoding.Name(image.encoding)
            if image.encoding in pb.ImageEncoding.values()
            else str(image.encoding)
        )
        raise WireError(f"{field}.encoding", "IMAGE_ENCODING_JPEG, _PNG or _RAW", name, "UNKNOWN_ENCODING")

    data = bytes(image.data)
    is_png = image.encoding == pb.IMAGE_ENCODING_PNG
    kind = "PNG" if is_png else "JPEG"
    magic_ok = data.startswith(_PNG_MAGIC) if is_png else data.startswith(_JPEG_MAGIC)
    size = (_png_size(data) if is_png else _jpeg_size(data)) if magic_ok else None
    if size is None:
        raise WireError(
            field,
            f"{kind} data",
            f"{len(data)} bytes that are not a valid {kind} header",
            "IMAGE_DECODE_FAILED",
        )
    # Size check before decoding: a few hundred bytes can declare a gigapixel frame.
    check_size(*size, kind)
    if (image.height or image.width) and (image.height, image.width) != size:
        raise WireError(
            f"{field}.height",
            f"the declared size to match the {kind} data {list(size)}",
            f"[{image.height}, {image.width}]",
            "BAD_IMAGE",
        )
    cv2 = _opencv(field, f"{kind} data and OpenCV to decode it", "IMAGE_DECODE_FAILED")
    decoded = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_UNCHANGED)
    if decoded is None:
        raise WireError(
            field, f"{kind} data", f"{len(data)} bytes OpenCV cannot decode", "IMAGE_DECODE_FAILED"
        )
    got_channels = 1 if decoded.ndim == 2 else decoded.shape[2]
    if image.channels and image.channels != got_channels:
        raise WireError(f"{field}.channels", f"the declared channels to match the {kind} data ({got_channels})",
                        str(image.channels), "BAD_IMAGE")
    if decoded.dtype != np.uint8 or got_channels != channels:
        raise WireError(
            field, expected, f"{kind} {decoded.dtype} with {got_channels} channel(s)", "SCHEMA_MISMATCH"
        )
    return cv2.cvtColor(decoded, cv2.COLOR_BGR2RGB) if channels == 3 else decoded
