"""Conditioning frames: camera images to a VAE-ready clip on a canvas, and back off the latent.

Cosmos3 action models condition on a clip placed on a canvas. An embodiment's cameras are first put side by
side as one frame (``side_by_side``: a camera shorter than the tallest scaled to its height, PIL bilinear, aspect
kept), which is then prepared as diffusers' `Cosmos3OmniPipeline` does (`prepare_clip`):
1. each frame is resized (PIL bilinear) down to multiples of the VAE's spatial compression;
2. the canvas is the one of the resolution tier's aspect-ratio bins closest to the frame's h/w;
3. the frames are downscaled to fit it with their aspect ratio kept (antialiased bicubic, never
   upscaled), anchored at the top-left corner and padded on the right and bottom (reflect, or
   replicate where the padding is wider than the content, where reflection is undefined).
After VAE encoding, the latent columns and rows that cover only padding are cropped off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.nn import functional as F

from policy_server.specs import width_beside

PAD_MODES = ("reflect", "replicate")

# Canvas bins (height, width) of each action resolution tier, in diffusers' `_ACTION_RESOLUTION_BINS` order
# (ties in aspect ratio go to the earlier bin).
RESOLUTION_TIERS: dict[int, tuple[tuple[int, int], ...]] = {
    256: ((256, 256), (256, 320), (320, 256), (192, 320), (320, 192)),
    480: ((640, 640), (544, 736), (736, 544), (480, 832), (832, 480)),
    704: ((960, 960), (832, 1088), (1088, 832), (704, 1280), (1280, 704)),
    720: ((960, 960), (832, 1104), (1104, 832), (720, 1280), (1280, 720)),
}


@dataclass(frozen=True)
class CanvasPlacement:
    """Where the content sits on the canvas (all sizes ``(height, width)`` in pixels)."""

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
    clip = torch.from_numpy(np.ascontiguousarray(frames)).permute(3, 0, 1, 2).unsqueeze(0).to(torch.float32)
    # diffusers' rounding: x / 255, then 2x - 1; in place, as a 2048 px frame's float copies take longer to
    # allocate than to compute.
    return clip.div_(255.0).mul_(2.0).sub_(1.0)


def downscale(images: Tensor, size_hw: tuple[int, int]) -> Tensor:
    """Resize images [N, C, H, W] down to ``size_hw`` (antialiased bicubic; the overshoot past [-1, 1] is
    kept, as the Cosmos3 models saw it).

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
    return F.interpolate(images, size=(target_h, target_w), mode="bicubic", align_corners=False, antialias=True)


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
    content_h, content_w = content_size(h, w, (canvas_h, canvas_w))

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
    placement = CanvasPlacement((content_h, content_w), (canvas_h, canvas_w), applied)
    return canvas, placement


def content_size(height: int, width: int, canvas_hw: tuple[int, int]) -> tuple[int, int]:
    """(h, w) of a `height` x `width` frame fitted to `canvas_hw`: aspect kept, downscaled only."""
    scale = min(canvas_hw[0] / height, canvas_hw[1] / width, 1.0)
    return max(1, int(scale * height + 0.5)), max(1, int(scale * width + 0.5))


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


def resize(frames: np.ndarray, size_hw: tuple[int, int]) -> np.ndarray:
    """uint8 RGB frames [T, H, W, 3] resized to ``size_hw`` (PIL bilinear, as diffusers' video processor does)."""
    return np.stack([np.asarray(Image.fromarray(frame).resize(size_hw[::-1], resample=Image.BILINEAR))
                     for frame in frames])


def floor_to_multiple(frames: np.ndarray, multiple: int) -> np.ndarray:
    """uint8 RGB frames [T, H, W, 3] resized (``resize``) down to the nearest multiples of ``multiple``; unchanged
    when they already are. Needs H, W >= ``multiple``."""
    _, h, w, _ = frames.shape
    size_hw = (h - h % multiple, w - w % multiple)
    return frames if size_hw == (h, w) else resize(frames, size_hw)


def side_by_side(cameras: Sequence[np.ndarray]) -> np.ndarray:
    """One embodiment's cameras, each uint8 RGB frames [T, H_i, W_i, 3] (the same T), left to right: [T, H, W, 3]
    with H the tallest camera's height. A shorter camera is first scaled to H (``resize``, aspect kept: it takes
    ``width_beside(H_i, W_i, H)`` columns); one already H tall is placed as sent, so cameras of one height are
    concatenated untouched."""
    tallest = max(frames.shape[1] for frames in cameras)
    scaled = [frames if frames.shape[1] == tallest
              else resize(frames, (tallest, width_beside(frames.shape[1], frames.shape[2], tallest)))
              for frames in cameras]
    return np.concatenate(scaled, axis=2) if len(scaled) > 1 else scaled[0]


def prepare_clip(frames: np.ndarray, num_frames: int, canvases: Sequence[tuple[int, int]], multiple: int,
                 pad_mode: str = "reflect") -> tuple[Tensor, CanvasPlacement]:
    """uint8 RGB frames [T, H, W, 3] -> the VAE-ready clip [1, 3, num_frames, canvas_h, canvas_w] in [-1, 1] on
    the closest of ``canvases``, and its placement (steps 1-3 of the module docstring)."""
    frames = floor_to_multiple(frames, multiple)
    canvas_hw = closest_canvas(frames.shape[1], frames.shape[2], canvases)
    return fit_to_canvas(frames_to_clip(frames, num_frames), canvas_hw, pad_mode=pad_mode)
