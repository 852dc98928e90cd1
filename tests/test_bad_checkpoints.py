"""`policy-server --checkpoint DIR` on folders that cannot be served: one line on stderr naming the file and
what was expected, exit status 2, no traceback, and no server left running."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys

import pytest
from cosmos3_folder import SCHEDULER, build_tiny_cosmos3_folder

from policy_server import cli
from policy_server.json_file import MAX_JSON_FILE_BYTES
from policy_server.pipeline.policy import CheckpointLoadError, PolicyPipeline
from policy_server.pipeline.policy_config import PolicyConfig, PolicyConfigError
from policy_server.pipeline.wan_vae import WanVideoVAE
from robots.embedded import build_random_pipeline


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good")
    build_random_pipeline(folder, seed=5)
    return folder


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _remove(path):
    path.unlink()


def _renaming(path, field, new_name):
    """A breakage: the JSON file's `field` misspelt as `new_name`."""
    data = json.loads(path.read_text())
    data[new_name] = data.pop(field)
    path.write_text(json.dumps(data))


def _writing(relative, content):
    """A breakage: the folder's file at `relative` replaced by `content` (str or bytes)."""
    def write(root):
        if isinstance(content, bytes):
            (root / relative).write_bytes(content)
        else:
            (root / relative).write_text(content)

    return write


def _bloated(relative):
    """A breakage: the folder's JSON file at `relative` grown (sparse, NULs) one byte past the cap on them."""
    def grow(root):
        os.truncate(root / relative, MAX_JSON_FILE_BYTES + 1)

    return grow


def _over_the_cap(relative):
    """What the server says of a JSON file `_bloated`: it reads one byte past the cap, no more."""
    return f"{relative}: more than {MAX_JSON_FILE_BYTES} bytes; expected a JSON file of at most 16 MiB"


BLOATED = ("policy.json", "embodiments.json", "action_stats.json", "transformer/config.json", "vae/config.json",
           "text_tokenizer/tokenizer_config.json")
BLOATED_DIFFUSERS = ("model_index.json", "scheduler/scheduler_config.json", "transformer/config.json",
                     "transformer/diffusion_pytorch_model.safetensors.index.json", "vae/config.json",
                     "text_tokenizer/tokenizer_config.json")


def _edit_weight_map(root, shard):
    """A breakage: the transformer's shard index gives its first tensor's shard as `shard`."""
    index = root / "transformer/diffusion_pytorch_model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][next(iter(data["weight_map"]))] = shard
    index.write_text(json.dumps(data))


