"""`Cosmos3TransformerConfig`: the fields of diffusers' `Cosmos3OmniTransformer` `config.json`.

Field names, order and defaults are those of diffusers 0.42.1, so a `transformer/config.json` from a
published Cosmos3 checkpoint loads unchanged and one we write loads in diffusers. Defaults describe
Cosmos3-Nano's Qwen3-VL-8B text backbone; Edge (Nemotron) sets `hidden_act="relu2"`,
`qk_norm_for_text=False` and `use_und_k_norm_for_gen=True`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy_server.json_file import read_json

# The diffusers class name and version written into `config.json` by `to_dict`.
DIFFUSERS_CLASS_NAME = "Cosmos3OmniTransformer"
DIFFUSERS_VERSION = "0.42.1"

# Keys that may sit in a `config.json` without being architecture fields. diffusers writes the
# `_`-prefixed bookkeeping keys and injects `dtype` at load time; the Cosmos3 Edge exporter adds
# `backbone_type` and `temporal_compression_factor` as metadata. None of them changes the module.
_METADATA_KEYS = frozenset({"dtype", "backbone_type", "temporal_compression_factor"})

_SUPPORTED_ACTIVATIONS = ("silu", "relu2")

# The largest size field (a width, a head count, the vocabulary). A weight's shape is the product of up to three of
# them (`action_proj_in`: domains x action_dim * hidden_size), which must fit torch's int64 byte count: a config with
# sizes of 10**12 made building the model raise "Storage size calculation overflowed". Cosmos3 Super's largest is
# its vocabulary, 151936.
MAX_SIZE = 1 << 20
_SIZE_FIELDS = ("head_dim", "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                "num_key_value_heads", "latent_channel", "latent_patch_size", "patch_latent_dim", "vocab_size",
                "num_embodiment_domains")
_OPTIONAL_SIZE_FIELDS = ("action_dim", "sound_dim")
_BOOL_FIELDS = ("attention_bias", "enable_fps_modulation", "unified_3d_mrope_reset_spatial_ids", "action_gen",
                "sound_gen", "qk_norm_for_text", "use_und_k_norm_for_gen")
_POSITIVE_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "timestep_scale", "base_fps")  # base_fps: 24 or 24.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class ConfigError(ValueError):
    """A transformer config that cannot describe a valid Cosmos3 model; the message names the field."""


@dataclass
class Cosmos3TransformerConfig:
    """Architecture of a Cosmos3 MoT transformer (diffusers `config.json` field names and defaults)."""

    attention_bias: bool = False
    attention_dropout: float = 0.0
    head_dim: int = 128
    hidden_size: int = 4096
    intermediate_size: int = 12288
    base_fps: int = 24
    enable_fps_modulation: bool = True
    latent_channel: int = 48
    unified_3d_mrope_reset_spatial_ids: bool = True
    unified_3d_mrope_temporal_modality_margin: int = 15000
    latent_patch_size: int = 2
    num_attention_heads: int = 32
    num_hidden_layers: int = 36
    num_key_value_heads: int = 8
    patch_latent_dim: int = 192
    rms_norm_eps: float = 1e-6
    rope_scaling: dict | None = None
    rope_theta: float = 5000000.0
    action_dim: int | None = None
    action_gen: bool = False
    num_embodiment_domains: int = 32
    sound_dim: int | None = None
    sound_gen: bool = False
    sound_latent_fps: float = 25.0
    timestep_scale: float = 0.001
    vocab_size: int = 151936
    hidden_act: str = "silu"
    qk_norm_for_text: bool = True
    use_und_k_norm_for_gen: bool = False
    # mRoPE sections (T, H, W) in rotary frequency pairs. Like diffusers, `None` resolves from
    # `rope_scaling["mrope_section"]`, else to [24, 20, 20].
    rope_axes_dim: list[int] | None = field(default=None)

    def __post_init__(self) -> None:
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ConfigError(f"config field 'rope_scaling'={self.rope_scaling!r}: expected null or an object")
        if self.rope_axes_dim is None:
            self.rope_axes_dim = (self.rope_scaling or {}).get("mrope_section", [24, 20, 20])
        if not isinstance(self.rope_axes_dim, list | tuple):
            raise ConfigError(f"config field 'rope_axes_dim'={self.rope_axes_dim!r}: expected a list of 3 integers "
                              "(or rope_scaling's mrope_section)")
        self.rope_axes_dim = list(self.rope_axes_dim)
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, expected: str) -> None:
            raise ConfigError(f"config field {name!r}={getattr(self, name)!r}: expected {expected}")

        # Every field's JSON type first: a string, list or float where diffusers has an integer would otherwise reach
        # torch (a traceback), or load as something else (the string "false" is true).
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                fail(name, "true or false")
        for name in (*_SIZE_FIELDS, *(f for f in _OPTIONAL_SIZE_FIELDS if getattr(self, f) is not None)):
            if not _is_int(getattr(self, name)) or not 1 <= getattr(self, name) <= MAX_SIZE:
                fail(name, f"a positive integer up to {MAX_SIZE}")
        for name in (*_POSITIVE_FLOAT_FIELDS, *(("sound_latent_fps",) if self.sound_gen else ())):
            if not _is_number(getattr(self, name)) or not 0 < getattr(self, name) < math.inf:
                fail(name, "a finite number above 0")
        if not _is_number(self.attention_dropout) or not 0 <= self.attention_dropout < 1:
            fail("attention_dropout", "a number in [0, 1)")
        if not _is_int(self.unified_3d_mrope_temporal_modality_margin) \
                or not 0 <= self.unified_3d_mrope_temporal_modality_margin <= MAX_SIZE:
            fail("unified_3d_mrope_temporal_modality_margin", f"an integer from 0 to {MAX_SIZE}")
        if not all(_is_int(n) and n >= 0 for n in self.rope_axes_dim):
            fail("rope_axes_dim", "non-negative integers")
        if self.hidden_act not in _SUPPORTED_ACTIVATIONS:
            fail("hidden_act", f"one of {_SUPPORTED_ACTIVATIONS}")
        if self.head_dim % 2:
            fail("head_dim", "an even number (rotary pairs)")
        if self.num_attention_heads % self.num_key_value_heads:
            fail("num_key_value_heads", f"a divisor of num_attention_heads={self.num_attention_heads}")
        expected_patch_dim = self.latent_patch_size**2 * self.latent_channel
        if self.patch_latent_dim != expected_patch_dim:
            fail("patch_latent_dim", f"latent_patch_size**2 * latent_channel = {expected_patch_dim}")
        if len(self.rope_axes_dim) != 3 or sum(self.rope_axes_dim) != self.head_dim // 2:
            fail("rope_axes_dim", f"3 sections (T, H, W) summing to head_dim // 2 = {self.head_dim // 2}")
        if self.action_gen and self.action_dim is None:
            fail("action_dim", "a positive integer when action_gen is true")
        if self.sound_gen and self.sound_dim is None:
            fail("sound_dim", "a positive integer when sound_gen is true")

    # ------------------------------------------------------------------ derived properties

    @property
    def nemotron_backbone(self) -> bool:
        """True for the Edge (Nemotron) backbone: relu² MLPs and fp32-upcast RMSNorm everywhere."""
        return self.hidden_act == "relu2"

    @property
    def has_und_k_norm_for_gen(self) -> bool:
        """Whether each layer holds `k_norm_und_for_gen` (diffusers builds it only without text q/k norm)."""
        return self.use_und_k_norm_for_gen and not self.qk_norm_for_text

    # ------------------------------------------------------------------ (de)serialisation

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Cosmos3TransformerConfig:
        """Build from a `config.json` dict; bookkeeping keys are dropped, unknown keys are an error."""
        known = set(cls.field_names())
        unknown = sorted(k for k in values
                         if k not in known and not k.startswith("_") and k not in _METADATA_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown Cosmos3 transformer config field(s) {unknown}; expected only {sorted(known)} "
                "(plus '_'-prefixed bookkeeping keys and 'dtype')"
            )
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def from_json_file(cls, path: str | Path) -> Cosmos3TransformerConfig:
        path = Path(path)
        values = read_json(path, ConfigError)
        if not isinstance(values, dict):
            raise ConfigError(f"{path} must hold a JSON object of config fields, got {type(values).__name__}")
        if values.get("_class_name", DIFFUSERS_CLASS_NAME) != DIFFUSERS_CLASS_NAME:
            raise ConfigError(f"{path}: _class_name {values['_class_name']!r}; expected {DIFFUSERS_CLASS_NAME!r}")
        try:
            return cls.from_dict(values)
        except (TypeError, ValueError) as exc:  # ConfigError, or a value of the wrong type met by a check
            raise ConfigError(f"{path}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """The `config.json` content diffusers writes: class name, version, then every field."""
        return {"_class_name": DIFFUSERS_CLASS_NAME, "_diffusers_version": DIFFUSERS_VERSION,
                **dataclasses.asdict(self)}
