"""`Cosmos3OmniTransformer`: the Cosmos3 Mixture-of-Transformers generator, split at the cacheable boundary.

Config fields, `state_dict` keys and the `forward` signature/return value are those of diffusers'
`Cosmos3OmniTransformer` (0.42.1), so published `transformer/` checkpoints load unchanged. Besides
`forward`, the model exposes the boundary the sampler and SeaCache work with (docs/ARCHITECTURE.md):

    und_kv = model.prefill_und(input_ids, position_ids[:, :und_len])   # once per request and CFG branch
    layout = model.gen_layout(**forward_kwargs)                        # once per request and CFG branch
    gen = model.embed_gen(**forward_kwargs, layout=layout)             # every step
    vision, sound, action = model.heads(model.gen_stack(gen, und_kv), gen)

which equals `model.forward(**forward_kwargs, return_dict=False)`. The reasoner (autoregressive text)
runs through `reasoner_forward` with its own KV cache and never crosses this boundary.

Packed layout (no batch dim): the joint sequence is `[text (UND) | vision patches | sound | actions]`;
rows before `und_len` are UND, the rest GEN.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch import nn

from policy_server.model.boundary import GenInput, UndKV
from policy_server.model.config import Cosmos3TransformerConfig
from policy_server.model.decoder import Cosmos3MoTDecoderLayer, attend_text_and_own, gen_attention
from policy_server.model.gen_layout import GenLayout, ModalityLayout, build_gen_layout, require
from policy_server.model.layers import (
    DomainAwareLinear,
    Embedding,
    RMSNorm,
    TimestepEmbedding,
    sinusoidal_timestep_features,
)
from policy_server.model.reasoner_cache import ReasonerKVCache
from policy_server.model.rope import MultimodalRotaryEmbedding, RotaryTables

TIMESTEP_FEATURES = 256  # sinusoid width fed to `time_embedder`


@dataclass
class Cosmos3OmniTransformerOutput:
    """`forward(..., return_dict=True)` result: per-item velocity predictions."""

    sample: list[torch.Tensor]                # vision, each [1, C_lat, T, H, W]; zeros on clean frames
    sound: list[torch.Tensor] | None = None   # each [sound_dim, T]
    action: list[torch.Tensor] | None = None  # each [T, action_dim]; zeros on clean rows


class Cosmos3OmniTransformer(nn.Module):
    """Cosmos3 MoT transformer (UND + GEN pathways per layer, shared mRoPE, modality heads)."""

    def __init__(self, config: Cosmos3TransformerConfig):
        super().__init__()
        self.config = c = config
        d = c.hidden_size
        self.embed_tokens = Embedding(c.vocab_size, d)
        self.layers = nn.ModuleList(Cosmos3MoTDecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(d, c.rms_norm_eps, c.nemotron_backbone)
        self.norm_moe_gen = RMSNorm(d, c.rms_norm_eps, c.nemotron_backbone)
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
        require(input_ids.ndim == 1, f"input_ids must be [N_und], got {tuple(input_ids.shape)}")
        require(position_ids.shape[-1] == input_ids.shape[0],
                f"position_ids must cover {input_ids.shape[0]} text rows, got {tuple(position_ids.shape)}")
        return self._und_stack_kv(self.embed_tokens(input_ids), position_ids)

    def _und_stack_kv(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> UndKV:
        c = self.config
        if hidden.shape[0] == 0:
            empty = hidden.new_zeros((c.num_key_value_heads, 0, c.head_dim))
            return UndKV([empty] * c.num_hidden_layers, [empty] * c.num_hidden_layers)
        rotary = self.rotary_emb(position_ids, hidden.dtype)
        keys, values = [], []
        for layer in self.layers:
            hidden, k, v = layer.forward_und(hidden, rotary)
            keys.append(k.contiguous())
            values.append(v.contiguous())
        return UndKV(keys, values)

    # ------------------------------------------------------------------ GEN embedding (every step)

    def gen_layout(self, *, key: Hashable | None = None, **forward_kwargs) -> GenLayout:
        """The request-static part of `embed_gen` (rows, rotary tables, checks), from `forward`'s kwargs.

        Build it once per request and CFG branch and pass it as `embed_gen(..., layout=...)`; it only
        depends on the index/shape arguments, not on the step's latents or timesteps. `key`: the request
        shape those arguments come from (`GenLayout.key`, what batching groups on); None for a fresh one.
        """
        _check_forward_kwargs(forward_kwargs)
        layout_kwargs = {k: v for k, v in forward_kwargs.items() if k in _LAYOUT_ARGUMENTS}
        return build_gen_layout(self.config, self.rotary_emb, self.device, self.dtype, key=key, **layout_kwargs)

    def embed_gen(self, *, layout: GenLayout | None = None, time_embedding: torch.Tensor | None = None,
                  **forward_kwargs) -> GenInput:
        """Embed the generated rows of one step from `forward`'s keyword arguments.

        Vision patches get `proj_in`; sound rows `audio_proj_in` + `audio_modality_embed`; action rows
        `action_proj_in` (per domain) + `action_modality_embed`; noisy rows then get the timestep
        embedding of `timesteps * timestep_scale`. Text arguments are accepted and ignored, so one
        kwargs dict serves `forward` and this call. `layout`: `gen_layout(**forward_kwargs)` of this
        request, to skip rebuilding it every step. `time_embedding`: `timestep_embedding` `[1, D]` of the one
        timestep every noisy row has, when the caller has it (a sampler's schedule is the same every tick); the
        `*_timesteps` arguments are then not read.
        """
        _check_forward_kwargs(forward_kwargs)
        if layout is None:
            layout = self.gen_layout(**forward_kwargs)
        c, dtype = self.config, self.dtype
        hidden = torch.zeros((layout.num_gen, c.hidden_size), dtype=dtype, device=self.device)
        timed = [("vision", layout.vision)]  # the modalities whose noisy rows get the time embedding

        vision_tokens = forward_kwargs["vision_tokens"]
        hidden.index_copy_(0, layout.vision.rows, self.proj_in(self._patchify(vision_tokens, layout).to(dtype)))

        if layout.sound is not None:
            packed = torch.cat([s[:, : shape[0]].T for s, shape in zip(
                forward_kwargs["sound_tokens"], layout.sound.token_shapes, strict=True)])
            require(packed.shape == (layout.sound.rows.numel(), c.sound_dim),
                    f"sound tokens must pack to [{layout.sound.rows.numel()}, {c.sound_dim}], "
                    f"got {tuple(packed.shape)}")
            embedded = self.audio_proj_in(packed.to(dtype)) + self.audio_modality_embed
            hidden.index_copy_(0, layout.sound.rows, embedded)
            timed.append(("sound", layout.sound))

        if layout.action is not None:
            packed = torch.cat([a[: shape[0]] for a, shape in zip(
                forward_kwargs["action_tokens"], layout.action.token_shapes, strict=True)])
            require(packed.shape == (layout.action.rows.numel(), c.action_dim),
                    f"action tokens must pack to [{layout.action.rows.numel()}, {c.action_dim}], "
                    f"got {tuple(packed.shape)}")
            embedded = self.action_proj_in(packed.to(dtype), layout.action_row_domains) + self.action_modality_embed
            hidden.index_copy_(0, layout.action.rows, embedded)
            if layout.action.readout_rows.numel() > 0:  # mirrors the row set in `layout.time_rows`
                timed.append(("action", layout.action))

        if time_embedding is None:
            time_embedding = self.timestep_embedding(torch.cat([
                self._step_timesteps(forward_kwargs.get(f"{name}_timesteps"), modality, name)
                for name, modality in timed]))
        else:
            time_embedding = time_embedding.expand(layout.time_rows.numel(), -1)
        hidden.index_add_(0, layout.time_rows, time_embedding)
        return GenInput(hidden=hidden, layout=layout)

    def _step_timesteps(self, timesteps: torch.Tensor | None, modality: ModalityLayout, name: str) -> torch.Tensor:
        """One scheduler timestep per noisy row of a modality, as fp32 on the model's device."""
        expected = modality.noisy_rows.numel()
        require(timesteps is not None and timesteps.numel() == expected,
                f"{name}_timesteps must have one entry per noisy {name} token ({expected}), got "
                f"{None if timesteps is None else timesteps.numel()}")
        return timesteps.reshape(-1).to(device=self.device, dtype=torch.float32)

    def timestep_embedding(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Scheduler timesteps `[N]` (sigma * 1000) -> `[N, D]` in the model dtype (MLP in its own dtype).

        Every noisy row of a step usually shares one timestep, so the MLP runs once per distinct value.
        """
        distinct, row_of = torch.unique(timesteps, return_inverse=True)
        features = sinusoidal_timestep_features(distinct * self.config.timestep_scale, TIMESTEP_FEATURES)
        embed_dtype = self.time_embedder.linear_1.weight.dtype
        return self.time_embedder(features.to(embed_dtype)).to(self.dtype)[row_of]

    def _patchify(self, vision_tokens: list[torch.Tensor], layout: GenLayout) -> torch.Tensor:
        """Latents `[1, C, T, H, W]` -> packed patches `[sum T*h*w, p*p*C]` (t, h, w major; p, q, c minor).

        Odd H/W are zero-padded up to the patch size.
        """
        c, p = self.config.latent_channel, self.config.latent_patch_size
        require(len(vision_tokens) == len(layout.vision_latent_shapes),
                f"{len(vision_tokens)} vision_tokens, the layout has {len(layout.vision_latent_shapes)}")
        packed = []
        for latent, (t, h, w), (_, gh, gw) in zip(vision_tokens, layout.vision_latent_shapes,
                                                  layout.vision.token_shapes, strict=True):
            latent = latent.reshape(latent.shape[-4:])
            require(latent.shape == (c, t, h, w),
                    f"vision latent must be [1, {c}, {t}, {h}, {w}] as laid out, got {tuple(latent.shape)}")
            if h % p or w % p:
                latent = torch.nn.functional.pad(latent, (0, gw * p - w, 0, gh * p - h))
            patches = latent.reshape(c, t, gh, p, gw, p).permute(1, 2, 4, 3, 5, 0)
            packed.append(patches.reshape(-1, p * p * c))
        return torch.cat(packed)

    # ------------------------------------------------------------------ GEN stack (what SeaCache skips)

    def gen_stack(self, gen: GenInput, und_kv: UndKV) -> torch.Tensor:
        """All layers' GEN pathway against cached text K/V, then `norm_moe_gen`: `[N_gen, D]`.

        Batched (`GenInput.stack`, `UndKV.stack`): `[B, N_gen, D]`; decode item b with
        `heads(out[b], gen)`. Batched over text lengths (`GenInput.stack_varied(items)`,
        `UndKV.stack_padded`, e.g. a CFG step's cond and uncond branch): `[B, N_gen, D]`; decode item b
        with `heads(out[b], items[b])`.
        """
        ragged = self._check_gen_stack(gen, und_kv)
        x, rotary = gen.hidden, gen.layout.rotary
        for layer, k, v in zip(self.layers, und_kv.keys, und_kv.values, strict=True):
            x = layer.forward_gen(x, rotary, k, v, ragged)
        return self.norm_moe_gen(x)

    def compiled_gen_stack(self) -> Callable[[GenInput, UndKV], torch.Tensor]:
        """`gen_stack` with each layer's GEN pathway compiled by `torch.compile`, all but attention: the parts before
        and after attention depend on the generated rows alone, so one compile per batching pattern (one call; a
        batch of one layout; a batch of several text lengths) serves every layer, text length and row count
        (dynamic shapes), while attention, whose shapes follow the text, stays eager. A pattern compiles on its
        first call, for seconds: make those calls before any deadline runs."""
        before = torch.compile(Cosmos3MoTDecoderLayer.gen_attention_inputs, dynamic=True)
        after = torch.compile(Cosmos3MoTDecoderLayer.gen_attention_output, dynamic=True)

        def gen_stack(gen: GenInput, und_kv: UndKV) -> torch.Tensor:
            ragged = self._check_gen_stack(gen, und_kv)
            x, rotary = gen.hidden, gen.layout.rotary
            for layer, k, v in zip(self.layers, und_kv.keys, und_kv.values, strict=True):
                x = after(layer, x, gen_attention(*before(layer, x, rotary), k, v, ragged))
            return self.norm_moe_gen(x)

        return gen_stack

    def gen_stack_per_item_inputs(self, gen: GenInput, und_kv: UndKV
                                  ) -> tuple[torch.Tensor, RotaryTables, tuple[torch.Tensor, ...]]:
        """Check that `gen` and `und_kv` belong together and give them as `gen_stack_per_item` takes them: each
        item's text K/V unpadded (`UndKV.per_item`), so a graph traced with text lengths dynamic serves every
        instruction (`pipeline/compiled_stack.py`)."""
        self._check_gen_stack(gen, und_kv)
        return gen.hidden, gen.layout.rotary, und_kv.per_item

    def gen_stack_per_item(self, x: torch.Tensor, rotary: RotaryTables, text_kv: tuple[torch.Tensor, ...]
                           ) -> torch.Tensor:
        """`gen_stack` of rows `x` `[N_gen, D]` (one item) or `[B, N_gen, D]`, item b against `text_kv[b]`
        `[L, 2, KV, n_b, hd]`."""
        for index, layer in enumerate(self.layers):
            q, k, v = layer.gen_attention_inputs(x, rotary)
            if x.ndim == 2:
                attended = attend_text_and_own(q, k, v, *text_kv[0][index])
            else:
                attended = torch.stack([attend_text_and_own(q[b], k[b], v[b], *item[index])
                                        for b, item in enumerate(text_kv)])
            x = layer.gen_attention_output(x, attended)
        return self.norm_moe_gen(x)

    def _check_gen_stack(self, gen: GenInput, und_kv: UndKV) -> tuple[int, ...] | None:
        """Check that `gen` and `und_kv` belong together; returns each item's text rows when they differ."""
        require(und_kv.num_layers == len(self.layers),
                f"und_kv has {und_kv.num_layers} layers, the model {len(self.layers)}")
        require(gen.hidden.ndim == und_kv.keys[0].ndim - 1
                and (gen.hidden.ndim == 2 or gen.hidden.shape[0] == und_kv.keys[0].shape[0]),
                f"GEN rows {tuple(gen.hidden.shape)} and text K/V {tuple(und_kv.keys[0].shape)} "
                "must both be single or both batched with the same B")
        require(und_kv.length == gen.und_len,
                f"und_kv holds {und_kv.length} text rows but this step's und_len is {gen.und_len} "
                "(K/V from another prompt or CFG branch?)")
        # Where anything is padded, each item must attend to exactly its own text rows.
        padded_kv = und_kv.lengths is not None and len(set(und_kv.lengths)) > 1
        ragged = gen.ragged_und_lens
        require(not (padded_kv or ragged is not None) or und_kv.lengths == gen.und_lens,
                f"padded text K/V and GEN batch must agree on each item's text rows: und_kv "
                f"(UndKV.stack_padded) has {und_kv.lengths}, the GEN batch (GenInput.stack_varied) {gen.und_lens}")
        return ragged

    # ------------------------------------------------------------------ heads (every step)

    def heads(self, gen_out: torch.Tensor, gen: GenInput):
        """GEN hidden states `[N_gen, D]` -> `(vision, sound | None, action | None)` velocity lists."""
        layout = gen.layout
        vision = self._unpatchify(self.proj_out(gen_out[layout.vision.readout_rows]), layout)
        sound = None
        if layout.sound is not None:
            preds = self.audio_proj_out(gen_out[layout.sound.readout_rows])
            sound = [item.T for item in self._scatter_noisy(preds, layout.sound)]
        action = None
        if layout.action is not None:
            preds = self.action_proj_out(gen_out[layout.action.readout_rows], layout.action_readout_domains)
            action = self._scatter_noisy(preds, layout.action)
        return vision, sound, action

    @staticmethod
    def _scatter_noisy(preds: torch.Tensor, modality: ModalityLayout) -> list[torch.Tensor]:
        """Packed `[N_noisy, C]` -> per item `[T, C]`, zeros on clean rows."""
        items, start = [], 0
        for shape, noisy in zip(modality.token_shapes, modality.noisy_frame_indexes, strict=True):
            out = preds.new_zeros((shape[0], preds.shape[1]))
            out[noisy] = preds[start : start + noisy.shape[0]]  # not len(): a trace keeps a shape symbolic
            start += noisy.shape[0]
            items.append(out)
        return items

    def _unpatchify(self, preds: torch.Tensor, layout: GenLayout) -> list[torch.Tensor]:
        """Noisy patches `[N, p*p*C]` -> `[1, C, T, H, W]` per item: zeros on clean frames, padding cropped."""
        c, p = self.config.latent_channel, self.config.latent_patch_size
        items, start = [], 0
        for (t, gh, gw), (_, h, w), noisy in zip(layout.vision.token_shapes, layout.vision_latent_shapes,
                                                 layout.vision.noisy_frame_indexes, strict=True):
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
        # The same keyword set goes on to embed_gen, which ignores the text arguments.
        kwargs = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        text_indexes = text_indexes.reshape(-1)
        require(text_indexes.numel() == input_ids.numel(),
                f"text_indexes has {text_indexes.numel()} entries for {input_ids.numel()} input_ids")
        require(text_indexes.numel() == 0 or int(text_indexes.max()) < und_len,
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
        require(input_ids.ndim == 1 and input_ids.numel() > 0,
                f"input_ids must be a non-empty [n] tensor, got {tuple(input_ids.shape)}")
        n = input_ids.shape[0]
        positions = torch.arange(cache.length, cache.length + n, device=input_ids.device, dtype=torch.float32)
        rotary = self.rotary_emb(positions, self.dtype)
        hidden = self.embed_tokens(input_ids)
        for index, layer in enumerate(self.layers):
            hidden, _, _ = layer.forward_und(hidden, rotary, store=cache.writer(index, n))
        cache.advance(n)
        if not all_positions:
            hidden = hidden[-1]
        return self.lm_head(self.norm(hidden))


# Keyword arguments of the diffusers-compatible `forward`, which `embed_gen` and `gen_layout` accept,
# and the subset that fixes the GEN layout.
_FORWARD_ARGUMENTS = frozenset(inspect.signature(Cosmos3OmniTransformer.forward).parameters) - {"self"}
_LAYOUT_ARGUMENTS = _FORWARD_ARGUMENTS & frozenset(inspect.signature(build_gen_layout).parameters)


def _check_forward_kwargs(kwargs: dict) -> None:
    unknown = kwargs.keys() - _FORWARD_ARGUMENTS
    require(not unknown, f"unknown argument(s) {sorted(unknown)}; expected the keywords of forward()")
