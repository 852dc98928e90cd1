"""Building blocks of the Cosmos3 MoT transformer: norms, MLPs, projections, the timestep embedding.

Attribute names are those of diffusers' `transformer_cosmos3.py`, so `state_dict()` keys match the
published `transformer/` checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_HALF_DTYPES = (torch.float16, torch.bfloat16)


class Embedding(nn.Embedding):
    """`nn.Embedding`, left uninitialised on the meta device, where a checkpoint's model is built to be loaded
    into: torch's `normal_` of a meta tensor imports dynamo, seconds of a server's start that compiles nothing."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, in the Qwen or the Nemotron (Edge) precision convention.

    Both take statistics in fp32. Qwen rounds the normalised input to a low-precision weight's dtype
    before scaling; Nemotron upcasts the weight and scales in fp32, then casts back to the input's
    dtype. Identical in fp32.
    """

    def __init__(self, dim: int, eps: float, nemotron: bool = False):
        super().__init__()
        self.eps = eps
        self.nemotron = nemotron
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(self, x)


def rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` without the module call (hot paths call this directly)."""
    weight = norm.weight
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, norm.eps)  # the same arithmetic, one call
    if norm.nemotron:
        scaled = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.eps)
        return (weight.float() * scaled).to(x.dtype)
    x = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.eps)
    if weight.dtype in _HALF_DTYPES:
        x = x.to(weight.dtype)
    return x * weight


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` without the module call."""
    return F.linear(x, layer.weight, layer.bias)


class GatedMLP(nn.Module):
    """Decoder MLP: SwiGLU `down(silu(gate(x)) * up(x))`, or Nemotron's `down(relu(up(x))**2)` (no gate)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str):
        super().__init__()
        self.relu2 = hidden_act == "relu2"
        if not self.relu2:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(self, x)


def gated_mlp(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    """`mlp(x)` without the module calls."""
    if mlp.relu2:
        return linear(mlp.down_proj, torch.relu(linear(mlp.up_proj, x)).square())
    return linear(mlp.down_proj, F.silu(linear(mlp.gate_proj, x)) * linear(mlp.up_proj, x))


@dataclass(frozen=True)
class DomainIds:
    """The embodiment domain of each row, `rows` `[N]` (long, on the model's device), and the distinct domains
    among them: fixed per layout, so the projections below never look them up per call."""

    rows: torch.Tensor
    distinct: tuple[int, ...]

    @classmethod
    def of(cls, rows: torch.Tensor) -> DomainIds:
        return cls(rows, tuple(sorted(set(rows.tolist()))))


class DomainAwareLinear(nn.Module):
    """One affine map per embodiment domain, stored as embeddings: `y = x @ W[d] + b[d]`.

    `fc.weight[d]` holds `W[d]` flattened in `[in, out]` order (not `nn.Linear`'s `[out, in]`), which is
    the Cosmos3 checkpoint layout.
    """

    def __init__(self, input_size: int, output_size: int, num_domains: int):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.num_domains = num_domains
        self.fc = Embedding(num_domains, input_size * output_size)
        self.bias = Embedding(num_domains, output_size)

    def forward(self, x: torch.Tensor, domains: DomainIds) -> torch.Tensor:
        """x `[N, in]`, one domain per row -> `[N, out]`."""
        if not domains.distinct:  # no noisy action rows (forward dynamics): nothing to project
            return x.new_zeros((0, self.output_size))
        if len(domains.distinct) == 1:
            # The usual case (one embodiment per request): one matmul instead of a per-row bmm. The domain's
            # weights are looked up by the rows' id, not the Python one, so a compiled graph serves every domain.
            domain = domains.rows[:1]
            return x @ self.fc(domain).view(self.input_size, self.output_size) + self.bias(domain)
        weight = self.fc(domains.rows).view(-1, self.input_size, self.output_size)
        return torch.bmm(x.unsqueeze(1), weight).squeeze(1) + self.bias(domains.rows)


def sinusoidal_timestep_features(timesteps: torch.Tensor, dim: int = 256,
                                 max_period: float = 10000.0) -> torch.Tensor:
    """`[N]` timesteps -> `[N, dim]` fp32 `[cos(t f_i) | sin(t f_i)]`, `f_i = max_period**(-i / (dim/2))`."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half
    angles = timesteps[:, None].float() * torch.exp(exponent)[None, :]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class TimestepEmbedding(nn.Module):
    """`Linear(256, D) -> SiLU -> Linear(D, D)`; Cosmos3 keeps these weights in fp32."""

    def __init__(self, in_channels: int, embed_dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, embed_dim)
        self.linear_2 = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))