BROKEN = {
    "empty_folder": (lambda root: [_remove(p) for p in root.rglob("*") if p.is_file()],
                     "no model_index.json; expected a Cosmos3OmniPipeline folder as diffusers' save_pretrained writes"),
    "embedded_folder_without_its_policy_json": (lambda root: _remove(root / "policy.json"),
                                                "policy.json: no policy config"),
    "embedded_folder_named_a_diffusers_pipeline": (
        lambda root: _edit_json(root / "model_index.json", _class_name="Cosmos3OmniPipeline"),
        "model_index.json: vae=['policy_server', 'SmallVideoVAE']; expected ['diffusers', 'AutoencoderKLWan']"),
    "missing_transformer_weights": (lambda root: _remove(root / "transformer/diffusion_pytorch_model.safetensors"),
                                    "no weights in"),
    "unknown_transformer_config_field": (lambda root: _edit_json(root / "transformer/config.json", hiden_size=3),
                                         "hiden_size"),
    "transformer_shape_mismatch": (lambda root: _edit_json(root / "transformer/config.json", action_dim=32),
                                   "shape mismatch"),
    "foreign_vae_class": (lambda root: _edit_json(root / "vae/config.json", _class_name="AutoencoderKLWan"),
                          "vae/config.json: config is for 'AutoencoderKLWan'; expected 'SmallVideoVAE'"),
    "truncated_vae_weights": (_writing("vae/diffusion_pytorch_model.safetensors", b"\x00" * 7),
                              "vae/diffusion_pytorch_model.safetensors: not a readable safetensors file"),
    "nan_vae_weight": (lambda root: _poisoned(root / "vae/diffusion_pytorch_model.safetensors"),
                       "vae/diffusion_pytorch_model.safetensors: NaN or Inf values in 'frame_decoder.conv_out.bias'; "
                       "expected finite weights"),
    "truncated_transformer_weights": (
        _writing("transformer/diffusion_pytorch_model.safetensors", b"\x00" * 7),
        "transformer/diffusion_pytorch_model.safetensors: not a readable safetensors file"),
    "missing_tokenizer": (lambda root: shutil.rmtree(root / "text_tokenizer"), "no tokenizer.json in"),
    "bad_embodiment_entry": (
        lambda root: _edit_json(root / "embodiments.json", embodiments=[{"name": "pusht", "domain_id": 99}]),
        "domain_id"),
    "camera_smaller_than_the_vae_takes": (
        lambda root: _edit_json(root / "embodiments.json", embodiments=[
            {"name": "pusht", "camera_sizes": {"image": [4, 64]}}]),
        "embodiments.json: pusht's camera_sizes: camera 'image' is 4x64 px; expected sides of 8 to 2048 px (8: the "
        "VAE's spatial compression, the smallest frame side the server takes)"),
    **{f"camera_size_{'x'.join(map(str, size))}": (  # "camera_sizes.image.1: Field required", of [64]
        lambda root, size=size: _edit_json(root / "embodiments.json", embodiments=[
            {"name": "pusht", "camera_sizes": {"image": size}}]),
        f"embodiments.json: embodiments[0] ('pusht').camera_sizes: Value error, camera 'image' is {size}; expected "
        "[height, width], two integers (px)") for size in ([64], [64, 64, 3])},
    "camera_too_wide_beside_the_tallest": (
        lambda root: _edit_json(root / "embodiments.json", embodiments=[
            {"name": "pusht", "cameras": ["scene", "wrist"], "camera_sizes": {"scene": [512, 512], "wrist": [8, 64]}}]),
        "pusht's camera_sizes: camera 'wrist' is 8x64 px, 4096 px wide scaled to the height of camera 'scene' (512 "
        "px, aspect kept); expected at most 2048"),
    "missing_stats_file": (lambda root: _remove(root / "action_stats.json"), "action_stats.json"),
    "guidance_interval_between_two_timesteps": (  # was served, guidance never running
        lambda root: _edit_json(root / "policy.json", num_steps=4, shift=5.0, guidance_interval=[950, 990]),
        "policy.json: Value error, guidance_interval [950, 990] holds none of the 4 sampler timesteps (int(sigma * "
        "1000), 999 down to 625) at num_steps=4, so guidance would never run"),
    "vae_config_not_an_object": (_writing("vae/config.json", "[]"),
                                 "vae/config.json: expected a JSON object of SmallVideoVAE config fields"),
    "embodiments_json_nested_past_the_parser": (_writing("embodiments.json", "[" * 100_000),
                                                "embodiments.json: JSON nested too deeply to parse"),
    **{f"bloated {relative}": (_bloated(relative), _over_the_cap(relative)) for relative in BLOATED},
}


