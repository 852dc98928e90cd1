"""Checkpoint IO for `Cosmos3OmniTransformer`: diffusers-layout directories, safetensors only.

Accepted layouts (what `Cosmos3OmniTransformer.save_pretrained` and the Hugging Face Cosmos3 repos ship):
- a transformer directory: `config.json` plus `diffusion_pytorch_model.safetensors`, or shards listed in
  `diffusion_pytorch_model.safetensors.index.json`;
- a pipeline root: `model_index.json` with the transformer under `transformer/`.
Weights named in the cosmos-framework's native scheme (`language_model.model.layers.*.q_proj_moe_gen`,
`vae2llm`, ...) are renamed by `remap_native_keys`, automatically when the loader sees them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from policy_server.json_file import read_json
from policy_server.model.config import Cosmos3TransformerConfig
from policy_server.model.transformer import Cosmos3OmniTransformer

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
CONFIG_NAME = "config.json"
PIPELINE_INDEX_NAME = "model_index.json"

# Modules diffusers keeps in fp32 whatever the load dtype (`_keep_in_fp32_modules`).
_FP32_MODULES = ("time_embedder",)


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the offending files, keys or shapes."""


# ---------------------------------------------------------------------------------------------- keys

# Attention projections, native -> diffusers. `*_moe_gen` (GEN) entries must be tried before the
# plain (UND) ones, which are their prefixes.
_NATIVE_ATTENTION_NAMES = (
    ("q_proj_moe_gen", "add_q_proj"),
    ("k_proj_moe_gen", "add_k_proj"),
    ("v_proj_moe_gen", "add_v_proj"),
    ("o_proj_moe_gen", "to_add_out"),
    ("q_norm_moe_gen", "norm_added_q"),
    ("k_norm_moe_gen", "norm_added_k"),
    ("q_proj", "to_q"),
    ("k_proj", "to_k"),
    ("v_proj", "to_v"),
    ("o_proj", "to_out"),
    ("q_norm", "norm_q"),
    ("k_norm", "norm_k"),
)
# Top-level heads, native module prefix -> diffusers module prefix.
_NATIVE_HEAD_NAMES = (
    ("vae2llm.", "proj_in."),
    ("llm2vae.", "proj_out."),
    ("time_embedder.mlp.0.", "time_embedder.linear_1."),
    ("time_embedder.mlp.2.", "time_embedder.linear_2."),
    ("action2llm.", "action_proj_in."),
    ("llm2action.", "action_proj_out."),
    ("sound2llm.", "audio_proj_in."),
    ("llm2sound.", "audio_proj_out."),
)
_NATIVE_PARAMETER_NAMES = {
    "action_modality_embed": "action_modality_embed",
    "sound_modality_embed": "audio_modality_embed",
    "language_model.lm_head.weight": "lm_head.weight",
}
_LANGUAGE_MODEL_PREFIX = "language_model.model."
# Wrappers around the network in framework exports (`model.net.*`) and training checkpoints (`net.*`).
_NATIVE_WRAPPER_PREFIXES = ("model.net.", "net.")
# The reasoner's ViT rides along in native checkpoints; it is not part of the generator transformer.
_NATIVE_VISION_PREFIXES = ("language_model.visual.", "language_model.model.visual.")
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.")
_ATTENTION_KEY = re.compile(r"^(layers\.\d+\.self_attn\.)([a-z_]+)(\..+)$")


V = TypeVar("V")  # what a key maps to: a tensor, or where the tensor is stored


def is_native_state_dict(state_dict: Mapping[str, object]) -> bool:
    """Whether keys use the cosmos-framework native names (`language_model.*`, `vae2llm.*`, ...)."""
    native_roots = ("language_model.", "vae2llm.", "llm2vae.") + _NATIVE_WRAPPER_PREFIXES
    return any(key.startswith(native_roots) for key in state_dict)


