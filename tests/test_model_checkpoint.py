"""Checkpoint IO: diffusers layouts, native-key remap, and errors that name what is wrong."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer as Reference
from safetensors.torch import load_file, save_file

from policy_server.benchmarks.forward import random_model
from policy_server.model import (
    CheckpointError,
    ConfigError,
    Cosmos3OmniTransformer,
    Cosmos3TransformerConfig,
    load_transformer,
    remap_native_keys,
    save_transformer,
    to_native_keys,
)
from policy_server.model.checkpoint import CONFIG_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME, weights_digest

REPO = Path(__file__).resolve().parents[1]

TINY = dict(head_dim=16, hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
            num_hidden_layers=2, vocab_size=64, latent_channel=4, patch_latent_dim=16,
            rope_axes_dim=[4, 2, 2], action_gen=True, action_dim=6, sound_gen=True, sound_dim=8)
# 54 M parameters, 207 MiB in fp32; its largest tensors (embed_tokens, lm_head) are 32 MiB each.
LARGE = dict(head_dim=64, hidden_size=1024, intermediate_size=2048, num_attention_heads=16, num_key_value_heads=4,
             num_hidden_layers=2, vocab_size=8192, latent_channel=4, patch_latent_dim=16, rope_axes_dim=[16, 8, 8],
             action_gen=True, action_dim=6)
EDGE = TINY | dict(hidden_act="relu2", qk_norm_for_text=False, use_und_k_norm_for_gen=True, sound_gen=False,
                   sound_dim=None)


@pytest.fixture(scope="module")
def model():
    return random_model(Cosmos3TransformerConfig(**TINY), seed=4)


@pytest.fixture
def saved(model, tmp_path):
    return save_transformer(model, tmp_path / "transformer")


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_save_then_load_round_trips(model, saved):
    loaded = load_transformer(saved)
    assert loaded.config == model.config
    assert_same_weights(loaded, model)
    assert not loaded.training


def test_saved_directory_loads_in_diffusers(model, saved):
    reference = Reference.from_pretrained(saved)
    assert reference.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(reference.state_dict()[key], value), key


def test_a_checkpoint_written_over_in_place_leaves_the_loaded_weights_as_loaded(model, saved, tmp_path):
    """`cp` of another fine-tune over the served folder writes into the same files; the loaded model owns its
    weights (they were views of the mapped file: the model changed to weights never loaded, or died of SIGBUS)."""
    loaded = load_transformer(saved)
    other = save_transformer(random_model(Cosmos3TransformerConfig(**TINY), seed=5), tmp_path / "other")
    with open(saved / WEIGHTS_NAME, "r+b") as file:  # same inode, as cp writes it
        file.write((other / WEIGHTS_NAME).read_bytes())
    assert_same_weights(loaded, model)


def test_the_digest_of_a_folder_of_symlinked_components_is_that_of_its_weights(saved, tmp_path):
    """A folder assembled from links to components (a fine-tune's transformer beside a shared VAE) is digested through
    them: two such folders of other weights had one digest, that of no file, so a quality profile measured on one was
    taken for the other."""
    other = save_transformer(random_model(Cosmos3TransformerConfig(**TINY), seed=5), tmp_path / "other")
    linked, copied = [], []
    for name, transformer in (("a", saved), ("b", other)):
        (tmp_path / "linked" / name).mkdir(parents=True)
        (tmp_path / "linked" / name / "transformer").symlink_to(transformer)
        (tmp_path / "linked" / name / "loop").symlink_to(tmp_path / "linked" / name)  # walked once, not forever
        linked.append(weights_digest(tmp_path / "linked" / name))
        shutil.copytree(transformer, tmp_path / "copied" / name / "transformer")
        copied.append(weights_digest(tmp_path / "copied" / name))
    assert linked == copied and linked[0] != linked[1]


def test_sharded_diffusers_checkpoint_and_pipeline_root(model, tmp_path):
    reference = Reference(**TINY)
    reference.load_state_dict(model.state_dict())
    reference.save_pretrained(tmp_path / "transformer", max_shard_size="40KB")
    assert (tmp_path / "transformer" / WEIGHTS_INDEX_NAME).is_file()
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "Cosmos3OmniPipeline"}))
    for path in (tmp_path / "transformer", tmp_path):
        assert_same_weights(load_transformer(path), model)


def test_edge_checkpoint_with_exporter_metadata_loads(tmp_path):
    reference = Reference(**EDGE)
    reference.load_state_dict(random_model(Cosmos3TransformerConfig(**EDGE), seed=5).state_dict())
    reference.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    # The Cosmos3 Edge exporter writes these two metadata fields into transformer/config.json.
    config.update(backbone_type="cosmos3_edge_nemotron_dense", temporal_compression_factor=4)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_transformer(tmp_path)
    assert "layers.0.self_attn.k_norm_und_for_gen.weight" in loaded.state_dict()
    assert "layers.0.self_attn.norm_q.weight" not in loaded.state_dict()
    assert "layers.0.mlp.gate_proj.weight" not in loaded.state_dict()
    assert_same_weights(loaded, reference)


def rewrite_weights(directory, edit):
    tensors = load_file(directory / WEIGHTS_NAME)
    edit(tensors)
    save_file(tensors, directory / WEIGHTS_NAME)


def test_missing_key_is_named(saved):
    rewrite_weights(saved, lambda t: t.pop("layers.1.self_attn.add_k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing key.*layers\.1\.self_attn\.add_k_proj\.weight"):
        load_transformer(saved)


def test_unexpected_key_is_named(saved):
    rewrite_weights(saved, lambda t: t.update({"layers.0.self_attn.extra_proj.weight": torch.zeros(2)}))
    expected = r"the weights do not match config\.json: unexpected key.*layers\.0\.self_attn\.extra_proj\.weight " \
               r"\(diffusion_pytorch_model\.safetensors\)"
    with pytest.raises(CheckpointError, match=expected):
        load_transformer(saved)


def test_shape_mismatch_is_named(saved):
    rewrite_weights(saved, lambda t: t.update({"proj_out.bias": torch.zeros(7)}))
    expected = (r"shape mismatch.*proj_out\.bias \(diffusion_pytorch_model\.safetensors\): "
                r"checkpoint \(7,\) vs model \(16,\)")
    with pytest.raises(CheckpointError, match=expected):
        load_transformer(saved)


def test_a_weight_that_overflows_the_dtype_it_loads_in_is_named(saved):
    """An fp32 weight past float16's range loads as Inf in float16 (the server's --dtype), and serves NaN actions."""
    rewrite_weights(saved, lambda t: t["proj_out.bias"].fill_(1e6))
    assert torch.equal(load_transformer(saved).proj_out.bias, torch.full((16,), 1e6))
    with pytest.raises(CheckpointError) as raised:
        load_transformer(saved, dtype=torch.float16)
    assert str(raised.value) == (f"{saved / 'diffusion_pytorch_model.safetensors'}: NaN or Inf values in "
                                 "'proj_out.bias' once cast from torch.float32 to torch.float16; expected finite "
                                 "weights")


def test_a_nan_weight_is_named_as_stored_whatever_dtype_it_loads_in(saved):
    rewrite_weights(saved, lambda t: t["proj_out.bias"].fill_(math.nan))
    for dtype in (None, torch.float16):
        with pytest.raises(CheckpointError) as raised:
            load_transformer(saved, dtype=dtype)
        assert str(raised.value) == (f"{saved / 'diffusion_pytorch_model.safetensors'}: NaN or Inf values in "
                                     "'proj_out.bias'; expected finite weights")


def test_unknown_config_field_is_named(saved):
    config = json.loads((saved / "config.json").read_text())
    config["num_experts"] = 8
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="num_experts"):
        load_transformer(saved)


def test_config_accepts_diffusers_bookkeeping_and_resolves_rope_sections():
    config = Cosmos3TransformerConfig.from_dict(
        {"_class_name": "Cosmos3OmniTransformer", "_diffusers_version": "0.42.1", "dtype": "bfloat16",
         "_name_or_path": "nvidia/x", "rope_scaling": {"mrope_section": [24, 20, 20]}})
    assert config.rope_axes_dim == [24, 20, 20]
    assert config == Cosmos3TransformerConfig(rope_scaling={"mrope_section": [24, 20, 20]})
    smaller = Cosmos3TransformerConfig(head_dim=64, rope_scaling={"mrope_section": [16, 8, 8]})
    assert smaller.rope_axes_dim == [16, 8, 8]
    with pytest.raises(ConfigError, match="hidden_act"):
        Cosmos3TransformerConfig(hidden_act="gelu")
    with pytest.raises(ConfigError, match="rope_axes_dim"):
        Cosmos3TransformerConfig(rope_axes_dim=[24, 20, 19])


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("hidden_size", 10**12, "a positive integer up to 1048576"),  # was torch's "Storage size calculation overflowed"
    ("action_dim", 6.0, "a positive integer up to 1048576"),  # was a TypeError from torch.empty
    ("num_hidden_layers", True, "a positive integer up to 1048576"),
    ("rope_theta", "1e6", "a finite number above 0"),  # was a TypeError from the rotary embedding
    ("rope_theta", -1.0, "a finite number above 0"),  # loaded
    ("rms_norm_eps", float("nan"), "a finite number above 0"),  # loaded
    ("timestep_scale", "0.001", "a finite number above 0"),  # loaded
    ("base_fps", 0, "a finite number above 0"),  # loaded
    ("unified_3d_mrope_temporal_modality_margin", -5, "an integer from 0 to 1048576"),  # loaded
    ("attention_dropout", 2, "a number in [0, 1)"),  # loaded
    ("qk_norm_for_text", "false", "true or false"),  # loaded as true
    ("action_gen", "yes", "true or false"),  # loaded
    ("rope_scaling", [1, 2], "null or an object"),  # loaded
    ("rope_axes_dim", "abc", "a list of 3 integers (or rope_scaling's mrope_section)"),  # "unsupported operand"
    ("rope_axes_dim", [10, -1, -1], "non-negative integers"),  # loaded
])
def test_a_config_value_of_the_wrong_type_or_out_of_range_is_named(saved, field, value, expected):
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ConfigError) as info:
        load_transformer(saved)
    assert str(info.value) == f"{saved / 'config.json'}: config field {field!r}={value!r}: expected {expected}"


def test_a_config_as_converters_may_write_it_loads():
    """base_fps as a float (the packing uses it so), and no sound_latent_fps where the model makes no sound (Edge)."""
    config = Cosmos3TransformerConfig(base_fps=24.0, sound_gen=False, sound_dim=None, sound_latent_fps=None)
    assert config.base_fps == 24.0
    with pytest.raises(ConfigError, match="sound_latent_fps"):
        Cosmos3TransformerConfig(sound_gen=True, sound_dim=64, sound_latent_fps=None)


def test_more_layers_in_the_config_than_in_the_weights_is_refused_before_the_model_is_built(saved):
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 100_000}))  # took > 60 s to build
    with pytest.raises(CheckpointError) as info:
        load_transformer(saved)
    assert str(info.value) == (f"{saved / 'config.json'}: num_hidden_layers=100000; the weights hold 2 layer(s) "
                               "(layers.0 to layers.1)")


def test_not_a_checkpoint_is_reported(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_transformer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(CheckpointError, match=WEIGHTS_NAME):
        load_transformer(tmp_path)


def test_native_key_names():
    lm = "language_model.model."
    names = {
        f"{lm}layers.0.self_attn.q_proj_moe_gen.weight": "layers.0.self_attn.add_q_proj.weight",
        f"{lm}layers.0.self_attn.o_proj_moe_gen.weight": "layers.0.self_attn.to_add_out.weight",
        f"{lm}layers.0.self_attn.k_norm_moe_gen.weight": "layers.0.self_attn.norm_added_k.weight",
        f"{lm}layers.3.self_attn.q_proj.weight": "layers.3.self_attn.to_q.weight",
        f"{lm}layers.3.self_attn.k_norm.weight": "layers.3.self_attn.norm_k.weight",
        f"{lm}layers.3.self_attn.k_norm_und_for_gen.weight": "layers.3.self_attn.k_norm_und_for_gen.weight",
        f"{lm}layers.3.mlp_moe_gen.up_proj.weight": "layers.3.mlp_moe_gen.up_proj.weight",
        f"{lm}layers.3.input_layernorm_moe_gen.weight": "layers.3.input_layernorm_moe_gen.weight",
        f"{lm}embed_tokens.weight": "embed_tokens.weight",
        f"{lm}norm_moe_gen.weight": "norm_moe_gen.weight",
        "language_model.lm_head.weight": "lm_head.weight",
        "vae2llm.weight": "proj_in.weight",
        "llm2vae.bias": "proj_out.bias",
        "time_embedder.mlp.0.weight": "time_embedder.linear_1.weight",
        "time_embedder.mlp.2.bias": "time_embedder.linear_2.bias",
        "action2llm.fc.weight": "action_proj_in.fc.weight",
        "llm2action.bias.weight": "action_proj_out.bias.weight",
        "action_modality_embed": "action_modality_embed",
        "sound2llm.weight": "audio_proj_in.weight",
        "llm2sound.bias": "audio_proj_out.bias",
        "sound_modality_embed": "audio_modality_embed",
    }
    native = {f"model.net.{key}": torch.zeros(1) for key in names}  # framework export wrapper
    # The reasoner's ViT is not part of the generator transformer: dropped.
    native["model.net.language_model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(1)
    assert sorted(remap_native_keys(native)) == sorted(names.values())
    with pytest.raises(CheckpointError, match="net_ema.vae2llm.weight"):
        remap_native_keys({"net_ema.vae2llm.weight": torch.zeros(1)})


def test_native_remap_round_trip_and_native_checkpoint_loads(model, saved):
    state = model.state_dict()
    native = to_native_keys(state)
    assert "language_model.model.layers.0.self_attn.q_proj_moe_gen.weight" in native
    assert "vae2llm.weight" in native and "llm2sound.weight" in native
    back = remap_native_keys(native)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    save_file({k: v.contiguous() for k, v in native.items()}, saved / WEIGHTS_NAME)
    assert_same_weights(load_transformer(saved), model)


# Loads the tiny checkpoint first, so that one-off costs (imports, the first meta-device model) are paid
# before the baseline, then prints how far the large load raised the peak RSS, in bytes. VmHWM, not
# ru_maxrss: a child's ru_maxrss starts from its parent's peak, which here is larger than the load.
PEAK_RSS_GROWTH = """
import sys, torch
from policy_server.model import load_transformer
def peak_rss():
    status = open("/proc/self/status").read().splitlines()
    return 1024 * int(next(line for line in status if line.startswith("VmHWM:")).split()[1])
