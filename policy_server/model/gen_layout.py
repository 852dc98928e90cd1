"""Where each generated (GEN) row of a packed Cosmos3 sequence lives, checked once per request.

Everything here depends only on the request's layout (prompt length, latent and action shapes,
which frames are clean), not on the denoising step. `build_gen_layout` turns the index arguments of
diffusers' `Cosmos3OmniTransformer.forward` into GEN-local row tensors (joint index minus `und_len`)
and validates them; `embed_gen` can then reuse the result every step.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from policy_server.model.config import Cosmos3TransformerConfig
from policy_server.model.layers import DomainIds
from policy_server.model.rope import RotaryTables


@dataclass(frozen=True)
class ModalityLayout:
    """GEN-local rows of one modality (vision, sound or action), items packed in order."""

    rows: torch.Tensor                        # [n_tokens] row of each packed token
    token_shapes: list[tuple[int, int, int]]  # (T, h, w) per item; (T, 1, 1) for sound/action
    noisy_frame_indexes: list[torch.Tensor]   # frames (rows for sound/action) predicted, per item
    noisy_rows: torch.Tensor                  # [n_noisy] rows of noisy tokens, packed order
    readout_rows: torch.Tensor                # [n_noisy] rows the output head reads


@dataclass(frozen=True)
class GenLayout:
    """Static layout of the generated rows of one request and CFG branch.

    `key` names the request shape the layout was built for: inputs whose layouts share a key can run
    their GEN stacks as one batch (`GenInput.stack`, given one layout object per key). A layout built
    without a key gets a unique one, so it batches only with itself.
    """

    key: Hashable
    und_len: int                              # text rows before the generated ones
    num_gen: int                              # generated rows, N_gen
    rotary: RotaryTables                      # rotation tables of the generated rows, [N_gen, hd]
    vision: ModalityLayout
    vision_latent_shapes: list[tuple[int, int, int]]  # unpadded latent (T, H, W) per item
    sound: ModalityLayout | None
    action: ModalityLayout | None
    action_row_domains: DomainIds | None      # of each packed action row, [n_action_tokens]
    action_readout_domains: DomainIds | None  # of each read action row, [n_noisy_actions]
    time_rows: torch.Tensor                   # rows that get a time embedding: vision, sound, action


def require(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition``: the model's check of caller-supplied inputs."""
    if not condition:
        raise ValueError(message)


def noisy_packed_rows(noisy_frame_indexes: list[torch.Tensor], token_shapes: list[tuple[int, int, int]],
                      device: torch.device) -> torch.Tensor:
    """Packed-token indexes of every token in a noisy frame, items concatenated in order."""
    rows, start = [], 0
    for noisy, shape in zip(noisy_frame_indexes, token_shapes, strict=True):
        per_frame = shape[1] * shape[2]
        frame_rows = noisy.to(device=device, dtype=torch.long)[:, None] * per_frame
        rows.append((frame_rows + torch.arange(per_frame, device=device) + start).reshape(-1))
        start += shape[0] * per_frame
    return torch.cat(rows)


