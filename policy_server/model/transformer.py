"""`Cosmos3OmniTransformer`: the Cosmos3 Mixture-of-Transformers generator, split at the cacheable boundary.

Config fields, `state_dict` keys and the `forward` signature/return value are those of diffusers'
`Cosmos3OmniTransformer` (0.42.1), so published `transformer/` checkpoints load unchanged. Besides
`forward`, the model exposes the boundary the sampler and SeaCache work with (docs/ARCHITECTURE.md):

    und_kv = model.prefill_und(input_ids, position_ids[:, :und_len])   # once per request and CFG branch
    gen = model.embed_gen(**forward_kwargs)                            # every step
    vision, sound, action = model.heads(model.gen_stack(gen, und_kv), gen)

which equals `model.forward(**forward_kwargs, return_dict=False)`. The reasoner (autoregressive text)
runs through `reasoner_forward` with its own KV cache and never crosses this boundary.

Packed layout (no batch dim): the joint sequence is `[text (UND) | vision patches | sound | actions]`;
rows before `und_len` are UND, the rest GEN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from policy_server.model.boundary import GenInput, UndKV
from policy_server.model.config import Cosmos3TransformerConfig
from policy_server.model.decoder import Cosmos3MoTDecoderLayer
from policy_server.model.layers import (
    DomainAwareLinear,
    TimestepEmbedding,
    make_rms_norm,
    sinusoidal_timestep_features,
)
from policy_server.model.reasoner_cache import ReasonerKVCache
from policy_server.model.rope import MultimodalRotaryEmbedding

TIMESTEP_FEATURES = 256  # sinusoid width fed to `time_embedder`


@dataclass
class Cosmos3OmniTransformerOutput:
    """`forward(..., return_dict=True)` result: per-item velocity predictions."""

    sample: list[torch.Tensor]                # vision, each [1, C_lat, T, H, W]; zeros on clean frames
    sound: list[torch.Tensor] | None = None   # each [sound_dim, T]
    action: list[torch.Tensor] | None = None  # each [T, action_dim]; zeros on clean rows


def _noisy_packed_rows(noisy_frame_indexes: list[torch.Tensor], token_shapes: list[tuple[int, int, int]],
                       device: torch.device) -> torch.Tensor:
    """Packed-row indexes of every token in a noisy frame, items concatenated in order."""
    rows, start = [], 0
    for noisy, shape in zip(noisy_frame_indexes, token_shapes, strict=True):
        per_frame = shape[1] * shape[2]
        frame_rows = noisy.to(device=device, dtype=torch.long)[:, None] * per_frame
        rows.append((frame_rows + torch.arange(per_frame, device=device) + start).reshape(-1))
        start += shape[0] * per_frame
    return torch.cat(rows)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


class Cosmos3OmniTransformer(nn.Module):
    """Cosmos3 MoT transformer (UND + GEN pathways per layer, shared mRoPE, modality heads)."""

    def __init__(self, config: Cosmos3TransformerConfig):
        super().__init__()
        self.config = c = config
        d = c.hidden_size
        self.embed_tokens = nn.Embedding(c.vocab_size, d)
        self.layers = nn.ModuleList(Cosmos3MoTDecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = make_rms_norm(d, c.rms_norm_eps, c.nemotron_backbone)
        self.norm_moe_gen = make_rms_norm(d, c.rms_norm_eps, c.nemotron_backbone)
        self.rotary_emb = MultimodalRotaryEmbedding(c.head_dim, c.rope_theta, c.rope_axes_dim)
        self.lm_head = nn.Linear(d, c.vocab_size, bias=False)
        self.proj_in = nn.Linear(c.patch_latent_dim, d)
        self.proj_out = nn.Linear(d, c.patch_latent_dim)
        self.time_embedder = TimestepEmbedding(TIMESTEP_FEATURES, d)
        if c.action_gen:
            self.action_proj_in = DomainAwareLinear(c.action_dim, d, c.num_embodiment_domains)
            self.action_proj_out = DomainAwareLinear(d, c.action_dim, c.num_embodiment_domains)
            self.action_modality_embed = nn.Parameter(torch.zeros(d))
        if c.sound_gen:
            self.audio_proj_in = nn.Linear(c.sound_dim, d)
            self.audio_proj_out = nn.Linear(d, c.sound_dim)
            self.audio_modality_embed = nn.Parameter(torch.zeros(d))

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the hidden rows (the time embedder alone may stay fp32)."""
        return self.proj_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_in.weight.device

    # ------------------------------------------------------------------ UND (text) prefill

    def prefill_und(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> UndKV:
        """Text ids `[N_und]` at mRoPE positions `[3, N_und]` -> per-layer K/V the GEN pathway reads."""
        _require(input_ids.ndim == 1, f"input_ids must be [N_und], got {tuple(input_ids.shape)}")
        _require(position_ids.shape[-1] == input_ids.shape[0],
                 f"position_ids must cover {input_ids.shape[0]} text rows, got {tuple(position_ids.shape)}")
        return self._und_stack_kv(self.embed_tokens(input_ids), position_ids)

    def _und_stack_kv(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> UndKV:
        c = self.config
        if hidden.shape[0] == 0:
            empty = hidden.new_zeros((c.num_key_value_heads, 0, c.head_dim))
            return UndKV([empty] * c.num_hidden_layers, [empty] * c.num_hidden_layers)
        cos, sin = self.rotary_emb(position_ids, hidden.dtype)
        keys, values = [], []
        for layer in self.layers:
            hidden, k, v = layer.forward_und(hidden, cos, sin)
            keys.append(k.contiguous())
            values.append(v.contiguous())
        return UndKV(keys, values)

    # ------------------------------------------------------------------ GEN embedding (every step)

    def gen_rotary(self, position_ids: torch.Tensor, und_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary `cos, sin [N_gen, hd]` of the generated rows; static per request, so reusable."""
        return self.rotary_emb(position_ids[..., und_len:], self.dtype)

    def embed_gen(
        self,
        input_ids: torch.Tensor | None = None,
        text_indexes: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        und_len: int = 0,
        sequence_length: int = 0,
        vision_tokens: list[torch.Tensor] | None = None,
        vision_token_shapes: list[tuple[int, int, int]] | None = None,
        vision_sequence_indexes: torch.Tensor | None = None,
        vision_mse_loss_indexes: torch.Tensor | None = None,
        vision_timesteps: torch.Tensor | None = None,
        vision_noisy_frame_indexes: list[torch.Tensor] | None = None,
        sound_tokens: list[torch.Tensor] | None = None,
        sound_token_shapes: list[tuple[int, int, int]] | None = None,
        sound_sequence_indexes: torch.Tensor | None = None,
        sound_mse_loss_indexes: torch.Tensor | None = None,
        sound_timesteps: torch.Tensor | None = None,
        sound_noisy_frame_indexes: list[torch.Tensor] | None = None,
        action_tokens: list[torch.Tensor] | None = None,
        action_token_shapes: list[tuple[int, int, int]] | None = None,
        action_sequence_indexes: torch.Tensor | None = None,
        action_mse_loss_indexes: torch.Tensor | None = None,
        action_timesteps: torch.Tensor | None = None,
        action_noisy_frame_indexes: list[torch.Tensor] | None = None,
        action_domain_ids: list[torch.Tensor] | None = None,
        return_dict: bool = True,
        gen_rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> GenInput:
        """Embed the generated rows of one step. Takes `forward`'s keyword arguments.

        Text arguments (`input_ids`, `text_indexes`) and `return_dict` are accepted and ignored, so one
        kwargs dict serves both calls. `gen_rotary` may pass `gen_rotary(position_ids, und_len)`
        computed once per request. Vision patches get `proj_in`, sound rows `audio_proj_in` +
        `audio_modality_embed`, action rows `action_proj_in` (per domain) + `action_modality_embed`;
        noisy rows then get the timestep embedding of `timesteps * timestep_scale`.
        """
        del input_ids, text_indexes, return_dict
        c = self.config
        _require(position_ids is not None and vision_tokens is not None and vision_token_shapes is not None
                 and vision_sequence_indexes is not None and vision_mse_loss_indexes is not None
                 and vision_timesteps is not None and vision_noisy_frame_indexes is not None,
                 "position_ids and all vision_* arguments are required (the diffusers forward signature)")
        num_gen = sequence_length - und_len
        _require(und_len >= 0 and num_gen >= 0,
                 f"need 0 <= und_len <= sequence_length, got {und_len} and {sequence_length}")
        _require(position_ids.shape[-1] == sequence_length,
                 f"position_ids must be [3, {sequence_length}] or [{sequence_length}], "
                 f"got {tuple(position_ids.shape)}")
        dtype, device = self.dtype, self.device
        has_sound = sound_tokens is not None and sound_sequence_indexes is not None
        has_action = action_tokens is not None and action_sequence_indexes is not None
        _require(not has_sound or c.sound_gen, "sound_tokens given but this model has sound_gen=False")
        _require(not has_action or c.action_gen, "action_tokens given but this model has action_gen=False")

        def gen_rows(indexes: torch.Tensor, count: int, name: str) -> torch.Tensor:
            """Joint-sequence indexes -> GEN-local rows, checked to lie in the GEN part."""
            indexes = indexes.to(device=device, dtype=torch.long).reshape(-1)
            _require(indexes.numel() == count, f"{name} has {indexes.numel()} entries, expected {count}")
            if count:
                low, high = (int(v) for v in torch.aminmax(indexes))
                _require(low >= und_len and high < sequence_length,
                         f"{name} must index generated rows [{und_len}, {sequence_length}), "
                         f"got [{low}, {high}]")
            return indexes - und_len

        blocks: list[tuple[torch.Tensor, torch.Tensor]] = []  # (GEN rows, embedded rows)
        noisy_rows: list[torch.Tensor] = []                    # GEN rows that get a time embedding
        timesteps: list[torch.Tensor] = []

        # Vision: pad to the patch grid, patchify, project.
        patches, latent_shapes = self._patchify(vision_tokens, vision_token_shapes)
        rows = gen_rows(vision_sequence_indexes, patches.shape[0], "vision_sequence_indexes")
        blocks.append((rows, self.proj_in(patches.to(dtype))))
        noisy = _noisy_packed_rows(vision_noisy_frame_indexes, vision_token_shapes, device)
        _require(vision_timesteps.numel() == noisy.numel(),
                 f"vision_timesteps has {vision_timesteps.numel()} entries, expected one per noisy patch "
                 f"({noisy.numel()})")
        noisy_rows.append(rows[noisy])
        timesteps.append(vision_timesteps.reshape(-1))
        vision_readout = gen_rows(vision_mse_loss_indexes, noisy.numel(), "vision_mse_loss_indexes")

        sound_readout = None
        if has_sound:
            _require(len(sound_tokens) == len(sound_token_shapes) == len(sound_noisy_frame_indexes),
                     "sound_tokens, sound_token_shapes and sound_noisy_frame_indexes need one entry per item")
            packed = torch.cat([s[:, : shape[0]].T
                                for s, shape in zip(sound_tokens, sound_token_shapes, strict=True)])
            _require(packed.shape[1] == c.sound_dim, f"sound tokens must have {c.sound_dim} channels")
            rows = gen_rows(sound_sequence_indexes, packed.shape[0], "sound_sequence_indexes")
            blocks.append((rows, self.audio_proj_in(packed.to(dtype)) + self.audio_modality_embed))
            noisy = _noisy_packed_rows(sound_noisy_frame_indexes, sound_token_shapes, device)
            _require(sound_timesteps is not None and sound_timesteps.numel() == noisy.numel(),
                     f"sound_timesteps must have one entry per noisy sound row ({noisy.numel()})")
            noisy_rows.append(rows[noisy])
            timesteps.append(sound_timesteps.reshape(-1))
            sound_readout = gen_rows(sound_mse_loss_indexes, noisy.numel(), "sound_mse_loss_indexes")

        action_readout = action_readout_domains = None
        if has_action:
            _require(action_domain_ids is not None
                     and len(action_tokens) == len(action_token_shapes) == len(action_noisy_frame_indexes)
                     == len(action_domain_ids),
                     "action_tokens, action_token_shapes, action_noisy_frame_indexes and action_domain_ids "
                     "must have one entry per item")
            items = list(zip(action_tokens, action_token_shapes, action_domain_ids, strict=True))
            packed = torch.cat([a[: shape[0]] for a, shape, _ in items])
            _require(packed.ndim == 2 and packed.shape[1] == c.action_dim,
                     f"action tokens must be [T, {c.action_dim}], got rows of {tuple(packed.shape[1:])}")
            row_domains = torch.cat([d.reshape(1).expand(shape[0]) for _, shape, d in items])
            rows = gen_rows(action_sequence_indexes, packed.shape[0], "action_sequence_indexes")
            embedded = self.action_proj_in(packed.to(dtype), row_domains) + self.action_modality_embed
            blocks.append((rows, embedded))
            noisy = _noisy_packed_rows(action_noisy_frame_indexes, action_token_shapes, device)
            action_readout = gen_rows(action_mse_loss_indexes, noisy.numel(), "action_mse_loss_indexes")
            if action_readout.numel() > 0:  # the reference adds no time embedding when no action row is read
                _require(action_timesteps is not None and action_timesteps.numel() == noisy.numel(),
                         f"action_timesteps must have one entry per noisy action row ({noisy.numel()})")
                noisy_rows.append(rows[noisy])
                timesteps.append(action_timesteps.reshape(-1))
            action_readout_domains = torch.cat([
                d.reshape(1).expand(len(n))
                for d, n in zip(action_domain_ids, action_noisy_frame_indexes, strict=True)
            ])

        hidden = torch.zeros((num_gen, c.hidden_size), dtype=dtype, device=device)
        for rows, embedded in blocks:
            hidden.index_copy_(0, rows, embedded)
        hidden.index_add_(0, torch.cat(noisy_rows), self._timestep_embedding(torch.cat(
            [t.to(device=device, dtype=torch.float32) for t in timesteps])))

        cos, sin = gen_rotary if gen_rotary is not None else self.gen_rotary(position_ids, und_len)
        _require(cos.shape[0] == num_gen, f"gen_rotary must cover {num_gen} generated rows, has {len(cos)}")
        return GenInput(
            hidden=hidden, cos=cos, sin=sin, und_len=und_len,
            vision_token_shapes=[tuple(s) for s in vision_token_shapes], vision_latent_shapes=latent_shapes,
            vision_noisy_frame_indexes=list(vision_noisy_frame_indexes), vision_readout_rows=vision_readout,
            sound_token_shapes=sound_token_shapes if has_sound else None,
            sound_noisy_frame_indexes=sound_noisy_frame_indexes if has_sound else None,
            sound_readout_rows=sound_readout,
            action_token_shapes=action_token_shapes if has_action else None,
            action_noisy_frame_indexes=action_noisy_frame_indexes if has_action else None,
            action_readout_rows=action_readout, action_readout_domain_ids=action_readout_domains,
        )

    def _timestep_embedding(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Scheduler timesteps `[N]` (sigma * 1000) -> `[N, D]` in the model dtype (MLP in its own dtype)."""
        features = sinusoidal_timestep_features(timesteps * self.config.timestep_scale, TIMESTEP_FEATURES)
        embed_dtype = self.time_embedder.linear_1.weight.dtype
        return self.time_embedder(features.to(embed_dtype)).to(self.dtype)

    def _patchify(self, vision_tokens: list[torch.Tensor], token_shapes: list[tuple[int, int, int]]):
        """Latents `[1, C, T, H, W]` -> packed patches `[sum T*h*w, p*p*C]` (t, h, w major; p, q, c minor).

        Odd H/W are zero-padded up to the patch size; the unpadded `(T, H, W)` is returned per item.
        """
        c, p = self.config.latent_channel, self.config.latent_patch_size
        _require(len(vision_tokens) == len(token_shapes),
                 f"{len(vision_tokens)} vision_tokens but {len(token_shapes)} vision_token_shapes")
        packed, latent_shapes = [], []
        for latent, shape in zip(vision_tokens, token_shapes, strict=True):
            if latent.ndim == 5:
                _require(latent.shape[0] == 1, f"vision latent batch must be 1, got {tuple(latent.shape)}")
                latent = latent[0]
            _require(latent.ndim == 4 and latent.shape[0] == c,
                     f"vision latent must be [1, {c}, T, H, W], got {tuple(latent.shape)}")
            t, h, w = latent.shape[1:]
            grid = (t, math.ceil(h / p), math.ceil(w / p))
            _require(tuple(shape) == grid, f"vision_token_shapes entry {tuple(shape)} does not match the "
                     f"latent's patch grid {grid} (latent T, H, W = {t}, {h}, {w}; patch {p})")
            if h % p or w % p:
                latent = torch.nn.functional.pad(latent, (0, grid[2] * p - w, 0, grid[1] * p - h))
            patches = latent.reshape(c, t, grid[1], p, grid[2], p).permute(1, 2, 4, 3, 5, 0)
            packed.append(patches.reshape(-1, p * p * c))
            latent_shapes.append((t, h, w))
        return torch.cat(packed), latent_shapes

    # ------------------------------------------------------------------ GEN stack (what SeaCache skips)

    def gen_stack(self, gen: GenInput, und_kv: UndKV) -> torch.Tensor:
        """All layers' GEN pathway against cached text K/V, then `norm_moe_gen`: `[N_gen, D]`."""
        _require(und_kv.num_layers == len(self.layers),
                 f"und_kv has {und_kv.num_layers} layers, the model {len(self.layers)}")
        _require(und_kv.length == gen.und_len,
                 f"und_kv holds {und_kv.length} text rows but this step's und_len is {gen.und_len} "
                 "(K/V from another prompt or CFG branch?)")
        x = gen.hidden
        for layer, k, v in zip(self.layers, und_kv.keys, und_kv.values, strict=True):
            x = layer.forward_gen(x, gen.cos, gen.sin, k, v)
        return self.norm_moe_gen(x)

    # ------------------------------------------------------------------ heads (every step)

    def heads(self, gen_out: torch.Tensor, gen: GenInput):
        """GEN hidden states `[N_gen, D]` -> `(vision, sound | None, action | None)` velocity lists."""
        vision = self._unpatchify(self.proj_out(gen_out[gen.vision_readout_rows]), gen)
        sound = None
        if gen.sound_readout_rows is not None:
            preds = self.audio_proj_out(gen_out[gen.sound_readout_rows])
            items = self._scatter_noisy(preds, gen.sound_token_shapes, gen.sound_noisy_frame_indexes)
            sound = [item.T for item in items]
        action = None
        if gen.action_readout_rows is not None:
            preds = self.action_proj_out(gen_out[gen.action_readout_rows], gen.action_readout_domain_ids)
            action = self._scatter_noisy(preds, gen.action_token_shapes, gen.action_noisy_frame_indexes)
        return vision, sound, action

    @staticmethod
    def _scatter_noisy(preds: torch.Tensor, token_shapes, noisy_frame_indexes) -> list[torch.Tensor]:
        """Packed `[N_noisy, C]` -> per item `[T, C]`, zeros on clean rows."""
        items, start = [], 0
        for shape, noisy in zip(token_shapes, noisy_frame_indexes, strict=True):
            out = preds.new_zeros((shape[0], preds.shape[1]))
            out[noisy] = preds[start : start + len(noisy)]
            start += len(noisy)
            items.append(out)
        return items

    def _unpatchify(self, preds: torch.Tensor, gen: GenInput) -> list[torch.Tensor]:
        """Noisy patches `[N, p*p*C]` -> `[1, C, T, H, W]`: zeros on clean frames, padding cropped."""
        c, p = self.config.latent_channel, self.config.latent_patch_size
        items, start = [], 0
        for (t, gh, gw), (_, h, w), noisy in zip(gen.vision_token_shapes, gen.vision_latent_shapes,
                                                 gen.vision_noisy_frame_indexes, strict=True):
            out = preds.new_zeros((c, t, h, w))
            count = len(noisy) * gh * gw
            if count:
                frames = preds[start : start + count].reshape(len(noisy), gh, gw, p, p, c)
                frames = frames.permute(5, 0, 1, 3, 2, 4).reshape(c, len(noisy), gh * p, gw * p)
                out[:, noisy] = frames[:, :, :h, :w]
                start += count
            items.append(out.unsqueeze(0))
        return items

    # ------------------------------------------------------------------ diffusers-compatible forward

    def forward(
        self,
        input_ids: torch.Tensor,
        text_indexes: torch.Tensor,
        position_ids: torch.Tensor,
        und_len: int,
        sequence_length: int,
        vision_tokens: list[torch.Tensor],
        vision_token_shapes: list[tuple[int, int, int]],
        vision_sequence_indexes: torch.Tensor,
        vision_mse_loss_indexes: torch.Tensor,
        vision_timesteps: torch.Tensor,
        vision_noisy_frame_indexes: list[torch.Tensor],
        sound_tokens: list[torch.Tensor] | None = None,
        sound_token_shapes: list[tuple[int, int, int]] | None = None,
        sound_sequence_indexes: torch.Tensor | None = None,
        sound_mse_loss_indexes: torch.Tensor | None = None,
        sound_timesteps: torch.Tensor | None = None,
        sound_noisy_frame_indexes: list[torch.Tensor] | None = None,
        action_tokens: list[torch.Tensor] | None = None,
        action_token_shapes: list[tuple[int, int, int]] | None = None,
        action_sequence_indexes: torch.Tensor | None = None,
        action_mse_loss_indexes: torch.Tensor | None = None,
        action_timesteps: torch.Tensor | None = None,
        action_noisy_frame_indexes: list[torch.Tensor] | None = None,
        action_domain_ids: list[torch.Tensor] | None = None,
        return_dict: bool = True,
    ):
        """One full denoising-step pass (both pathways), diffusers' signature and return value.

        Returns `(vision, sound, action)` with `return_dict=False`, else `Cosmos3OmniTransformerOutput`.
        Text rows are `embed_tokens(input_ids)` placed at `text_indexes` (all below `und_len`).
        """
        kwargs = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        text_indexes = text_indexes.reshape(-1)
        _require(text_indexes.numel() == input_ids.numel(),
                 f"text_indexes has {text_indexes.numel()} entries for {input_ids.numel()} input_ids")
        _require(text_indexes.numel() == 0 or int(text_indexes.max()) < und_len,
                 f"text_indexes must lie in the UND prefix [0, {und_len})")
        text_rows = torch.zeros((und_len, self.config.hidden_size), dtype=self.embed_tokens.weight.dtype,
                                device=self.device)
        text_rows[text_indexes] = self.embed_tokens(input_ids)
        und_kv = self._und_stack_kv(text_rows, position_ids[..., :und_len])
        gen = self.embed_gen(**kwargs)
        vision, sound, action = self.heads(self.gen_stack(gen, und_kv), gen)
        if not return_dict:
            return vision, sound, action
        return Cosmos3OmniTransformerOutput(sample=vision, sound=sound, action=action)

    # ------------------------------------------------------------------ reasoner (autoregressive text)

    def new_reasoner_cache(self, capacity: int) -> ReasonerKVCache:
        """An empty KV cache for `capacity` text tokens, on this model's device and dtype."""
        c = self.config
        return ReasonerKVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, capacity,
                               device=self.device, dtype=self.dtype)

    def reasoner_forward(self, input_ids: torch.Tensor, cache: ReasonerKVCache,
                         all_positions: bool = False) -> torch.Tensor:
        """Run new text tokens `[n]` through the UND weights after everything already in `cache`.

        Uses only the UND pathway, `embed_tokens`, `norm` and `lm_head`; positions continue from the
        cache length on all three mRoPE axes. Returns logits `[vocab]` of the last token, or `[n, vocab]`
        with `all_positions`. The cache is advanced by `n`.
        """
        _require(input_ids.ndim == 1 and input_ids.numel() > 0,
                 f"input_ids must be a non-empty [n] tensor, got {tuple(input_ids.shape)}")
        n = input_ids.shape[0]
        positions = torch.arange(cache.length, cache.length + n, device=input_ids.device, dtype=torch.float32)
        cos, sin = self.rotary_emb(positions, self.dtype)
        hidden = self.embed_tokens(input_ids)
        for index, layer in enumerate(self.layers):
            hidden, _, _ = layer.forward_und(hidden, cos, sin, store=cache.writer(index, n))
        cache.advance(n)
        if not all_positions:
            hidden = hidden[-1]
        return self.lm_head(self.norm(hidden))
