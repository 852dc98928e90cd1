"""The data that crosses the cacheable boundary of `Cosmos3OmniTransformer`.

`UndKV` is computed once per request and CFG branch (`prefill_und`); `GenInput` once per denoising
step (`embed_gen`, which may reuse a request's `GenLayout`); `gen_stack` maps `(GenInput, UndKV)` to
the GEN hidden states that `heads` decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from policy_server.model.gen_layout import GenLayout


@dataclass
class UndKV:
    """Per-layer keys/values of the text (UND) rows as GEN queries read them.

    `keys[l]`, `values[l]`: `[KV, N_und, hd]`, or `[B, KV, N_und, hd]` for a batch (`stack`). Keys are
    taken after the q/k norm and RoPE; on Edge they are the `k_norm_und_for_gen` version, not the keys
    the causal text path uses.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def stack(cls, items: list[UndKV]) -> UndKV:
        """The K/V of B requests with the same text length, batched layer by layer."""
        return cls([torch.stack(layer) for layer in zip(*(i.keys for i in items), strict=True)],
                   [torch.stack(layer) for layer in zip(*(i.values for i in items), strict=True)])

    @property
    def length(self) -> int:
        """N_und, the number of text rows."""
        return self.keys[0].shape[-2]

    @property
    def num_layers(self) -> int:
        return len(self.keys)


@dataclass
class GenInput:
    """Embedded generated rows of one denoising step, plus their request-static layout.

    `layout` holds the rotary tables and GEN-local rows (joint index minus `und_len`) the stack and
    the heads need; it is the same object every step when the caller passes one to `embed_gen`.
    """

    hidden: torch.Tensor  # [N_gen, D] projected rows, time embedding added on noisy rows; [B, N_gen, D] batched
    layout: GenLayout

    @classmethod
    def stack(cls, items: list[GenInput]) -> GenInput:
        """B steps' inputs that share one layout object, as one batch."""
        layout = items[0].layout
        if any(item.layout is not layout for item in items):
            raise ValueError("only inputs built with the same GenLayout object can be batched")
        return cls(torch.stack([item.hidden for item in items]), layout)

    @property
    def und_len(self) -> int:
        """Text rows the `UndKV` paired with this input must hold."""
        return self.layout.und_len
