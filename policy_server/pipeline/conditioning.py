"""Conditioning frames: camera images to a VAE-ready clip on a fixed canvas, and back off the latent.

Cosmos3 action models condition on a clip placed on a canvas of fixed size: the frames are
downscaled with their aspect ratio kept (never upscaled), anchored at the top-left corner and
padded on the right and bottom (reflect, or replicate where the padding is wider than the
content, where reflection is undefined). After VAE encoding, the latent columns and rows that
cover only padding are cropped off before packing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

PAD_MODES = ("reflect", "replicate")


@dataclass(frozen=True)
class CanvasPlacement:
    """Where the content sits on the canvas (all sizes ``(height, width)`` in pixels)."""

    source_hw: tuple[int, int]
    content_hw: tuple[int, int]
    canvas_hw: tuple[int, int]
    pad_mode: str  # the mode actually applied; "none" when the content fills the canvas

    def latent_content_hw(self, spatial_compression: int) -> tuple[int, int]:
        """Latent rows and columns that hold content (at least one each)."""
        h, w = self.content_hw
        return max(h // spatial_compression, 1), max(w // spatial_compression, 1)


def frames_to_clip(frames: np.ndarray, num_frames: int | None = None) -> Tensor:
    """uint8 RGB frames [H, W, 3] or [T, H, W, 3] -> float clip [1, 3, T', H, W] in [-1, 1].

    A single image is repeated to ``num_frames`` frames; a shorter video is extended by repeating
    its last frame and a longer one truncated (the policy conditions on the leading frames).
    """
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8:
        raise ValueError(
            f"frames must be a uint8 numpy array [H, W, 3] or [T, H, W, 3], got "
            f"{type(frames).__name__} {getattr(frames, 'dtype', '')}"
        )
    if frames.ndim == 3:
        frames = frames[None]
    if frames.ndim != 4 or frames.shape[-1] != 3 or min(frames.shape[:3]) < 1:
        raise ValueError(f"frames have shape {frames.shape}; expected [H, W, 3] or [T, H, W, 3] RGB")
    if num_frames is not None:
        if num_frames < 1:
            raise ValueError(f"num_frames={num_frames}; expected at least 1")
        index = np.minimum(np.arange(num_frames), len(frames) - 1)
        frames = frames[index]
    clip = torch.from_numpy(np.ascontiguousarray(frames)).permute(3, 0, 1, 2).unsqueeze(0)
    return clip.to(torch.float32) / 127.5 - 1.0


def downscale(images: Tensor, size_hw: tuple[int, int]) -> Tensor:
    """Resize images [N, C, H, W] down to ``size_hw`` (antialiased bicubic, clamped to [-1, 1]).

    Raises ``ValueError`` if either side would grow: upscaling invents detail the model never saw.
    """
    h, w = images.shape[-2:]
    target_h, target_w = size_hw
    if target_h > h or target_w > w:
        raise ValueError(f"cannot resize {h}x{w} to {target_h}x{target_w}: only downscaling is allowed")
    if target_h < 1 or target_w < 1:
        raise ValueError(f"target size {target_h}x{target_w} must be at least 1x1")
    if (target_h, target_w) == (h, w):
        return images
    resized = F.interpolate(images, size=(target_h, target_w), mode="bicubic", align_corners=False, antialias=True)
    return resized.clamp(-1.0, 1.0)


def fit_to_canvas(
    clip: Tensor, canvas_hw: tuple[int, int], pad_mode: str = "reflect"
) -> tuple[Tensor, CanvasPlacement]:
    """Place ``clip`` [B, C, T, H, W] on a canvas: downscale to fit (aspect kept), pad right/bottom.

    Returns the canvas clip [B, C, T, canvas_h, canvas_w] and its ``CanvasPlacement``.
    """
    if pad_mode not in PAD_MODES:
        raise ValueError(f"pad_mode={pad_mode!r}; expected one of {PAD_MODES}")
    if not isinstance(clip, Tensor) or clip.ndim != 5 or not clip.is_floating_point():
        raise ValueError(f"clip must be a float tensor [B, C, T, H, W], got {tuple(getattr(clip, 'shape', ()))}")
    canvas_h, canvas_w = (int(s) for s in canvas_hw)
    if canvas_h < 1 or canvas_w < 1:
        raise ValueError(f"canvas {canvas_h}x{canvas_w} must be at least 1x1")
    b, c, t, h, w = clip.shape
    scale = min(canvas_h / h, canvas_w / w, 1.0)
    content_h, content_w = max(1, int(scale * h + 0.5)), max(1, int(scale * w + 0.5))
    # Rounding may overshoot by one pixel on the side that defines the scale.
    content_h, content_w = min(content_h, canvas_h), min(content_w, canvas_w)

    images = clip.transpose(1, 2).reshape(b * t, c, h, w)
    images = downscale(images, (content_h, content_w))
    pad_bottom, pad_right = canvas_h - content_h, canvas_w - content_w
    applied = "none"
    if pad_bottom or pad_right:
        # Reflection needs padding narrower than the content; fall back to replication otherwise.
        reflect_possible = pad_bottom < content_h and pad_right < content_w
        applied = "reflect" if pad_mode == "reflect" and reflect_possible else "replicate"
        images = F.pad(images, (0, pad_right, 0, pad_bottom), mode=applied)
    canvas = images.reshape(b, t, c, canvas_h, canvas_w).transpose(1, 2)
    placement = CanvasPlacement((h, w), (content_h, content_w), (canvas_h, canvas_w), applied)
    return canvas, placement


def crop_latent_padding(latents: Tensor, placement: CanvasPlacement, spatial_compression: int) -> Tensor:
    """Drop latent rows/columns that cover only canvas padding: [B, C, T, h, w] -> [B, C, T, h', w']."""
    canvas_h, canvas_w = placement.canvas_hw
    expected = (canvas_h // spatial_compression, canvas_w // spatial_compression)
    if latents.ndim != 5 or tuple(latents.shape[-2:]) != expected:
        raise ValueError(
            f"latents have shape {tuple(latents.shape)}; expected [B, C, T, {expected[0]}, {expected[1]}] "
            f"for a {canvas_h}x{canvas_w} canvas at spatial compression {spatial_compression}"
        )
    rows, cols = placement.latent_content_hw(spatial_compression)
    return latents[..., :rows, :cols].contiguous()


def closest_canvas(height: int, width: int, canvases: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The canvas ``(h, w)`` whose aspect ratio h/w is closest to that of a ``height`` x ``width`` image."""
    if not canvases:
        raise ValueError("no canvases to choose from")
    ratio = height / width
    return min(canvases, key=lambda hw: abs(hw[0] / hw[1] - ratio))
