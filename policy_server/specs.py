"""The embodiment schema a server declares: what every observation must carry and what an action is.

Plain frozen dataclasses (no torch, no protobuf) and the size rule of cameras side by side (``width_beside``),
imported by both sides of the engine: the pipeline builds them from its ``Embodiment`` models
(``Embodiment.to_spec``) and scales its cameras by that rule, and ``engine.api`` re-exports them as part of the
transport's contract (``ServerInfo.embodiments``), whose validation bounds the scaled widths. A leaf module, like
``limits``: it imports nothing of the project but ``limits``, so neither layer imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from policy_server.limits import MAX_FRAME_SIDE


class ImageEncoding(StrEnum):
    """How a camera frame travels on the wire. RAW is 8-bit RGB, row-major [H, W, C]."""

    JPEG = "jpeg"
    PNG = "png"
    RAW = "raw"


@dataclass(frozen=True)
class CameraSpec:
    """One camera the embodiment expects in every observation: uint8 RGB [H, W, channels] with both sides
    in ``min_side..max_side`` px. The model sees the embodiment's cameras side by side: a camera shorter than the
    tallest is scaled to its height first (aspect kept, ``width_beside``), and scaled it must still be at most
    ``max_side`` px wide.
    ``height`` x ``width``: the frame size to send, the one the model was trained on: the embodiment's declared
    ``camera_sizes`` (a robot trained by ``robots.train_policy``: its cameras as recorded), else the camera's share
    of the model's largest canvas (the largest frame it sees unscaled). Any size within the bounds is taken; the
    cameras side by side are downscaled to fit the canvas, never upscaled, and padded."""

    name: str
    height: int
    width: int
    channels: int = 3
    encodings: tuple[ImageEncoding, ...] = (ImageEncoding.JPEG, ImageEncoding.PNG, ImageEncoding.RAW)
    max_side: int = MAX_FRAME_SIDE
    min_side: int = 1


def width_beside(height: int, width: int, tallest: int) -> int:
    """The width (px) a ``height`` x ``width`` camera frame takes beside the embodiment's tallest camera, ``tallest``
    px high: scaled to that height with its aspect ratio kept, rounded to the nearest pixel; ``width`` when the frame
    is that tall."""
    return width if height == tallest else (2 * width * tallest + height) // (2 * height)


def too_wide_beside(sizes: Mapping[str, tuple[int, int]], max_width: Mapping[str, int]) -> tuple[str, str, int] | None:
    """Cameras' frame sizes ``(height, width)`` by name, side by side: the first camera whose frame, scaled to the
    tallest camera's height (``width_beside``), is wider than its ``max_width`` px, as ``(camera, tallest camera,
    scaled width)``; None when every one fits. Bounded so, cameras side by side are never larger than frames of one
    height at the bounds; unbounded, an 8 x 2048 px frame beside a 2048 px high one would become 2048 x 524288 px."""
    tallest = max(sizes, key=lambda name: sizes[name][0])
    for name, (height, width) in sizes.items():
        if (scaled := width_beside(height, width, sizes[tallest][0])) > max_width[name]:
            return name, tallest, scaled
    return None


def frame_sizes_outside(sizes: Mapping[str, tuple[int, int]], min_side: int) -> str | None:
    """What a server taking sides of ``min_side`` (the VAE's spatial compression) to ``MAX_FRAME_SIDE`` px
    (``CameraSpec``'s bounds) refuses of cameras' frame sizes ``(height, width)`` by name, side by side: the first
    camera with a side outside them, or one too wide beside the tallest (``too_wide_beside``), in words; None when
    it takes them all."""
    for name, (height, width) in sizes.items():
        if not (min_side <= height <= MAX_FRAME_SIDE and min_side <= width <= MAX_FRAME_SIDE):
            return (f"camera {name!r} is {height}x{width} px; expected sides of {min_side} to {MAX_FRAME_SIDE} px "
                    f"({min_side}: the VAE's spatial compression, the smallest frame side the server takes)")
    too_wide = too_wide_beside(sizes, dict.fromkeys(sizes, MAX_FRAME_SIDE))
    if too_wide is None:
        return None
    name, tallest, scaled = too_wide
    height, width = sizes[name]
    return (f"camera {name!r} is {height}x{width} px, {scaled} px wide scaled to the height of camera {tallest!r} "
            f"({sizes[tallest][0]} px, aspect kept); expected at most {MAX_FRAME_SIDE}")


@dataclass(frozen=True)
class ActionSpec:
    """The action vector of one control step: float32 [dim] in physical units.

    ``names`` / ``units`` hold one entry per dimension (or are empty).

    ``low``/``high`` are the declared per-dimension limits (empty = unbounded); the engine
    guarantees every returned action is finite and inside them. ``given_low``/``given_high``: the range the actions
    a caller gives (forward dynamics, committed actions) are accepted in, the declared limits or, without them, what
    the model's normalisation maps onto its input bound (empty: what float32 holds).
    """

    dim: int
    names: tuple[str, ...] = ()
    units: tuple[str, ...] = ()
    low: tuple[float, ...] = ()
    high: tuple[float, ...] = ()
    given_low: tuple[float, ...] = ()
    given_high: tuple[float, ...] = ()


@dataclass(frozen=True)
class EmbodimentSpec:
    """Observation and action schema of one robot type the model can drive.

    ``state_dim`` 0 means the embodiment takes no proprioceptive state; ``state_low`` /
    ``state_high`` bound each state dimension (inclusive). A chunk holds ``chunk_size`` consecutive
    actions, one per control period (1 / ``control_hz`` s).
    """

    name: str
    cameras: tuple[CameraSpec, ...]
    state_dim: int
    action: ActionSpec
    state_names: tuple[str, ...] = ()
    state_units: tuple[str, ...] = ()  # one per state dimension, or empty
    state_low: tuple[float, ...] = ()
    state_high: tuple[float, ...] = ()
    default_chunk_size: int = 8
    min_chunk_size: int = 1
    max_chunk_size: int = 8
    control_hz: float = 10.0

    def camera(self, name: str) -> CameraSpec | None:
        return next((c for c in self.cameras if c.name == name), None)