def build_gen_layout(config: Cosmos3TransformerConfig, rotary, device: torch.device, dtype: torch.dtype, *,
                     und_len: int, sequence_length: int, key: Hashable | None = None,
                     position_ids: torch.Tensor | None = None,
                     vision_tokens: list[torch.Tensor] | None = None,
                     vision_token_shapes: list[tuple[int, int, int]] | None = None,
                     vision_sequence_indexes: torch.Tensor | None = None,
                     vision_mse_loss_indexes: torch.Tensor | None = None,
                     vision_noisy_frame_indexes: list[torch.Tensor] | None = None,
                     sound_tokens: list[torch.Tensor] | None = None,
                     sound_token_shapes: list[tuple[int, int, int]] | None = None,
                     sound_sequence_indexes: torch.Tensor | None = None,
                     sound_mse_loss_indexes: torch.Tensor | None = None,
                     sound_noisy_frame_indexes: list[torch.Tensor] | None = None,
                     action_tokens: list[torch.Tensor] | None = None,
                     action_token_shapes: list[tuple[int, int, int]] | None = None,
                     action_sequence_indexes: torch.Tensor | None = None,
                     action_mse_loss_indexes: torch.Tensor | None = None,
                     action_noisy_frame_indexes: list[torch.Tensor] | None = None,
                     action_domain_ids: list[torch.Tensor] | None = None) -> GenLayout:
    """Validate the forward kwargs' GEN layout and express it in GEN-local rows.

    `rotary(position_ids, dtype) -> RotaryTables` builds the rotation tables of the generated rows;
    `key`: the request shape (`GenLayout.key`), None for a fresh one.
    Raises `ValueError` naming the argument that does not fit.
    """
    require(position_ids is not None and vision_tokens is not None and vision_token_shapes is not None
            and vision_sequence_indexes is not None and vision_mse_loss_indexes is not None
            and vision_noisy_frame_indexes is not None,
            "position_ids and all vision_* arguments are required (the diffusers forward signature)")
    num_gen = sequence_length - und_len
    require(und_len >= 0 and num_gen >= 0,
            f"need 0 <= und_len <= sequence_length, got {und_len} and {sequence_length}")
    require(position_ids.ndim in (1, 2) and position_ids.shape[-1] == sequence_length
            and (position_ids.ndim == 1 or position_ids.shape[0] == 3),
            f"position_ids must be [3, {sequence_length}] or [{sequence_length}], got {tuple(position_ids.shape)}")
    has_sound = sound_tokens is not None and sound_sequence_indexes is not None
    has_action = action_tokens is not None and action_sequence_indexes is not None
    require(not has_sound or config.sound_gen, "sound_tokens given but this model has sound_gen=False")
    require(not has_action or config.action_gen, "action_tokens given but this model has action_gen=False")

    def gen_rows(indexes: torch.Tensor, count: int, name: str) -> torch.Tensor:
        """Joint-sequence indexes -> GEN-local rows, checked to lie in the GEN part."""
        indexes = indexes.to(device=device, dtype=torch.long).reshape(-1)
        require(indexes.numel() == count, f"{name} has {indexes.numel()} entries, expected {count}")
        if count:
            low, high = (int(v) for v in torch.aminmax(indexes))
            require(low >= und_len and high < sequence_length,
                    f"{name} must index generated rows [{und_len}, {sequence_length}), got [{low}, {high}]")
        return indexes - und_len

    def modality(name: str, token_shapes, sequence_indexes, mse_loss_indexes, noisy_frame_indexes):
        require(noisy_frame_indexes is not None and len(noisy_frame_indexes) == len(token_shapes),
                f"{name}_noisy_frame_indexes needs one entry per {name} item ({len(token_shapes)})")
        shapes = [tuple(int(v) for v in shape) for shape in token_shapes]
        rows = gen_rows(sequence_indexes, sum(math.prod(s) for s in shapes), f"{name}_sequence_indexes")
        noisy = noisy_packed_rows(noisy_frame_indexes, shapes, device)
        require(mse_loss_indexes is not None, f"{name}_mse_loss_indexes is required with {name}_tokens")
        readout = gen_rows(mse_loss_indexes, noisy.numel(), f"{name}_mse_loss_indexes")
        noisy_frames = [n.to(device=device, dtype=torch.long) for n in noisy_frame_indexes]
        return ModalityLayout(rows, shapes, noisy_frames, rows[noisy], readout)

    require(len(vision_tokens) == len(vision_token_shapes),
            f"{len(vision_tokens)} vision_tokens but {len(vision_token_shapes)} vision_token_shapes")
    latent_shapes = [_latent_shape(config, latent, shape) for latent, shape in zip(
        vision_tokens, vision_token_shapes, strict=True)]
    vision = modality("vision", vision_token_shapes, vision_sequence_indexes, vision_mse_loss_indexes,
                      vision_noisy_frame_indexes)
    time_rows = [vision.noisy_rows]

    sound = None
    if has_sound:
        require(sound_token_shapes is not None and len(sound_tokens) == len(sound_token_shapes),
                "sound_tokens and sound_token_shapes need one entry per sound item")
        sound = modality("sound", sound_token_shapes, sound_sequence_indexes, sound_mse_loss_indexes,
                         sound_noisy_frame_indexes)
        time_rows.append(sound.noisy_rows)

    action = row_domains = readout_domains = None
    if has_action:
        require(action_token_shapes is not None and action_domain_ids is not None
                and len(action_tokens) == len(action_token_shapes) == len(action_domain_ids),
                "action_tokens, action_token_shapes and action_domain_ids need one entry per action item")
        action = modality("action", action_token_shapes, action_sequence_indexes, action_mse_loss_indexes,
                          action_noisy_frame_indexes)
        domains = [d.to(device=device, dtype=torch.long).reshape(1) for d in action_domain_ids]
        low, high = int(torch.cat(domains).min()), int(torch.cat(domains).max())
        require(low >= 0 and high < config.num_embodiment_domains,
                f"action domain ids must be in [0, {config.num_embodiment_domains}), got [{low}, {high}]")
        row_domains = DomainIds.of(torch.cat([d.expand(s[0]) for d, s in zip(domains, action.token_shapes,
                                                                              strict=True)]))
        readout_domains = DomainIds.of(torch.cat([d.expand(len(n)) for d, n in zip(
            domains, action.noisy_frame_indexes, strict=True)]))
        if action.readout_rows.numel() > 0:  # the reference adds no time embedding when no action row is read
            time_rows.append(action.noisy_rows)

    return GenLayout(key=object() if key is None else key, und_len=und_len, num_gen=num_gen,
                     rotary=rotary(position_ids[..., und_len:].to(device), dtype),
                     vision=vision, vision_latent_shapes=latent_shapes, sound=sound, action=action,
                     action_row_domains=row_domains, action_readout_domains=readout_domains,
                     time_rows=torch.cat(time_rows))


def _latent_shape(config: Cosmos3TransformerConfig, latent: torch.Tensor,
                  token_shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """Unpadded `(T, H, W)` of a vision latent `[1, C, T, H, W]`, checked against its patch grid."""
    c, p = config.latent_channel, config.latent_patch_size
    require(latent.ndim in (4, 5) and (latent.ndim == 4 or latent.shape[0] == 1) and latent.shape[-4] == c,
            f"vision latent must be [1, {c}, T, H, W], got {tuple(latent.shape)}")
    t, h, w = latent.shape[-3:]
    grid = (t, math.ceil(h / p), math.ceil(w / p))
    require(tuple(token_shape) == grid,
            f"vision_token_shapes entry {tuple(token_shape)} does not match the latent's patch grid {grid} "
            f"(latent T, H, W = {t}, {h}, {w}; patch {p})")
    return (t, h, w)
