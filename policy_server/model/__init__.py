"""Pure `nn.Module`s of the Cosmos3 generator and their checkpoint IO (no diffusers at run time)."""

from policy_server.model.boundary import GenInput, UndKV
from policy_server.model.checkpoint import (
    CheckpointError,
    load_transformer,
    remap_native_keys,
    save_transformer,
    to_native_keys,
)
from policy_server.model.config import ConfigError, Cosmos3TransformerConfig
from policy_server.model.gen_layout import GenLayout, ModalityLayout
from policy_server.model.reasoner_cache import ReasonerKVCache
from policy_server.model.transformer import Cosmos3OmniTransformer, Cosmos3OmniTransformerOutput

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Cosmos3OmniTransformer",
    "Cosmos3OmniTransformerOutput",
    "Cosmos3TransformerConfig",
    "GenInput",
    "GenLayout",
    "ModalityLayout",
    "ReasonerKVCache",
    "UndKV",
    "load_transformer",
    "remap_native_keys",
    "save_transformer",
    "to_native_keys",
]
