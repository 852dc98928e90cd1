"""Small video VAE (tokenizer interface) and the conditioning canvas helpers."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import policy_server
from policy_server.model.vae import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    SmallVideoVAE,
    SmallVideoVAEConfig,
    VideoTokenizer,
    count_parameters,
    psnr,
)
from policy_server.pipeline.conditioning import (
    closest_canvas,
    crop_latent_padding,
    downscale,
    fit_to_canvas,
    frames_to_clip,
)
from robots.envs import COLORS, HELDOUT_SEED_OFFSET, ReachConfig, ReachEnv
from robots.expert import ReachExpert

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def vae() -> SmallVideoVAE:
    torch.manual_seed(0)
    config = SmallVideoVAEConfig(
        latents_mean=[0.1 * i for i in range(16)], latents_std=[0.5 + 0.1 * i for i in range(16)]
    )
    return SmallVideoVAE(config).eval()


def random_video(t: int, h: int = 64, w: int = 64, b: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.rand(b, 3, t, h, w, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_implements_tokenizer_interface_and_is_small(vae):
    assert isinstance(vae, VideoTokenizer)
    assert (vae.spatial_compression, vae.temporal_compression, vae.latent_channels) == (8, 4, 16)
    assert count_parameters(vae) < 1_000_000


@pytest.mark.parametrize("t", [1, 5, 9, 17])
def test_shapes_and_latent_frame_count(vae, t):
    with torch.no_grad():
        latents = vae.encode(random_video(t, 64, 48, b=2))
        assert latents.shape == (2, 16, (t - 1) // 4 + 1, 8, 6)
        assert vae.num_latent_frames(t) == latents.shape[2]
        video = vae.decode(latents)
    assert video.shape == (2, 3, t, 64, 48)
    assert vae.num_pixel_frames(latents.shape[2]) == t
    assert video.min() >= -1 and video.max() <= 1


def test_first_frame_is_encoded_alone_and_time_is_causal(vae):
    video = random_video(9, seed=1)
    with torch.no_grad():
        base = vae.encode(video)
        single = vae.encode(video[:, :, :1])
        changed_late = video.clone()
        changed_late[:, :, 5:] = -changed_late[:, :, 5:]  # frames of latent frame 2 only
        late = vae.encode(changed_late)
        changed_first = video.clone()
        changed_first[:, :, 0] = 0.0
        first = vae.encode(changed_first)
    # latent frame 0 depends on frame 0 only
    torch.testing.assert_close(base[:, :, :1], single, rtol=0, atol=1e-5)
    # changing frames 5..8 leaves latent frames 0 and 1 untouched
    torch.testing.assert_close(base[:, :, :2], late[:, :, :2], rtol=0, atol=0)
    assert not torch.allclose(base[:, :, 2], late[:, :, 2])
    # changing frame 0 changes latent frame 0 but not the later groups
    assert not torch.allclose(base[:, :, 0], first[:, :, 0])
    torch.testing.assert_close(base[:, :, 1:], first[:, :, 1:], rtol=0, atol=0)


def test_decode_of_latent_frame_zero_gives_frame_zero(vae):
    with torch.no_grad():
        latents = vae.encode(random_video(9, seed=2))
        full = vae.decode(latents)
        first_only = vae.decode(latents[:, :, :1])
    torch.testing.assert_close(full[:, :, :1], first_only, rtol=0, atol=1e-5)


def test_normalisation_uses_latents_mean_and_std(vae):
    video = random_video(5, seed=3)
    with torch.no_grad():
        raw, _ = vae.encode_moments(video)
        normalised = vae.encode(video)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(normalised, (raw - mean) / std)
    torch.testing.assert_close(vae.denormalize(normalised), raw, rtol=1e-5, atol=1e-5)


def test_sampling_is_seeded(vae):
    video = random_video(5, seed=4)
    with torch.no_grad():
        a = vae.encode(video, sample=True, generator=torch.Generator().manual_seed(7))
        b = vae.encode(video, sample=True, generator=torch.Generator().manual_seed(7))
        mean = vae.encode(video)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, mean)


def test_save_load_round_trip_is_bit_identical(vae, tmp_path):
    vae.save_pretrained(tmp_path / "vae")
    assert (tmp_path / "vae" / CONFIG_NAME).is_file() and (tmp_path / "vae" / WEIGHTS_NAME).is_file()
    loaded = SmallVideoVAE.from_pretrained(tmp_path, subfolder="vae")
    assert loaded.config == vae.config
    for key, value in vae.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    video = random_video(9, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode(video), vae.encode(video), rtol=0, atol=0)
        latents = vae.encode(video)
        torch.testing.assert_close(loaded.decode(latents), vae.decode(latents), rtol=0, atol=0)
    config = json.loads((tmp_path / "vae" / CONFIG_NAME).read_text())
    assert config["_class_name"] == "SmallVideoVAE" and len(config["latents_std"]) == 16


def test_from_pretrained_rejects_mismatches(vae, tmp_path):
    with pytest.raises(FileNotFoundError, match=CONFIG_NAME):
        SmallVideoVAE.from_pretrained(tmp_path)
    vae.save_pretrained(tmp_path)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    (tmp_path / CONFIG_NAME).write_text(
        json.dumps({**config, "latent_channels": 8, "latents_mean": [0.0] * 8, "latents_std": [1.0] * 8})
    )
    with pytest.raises(ValueError, match="missing|unexpected|size"):
        SmallVideoVAE.from_pretrained(tmp_path)
    (tmp_path / CONFIG_NAME).write_text(json.dumps({**config, "latent_chanels": 8}))
    with pytest.raises(ValueError, match="latent_chanels"):
        SmallVideoVAE.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((1, 3, 4, 64, 64), "4k \\+ 1"),
        ((1, 4, 5, 64, 64), "channels"),
        ((1, 3, 5, 60, 64), "multiples of 8"),
        ((3, 5, 64, 64), "\\[B, 3, T, H, W\\]"),
    ],
)
def test_encode_rejects_bad_video(vae, shape, message):
    with pytest.raises(ValueError, match=message):
        vae.encode(torch.zeros(shape))


def test_decode_rejects_wrong_channels(vae):
    with pytest.raises(ValueError, match="16"):
        vae.decode(torch.zeros(1, 8, 2, 8, 8))


def test_config_validation():
    with pytest.raises(ValueError, match="latents_mean"):
        SmallVideoVAEConfig(latent_channels=4, latents_mean=[0.0] * 3)
    assert SmallVideoVAEConfig(block_channels=(8, 16)).spatial_compression == 4


# ---------------------------------------------------------------- conditioning canvas


def test_frames_to_clip_repeats_and_scales():
    image = np.zeros((6, 4, 3), np.uint8)
    image[..., 0] = 255
    clip = frames_to_clip(image, num_frames=5)
    assert clip.shape == (1, 3, 5, 6, 4) and clip.dtype == torch.float32
    assert clip[0, 0].eq(1.0).all() and clip[0, 1].eq(-1.0).all()
    with pytest.raises(ValueError, match="uint8"):
        frames_to_clip(image.astype(np.float32))
    with pytest.raises(ValueError, match="\\[H, W, 3\\]"):
        frames_to_clip(np.zeros((6, 4), np.uint8))


def test_downscale_never_upscales_and_names_sizes():
    images = torch.zeros(1, 3, 32, 48)
    assert downscale(images, (16, 24)).shape == (1, 3, 16, 24)
    assert downscale(images, (32, 48)) is images
    with pytest.raises(ValueError, match="32x48 to 64x48"):
        downscale(images, (64, 48))


def test_fit_to_canvas_downscales_and_reflect_pads():
    clip = torch.linspace(-1, 1, 96).view(1, 1, 1, 1, 96).expand(1, 3, 5, 128, 96).contiguous()
    canvas, placement = fit_to_canvas(clip, (64, 64))
    assert canvas.shape == (1, 3, 5, 64, 64)
    assert placement.content_hw == (64, 48) and placement.pad_mode == "reflect"
    # reflected columns mirror the content about its last column
    torch.testing.assert_close(canvas[..., 48:], canvas[..., 31:47].flip(-1))
    # latent crop: 64x48 content on a 64x64 canvas at ÷8 keeps 8x6 latent cells
    latents = torch.zeros(1, 16, 2, 8, 8)
    assert crop_latent_padding(latents, placement, 8).shape == (1, 16, 2, 8, 6)


def test_fit_to_canvas_small_input_is_padded_not_upscaled_with_replicate_fallback():
    clip = torch.rand(1, 3, 1, 16, 16) * 2 - 1
    canvas, placement = fit_to_canvas(clip, (64, 64))
    assert placement.content_hw == (16, 16) and placement.pad_mode == "replicate"
    torch.testing.assert_close(canvas[..., :16, :16], clip)
    torch.testing.assert_close(canvas[..., 40, 50], clip[..., 15, 15])
    same, placement = fit_to_canvas(clip, (16, 16), pad_mode="replicate")
    assert placement.pad_mode == "none" and torch.equal(same, clip)
    with pytest.raises(ValueError, match="pad_mode"):
        fit_to_canvas(clip, (64, 64), pad_mode="zeros")


def test_crop_latent_padding_checks_canvas_shape():
    _, placement = fit_to_canvas(torch.zeros(1, 3, 1, 32, 64), (64, 64))
    assert placement.content_hw == (32, 64)
    with pytest.raises(ValueError, match="64x64 canvas"):
        crop_latent_padding(torch.zeros(1, 16, 1, 4, 4), placement, 8)
    assert crop_latent_padding(torch.zeros(1, 16, 1, 8, 8), placement, 8).shape == (1, 16, 1, 4, 8)


def test_closest_canvas():
    canvases = [(64, 64), (48, 80), (80, 48)]
    assert closest_canvas(480, 640, canvases) == (48, 80)
    assert closest_canvas(100, 100, canvases) == (64, 64)


def test_vae_on_canvas_end_to_end(vae):
    image = (np.random.default_rng(0).random((96, 128, 3)) * 255).astype(np.uint8)
    canvas, placement = fit_to_canvas(frames_to_clip(image, num_frames=9), (64, 64))
    with torch.no_grad():
        latents = crop_latent_padding(vae.encode(canvas), placement, vae.spatial_compression)
    assert placement.content_hw == (48, 64)
    assert latents.shape == (1, 16, 3, 6, 8)


# ---------------------------------------------------------------- the shipped (trained) VAE

EMBEDDED_VAE = Path(policy_server.__file__).parent / "assets" / "embedded" / "vae"


def expert_clip(seed: int, num_frames: int = 9) -> tuple[np.ndarray, ReachEnv]:
    """Frames [T, 64, 64, 3] of an expert episode on a held-out seed (last frame repeated)."""
    env = ReachEnv()
    obs, _ = env.reset(seed=HELDOUT_SEED_OFFSET + seed)
    first_scene = (env.scene.object_xy.copy(), env.scene.object_colors)
    frames, done, expert = [obs["image"]], False, ReachExpert()
    while not done and len(frames) < num_frames:
        obs, _, terminated, truncated, _ = env.step(expert(env))
        frames.append(obs["image"])
        done = terminated or truncated
    frames += [frames[-1]] * (num_frames - len(frames))
    return np.stack(frames), first_scene


def test_embedded_vae_is_small_and_reconstructs_held_out_scenes():
    assert (EMBEDDED_VAE / WEIGHTS_NAME).stat().st_size <= 2 * 1024 * 1024
    vae = SmallVideoVAE.from_pretrained(EMBEDDED_VAE)
    clips, scenes = zip(*(expert_clip(seed) for seed in range(8)), strict=True)
    video = torch.cat([frames_to_clip(frames) for frames in clips])
    with torch.no_grad():
        latents = vae.encode(video)
        recon = vae.decode(latents)
    assert psnr(video, recon) > 30.0
    # normalisation statistics fit unseen scenes: per-channel moments near 0 and 1
    per_channel = latents.transpose(0, 1).reshape(vae.latent_channels, -1)
    assert per_channel.mean(1).abs().max() < 0.5
    assert ((per_channel.std(1) > 0.5) & (per_channel.std(1) < 1.5)).all()
    # what the policy needs: every disc keeps its colour in the reconstructed first frame
    palette = {name: np.array(rgb, np.float32) for name, rgb in COLORS.items()}
    first = ((recon[:, :, 0].permute(0, 2, 3, 1).numpy() + 1) * 127.5).astype(np.float32)
    size, table = first.shape[1], ReachConfig().table_size
    for image, (object_xy, colors) in zip(first, scenes, strict=True):
        for (x, y), color in zip(object_xy, colors, strict=True):
            col, row = int(x / table * size), int((table - y) / table * size)
            pixel = image[row, col]
            nearest = min(palette, key=lambda name: np.abs(palette[name] - pixel).sum())
            assert nearest == color
