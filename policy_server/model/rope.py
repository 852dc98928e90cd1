"""Interleaved 3-axis multimodal RoPE (Qwen3-VL style), as Cosmos3 uses it for every modality.

Each rotary frequency pair `k` (of `head_dim / 2`) reads one position axis: H when `k % 3 == 1` and
`k < 3 * sections[1]`, W when `k % 3 == 2` and `k < 3 * sections[2]`, T otherwise. Text rows carry the
same id on all three axes, which makes this plain 1-D RoPE for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RotaryTables:
    """Rotation tables of N rows: `cos`, `sin` `[N, head_dim]` (`cat(freqs, freqs)` layout).

    Stacked per item (`stack`): `[B, N, head_dim]`, for a batch whose rows sit at different positions.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    # rotate_half(x) * sin == roll(x, hd/2) * signed_sin: folding the sign into the table makes the
    # rotation three kernels (mul, roll, addcmul) instead of five; it runs on every step.
    _cos_rows: torch.Tensor = field(init=False, repr=False)
    _signed_sin_rows: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        half = self.sin.shape[-1] // 2
        signed = torch.cat((-self.sin[..., :half], self.sin[..., half:]), dim=-1)
        # A heads axis before head_dim: [(B,) N, 1, hd] broadcasts against x [(B,) N, heads, hd].
        object.__setattr__(self, "_cos_rows", self.cos.unsqueeze(-2))
        object.__setattr__(self, "_signed_sin_rows", signed.unsqueeze(-2))

    @classmethod
    def stack(cls, tables: list[RotaryTables]) -> RotaryTables:
        """B tables of N rows each -> one table `[B, N, head_dim]`, item b rotating batch row b."""
        return cls(torch.stack([t.cos for t in tables]), torch.stack([t.sin for t in tables]))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The memory `apply` and `apply_unfused` read: `cos` (its row view shares it) and the signed sine."""
        return self.cos, self._signed_sin_rows

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE of `x [(B,) N, heads, head_dim]`: `x * cos + rotate_half(x) * sin`.

        Unstacked tables rotate every batch item alike; stacked ones (`[B, N, hd]`) each item by its own."""
        return torch.addcmul(x * self._cos_rows, x.roll(x.shape[-1] // 2, dims=-1), self._signed_sin_rows)

    def apply_unfused(self, x: torch.Tensor) -> torch.Tensor:
        """`apply` with the reference's roundings: each product is rounded before the sum.

        The fused `addcmul` of `apply` adds the second product unrounded where transformers and diffusers
        round it first, one ulp apart on many entries (in bf16 a logit's ulp is ~1e-2). The UND pathway
        (once per prompt, and per reasoner token) uses this, so text K/V and reasoner logits equal Qwen3's
        bit for bit; the GEN pathway, which runs on every step, keeps the fused kernel.
        """
        return x * self._cos_rows + x.roll(x.shape[-1] // 2, dims=-1) * self._signed_sin_rows


class MultimodalRotaryEmbedding:
    """Builds `RotaryTables` from position ids `[3, N]` (t, h, w) or `[N]`.

    Not an `nn.Module` on purpose: the inverse frequencies must stay fp32 when the model is cast to
    bf16, and the position products must be computed in fp32 (bf16 cannot tell positions above 256
    apart; Cosmos3 positions start past 15000 for generated tokens and may be fractional).
    """

    def __init__(self, head_dim: int, theta: float, sections: list[int]):
        self.head_dim = head_dim
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
        self.inv_freq = 1.0 / (theta**exponents)
        axis = torch.zeros(head_dim // 2, dtype=torch.long, device="cpu")
        axis[1 : 3 * sections[1] : 3] = 1
        axis[2 : 3 * sections[2] : 3] = 2
        self.axis_of_frequency = axis
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._on_device:
            self._on_device[device] = (self.inv_freq.to(device), self.axis_of_frequency.to(device))
        return self._on_device[device]

    def __call__(self, position_ids: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
        """position_ids `[3, N]` or `[N]` (int or float) -> tables `[N, head_dim]` in `dtype`."""
        if position_ids.ndim == 1:
            position_ids = position_ids.unsqueeze(0).expand(3, -1)
        if position_ids.ndim != 2 or position_ids.shape[0] != 3:
            raise ValueError(f"position_ids must be [3, N] or [N], got {tuple(position_ids.shape)}")
        inv_freq, axis = self._tables(position_ids.device)
        with torch.autocast(device_type=position_ids.device.type, enabled=False):
            positions = position_ids.float()[axis].T  # [N, head_dim/2]: the axis each frequency reads
            freqs = positions * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return RotaryTables(angles.cos().to(dtype), angles.sin().to(dtype))