def remap_native_keys(state_dict: Mapping[str, V]) -> dict[str, V]:
    """Rename a cosmos-framework native state dict to diffusers' flat `Cosmos3OmniTransformer` keys.

    Strips `model.net.` / `net.` wrappers and `language_model.model.`, renames attention projections
    (`q_proj_moe_gen` -> `add_q_proj`, `q_proj` -> `to_q`, ...), the heads (`vae2llm` -> `proj_in`,
    `llm2vae` -> `proj_out`, `time_embedder.mlp.{0,2}` -> `time_embedder.linear_{1,2}`, `action2llm` ->
    `action_proj_in`, `llm2action` -> `action_proj_out`, `sound2llm` -> `audio_proj_in`, `llm2sound` ->
    `audio_proj_out`, `sound_modality_embed` -> `audio_modality_embed`) and drops the ViT. Keys it does
    not recognise raise `CheckpointError` naming them.
    """
    remapped: dict[str, V] = {}
    unknown: list[str] = []
    for key, tensor in state_dict.items():
        name = key
        for wrapper in _NATIVE_WRAPPER_PREFIXES:
            if name.startswith(wrapper):
                name = name[len(wrapper):]
                break
        if name.startswith(_NATIVE_VISION_PREFIXES):
            continue
        new = _remap_native_key(name)
        if new is None:
            unknown.append(key)
            continue
        if new in remapped:
            raise CheckpointError(f"native keys collide: {key!r} maps to {new!r}, already taken")
        remapped[new] = tensor
    if unknown:
        raise CheckpointError(f"unrecognised native Cosmos3 key(s): {show_names(unknown)}")
    return remapped


def _remap_native_key(name: str) -> str | None:
    if name in _NATIVE_PARAMETER_NAMES:
        return _NATIVE_PARAMETER_NAMES[name]
    for native, diffusers in _NATIVE_HEAD_NAMES:
        if name.startswith(native):
            return diffusers + name[len(native):]
    if not name.startswith(_LANGUAGE_MODEL_PREFIX):
        return None
    name = name[len(_LANGUAGE_MODEL_PREFIX):]
    match = _ATTENTION_KEY.match(name)
    if match:
        prefix, module, rest = match.groups()
        renamed = dict(_NATIVE_ATTENTION_NAMES).get(module, module)  # k_norm_und_for_gen keeps its name
        return prefix + renamed + rest
    return name