@pytest.fixture
def serves_nothing(monkeypatch):
    """A folder that loads fails the test at once: `cli.main` would otherwise serve it until stopped."""
    def loaded(config, engine):
        raise AssertionError(f"{config.checkpoint} loaded; expected it refused")

    monkeypatch.setattr("policy_server.server.app.build_server", loaded)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_checkpoint_that_cannot_be_served_is_one_line_and_exit_2(good_folder, tmp_path, capsys, name,
                                                                    serves_nothing):
    breakage, expected = BROKEN[name]
    root = tmp_path / "ckpt"
    shutil.copytree(good_folder, root)
    breakage(root)
    assert cli.main(["--checkpoint", str(root), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"policy-server: cannot serve checkpoint {root}: ") and "\n" not in err, err
    assert expected in err and "Traceback" not in err


@pytest.fixture(scope="module")
def diffusers_folder(tmp_path_factory):
    """A sharded `Cosmos3OmniPipeline` folder as diffusers' `save_pretrained` writes it."""
    return build_tiny_cosmos3_folder(tmp_path_factory.mktemp("cosmos3") / "pipe", max_shard_size="200KB")


def _pickled_only(folder):
    """Weights as a pickle, which the server must never load."""
    for path in folder.glob("diffusion_pytorch_model*.safetensors*"):
        path.unlink()
    (folder / "diffusion_pytorch_model.bin").write_bytes(b"a pickle would run code when loaded")


def _first_shard(root):
    return sorted((root / "transformer").glob("*-of-*.safetensors"))[0]


def _stored_as_integers(path):
    """A breakage: the shard's tensors stored as int32 (a float weight of 0.03 would load as 0)."""
    import torch
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(path))
    save_file({key: tensor.to(torch.int32) for key, tensor in tensors.items()}, str(path), metadata={"format": "pt"})


