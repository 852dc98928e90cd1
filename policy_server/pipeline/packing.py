"""Sequence packing for one Cosmos3 request: `[text | vision patches | sound frames | action rows]`.

Everything here is static for a request and CFG branch; only the noisy latents and the timestep
change between denoising steps, and `PackedSequence.model_kwargs` splices them in. The result is the
keyword set of `Cosmos3OmniTransformer.forward` (the diffusers signature).

Positions follow Cosmos3's unified 3-axis mRoPE: text rows take `0..N_und-1` on all three axes; the
generation modalities start at `N_und + modality_margin`; latent frame `j` sits at
`offset + j * (base_fps / 4) / (fps / 4)`; action row `i` of the chunk sits at the time of pixel frame
`i + 1`, so it lines up with the frame it leads to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from policy_server.model.config import Cosmos3TransformerConfig

VAE_TEMPORAL_COMPRESSION = 4  # Cosmos3 video latents: 4 pixel frames per latent frame, first frame kept


def text_position_ids(num_tokens: int, float_positions: bool) -> torch.Tensor:
    """`[3, N]` positions of the text prefix; all three axes count `0..N-1`."""
    dtype = torch.float32 if float_positions else torch.long
    return torch.arange(num_tokens, dtype=dtype).expand(3, -1).contiguous()


def grid_position_ids(
    grid_t: int,
    grid_h: int,
    grid_w: int,
    temporal_offset: float,
    fps: float | None,
    base_fps: float,
    temporal_compression: int,
    base_temporal_compression: int,
    start_frame_offset: int = 0,
) -> torch.Tensor:
    """`[3, T*H*W]` (t, h, w) positions of a token grid, t-major.

    With `fps` set (fps modulation) and more than one frame, temporal positions are rescaled from the
    grid's tick rate `fps / temporal_compression` to the model's `base_fps / base_temporal_compression`
    and are fractional; otherwise they are integer frame indices. Spatial ids restart at 0.
    """
    frames = torch.arange(grid_t, dtype=torch.float32) + start_frame_offset
    modulated = fps is not None and grid_t > 1
    if modulated:
        ticks_per_s = fps / temporal_compression
        base_ticks_per_s = base_fps / base_temporal_compression
        t = frames / ticks_per_s * base_ticks_per_s + temporal_offset
    else:
        t = frames + int(temporal_offset)
    t = t.view(-1, 1).expand(-1, grid_h * grid_w).reshape(-1)
    h = torch.arange(grid_h, dtype=torch.float32).view(1, -1, 1).expand(grid_t, -1, grid_w).reshape(-1)
    w = torch.arange(grid_w, dtype=torch.float32).view(1, 1, -1).expand(grid_t, grid_h, -1).reshape(-1)
    ids = torch.stack([t, h, w])
    return ids if modulated else ids.long()


@dataclass(frozen=True)
class ActionLayout:
    """Rows of the action stream: `num_prefix` clean rows (history, then state) before the chunk."""

    chunk_size: int
    num_prefix: int
    clean_rows: tuple[int, ...]
    domain_id: int

    @property
    def num_rows(self) -> int:
        return self.num_prefix + self.chunk_size


@dataclass(frozen=True)
class RequestShape:
    """What a packed request's GEN rows and rotary tables depend on: the `pack_request` arguments but the
    prompt's words. Requests of one shape share one `GenLayout` (this is its `key`), which is what lets
    ticks run their GEN stacks as one batch."""

    und_len: int
    latent_shape: tuple[int, int, int, int]
    clean_frames: tuple[int, ...]
    fps: float
    action: ActionLayout | None
    sound_frames: int


@dataclass
class PackedSequence:
    """Static layout of one packed request (one CFG branch). Indexes are positions in the joint sequence."""

    shape: RequestShape
    und_len: int
    sequence_length: int
    input_ids: torch.Tensor  # [N_und] long
    position_ids: torch.Tensor  # [3, N] float32 (fp32 position math)
    vision_token_shape: tuple[int, int, int]  # patch grid (T, h, w)
    vision_noisy_frames: torch.Tensor  # [T_noisy] long, latent frame indices
    vision_sequence_indexes: torch.Tensor  # [T*h*w]
    vision_mse_loss_indexes: torch.Tensor  # [T_noisy*h*w]
    sound_frames: int  # noisy sound latent frames (0: no sound)
    action: ActionLayout | None
    action_noisy_rows: torch.Tensor | None  # [K_noisy] long
    action_sequence_indexes: torch.Tensor | None
    action_mse_loss_indexes: torch.Tensor | None

    @property
    def num_noisy_vision_tokens(self) -> int:
        return self.vision_mse_loss_indexes.numel()

    def model_kwargs(
        self,
        vision_latents: torch.Tensor,
        action_latents: torch.Tensor | None,
        timestep: float,
        sound_latents: torch.Tensor | None = None,
    ) -> dict:
        """Forward kwargs for one step. `vision_latents` `[C, T, H, W]`, `action_latents` `[rows, A]`,
        `sound_latents` `[C_sound, T_sound]`, `timestep` = sigma * 1000 (the scheduler timestep)."""
        device = vision_latents.device
        kwargs = dict(
            input_ids=self.input_ids,
            text_indexes=torch.arange(self.und_len, device=device),
            position_ids=self.position_ids,
            und_len=self.und_len,
            sequence_length=self.sequence_length,
            vision_tokens=[vision_latents.unsqueeze(0)],
            vision_token_shapes=[self.vision_token_shape],
            vision_sequence_indexes=self.vision_sequence_indexes,
            vision_mse_loss_indexes=self.vision_mse_loss_indexes,
            vision_timesteps=torch.full((self.num_noisy_vision_tokens,), timestep, device=device),
            vision_noisy_frame_indexes=[self.vision_noisy_frames],
        )
        if self.sound_frames:
            start = self.und_len + self.vision_sequence_indexes.numel()
            rows = torch.arange(start, start + self.sound_frames, device=device)
            kwargs.update(
                sound_tokens=[sound_latents],
                sound_token_shapes=[(self.sound_frames, 1, 1)],
                sound_sequence_indexes=rows,
                sound_mse_loss_indexes=rows,
                sound_timesteps=torch.full((self.sound_frames,), timestep, device=device),
                sound_noisy_frame_indexes=[torch.arange(self.sound_frames, device=device)],
            )
        if self.action is not None:
            kwargs.update(
                action_tokens=[action_latents],
                action_token_shapes=[(self.action.num_rows, 1, 1)],
                action_sequence_indexes=self.action_sequence_indexes,
                action_mse_loss_indexes=self.action_mse_loss_indexes,
                action_timesteps=torch.full((self.action_noisy_rows.numel(),), timestep, device=device),
                action_noisy_frame_indexes=[self.action_noisy_rows],
                action_domain_ids=[torch.tensor([self.action.domain_id], device=device)],
            )
        return kwargs


def request_shape(input_ids: list[int], latent_shape: tuple[int, int, int, int], clean_frames: list[int], fps: float,
                  action: ActionLayout | None, sound_frames: int = 0) -> RequestShape:
    """The shape of the request `pack_request` lays out from the same arguments, without laying it out."""
    return RequestShape(len(input_ids), tuple(latent_shape), tuple(clean_frames), fps, action, sound_frames)


def pack_request(
    config: Cosmos3TransformerConfig,
    input_ids: list[int],
    latent_shape: tuple[int, int, int, int],
    clean_frames: list[int],
    fps: float,
    action: ActionLayout | None,
    device: torch.device | str = "cpu",
    sound_frames: int = 0,
) -> PackedSequence:
    """Lay out one request.

    Args:
        input_ids: tokenized prompt, special tokens included.
        latent_shape: `(C, T, H, W)` of the video latent (after the canvas padding is cropped off).
        clean_frames: latent frames given as conditioning (no timestep embedding, zero velocity).
        fps: frame rate of the pixel video, Hz.
        action: action-stream layout, or None for a video-only request.
        sound_frames: noisy sound latent frames between the vision and action rows (0: none); they tick
            at `config.sound_latent_fps` from the same temporal offset as the video.
    """
    float_positions = config.enable_fps_modulation
    und_len = len(input_ids)
    text_ids = text_position_ids(und_len, float_positions)
    gen_offset = und_len + config.unified_3d_mrope_temporal_modality_margin
    fps_for_rope = fps if config.enable_fps_modulation else None

    _, latent_t, latent_h, latent_w = latent_shape
    p = config.latent_patch_size
    grid = (latent_t, math.ceil(latent_h / p), math.ceil(latent_w / p))
    per_frame = grid[1] * grid[2]
    num_vision = latent_t * per_frame
    vision_ids = grid_position_ids(
        *grid,
        temporal_offset=gen_offset,
        fps=fps_for_rope,
        base_fps=float(config.base_fps),
        temporal_compression=VAE_TEMPORAL_COMPRESSION,
        base_temporal_compression=VAE_TEMPORAL_COMPRESSION,
    )
    noisy_frames = torch.tensor([f for f in range(latent_t) if f not in set(clean_frames)], dtype=torch.long)
    vision_seq = torch.arange(und_len, und_len + num_vision)
    vision_mse = (und_len + noisy_frames.view(-1, 1) * per_frame + torch.arange(per_frame)).reshape(-1)

    segments = [text_ids.float(), vision_ids.float()]
    length = und_len + num_vision
    if sound_frames:
        segments.append(grid_position_ids(
            sound_frames, 1, 1, temporal_offset=gen_offset,
            fps=config.sound_latent_fps if config.enable_fps_modulation else None,
            base_fps=float(config.base_fps), temporal_compression=1, base_temporal_compression=1,
        ).float())
        length += sound_frames
    action_noisy = action_seq = action_mse = None
    if action is not None:
        # History/state rows precede the chunk; shift them so chunk row 0 lands on pixel frame 1.
        action_ids = grid_position_ids(
            action.num_rows,
            1,
            1,
            temporal_offset=gen_offset,
            fps=fps_for_rope,
            base_fps=float(config.base_fps),
            temporal_compression=1,
            base_temporal_compression=VAE_TEMPORAL_COMPRESSION,
            start_frame_offset=1 - action.num_prefix,
        )
        segments.append(action_ids.float())
        clean = set(action.clean_rows)
        action_noisy = torch.tensor([r for r in range(action.num_rows) if r not in clean], dtype=torch.long)
        action_seq = torch.arange(length, length + action.num_rows)
        action_mse = action_seq[action_noisy]
        length += action.num_rows

    def to_device(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return PackedSequence(
        shape=request_shape(input_ids, latent_shape, clean_frames, fps, action, sound_frames),
        und_len=und_len,
        sequence_length=length,
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        position_ids=torch.cat(segments, dim=1).to(device),
        vision_token_shape=grid,
        vision_noisy_frames=noisy_frames.to(device),
        vision_sequence_indexes=vision_seq.to(device),
        vision_mse_loss_indexes=vision_mse.to(device),
        sound_frames=sound_frames,
        action=action,
        action_noisy_rows=to_device(action_noisy),
        action_sequence_indexes=to_device(action_seq),
        action_mse_loss_indexes=to_device(action_mse),
    )