load_transformer(sys.argv[1], dtype=torch.bfloat16)
before = peak_rss()
model = load_transformer(sys.argv[2], dtype=torch.bfloat16)
assert model.lm_head.weight.dtype == torch.bfloat16
print(peak_rss() - before)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_bf16_load_of_an_fp32_checkpoint_peaks_near_the_bf16_model(saved, tmp_path):
    """Tensors are read and cast one at a time: the peak stays near the bf16 model (half the file) plus
    one stored tensor. Reading the whole fp32 state dict before casting peaked at 1.5x the file (measured
    314 MiB for this 207 MiB file, against 132 MiB now)."""
    config = Cosmos3TransformerConfig(**LARGE)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Cosmos3OmniTransformer(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    large = tmp_path / "large"
    large.mkdir()
    (large / CONFIG_NAME).write_text(json.dumps(config.to_dict()))
    save_file({k: torch.rand(shape, generator=generator) for k, shape in shapes.items()}, large / WEIGHTS_NAME)
    size = (large / WEIGHTS_NAME).stat().st_size
    result = subprocess.run([sys.executable, "-c", PEAK_RSS_GROWTH, str(saved), str(large)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    growth = int(result.stdout)
    assert growth < 0.8 * size, f"peak RSS grew {growth / 2**20:.0f} MiB loading a {size / 2**20:.0f} MiB file"
