"""A diffusers `Cosmos3OmniPipeline` folder, exactly as `save_pretrained` writes it: what the server reads from it.

    model_index.json   `_class_name` Cosmos3OmniPipeline, the component classes, and the flags
                       `default_use_system_prompt`, `use_native_flow_schedule`, `enable_safety_checker`
    transformer/       Cosmos3OmniTransformer (served by this project's own model, `policy_server.model`)
    vae/               AutoencoderKLWan, the Wan2.2 VAE (through diffusers, `WanVideoVAE`)
    text_tokenizer/    Qwen2Tokenizer files with `chat_template.jinja`
    scheduler/         UniPCMultistepScheduler config: the sampler's sigma schedule
    vision_encoder/, sound_tokenizer/, safety_checker/: optional; unused by the action path

Defaults come from these files plus Cosmos3's action-mode defaults (`ACTION_DEFAULTS`); the embodiments from the
built-in Cosmos3 registry. An optional `policy.json` overrides `PolicyConfig` fields, and an optional
`embodiments.json` declares the embodiments to serve, adding or changing registry entries (stats for physical
units, cameras, limits, chunk sizes), both in the embedded model's format.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from policy_server.json_file import read_json
from policy_server.model.checkpoint import CheckpointError
from policy_server.pipeline.embodiments import EmbodimentRegistry
from policy_server.pipeline.policy_config import PolicyConfig, PolicyConfigError, describe
from policy_server.pipeline.schedulers import scheduler_settings

PIPELINE_CLASS = "Cosmos3OmniPipeline"
EMBEDDED_PIPELINE_CLASS = "Cosmos3PolicyPipeline"  # the embedded layout's model_index.json (`robots.embedded`)
# component -> (library, accepted class names)
REQUIRED_COMPONENTS = {
    "transformer": ("diffusers", ("Cosmos3OmniTransformer",)),
    "vae": ("diffusers", ("AutoencoderKLWan",)),
    "scheduler": ("diffusers", ("UniPCMultistepScheduler",)),
    "text_tokenizer": ("transformers", ("Qwen2Tokenizer", "Qwen2TokenizerFast")),
}
OPTIONAL_COMPONENTS = ("vision_encoder", "sound_tokenizer", "safety_checker")
FLAGS = ("default_use_system_prompt", "use_native_flow_schedule", "enable_safety_checker")
# Cosmos3's action-mode sampling defaults: the framework's forward/inverse dynamics and policy (`wam`)
# sample args and diffusers' action example (30 steps, no CFG, tier 480). diffusers' generic call defaults
# (35 steps, guidance 6) are its text-to-video ones.
ACTION_DEFAULTS = {"num_steps": 30, "guidance": 1.0, "resolution_tier": 480}
# Domains without a canonical action width (set per dataset); diffusers refuses them for action inference.
NO_CANONICAL_WIDTH = ("libero",)


def read_model_index(root: Path) -> dict | None:
    """`root/model_index.json` if it names a `Cosmos3OmniPipeline`, else None (no such file, or the embedded layout:
    a `policy.json` beside it); one that does not parse, or names another pipeline, is a CheckpointError."""
    path = root / "model_index.json"
    if not path.is_file():
        return None
    index = read_json(path, CheckpointError)
    named = index.get("_class_name") if isinstance(index, dict) else None
    if named == PIPELINE_CLASS:
        return index
    if not (root / "policy.json").is_file() and named != EMBEDDED_PIPELINE_CLASS:
        # Another diffusers pipeline (WanPipeline, ...): without this, the folder was taken for the embedded layout and
        # refused for its missing policy.json.
        raise CheckpointError(f"{path}: _class_name {named!r}; expected {PIPELINE_CLASS!r}, a Cosmos3 folder as "
                              "diffusers' save_pretrained writes it")
    return None


def model_index_flags(root: Path, index: dict) -> dict[str, bool]:
    """Check `index` (`read_model_index`) names the components this server serves; returns its flags."""
    path = root / "model_index.json"
    for name, (library, classes) in REQUIRED_COMPONENTS.items():
        entry = index.get(name)
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == library and entry[1] in classes):
            expected = " or ".join(map(repr, classes))
            raise CheckpointError(f"{path}: {name}={entry!r}; expected [{library!r}, {expected}]")
        if not (root / name).is_dir():
            raise CheckpointError(f"{path} lists {name} but {root / name} is not a directory")
    known = {"_class_name", "_diffusers_version", "_name_or_path", *REQUIRED_COMPONENTS, *OPTIONAL_COMPONENTS, *FLAGS}
    if unknown := sorted(set(index) - known):
        raise CheckpointError(f"{path}: unknown field(s) {unknown}; expected the Cosmos3OmniPipeline components "
                              f"and flags {list(FLAGS)}")
    flags = {}
    for flag in FLAGS:
        value = index.get(flag, False)
        if not isinstance(value, bool):
            raise CheckpointError(f"{path}: {flag}={value!r}; expected true or false")
        flags[flag] = value
    if flags["use_native_flow_schedule"]:
        raise CheckpointError(f"{path}: use_native_flow_schedule=true; this server implements the scheduler "
                              "config's own sigma schedule (false)")
    return flags


def policy_config(root: Path, name: str, flags: dict[str, bool]) -> PolicyConfig:
    """The folder's defaults (`name`, scheduler config, index flags, `ACTION_DEFAULTS`), overridden by `policy.json`."""
    defaults: dict[str, object] = {
        "name": name, **ACTION_DEFAULTS, **scheduler_settings(root / "scheduler" / "scheduler_config.json"),
        "use_system_prompt": flags["default_use_system_prompt"],
    }
    path = root / "policy.json"
    if not path.is_file():
        return PolicyConfig.model_validate(defaults)
    overrides = read_json(path, PolicyConfigError)
    if not isinstance(overrides, dict):
        raise PolicyConfigError(f"{path}: expected a JSON object of PolicyConfig fields")
    if {"canvases", "resolution_tier"} & set(overrides):
        defaults.pop("resolution_tier")  # the override sets the canvases its own way
    try:
        return PolicyConfig.model_validate({**defaults, **overrides})
    except ValidationError as error:
        raise PolicyConfigError(describe(error, path)) from None


def served_embodiments(root: Path, registry: EmbodimentRegistry, action_dim: int,
                       embodiments_file: str) -> list[str]:
    """What the server offers: the embodiments `embodiments_file` declares (adding or changing registry entries)
    when the folder has one, as in the embedded layout; otherwise every registry embodiment the transformer's
    action head can represent (`raw_action_dim <= action_dim`) that has a canonical width. A file other than
    embodiments.json (named by policy.json) must exist."""
    path = root / embodiments_file
    if not path.exists():
        if embodiments_file != PolicyConfig.model_fields["embodiments_file"].default:
            # named by policy.json: serving every registry embodiment instead would hide the misnamed file
            raise CheckpointError(f"{root / 'policy.json'}: embodiments_file {embodiments_file!r}: no {path}; "
                                  "expected the embodiments file it names")
        return [e.name for e in registry if e.raw_action_dim <= action_dim and e.name not in NO_CANONICAL_WIDTH]
    return registry.load_config(path)
