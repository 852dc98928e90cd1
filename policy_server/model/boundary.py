"""The data that crosses the cacheable boundary of `Cosmos3OmniTransformer`.

`UndKV` is computed once per request and CFG branch (`prefill_und`); `GenInput` once per denoising
step (`embed_gen`); `gen_stack` maps `(GenInput, UndKV)` to the GEN hidden states that `heads` decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class UndKV:
    """Per-layer keys/values of the text (UND) rows as GEN queries read them.

    `keys[l]`, `values[l]`: `[KV, N_und, hd]`. Keys are taken after the q/k norm and RoPE; on Edge
    they are the `k_norm_und_for_gen` version, not the keys the causal text path uses.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        """N_und, the number of text rows."""
        return self.keys[0].shape[1]

    @property
    def num_layers(self) -> int:
        return len(self.keys)


@dataclass
class GenInput:
    """Embedded generated rows of one denoising step plus what the heads need to decode them.

    Row indexes below are GEN-local: joint-sequence index minus `und_len`.
    """

    hidden: torch.Tensor                      # [N_gen, D] projected rows, time embedding on noisy rows
    cos: torch.Tensor                         # [N_gen, hd] rotary cosines of the generated rows
    sin: torch.Tensor                         # [N_gen, hd]
    und_len: int                              # text rows the UndKV must hold
    vision_token_shapes: list[tuple[int, int, int]]   # patch grid (T, h, w) per vision item
    vision_latent_shapes: list[tuple[int, int, int]]  # unpadded latent (T, H, W) per item
    vision_noisy_frame_indexes: list[torch.Tensor]    # latent frames predicted, per item
    vision_readout_rows: torch.Tensor                 # [N_noisy_patches] rows read by proj_out
    sound_token_shapes: list[tuple[int, int, int]] | None = None
    sound_noisy_frame_indexes: list[torch.Tensor] | None = None
    sound_readout_rows: torch.Tensor | None = None
    action_token_shapes: list[tuple[int, int, int]] | None = None
    action_noisy_frame_indexes: list[torch.Tensor] | None = None
    action_readout_rows: torch.Tensor | None = None
    action_readout_domain_ids: torch.Tensor | None = None  # [N_noisy_actions] domain id per read row
