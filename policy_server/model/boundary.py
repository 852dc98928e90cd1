"""The data that crosses the cacheable boundary of `Cosmos3OmniTransformer`.

`UndKV` is computed once per request and CFG branch (`prefill_und`); `GenInput` once per denoising
step (`embed_gen`, which may reuse a request's `GenLayout`); `gen_stack` maps `(GenInput, UndKV)` to
the GEN hidden states that `heads` decode.

Batches: `GenInput.stack` + `UndKV.stack` for requests sharing one layout object; `GenInput.stack_varied`
+ `UndKV.stack_padded` for requests with one N_gen and any text lengths (the cond and uncond branches
of one CFG step: same generated rows, different prompts, so different K/V lengths and GEN rotary
positions; each item attends to its own text rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from policy_server.model.gen_layout import GenLayout, require
from policy_server.model.rope import RotaryTables


@dataclass
class UndKV:
    """Per-layer keys/values of the text (UND) rows as GEN queries read them.

    `keys[l]`, `values[l]`: `[KV, N_und, hd]`, or `[B, KV, N_und, hd]` for a batch (`stack`). Keys are
    taken after the q/k norm and RoPE; on Edge they are the `k_norm_und_for_gen` version, not the keys
    the causal text path uses. `lengths`: set by `stack_padded`, each item's text rows; rows past them
    are zero padding up to `N_und_max`.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: tuple[int, ...] | None = None

    @classmethod
    def stack(cls, items: list[UndKV]) -> UndKV:
        """The K/V of B requests with the same text length, batched layer by layer."""
        return cls([torch.stack(layer) for layer in zip(*(i.keys for i in items), strict=True)],
                   [torch.stack(layer) for layer in zip(*(i.values for i in items), strict=True)])

    @classmethod
    def stack_padded(cls, items: list[UndKV]) -> UndKV:
        """The K/V of B requests of any text lengths, zero-padded to the longest: `[B, KV, N_und_max, hd]`.

        Pair it with `GenInput.stack_varied` of the same requests in the same order: each item attends to
        its own rows only. Built once per request pair, like the K/V themselves.
        """
        lengths = tuple(item.length for item in items)
        longest = max(lengths)

        def padded(layers: list[torch.Tensor], length: int) -> list[torch.Tensor]:
            return [F.pad(t, (0, 0, 0, longest - length)) for t in layers]  # pads dim -2 at its end

        keys = [padded(item.keys, n) for item, n in zip(items, lengths, strict=True)]
        values = [padded(item.values, n) for item, n in zip(items, lengths, strict=True)]
        return cls([torch.stack(layer) for layer in zip(*keys, strict=True)],
                   [torch.stack(layer) for layer in zip(*values, strict=True)], lengths)

    @cached_property
    def per_item(self) -> tuple[torch.Tensor, ...]:
        """Each item's keys and values of every layer as one tensor, without padding: `[L, 2, KV, n_b, hd]`
        (2: keys, values), for `Cosmos3OmniTransformer.gen_stack_per_item`. Made on first use, then kept
        (a prompt's K/V serve every step of its ticks)."""
        if self.keys[0].ndim == 3:
            return (torch.stack([torch.stack(kv) for kv in zip(self.keys, self.values, strict=True)]),)
        lengths = self.lengths or (self.length,) * self.keys[0].shape[0]
        return tuple(torch.stack([torch.stack((k[b, :, :n], v[b, :, :n]))
                                  for k, v in zip(self.keys, self.values, strict=True)])
                     for b, n in enumerate(lengths))

    @property
    def length(self) -> int:
        """N_und, the number of text rows (N_und_max when padded)."""
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
    layout: GenLayout | PaddedGenLayouts  # the latter from `stack_varied`

    @classmethod
    def stack(cls, items: list[GenInput]) -> GenInput:
        """B steps' inputs that share one layout object, as one batch."""
        layout = items[0].layout
        if any(item.layout is not layout for item in items):
            raise ValueError("only inputs built with the same GenLayout object can be batched")
        return cls(torch.stack([item.hidden for item in items]), layout)

    @classmethod
    def stack_varied(cls, items: list[GenInput], layouts: PaddedGenLayouts | None = None) -> GenInput:
        """B steps' inputs with the same N_gen but any layouts (text lengths), as one batch.

        Pair it with `UndKV.stack_padded` of the items' K/V in the same order; decode row b of the
        stack's output with `heads(out[b], items[b])`. `layouts`: `PaddedGenLayouts.build` of the
        items' layouts, to reuse across steps (it is built here when None).
        """
        if layouts is None:
            layouts = PaddedGenLayouts.build([item.layout for item in items])
        if len(items) != len(layouts.layouts) or any(
                item.layout is not layout for item, layout in zip(items, layouts.layouts, strict=False)):
            raise ValueError("layouts must be built from these items' GenLayout objects, in order")
        return cls(torch.stack([item.hidden for item in items]), layouts)

    @property
    def und_len(self) -> int:
        """Text rows the `UndKV` paired with this input must hold (N_und_max for `stack_varied`)."""
        return self.layout.und_len

    @property
    def und_lens(self) -> tuple[int, ...] | None:
        """Each item's text rows for `stack_varied`, which the paired `UndKV.lengths` must equal; else None."""
        return self.layout.und_lens if isinstance(self.layout, PaddedGenLayouts) else None

    @property
    def ragged_und_lens(self) -> tuple[int, ...] | None:
        """Each item's text rows for `stack_varied` when they differ (the K/V are padded); else None."""
        return self.layout.ragged_und_lens if isinstance(self.layout, PaddedGenLayouts) else None


@dataclass(frozen=True)
class PaddedGenLayouts:
    """The request-static part of a `stack_varied` batch: B layouts with one N_gen, any text lengths.

    Build it once per set of layouts (e.g. a session's cond and uncond branch) and reuse it each step.
    """

    layouts: tuple[GenLayout, ...]
    rotary: RotaryTables             # per item, [B, N_gen, hd]: GEN positions start after each item's text
    und_lens: tuple[int, ...]        # text rows per item

    @classmethod
    def build(cls, layouts: list[GenLayout]) -> PaddedGenLayouts:
        num_gen = layouts[0].num_gen
        require(all(layout.num_gen == num_gen for layout in layouts),
                f"stack_varied needs one N_gen, got {[layout.num_gen for layout in layouts]}")
        return cls(tuple(layouts), RotaryTables.stack([layout.rotary for layout in layouts]),
                   tuple(layout.und_len for layout in layouts))

    @property
    def ragged_und_lens(self) -> tuple[int, ...] | None:
        """`und_lens` when they differ (attention then runs item by item over each one's rows), else None."""
        return self.und_lens if len(set(self.und_lens)) > 1 else None

    @property
    def und_len(self) -> int:
        """N_und_max, the text rows of the padded K/V."""
        return max(self.und_lens)

    @property
    def num_gen(self) -> int:
        return self.layouts[0].num_gen
