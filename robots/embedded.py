"""The embedded default policy: its architecture, embodiment and sampler defaults, and the folder layout.

The embedded model is a tiny Cosmos3 (same module tree and checkpoint keys as the real one) that
drives the built-in `PolicyServer/Reach-v0` task through the Cosmos3 `pusht` embodiment (domain 4,
raw action width 2: effector velocity in m/s) with the effector position as a clean state row.

A pipeline folder holds::

    model_index.json     the diffusers pipeline index: which folder holds which component
    policy.json          sampler defaults and conditioning canvas (PolicyConfig)
    embodiments.json     the served embodiment(s), pointing at the stats file
    action_stats.json    action/state statistics for normalisation
    transformer/         config.json + diffusion_pytorch_model.safetensors
    vae/                 config.json + diffusion_pytorch_model.safetensors
    text_tokenizer/      tokenizer.json (+ tokenizer_config.json)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from policy_server.model import Cosmos3OmniTransformer, Cosmos3TransformerConfig, save_transformer
from policy_server.model.text_tokenizer import TextTokenizer
from policy_server.model.vae import SmallVideoVAE
from policy_server.pipeline.diffusers_folder import EMBEDDED_PIPELINE_CLASS
from policy_server.pipeline.policy import PolicyPipeline, default_model_path
from policy_server.pipeline.policy_config import PolicyConfig
from robots.envs.reach import ACTION_DIM, DOMAIN_ID, EMBODIMENT, STATE_DIM, ReachConfig

CHUNK_SIZE = 8  # actions per tick: 0.8 s at 10 Hz
STATS_FILE = "action_stats.json"


def transformer_config() -> Cosmos3TransformerConfig:
    """Qwen-style backbone, 4 layers of width 128; head_dim 32 with mRoPE sections (T, H, W) = (6, 5, 5)."""
    return Cosmos3TransformerConfig(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_axes_dim=[6, 5, 5],
        vocab_size=512,
        latent_channel=16,
        latent_patch_size=2,
        patch_latent_dim=2 * 2 * 16,
        action_gen=True,
        action_dim=16,
    )


def policy_config() -> PolicyConfig:
    """20 UniPC steps with CFG 2: an uncached tick takes about 150 ms on one thread of this 2-core CPU, so
    the default 120 ms budget makes the controller cache (README, "Measured results")."""
    env = ReachConfig()
    return PolicyConfig(
        name="cosmos3-tiny-reach",
        sampler="unipc",
        num_steps=20,
        guidance=2.0,
        shift=3.0,
        canvases=((env.image_size, env.image_size),),
        use_system_prompt=False,
    )


def embodiment_entry() -> dict:
    """The `pusht` embodiment as the Reach task uses it (overrides the Cosmos3 registry defaults)."""
    env = ReachConfig()
    return {
        "name": EMBODIMENT,
        "domain_id": DOMAIN_ID,
        "raw_action_dim": ACTION_DIM,
        "action_names": ["vx", "vy"],
        "action_units": ["m/s", "m/s"],
        "action_low": [-env.max_speed] * ACTION_DIM,
        "action_high": [env.max_speed] * ACTION_DIM,
        "state_dim": STATE_DIM,
        "state_names": ["x", "y"],
        "state_units": ["m", "m"],
        "state_low": [0.0] * STATE_DIM,
        "state_high": [env.table_size] * STATE_DIM,
        "cameras": ["image"],
        "viewpoint": "third_person_view",
        "fps": env.control_hz,
        "default_chunk_size": CHUNK_SIZE,
        "max_chunk_size": 2 * CHUNK_SIZE,
        "normalization": {"method": "minmax", "stats_path": STATS_FILE},
        "description": "planar effector velocity on the built-in Reach table (PolicyServer/Reach-v0)",
    }


def default_stats() -> dict:
    """Stats from the task's declared limits, for an untrained folder: velocities within ±max_speed,
    effector positions on the table."""
    env = ReachConfig()
    return {
        "action": {"min": [-env.max_speed] * ACTION_DIM, "max": [env.max_speed] * ACTION_DIM},
        "state": {"min": [0.0] * STATE_DIM, "max": [env.table_size] * STATE_DIM},
    }


def write_pipeline_folder(
    directory: str | Path,
    transformer: Cosmos3OmniTransformer,
    vae: SmallVideoVAE,
    tokenizer: TextTokenizer,
    stats: dict,
    config: PolicyConfig | None = None,
    embodiment: dict | None = None,
) -> Path:
    """Write a loadable pipeline folder (see the module docstring) serving `embodiment` (an embodiments.json entry;
    default `embodiment_entry()`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_transformer(transformer, directory / "transformer")
    vae.save_pretrained(directory / "vae")
    tokenizer.save(directory / "text_tokenizer")
    (directory / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    served = {"embodiments": [embodiment or embodiment_entry()]}
    (directory / "embodiments.json").write_text(json.dumps(served, indent=2) + "\n")
    (config or policy_config()).save(directory / "policy.json")
    write_model_index(directory)
    return directory


def write_model_index(directory: str | Path) -> None:
    """`model_index.json` naming each component folder, so the folder is a diffusers-layout pipeline root."""
    index = {
        "_class_name": EMBEDDED_PIPELINE_CLASS,
        "_diffusers_version": "0.42.1",
        "transformer": ["diffusers", "Cosmos3OmniTransformer"],
        "vae": ["policy_server", "SmallVideoVAE"],
        "text_tokenizer": ["tokenizers", "Tokenizer"],
    }
    (Path(directory) / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def build_random_pipeline(directory: str | Path, seed: int = 0) -> PolicyPipeline:
    """An untrained embedded pipeline (random transformer, the shipped VAE and tokenizer) written to
    `directory` and loaded back. Used by tests and benchmarks that need the real shapes."""
    torch.manual_seed(seed)
    transformer = Cosmos3OmniTransformer(transformer_config())
    shipped = default_model_path()
    vae = SmallVideoVAE.from_pretrained(shipped / "vae")
    tokenizer = TextTokenizer.from_dir(shipped / "text_tokenizer")
    write_pipeline_folder(directory, transformer, vae, tokenizer, default_stats())
    return PolicyPipeline.from_pretrained(directory)