def to_native_keys(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `remap_native_keys` (without wrappers or ViT): diffusers keys -> native names."""
    attention = {diffusers: native for native, diffusers in _NATIVE_ATTENTION_NAMES}
    parameters = {diffusers: native for native, diffusers in _NATIVE_PARAMETER_NAMES.items()}
    native: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        if key in parameters:
            native[parameters[key]] = tensor
            continue
        head = next((n + key[len(d):] for n, d in _NATIVE_HEAD_NAMES if key.startswith(d)), None)
        if head is not None:
            native[head] = tensor
            continue
        match = _ATTENTION_KEY.match(key)
        if match:
            prefix, module, rest = match.groups()
            key = prefix + attention.get(module, module) + rest
        native[_LANGUAGE_MODEL_PREFIX + key] = tensor
    return native


def non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the tensors holding NaN or Inf: weights that load, then fail every tick (NonFiniteOutput)."""
    # Its extremes carry any NaN or Inf: one pass with no full-size temporary, much cheaper than `isfinite(t).all()`.
    return [name for name, tensor in named if tensor.is_floating_point() and tensor.numel()
            and not torch.isfinite(torch.stack(torch.aminmax(tensor))).all()]


def show_names(names: list[str], limit: int = 20) -> str:
    """The names, sorted and quoted, the first `limit` of them."""
    shown = ", ".join(repr(n) for n in sorted(names)[:limit])
    return shown + (f" ... ({len(names) - limit} more)" if len(names) > limit else "")


# ---------------------------------------------------------------------------------------------- files

def resolve_transformer_dir(path: str | Path) -> Path:
    """The directory holding the transformer's `config.json` (a pipeline root resolves to `transformer/`)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} is not a directory")
    if (path / PIPELINE_INDEX_NAME).is_file():
        path = path / "transformer"
        if not (path / CONFIG_NAME).is_file():
            raise CheckpointError(f"pipeline root has {PIPELINE_INDEX_NAME} but no {path / CONFIG_NAME}")
        return path
    if not (path / CONFIG_NAME).is_file():
        raise CheckpointError(
            f"{path} is not a Cosmos3 checkpoint: expected {CONFIG_NAME} (transformer directory) "
            f"or {PIPELINE_INDEX_NAME} with transformer/ (pipeline root)"
        )
    return path


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lives: its shard file and the name and shape it has there."""

    file: Path
    name: str
    shape: tuple[int, ...]


def index_tensors(directory: Path) -> dict[str, StoredTensor]:
    """Every tensor of a diffusers component directory, the transformer's or the VAE's (single file or index +
    shards), from the headers only; CheckpointError for a missing or unreadable file, or a weight stored as integers."""
    single, index = directory / WEIGHTS_NAME, directory / WEIGHTS_INDEX_NAME
    if index.is_file():
        stored = read_json(index, CheckpointError)
        weight_map = stored.get("weight_map") if isinstance(stored, dict) else None
        # A shard is a file of this folder: a path could make the loader read any file the server can.
        if not (isinstance(weight_map, dict) and weight_map
                and all(isinstance(shard, str) and shard == Path(shard).name for shard in weight_map.values())):
            raise CheckpointError(f"{index}: expected a 'weight_map' of tensor name -> shard file name in its folder")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard file(s) that do not exist: {missing}")
    elif single.is_file():
        weight_map, shards = None, [single.name]
    else:
        raise CheckpointError(f"no weights in {directory}: expected {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}"
                              + _variant_hint(directory))
    tensors: dict[str, StoredTensor] = {}
    for shard in shards:
        file = directory / shard
        not_float: dict[str, list[str]] = {}  # stored dtype -> keys
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    if weight_map is not None and weight_map.get(key) != shard:
                        continue  # the index is authoritative about which shard owns a key
                    stored = handle.get_slice(key)
                    tensors[key] = StoredTensor(file, key, tuple(stored.get_shape()))
                    if not stored.get_dtype().startswith(("F", "BF")):
                        not_float.setdefault(stored.get_dtype(), []).append(key)
        except SafetensorError as error:
            raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from None
        if not_float:
            # Every weight is floating point; cast to --dtype, an integer 0.03 would load as 0, silently.
            dtype, keys = next(iter(not_float.items()))
            raise CheckpointError(f"{file}: tensor(s) stored as {dtype}, expected floating point (F32, BF16, F16): "
                                  f"{show_names(keys)}")
    if weight_map is not None:
        absent = [k for k in weight_map if k not in tensors]
        if absent:
            raise CheckpointError(f"tensor(s) in {index.name} but absent from their shard: {show_names(absent)}")
    return tensors


# The weights `save_pretrained(variant=...)` writes: one file, or a shard index (its shards are named by it).
_VARIANT_WEIGHTS = re.compile(r"^diffusion_pytorch_model\.(?:safetensors\.index\.(\w+)\.json|(\w+)\.safetensors)$")


def _variant_hint(directory: Path) -> str:
    """What a folder saved by diffusers with `variant=` holds instead of the weights, and what to do; "" if none."""
    found = [(path.name, match[1] or match[2]) for path in sorted(directory.iterdir())
             if (match := _VARIANT_WEIGHTS.match(path.name))]
    if not found:
        return ""
    name, variant = found[0]
    return (f"; it holds {', '.join(name for name, _ in found)}: weights saved with variant={variant!r}, which "
            f"diffusers loads only when asked and this server does not; save without variant=, or rename {name} "
            f"without '.{variant}'")


def read_tensor(stored: StoredTensor, device: torch.device | str, dtype: torch.dtype | None) -> torch.Tensor:
    """One stored tensor on `device`, cast to `dtype` (None = as stored), in memory of its own.

    A handle maps its whole shard, and every page read through it stays resident until the handle
    closes: one handle per tensor keeps host memory at one tensor above what has been loaded.
    """
    try:
        with safe_open(str(stored.file), framework="pt", device=str(device)) as handle:
            tensor = handle.get_tensor(stored.name)
    except SafetensorError as error:
        raise CheckpointError(f"{stored.file}: cannot read {stored.name!r} ({error})") from None
    as_stored = tensor
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    elif tensor.device.type == "cpu":
        # On the CPU the tensor is a view of the mapped file: a file written over in place (`cp` of a new fine-tune)
        # would change the served weights under the server, or kill it (SIGBUS) while the file is short.
        tensor = tensor.clone()
    if non_finite([(stored.name, tensor)]):
        overflowed = tensor.dtype != as_stored.dtype and not non_finite([(stored.name, as_stored)])
        raise CheckpointError(f"{stored.file}: NaN or Inf values in {stored.name!r}"
                              + (f" once cast from {as_stored.dtype} to {dtype}" if overflowed else "")
                              + "; expected finite weights")
    return tensor


def load_transformer(path: str | Path, device: torch.device | str = "cpu",
                     dtype: torch.dtype | None = None) -> Cosmos3OmniTransformer:
    """Load a Cosmos3 transformer from a diffusers-layout directory (or pipeline root).

    `dtype=None` keeps the stored dtype; otherwise every weight is cast to `dtype`. The time embedder
    is fp32 in every case, as in diffusers. Tensors are read, cast and placed on `device` one at a
    time into a model built on the meta device, so peak memory is the loaded model plus one tensor.
    Returns the model in eval mode. Raises `ConfigError`/`CheckpointError` naming unknown config
    fields, missing or unexpected keys and shape mismatches.
    """
    directory = resolve_transformer_dir(path)
    config = Cosmos3TransformerConfig.from_json_file(directory / CONFIG_NAME)
    stored = index_tensors(directory)
    if is_native_state_dict(stored):
        stored = remap_native_keys(stored)
    # Checked before the model is built: building one of 10**9 layers, even on the meta device, takes hours.
    layers = 1 + max((int(match[1]) for key in stored if (match := _LAYER_KEY.match(key))), default=-1)
    if config.num_hidden_layers != layers:
        raise CheckpointError(f"{directory / CONFIG_NAME}: num_hidden_layers={config.num_hidden_layers}; the weights "
                              f"hold {layers} layer(s)" + (f" (layers.0 to layers.{layers - 1})" if layers else ""))
    with torch.device("meta"):
        model = Cosmos3OmniTransformer(config)
    check_state_dict(model, stored, directory)
    state_dict = {key: read_tensor(tensor, device, _load_dtype(key, dtype)) for key, tensor in stored.items()}
    model.load_state_dict(state_dict, strict=True, assign=True)
    return model.eval()


def _load_dtype(key: str, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype a model key loads in: fp32 inside `_FP32_MODULES`, else `dtype` (None = as stored)."""
    return torch.float32 if key.split(".", 1)[0] in _FP32_MODULES else dtype


def check_state_dict(model: torch.nn.Module, stored: dict[str, StoredTensor], directory: Path) -> None:
    """Raise `CheckpointError` listing missing keys, unexpected keys and shape mismatches of the weights `stored` in
    `directory` against `model`, built from its config; the file of each stored key it names."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = [k for k in expected if k not in stored]
    unexpected = [f"{k} ({stored[k].file.name})" for k in stored if k not in expected]
    mismatched = [f"{k} ({stored[k].file.name}): checkpoint {stored[k].shape} vs model {shape}"
                  for k, shape in expected.items() if k in stored and stored[k].shape != shape]
    problems = []
    if missing:
        problems.append(f"missing key(s): {show_names(missing)}")
    if unexpected:
        problems.append(f"unexpected key(s): {show_names(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatch(es): {'; '.join(mismatched[:20])}")
    if problems:
        raise CheckpointError(f"{directory}: the weights do not match {CONFIG_NAME}: " + " | ".join(problems))


def save_transformer(model: Cosmos3OmniTransformer, directory: str | Path) -> Path:
    """Write `config.json` and `diffusion_pytorch_model.safetensors` (loadable here and in diffusers)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(model.config.to_dict(), indent=2, sort_keys=True) + "\n")
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    return directory


def weights_digest(root: str | Path) -> str:
    """``sha256:<hex>`` over every ``.safetensors`` file under ``root`` (relative path and bytes, in path
    order), symlinked folders included: the identity of the weights a server serves."""
    root = Path(root)
    digest = hashlib.sha256()
    for path in _safetensors_files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        with path.open("rb") as file:
            digest.update(hashlib.file_digest(file, "sha256").digest())
    return f"sha256:{digest.hexdigest()}"


def _safetensors_files(root: Path) -> list[Path]:
    """The `.safetensors` files under `root`, sorted, through symlinked folders too (a folder assembled from links to
    other checkpoints' components: `Path.rglob` would skip them and give every such folder one digest), each real
    folder walked once (a link to a folder above would loop)."""
    files, walked = [], set()
    for folder, subfolders, names in os.walk(root, followlinks=True):
        stat = os.stat(folder)
        if (stat.st_dev, stat.st_ino) in walked:
            subfolders.clear()
            continue
        walked.add((stat.st_dev, stat.st_ino))
        subfolders.sort()  # which of two links to one folder is walked does not depend on the listing's order
        files += [Path(folder, name) for name in names if name.endswith(".safetensors")]
    return sorted(files)
