"""One Cosmos3 MoT decoder layer: an UND (text) pathway and a GEN (vision/sound/action) pathway.

The two pathways have separate weights (GEN names carry `_moe_gen`, `add_*`, `norm_added_*`) and
meet only in attention: GEN queries read the keys/values of UND and GEN rows; UND rows attend
causally among themselves and never see GEN. So a layer's UND K/V do not depend on the denoising
step, and the GEN pathway can run alone against K/V cached once per request (`forward_gen`).

Tensor layout: rows are packed without a batch dim, `[N, D]`; per-head tensors are `[N, heads, hd]`;
cached keys/values are head-major `[KV, N, hd]`, the layout attention consumes. The GEN pathway also
takes a leading batch dim: requests that share one layout (micro-batching and training), or requests
whose text lengths differ (CFG branches), their text K/V padded; each of those attends to its own rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from policy_server.model.config import Cosmos3TransformerConfig
from policy_server.model.layers import GatedMLP, RMSNorm, gated_mlp, linear, rms_norm
from policy_server.model.rope import RotaryTables


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
           mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product GQA (scale `hd**-0.5`): q `[(B,) N, H, hd]`, k/v `[(B,) KV, M, hd]` -> `[(B,) N, H*hd]`."""
    batched = q.ndim == 4
    heads_first = q.transpose(-3, -2)
    if not batched:
        heads_first, k, v = heads_first.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    out = F.scaled_dot_product_attention(heads_first, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    if not batched:
        out = out.squeeze(0)
    return out.transpose(-3, -2).reshape(*q.shape[:-2], -1)


class Cosmos3PackedMoTAttention(nn.Module):
    """Per-pathway Q/K/V/O projections and per-head q/k norms (diffusers names)."""

    def __init__(self, config: Cosmos3TransformerConfig):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        nemotron, eps, bias = config.nemotron_backbone, config.rms_norm_eps, config.attention_bias
        self.num_attention_heads = heads
        self.num_key_value_heads = kv_heads
        self.head_dim = hd

        # UND (text) pathway.
        self.to_q = nn.Linear(d, heads * hd, bias=bias)
        self.to_k = nn.Linear(d, kv_heads * hd, bias=bias)
        self.to_v = nn.Linear(d, kv_heads * hd, bias=bias)
        self.to_out = nn.Linear(heads * hd, d, bias=bias)
        # Edge has no text q/k norm: no module, hence no checkpoint keys.
        self.norm_q = RMSNorm(hd, eps, nemotron) if config.qk_norm_for_text else None
        self.norm_k = RMSNorm(hd, eps, nemotron) if config.qk_norm_for_text else None
        # Edge normalises the text keys a second way for GEN queries only; the causal path keeps raw keys.
        self.k_norm_und_for_gen = RMSNorm(hd, eps, nemotron) if config.has_und_k_norm_for_gen else None

        # GEN pathway: same shapes, always with q/k norm.
        self.add_q_proj = nn.Linear(d, heads * hd, bias=bias)
        self.add_k_proj = nn.Linear(d, kv_heads * hd, bias=bias)
        self.add_v_proj = nn.Linear(d, kv_heads * hd, bias=bias)
        self.to_add_out = nn.Linear(heads * hd, d, bias=bias)
        self.norm_added_q = RMSNorm(hd, eps, nemotron)
        self.norm_added_k = RMSNorm(hd, eps, nemotron)

    def und_qkv(self, x: torch.Tensor, rotary: RotaryTables):
        """Text rows `[N, D]` -> q `[N, H, hd]`, causal k, GEN-side k, v `[KV, N, hd]` (normed, rotated)."""
        n = x.shape[0]
        q = linear(self.to_q, x).view(n, self.num_attention_heads, self.head_dim)
        k = linear(self.to_k, x).view(n, self.num_key_value_heads, self.head_dim)
        v = linear(self.to_v, x).view(n, self.num_key_value_heads, self.head_dim)
        if self.norm_q is not None:
            q, k = rms_norm(self.norm_q, q), rms_norm(self.norm_k, k)
        # Unfused rotation: the text K/V and the reasoner's logits then round exactly as Qwen3's do.
        k_causal = rotary.apply_unfused(k).transpose(0, 1)
        if self.k_norm_und_for_gen is None:
            k_for_gen = k_causal
        else:
            k_for_gen = rotary.apply_unfused(rms_norm(self.k_norm_und_for_gen, k)).transpose(0, 1)
        return rotary.apply_unfused(q), k_causal, k_for_gen, v.transpose(0, 1)

    def gen_qkv(self, x: torch.Tensor, rotary: RotaryTables):
        """Generated rows `[(B,) N, D]` -> q `[(B,) N, H, hd]`, k/v `[(B,) KV, N, hd]` (normed, rotated)."""
        rows, heads = x.shape[:-1], self.num_attention_heads
        q = rms_norm(self.norm_added_q, linear(self.add_q_proj, x).view(*rows, heads, self.head_dim))
        k = rms_norm(self.norm_added_k,
                     linear(self.add_k_proj, x).view(*rows, self.num_key_value_heads, self.head_dim))
        v = linear(self.add_v_proj, x).view(*rows, self.num_key_value_heads, self.head_dim)
        qk = rotary.apply(torch.cat((q, k), dim=-2))  # one rotation for queries and keys
        return qk[..., :heads, :], qk[..., heads:, :].transpose(-3, -2), v.transpose(-3, -2)


class Cosmos3MoTDecoderLayer(nn.Module):
    """Pre-norm decoder layer with a full set of weights per pathway (diffusers names).

    The pathways call their submodules through `linear`/`rms_norm`/`gated_mlp` rather than
    `module(x)`: with few rows per step, module-call overhead is a sizeable share of a step
    (`policy_server/benchmarks/forward.py` measures it).
    """

    def __init__(self, config: Cosmos3TransformerConfig):
        super().__init__()
        d, eps, nemotron = config.hidden_size, config.rms_norm_eps, config.nemotron_backbone
        self.self_attn = Cosmos3PackedMoTAttention(config)
        self.mlp = GatedMLP(d, config.intermediate_size, config.hidden_act)
        self.mlp_moe_gen = GatedMLP(d, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(d, eps, nemotron)
        self.input_layernorm_moe_gen = RMSNorm(d, eps, nemotron)
        self.post_attention_layernorm = RMSNorm(d, eps, nemotron)
        self.post_attention_layernorm_moe_gen = RMSNorm(d, eps, nemotron)

    def forward_und(self, x: torch.Tensor, rotary: RotaryTables, store=None):
        """UND pathway for text rows `x [n, D]` with their rotary tables.

        Without `store`: causal attention among the `n` rows. Returns `(x_out, k_for_gen, v)`, the
        K/V GEN queries of this layer read (`[KV, n, hd]`).
        With `store(k, v) -> (k_all, v_all)` (a reasoner KV cache): the new causal keys are appended
        first and the rows attend to everything cached so far, causally. Returns `(x_out, None, None)`.
        """
        attn = self.self_attn
        q, k, k_for_gen, v = attn.und_qkv(rms_norm(self.input_layernorm, x), rotary)
        if store is None:
            out = attend(q, k, v, causal=True)
        else:
            k_all, v_all = store(k, v)
            past_len = k_all.shape[1] - x.shape[0]
            if past_len == 0:
                out = attend(q, k_all, v_all, causal=True)
            elif x.shape[0] == 1:
                out = attend(q, k_all, v_all)
            else:
                # New rows at positions past_len.. see every cached row and the new rows up to themselves.
                rows = torch.arange(x.shape[0], device=x.device)[:, None] + past_len
                mask = torch.arange(k_all.shape[1], device=x.device)[None, :] <= rows
                out = attend(q, k_all, v_all, mask=mask)
            k_for_gen = v = None
        x = x + linear(attn.to_out, out)
        x = x + gated_mlp(self.mlp, rms_norm(self.post_attention_layernorm, x))
        return x, k_for_gen, v

    def forward_gen(self, x: torch.Tensor, rotary: RotaryTables, und_k: torch.Tensor,
                    und_v: torch.Tensor, und_lens: tuple[int, ...] | None = None) -> torch.Tensor:
        """GEN pathway for generated rows `x [N_gen, D]` against this layer's text K/V `[KV, N_und, hd]`.

        A batch of requests with one layout runs as `x [B, N_gen, D]` against K/V `[B, KV, N_und, hd]`.
        A batch with different text lengths adds per-item rotary tables `[B, N_gen, hd]`, K/V padded to
        `N_und_max` and `und_lens`, each item's text rows: the projections and the MLP run as one batch,
        attention item by item over its own rows (cheaper than attending over the padding behind a mask).
        """
        q, k, v = self.gen_attention_inputs(x, rotary)
        return self.gen_attention_output(x, gen_attention(q, k, v, und_k, und_v, und_lens))

    def gen_attention_inputs(self, x: torch.Tensor, rotary: RotaryTables):
        """The GEN pathway before attention: q `[(B,) N_gen, H, hd]`, k/v `[(B,) KV, N_gen, hd]`. Its shapes
        follow the generated rows alone, not the text (what `Cosmos3OmniTransformer.compiled_gen_stack` needs)."""
        return self.self_attn.gen_qkv(rms_norm(self.input_layernorm_moe_gen, x), rotary)

    def gen_attention_output(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The GEN pathway after attention `[(B,) N_gen, H*hd]`: output projection, residual, MLP block."""
        x = x + linear(self.self_attn.to_add_out, attended)
        return x + gated_mlp(self.mlp_moe_gen, rms_norm(self.post_attention_layernorm_moe_gen, x))


def gen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, und_k: torch.Tensor, und_v: torch.Tensor,
                  und_lens: tuple[int, ...] | None) -> torch.Tensor:
    """Generated rows' queries over the text K/V and their own: `[(B,) N_gen, H*hd]` (`forward_gen`'s shapes)."""
    if und_lens is None:
        return attend_text_and_own(q, k, v, und_k, und_v)
    return torch.stack([attend_text_and_own(q[b], k[b], v[b], und_k[b, :, :n], und_v[b, :, :n])
                        for b, n in enumerate(und_lens)])


def attend_text_and_own(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, und_k: torch.Tensor,
                        und_v: torch.Tensor) -> torch.Tensor:
    """Queries `[(B,) N_gen, H, hd]` over the text K/V `[(B,) KV, N_und, hd]`, then their own K/V
    `[(B,) KV, N_gen, hd]`: `[(B,) N_gen, H*hd]`."""
    return attend(q, torch.cat((und_k, k), dim=-2), torch.cat((und_v, v), dim=-2))