def _poisoned(path, value=math.nan):
    """A breakage: the first tensor of a weights file holds `value` (a diverged fine-tune saves NaN weights)."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(path))
    first = sorted(tensors)[0]
    tensors[first].view(-1)[0] = value
    save_file(tensors, str(path), metadata={"format": "pt"})
    return first


def _saved_as_variant(root):
    """The folder saved again by diffusers with `variant="fp16"` (weights named `*.fp16.*`), sharded as it was."""
    from diffusers import Cosmos3OmniPipeline
    pipe = Cosmos3OmniPipeline.from_pretrained(root, local_files_only=True)
    shutil.rmtree(root)
    pipe.save_pretrained(root, variant="fp16", max_shard_size="200KB")


SCHEDULER_CONFIG = {"_class_name": "UniPCMultistepScheduler", **SCHEDULER}
def _token_past_the_embedding(root):
    """A breakage: the tokenizer's vocabulary given a token of id 400, past the tiny transformer's 300 rows."""
    path = root / "text_tokenizer/tokenizer.json"
    tokenizer = json.loads(path.read_text())
    tokenizer["model"]["vocab"]["zz"] = 400
    path.write_text(json.dumps(tokenizer))


BROKEN_DIFFUSERS = {
    "another_diffusers_pipeline": (  # was "policy.json: no policy config; expected a JSON file with the sampler ..."
        _writing("model_index.json", json.dumps({"_class_name": "WanPipeline", "_diffusers_version": "0.35.0",
                                                 "transformer": ["diffusers", "WanTransformer3DModel"],
                                                 "vae": ["diffusers", "AutoencoderKLWan"]})),
        "model_index.json: _class_name 'WanPipeline'; expected 'Cosmos3OmniPipeline', a Cosmos3 folder as diffusers' "
        "save_pretrained writes it"),
    "missing_component": (lambda root: shutil.rmtree(root / "vae"), "model_index.json lists vae but"),
    "wrong_pipeline_component_class": (
        lambda root: _edit_json(root / "model_index.json", transformer=["diffusers", "WanTransformer3DModel"]),
        "model_index.json: transformer=['diffusers', 'WanTransformer3DModel']; expected ['diffusers', "
        "'Cosmos3OmniTransformer']"),
    "unknown_transformer_config_field": (lambda root: _edit_json(root / "transformer/config.json", hiden_size=3),
                                         "hiden_size"),
    "missing_shard": (lambda root: _remove(_first_shard(root)), "lists shard file(s) that do not exist"),
    "weights_saved_as_a_variant": (
        _saved_as_variant,
        "transformer: expected diffusion_pytorch_model.safetensors or diffusion_pytorch_model.safetensors.index.json; "
        "it holds diffusion_pytorch_model.safetensors.index.fp16.json: weights saved with variant='fp16', which "
        "diffusers loads only when asked and this server does not; save without variant=, or rename "
        "diffusion_pytorch_model.safetensors.index.fp16.json without '.fp16'"),
    "integer_weights": (lambda root: _stored_as_integers(_first_shard(root)),
                        ".safetensors: tensor(s) stored as I32, expected floating point (F32, BF16, F16): "),
    "nan_weight": (lambda root: _poisoned(_first_shard(root)),
                   ".safetensors: NaN or Inf values in 'action_modality_embed'; expected finite weights"),
    "wan_vae_infinite_weight": (lambda root: _poisoned(sorted((root / "vae").glob("*.safetensors"))[0], math.inf),
                                "vae: NaN or Inf values in 'encoder.conv_in.bias'; expected finite weights"),
    "shape_mismatch": (lambda root: _edit_json(root / "transformer/config.json", intermediate_size=80),
                       "shape mismatch"),
    "unknown_scheduler": (lambda root: _edit_json(root / "scheduler/scheduler_config.json",
                                                  _class_name="DDIMScheduler"),
                          "scheduler_config.json: _class_name 'DDIMScheduler'; expected 'UniPCMultistepScheduler'"),
    "wan_vae_latent_stats": (lambda root: _edit_json(root / "vae/config.json", latents_std=[1.0]),
                             "vae/config.json: latents_std must hold z_dim=8 finite values"),
    "wan_vae_weights_pickled_only": (lambda root: _pickled_only(root / "vae"),
                                     "vae: expected diffusion_pytorch_model.safetensors or"),
    "wan_vae_integer_weights": (lambda root: _stored_as_integers(sorted((root / "vae").glob("*.safetensors"))[0]),
                                ".safetensors: tensor(s) stored as I32, expected floating point"),
    "wan_vae_zero_std": (lambda root: _edit_json(root / "vae/config.json", latents_std=[0.0] * 8),
                         "vae/config.json: latents_std must be positive"),
    "wan_vae_sizes_not_its_weights": (  # diffusers allocated the VAE it describes (108 TB asked for) before comparing
        lambda root: _edit_json(root / "vae/config.json", base_dim=10**6),
        "vae: the weights do not match config.json: shape mismatch(es): encoder.conv_in.weight (diffusion_pytorch_"
        "model-00001-of-00005.safetensors): checkpoint (8, 12, 3, 3, 3) vs model (1000000, 12, 3, 3, 3)"),
    "wan_vae_more_levels_than_downsamplings": (  # was an IndexError from diffusers, a traceback
        lambda root: _edit_json(root / "vae/config.json", dim_mult=[1, 2, 2, 2, 2]),
        "vae/config.json: cannot build the AutoencoderKLWan from it (list index out of range)"),
    "wan_vae_more_blocks_than_its_weights_hold": (  # built for 10 s (10**6: hours), then diffusers' shape error
        lambda root: _edit_json(root / "vae/config.json", num_res_blocks=1000),
        "vae/config.json: num_res_blocks=1000 on each of dim_mult's 4 level(s); expected a positive integer, and at "
        "most as many blocks in all as the weights hold tensors ("),
    "wan_vae_patch_size_a_string": (  # was "... compresses 22222222x in space", the string repeated
        lambda root: _edit_json(root / "vae/config.json", patch_size="2"),
        "vae/config.json: patch_size='2'; expected a positive integer or null"),
    "wan_vae_z_dim_a_string": (  # was "cannot build ... (not all arguments converted during string formatting)"
        lambda root: _edit_json(root / "vae/config.json", z_dim="8"),
        "vae/config.json: z_dim='8'; expected a positive integer"),
    "wan_vae_temperal_downsample_a_string": (  # was "cannot build ... (string index out of range)"
        lambda root: _edit_json(root / "vae/config.json", temperal_downsample="no"),
        "vae/config.json: temperal_downsample='no'; expected a list of true or false, one per level but the last"),
    "wan_vae_latents_mean_null": (
        lambda root: _edit_json(root / "vae/config.json", latents_mean=None),
        "vae/config.json: latents_mean=None; expected a list of numbers"),
    "wan_vae_unknown_field": (lambda root: _renaming(root / "vae/config.json", "z_dim", "z_dimm"),
                              "vae/config.json: unknown field(s) ['z_dimm']; expected the AutoencoderKLWan arguments"),
    "wan_vae_scale_not_its_architecture": (
        lambda root: _edit_json(root / "vae/config.json", scale_factor_spatial=8),
        "vae/config.json: scale_factor_spatial 8 and scale_factor_temporal 4; the architecture"),
    "model_index_not_json": (_writing("model_index.json", "{"),
                             "model_index.json: not valid JSON"),
    "flow_shift_not_a_number": (lambda root: _edit_json(root / "scheduler/scheduler_config.json", flow_shift="abc",
                                                        use_karras_sigmas=False),
                                "scheduler_config.json: flow_shift='abc'; expected a number above 0"),
    "karras_sigma_max_infinite": (  # was pydantic's ValidationError, a traceback
        _writing("scheduler/scheduler_config.json", json.dumps({**SCHEDULER_CONFIG, "sigma_max": math.inf})),
        "scheduler_config.json: use_karras_sigmas needs 0 < sigma_min < sigma_max < infinity, got 0.147, inf"),
    "solver_order_true": (  # was pydantic's ValidationError of PolicyConfig, a traceback and exit status 1
        lambda root: _edit_json(root / "scheduler/scheduler_config.json", solver_order=True),
        "scheduler_config.json: solver_order=True; expected 1..3"),
    "karras_flag_a_string": (  # was served on Karras sigmas: the string "false" is true
        lambda root: _edit_json(root / "scheduler/scheduler_config.json", use_karras_sigmas="false"),
        "scheduler_config.json: use_karras_sigmas='false'; expected true or false"),
    "corrector_disabled_on_some_steps": (
        lambda root: _edit_json(root / "scheduler/scheduler_config.json", disable_corrector=[0, 1]),
        "scheduler_config.json: disable_corrector=[0, 1]; this server implements []"),
    "tokenizer_not_parsed": (_writing("text_tokenizer/tokenizer.json", "{}"),
                             "tokenizer.json: not a tokenizers file"),
    "tokenizer_config_not_json": (_writing("text_tokenizer/tokenizer_config.json", "{"),
                                  "tokenizer_config.json: not valid JSON"),
    "eos_token_not_in_the_tokenizer": (  # the message named no file
        lambda root: _edit_json(root / "text_tokenizer/tokenizer_config.json", eos_token="<|end|>"),
        "text_tokenizer/tokenizer.json: the tokenizer has no eos token '<|end|>'; a Cosmos3 prompt needs it"),
    "eos_token_a_number": (  # was "tokenizer_config.json has no eos_token", of a file that has one
        lambda root: _edit_json(root / "text_tokenizer/tokenizer_config.json", eos_token=5),
        "text_tokenizer/tokenizer_config.json has no eos_token (eos_token 5 names none); expected the end-of-prompt "
        "token, a string or an AddedToken's object with its content, e.g. '<|im_end|>'"),
    "tokenizer_config_missing": (  # was "text_tokenizer/tokenizer_config.json has no eos_token", of a missing file
        lambda root: _remove(root / "text_tokenizer/tokenizer_config.json"),
        "text_tokenizer; expected one naming the end-of-prompt eos_token, e.g. '<|im_end|>'"),
    "chat_template_does_not_compile": (_writing("text_tokenizer/chat_template.jinja", "{% if"),
                                       "the chat template does not compile"),
    "shard_index_names_a_number": (
        lambda root: _edit_weight_map(root, 5),
        "index.json: expected a 'weight_map' of tensor name -> shard file name in its folder"),
    "shard_index_names_a_file_outside_its_folder": (
        lambda root: _edit_weight_map(root, "../text_tokenizer/tokenizer.json"),
        "index.json: expected a 'weight_map' of tensor name -> shard file name in its folder"),
    "shard_index_not_json": (_writing("transformer/diffusion_pytorch_model.safetensors.index.json", "["),
                             "index.json: not valid JSON"),
    "transformer_config_value_of_a_wrong_type": (
        lambda root: _edit_json(root / "transformer/config.json", hidden_size="64"),
        "transformer/config.json: config field 'hidden_size'='64': expected a positive integer"),
    "transformer_of_another_class": (lambda root: _edit_json(root / "transformer/config.json", _class_name="Foo"),
                                     "transformer/config.json: _class_name 'Foo'; expected 'Cosmos3OmniTransformer'"),
    "pad_mode": (_writing("policy.json", '{"pad_mode": "mirror"}'),
                 "policy.json: pad_mode: Input should be 'reflect' or 'replicate'"),
    "resolution_tier_a_string": (_writing("policy.json", '{"resolution_tier": "480"}'),
                                 "policy.json: resolution_tier: Input should be a valid integer"),
    "infinite_guidance": (_writing("policy.json", '{"guidance": Infinity}'),
                          "policy.json: guidance: Input should be a finite number"),
    "canvas_wider_than_the_cameras_side_by_side": (
        _writing("policy.json", '{"canvases": [[64, 64], [64, 2064]]}'),
        "policy.json: canvases [[64, 2064]]; expected widths of at most 2048 px, the 1 camera(s) of a served "
        "embodiment side by side at 2048 px each (a wider canvas is all padding there)"),
    "canvas_off_the_latent_grid": (_writing("policy.json", '{"canvases": [[72, 72]]}'),
                                   "policy.json: canvases [[72, 72]]; expected sides that are multiples of"),
    "embodiments_file_named_but_missing": (  # was served as if unnamed: every registry embodiment
        _writing("policy.json", '{"embodiments_file": "robots.json"}'),
        "policy.json: embodiments_file 'robots.json': no "),
    "no_embodiments": (_writing("embodiments.json", '{"embodiments": []}'),
                       "embodiments.json: embodiments is empty"),
    "state_wider_than_the_action_rows": (
        _writing("embodiments.json", '{"embodiments": [{"name": "pusht", "state_dim": 40}]}'),
        "embodiments.json: ['pusht'] have more action or state channels than the transformer's action_dim=32"),
    "embodiment_name_not_in_the_registry": (
        _writing("embodiments.json", '{"embodiments": [{"name": "bridge"}]}'),
        "embodiments.json: embodiments[0] ('bridge'): not a known embodiment (known: "),
    "raw_action_dim_a_string": (
        _writing("embodiments.json", '{"embodiments": [{"name": "pusht", "raw_action_dim": "2"}]}'),
        "embodiments.json: embodiments[0] ('pusht').raw_action_dim: Input should be a valid integer"),
    "stats_of_a_negative_std": (  # was served, that channel's actions and state of the flipped sign
        lambda root: [_writing("stats.json", json.dumps({"action": {"mean": [0.0, 0.0], "std": [0.5, -0.5]}}))(root),
                      _writing("embodiments.json", json.dumps({"embodiments": [{"name": "pusht", "normalization": {
                          "method": "meanstd", "stats_path": "stats.json"}}]}))(root)],
        "stats.json: feature 'action' has channels with a negative std (meanstd): [1]; expected standard deviations, "
        "0 or more"),
    "guidance_interval_reversed": (  # was served, guidance never running (no timestep inside)
        _writing("policy.json", '{"guidance": 3.0, "guidance_interval": [1001, 960]}'),
        "policy.json: guidance_interval: Value error, [1001.0, 960.0] holds no timestep; expected [lo, hi] with lo < "
        "hi (CFG runs while lo < sigma * 1000 < hi)"),
    "stats_path_not_a_path": (
        _writing("embodiments.json",
                 '{"embodiments": [{"name": "pusht", "normalization": {"method": "minmax", "stats_path": 5}}]}'),
        "normalization.stats_path: expected a file path, a string"),
    **{f"bloated {relative}": (_bloated(relative), _over_the_cap(relative)) for relative in BLOATED_DIFFUSERS},
}


@pytest.mark.parametrize("name", sorted(BROKEN_DIFFUSERS))
def test_a_diffusers_folder_that_cannot_be_served_is_one_line_and_exit_2(diffusers_folder, tmp_path, capsys, name,
                                                                          serves_nothing):
    assert len(list((diffusers_folder / "transformer").glob("*-of-*.safetensors"))) > 1
    breakage, expected = BROKEN_DIFFUSERS[name]
    root = tmp_path / "ckpt"
    shutil.copytree(diffusers_folder, root)
    breakage(root)
    assert cli.main(["--checkpoint", str(root), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"policy-server: cannot serve checkpoint {root}: ") and "\n" not in err, err
    assert expected in err and "Traceback" not in err


def test_a_port_in_use_is_one_line_and_exit_2(good_folder, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["--checkpoint", str(good_folder), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("policy-server: could not bind gRPC to 127.0.0.1:") and "\n" not in err, err


def test_policy_json_names_the_embodiments_file_of_a_diffusers_folder(diffusers_folder, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(diffusers_folder, root)
    (root / "policy.json").write_text('{"embodiments_file": "robots.json"}')
    (root / "robots.json").write_text('{"embodiments": [{"name": "bridge_orig_lerobot"}]}')
    assert PolicyPipeline.from_pretrained(root).served_embodiments == ["bridge_orig_lerobot"]


def test_the_wan_vae_config_may_carry_wan22s_clip_output(diffusers_folder, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(diffusers_folder, root)
    _edit_json(root / "vae/config.json", clip_output=False)  # as Wan2.2's (and Cosmos3's) vae/config.json has it
    assert WanVideoVAE.from_pretrained(root / "vae").latent_channels == 8


@pytest.mark.parametrize(("text", "field", "expected"), [
    ('{"num_steps": "4"}', "num_steps", "a valid integer"),
    ('{"num_steps": 4.0}', "num_steps", "a valid integer"),
    ('{"guidance": "2.5"}', "guidance", "a valid number"),
    ('{"canvases": [[64, "64"]]}', "canvases.0.1", "a valid integer"),
    ('{"guidance_interval": ["0", 900]}', "guidance_interval.0", "a valid number"),
])
def test_policy_json_numbers_are_not_converted(tmp_path, text, field, expected):
    path = tmp_path / "policy.json"
    path.write_text(text)
    with pytest.raises(PolicyConfigError) as info:
        PolicyConfig.load(path)
    assert str(info.value) == f"{path}: {field}: Input should be {expected}"


@pytest.mark.parametrize(("canvases", "expected"), [
    ([], "canvases: Value error, 0 canvases; expected 1 to 16"),
    ([[64, 64]] * 17, "canvases: Value error, 17 canvases; expected 1 to 16"),
    ([[64, 64], [4096, 64]], "canvases.1.0: Input should be less than or equal to 2048"),
    ([[0, 64]], "canvases.0.0: Input should be greater than or equal to 1"),
])
def test_policy_json_canvases_are_bounded(tmp_path, canvases, expected):
    """A canvas taller than the largest frame the server takes would be all padding below it, and each canvas costs
    warmup. A wider one may hold cameras side by side: the pipeline bounds its width by the cameras it serves
    (`canvas_wider_than_the_cameras_side_by_side`)."""
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"canvases": canvases}))
    with pytest.raises(PolicyConfigError) as info:
        PolicyConfig.load(path)
    assert str(info.value) == f"{path}: {expected}"
    path.write_text(json.dumps({"canvases": [[64, 4096]]}))  # two cameras of 64x2048
    assert PolicyConfig.load(path).canvases == ((64, 4096),)


@pytest.mark.parametrize(("interval", "nearest", "way"), [
    ([950, 990], "937 (at or below lo), 999 (at or above hi)", "lo below 937 or hi above 999"),  # between two
    ([1001, 2000], "999 (at or below lo)", "lo below 999"),  # beyond (0, 1000]
    ([-5, 0], "625 (at or above hi)", "hi above 625"),  # below the last step's
])
def test_policy_json_guidance_interval_must_hold_a_timestep_of_its_steps(tmp_path, interval, nearest, way):
    """An interval with lo < hi but none of the sampler's timesteps inside was served, guidance never running."""
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"num_steps": 4, "guidance": 3.0, "shift": 5.0, "guidance_interval": interval}))
    with pytest.raises(PolicyConfigError) as info:
        PolicyConfig.load(path)
    assert str(info.value) == (
        f"{path}: Value error, guidance_interval [{interval[0]}, {interval[1]}] holds none of the 4 sampler timesteps "
        f"(int(sigma * 1000), 999 down to 625) at num_steps=4, so guidance would never run; nearest: {nearest}; "
        f"expected an interval holding one of them ({way}), or null for CFG on every step")
    path.write_text(json.dumps({"num_steps": 4, "guidance": 3.0, "shift": 5.0, "guidance_interval": [960, 1001]}))
    assert PolicyConfig.load(path).guided_steps(4) == range(0, 1)  # Cosmos3's DROID settings: the first step


