"""The Wan2.2 VAE adapter against diffusers' own Cosmos3 pipeline on a tiny random folder."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from cosmos3_folder import build_tiny_cosmos3_folder, load_pipeline

from policy_server.model.checkpoint import CheckpointError
from policy_server.pipeline.wan_vae import WanVideoVAE


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_cosmos3_folder(tmp_path_factory.mktemp("wan") / "pipe", seed=1)


def test_encode_and_decode_equal_the_diffusers_pipeline(folder):
    pipe = load_pipeline(folder)
    vae = WanVideoVAE.from_pretrained(folder / "vae")
    assert (vae.spatial_compression, vae.temporal_compression) == (16, 4)
    assert vae.latent_channels == pipe.transformer.config.latent_channel
    video = torch.rand(1, 3, 5, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        latents = vae.encode(video)
        assert torch.equal(latents, pipe._encode_video(video))
        assert latents.shape[2:] == (vae.num_latent_frames(5), 2, 3)
        shape = (1, -1, 1, 1, 1)
        z_raw = latents / pipe._vae_latents_inv_std.view(shape) + pipe._vae_latents_mean.view(shape)
        assert torch.equal(vae.decode(latents), pipe.vae.decode(z_raw).sample.clamp(-1, 1))


def test_a_vae_written_over_in_place_leaves_the_loaded_weights_as_loaded(folder, tmp_path):
    """`cp` of another VAE over the served one writes into the same file; the loaded VAE owns its weights (diffusers'
    CPU weights were views of the mapped file: they changed to weights never loaded)."""
    served = tmp_path / "vae"
    shutil.copytree(folder / "vae", served)
    vae = WanVideoVAE.from_pretrained(served)
    loaded = {key: tensor.clone() for key, tensor in vae.state_dict().items()}
    other = build_tiny_cosmos3_folder(tmp_path / "other", seed=2) / "vae" / "diffusion_pytorch_model.safetensors"
    with open(served / "diffusion_pytorch_model.safetensors", "r+b") as file:  # same inode, as cp writes it
        file.write(other.read_bytes())
    assert all(torch.equal(tensor, loaded[key]) for key, tensor in vae.state_dict().items())


def test_a_vae_folder_without_latent_statistics_is_refused_by_name(folder, tmp_path):
    broken = tmp_path / "vae"
    shutil.copytree(folder / "vae", broken)
    config = json.loads((broken / "config.json").read_text())
    config["latents_std"] = config["latents_std"][:1]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="latents_std must hold z_dim="):
        WanVideoVAE.from_pretrained(broken)
    (broken / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="vae: expected diffusion_pytorch_model.safetensors or"):
        WanVideoVAE.from_pretrained(broken)


def test_the_embedded_model_does_not_import_diffusers():
    code = ("import sys; from policy_server.pipeline.policy import PolicyPipeline; "
            "PolicyPipeline.from_pretrained(None); assert 'diffusers' not in sys.modules, 'diffusers was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
