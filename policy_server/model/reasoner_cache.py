"""Per-layer key/value cache for autoregressive text decoding over the UND (reasoner) weights."""

from __future__ import annotations

import torch


class ReasonerKVCache:
    """Preallocated `[KV, capacity, hd]` keys and values per layer, filled left to right.

    A forward over `n` new tokens writes every layer's keys (after norm and RoPE, the causal-path
    version) at `[length, length + n)`, then `advance(n)` commits them. Preallocation keeps decoding
    free of per-token concatenation.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        if capacity < 1:
            raise ValueError(f"ReasonerKVCache capacity must be >= 1 token, got {capacity}")
        shape = (num_kv_heads, capacity, head_dim)
        self.keys = [torch.empty(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.empty(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.capacity = capacity
        self.length = 0

    def writer(self, layer: int, num_new: int):
        """A `store(k, v) -> (k_all, v_all)` callable for one layer of the current forward.

        `k, v`: `[KV, num_new, hd]`; returns views `[KV, length + num_new, hd]` of the cache.
        """
        end = self.length + num_new
        if end > self.capacity:
            raise ValueError(
                f"reasoner KV cache full: {self.length} cached + {num_new} new tokens > "
                f"capacity {self.capacity}"
            )

        def store(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.keys[layer][:, self.length:end] = k
            self.values[layer][:, self.length:end] = v
            return self.keys[layer][:, :end], self.values[layer][:, :end]

        return store

    def advance(self, num_new: int) -> None:
        """Commit `num_new` tokens written by every layer."""
        self.length += num_new