def test_policy_json_trained_domain_ids_are_rows_of_the_action_projections(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text('{"trained_domain_ids": [4, 32]}')
    with pytest.raises(PolicyConfigError) as info:
        PolicyConfig.load(path)
    assert str(info.value) == f"{path}: trained_domain_ids.1: Input should be less than 32"


def test_a_config_that_crashed_the_process_is_one_line_and_exit_2(diffusers_folder, tmp_path):
    """The real process: a transformer config.json with hidden_size 10**12 ended policy-server in torch's traceback."""
    root = tmp_path / "ckpt"
    shutil.copytree(diffusers_folder, root)
    _edit_json(root / "transformer/config.json", hidden_size=10**12)
    done = subprocess.run([sys.executable, "-m", "policy_server.cli", "--checkpoint", str(root), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"policy-server: cannot serve checkpoint {root}: {root}/transformer/config.json: config field "
        "'hidden_size'=1000000000000: expected a positive integer up to 1048576")


def test_a_tokenizer_of_ids_past_the_embedding_is_refused_at_load(diffusers_folder, tmp_path):
    """It loaded, and the first tick holding such an id would fail (on CUDA, a device-side assert)."""
    root = tmp_path / "ckpt"
    shutil.copytree(diffusers_folder, root)
    _token_past_the_embedding(root)
    with pytest.raises(CheckpointLoadError) as info:
        PolicyPipeline.from_pretrained(root)
    assert str(info.value) == (f"cannot serve checkpoint {root}: {root}/text_tokenizer: the tokenizer emits ids up to "
                               "400; expected ids below the transformer's vocab_size=300 "
                               f"({root}/transformer/config.json)")


def test_rollout_sampler_overrides_the_checkpoints_guidance_interval_leaves_unguided_are_one_line(good_folder,
                                                                                                  tmp_path, capsys):
    # Was: pydantic's ValidationError traceback once the model had loaded.
    from robots.rollout import main as rollout_main

    root = tmp_path / "ckpt"
    shutil.copytree(good_folder, root)
    _edit_json(root / "policy.json", num_steps=20, shift=5.0, guidance=2.0, guidance_interval=[900, 990])
    assert rollout_main(["--in-process", "--checkpoint", str(root), "--num-steps", "1", "--episodes", "1",
                         "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"policy-rollout: --num-steps 1 with the sampler settings of {root}: guidance_interval "
                          "[900, 990] holds none of the 1 sampler timesteps"), err
    assert "Traceback" not in err
