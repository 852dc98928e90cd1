"""A diffusers `Cosmos3OmniPipeline` folder, unchanged, served by `PolicyPipeline` with diffusers' outputs.

The folder is the tiny random pipeline of `tests/cosmos3_folder.py`, saved by diffusers' `save_pretrained`.
Every case compares our actions and generated video latents with diffusers' own call on the same folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cosmos3_folder import build_tiny_cosmos3_folder, diffusers_action_call, load_pipeline

from policy_server.client import PolicyClient, PolicyServerError
from policy_server.pipeline.errors import InvalidImage, InvalidNoise
from policy_server.pipeline.policy import CheckpointLoadError, InitialNoise, PolicyPipeline, PolicyRequest
from robots.soak import bound_listeners

ATOL = 1e-4
STEPS = 3
INSTRUCTION = "put the spoon in the pot"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tiny_cosmos3_folder(tmp_path_factory.mktemp("cosmos3") / "pipe", seed=0)


@pytest.fixture(scope="module")
def pipe(folder) -> PolicyPipeline:
    return PolicyPipeline.from_pretrained(folder)


@pytest.fixture(scope="module")
def tier256(folder, tmp_path_factory) -> Path:
    """The same folder with a `policy.json` override: the 256 resolution tier."""
    copy = tmp_path_factory.mktemp("cosmos3-256") / "pipe"
    shutil.copytree(folder, copy)
    (copy / "policy.json").write_text(json.dumps({"resolution_tier": 256}))
    return copy


def frames(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def ours(pipe: PolicyPipeline, mode: str, video: np.ndarray, embodiment: str, chunk: int, seed: int = 0,
         **extra) -> tuple[np.ndarray, np.ndarray]:
    request = PolicyRequest(images={"image": video[0]}, instruction=INSTRUCTION, embodiment=embodiment, mode=mode,
                            chunk_size=chunk, num_steps=STEPS, seed=seed,
                            video={"image": video} if mode == "inverse_dynamics" else None, **extra)
    out = pipe(request)
    return out.actions, out.latents.numpy()


def reference(folder: Path, pipe: PolicyPipeline, mode: str, video: np.ndarray, embodiment: str, chunk: int,
              tier: int, seed: int = 0, **extra):
    e = pipe.embodiments.get(embodiment)
    return diffusers_action_call(folder, mode, video, INSTRUCTION, embodiment, chunk, STEPS, seed, fps=e.fps,
                                 view_point=e.viewpoint, resolution_tier=tier, **extra)


def test_the_unchanged_folder_takes_its_defaults_from_its_files(folder, pipe):
    assert not (folder / "policy.json").exists() and not (folder / "embodiments.json").exists()
    config = pipe.config
    assert (config.sigma_schedule, config.sigma_min, config.sigma_max) == ("karras", 0.147, 200.0)
    assert (config.num_steps, config.guidance, config.resolution_tier) == (30, 1.0, 480)
    assert config.use_system_prompt is True  # model_index.json: default_use_system_prompt
    assert type(pipe.vae).__name__ == "WanVideoVAE" and pipe.vae.spatial_compression == 16
    # Every shared embodiment whose width fits the 32-wide action head; libero has no canonical width.
    assert "hand_pose" not in pipe.served_embodiments and "libero" not in pipe.served_embodiments
    assert {"pusht", "bridge_orig_lerobot", "robomind-franka-dual", "droid_lerobot"} <= set(pipe.served_embodiments)
    assert all(pipe.embodiments.get(n).normalization.method == "none" for n in pipe.served_embodiments)


@pytest.mark.parametrize("size", [(64, 64), (50, 70), (300, 400), (100, 260)])
@pytest.mark.parametrize("embodiment,chunk", [("pusht", 4), ("bridge_orig_lerobot", 5)])
def test_policy_mode_equals_diffusers(folder, tier256, size, embodiment, chunk):
    pipe = PolicyPipeline.from_pretrained(tier256)
    video = frames((1, *size, 3), seed=size[0])
    actions, latents = ours(pipe, "policy", video, embodiment, chunk, seed=3)
    ref = reference(folder, pipe, "policy", video, embodiment, chunk, tier=256, seed=3)
    assert latents.shape == ref.latents.shape[1:]
    np.testing.assert_allclose(actions, ref.actions, atol=ATOL, rtol=0)
    np.testing.assert_allclose(latents, ref.latents[0], atol=ATOL, rtol=0)


def test_latent_grid_of_a_frame_that_is_not_a_multiple_of_16(tier256):
    """300x400 is floored to 288x400, binned to the 256x320 canvas and downscaled to 230x320: 14x20 latents."""
    pipe = PolicyPipeline.from_pretrained(tier256)
    _, latents = ours(pipe, "policy", frames((1, 300, 400, 3)), "pusht", 4)
    assert latents.shape == (8, 2, 14, 20)


@pytest.mark.parametrize("mode", ["policy", "forward_dynamics", "inverse_dynamics"])
@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_every_mode_equals_diffusers_at_the_default_tier(folder, pipe, mode, guidance):
    """Tier 480, with and without classifier-free guidance; a chunk of 5 spans 6 frames, of which the VAE
    encodes 5 (2 latent frames) as diffusers' does."""
    embodiment, chunk = "bridge_orig_lerobot", 5
    video = frames((chunk + 1, 120, 160, 3), seed=7)
    given = np.random.default_rng(1).normal(size=(chunk, 10)).astype(np.float32)
    extra = {"actions": given} if mode == "forward_dynamics" else {}
    actions, latents = ours(pipe, mode, video, embodiment, chunk, seed=5, guidance=guidance, **extra)
    ref = reference(folder, pipe, mode, video, embodiment, chunk, tier=480, seed=5, guidance_scale=guidance,
                    raw_actions=given if mode == "forward_dynamics" else None)
    assert latents.shape == ref.latents.shape[1:] == (8, 2, 7, 10)
    np.testing.assert_allclose(latents, ref.latents[0], atol=ATOL, rtol=0)
    if mode == "forward_dynamics":
        assert ref.actions is None
    else:
        np.testing.assert_allclose(actions, ref.actions, atol=ATOL, rtol=0)


def test_explicit_initial_noise_equals_diffusers_latents(folder, pipe):
    """The same tensors passed as our `InitialNoise` and as diffusers' `latents` / `action_latents` give the same
    outputs, whatever either side's seed; the noise under the clean frame is replaced by the conditioning."""
    embodiment, chunk = "bridge_orig_lerobot", 8
    video = frames((1, 96, 128, 3), seed=9)
    g = torch.Generator().manual_seed(123)
    vision = torch.randn((8, chunk // 4 + 1, 6, 8), generator=g)
    action_noise = torch.randn((chunk, 32), generator=g)
    action_noise[:, 10:] = 0
    actions, latents = ours(pipe, "policy", video, embodiment, chunk, seed=1,
                            noise=InitialNoise(vision=vision, actions=action_noise))
    again, _ = ours(pipe, "policy", video, embodiment, chunk, seed=2,
                    noise=InitialNoise(vision=vision, actions=action_noise))
    np.testing.assert_array_equal(actions, again)
    assert torch.equal(vision, torch.randn((8, chunk // 4 + 1, 6, 8), generator=torch.Generator().manual_seed(123)))

    # diffusers takes `latents` as given: frame 0 must already hold its clean conditioning latent.
    clean = torch.from_numpy(latents[:, :1])  # ours; equal to diffusers' within float rounding
    diffusers_latents = torch.cat([clean, vision[:, 1:]], dim=1)[None]
    ref = reference(folder, pipe, "policy", video, embodiment, chunk, tier=480, seed=99,
                    latents=diffusers_latents, action_latents=action_noise)
    np.testing.assert_allclose(actions, ref.actions, atol=ATOL, rtol=0)
    np.testing.assert_allclose(latents, ref.latents[0], atol=ATOL, rtol=0)


def test_clean_conditioning_latent_equals_diffusers(folder, pipe):
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition
    from PIL import Image

    reference_pipe = load_pipeline(folder)
    image = frames((1, 50, 70, 3), seed=4)[0]
    action = CosmosActionCondition(mode="policy", chunk_size=4, domain_name="pusht", image=Image.fromarray(image))
    prepared = reference_pipe.prepare_latents(num_frames=5, fps=24.0, generator=torch.Generator().manual_seed(0),
                                              device="cpu", dtype=torch.float32, action=action)
    request = PolicyRequest(images={"image": image}, instruction=INSTRUCTION, embodiment="pusht", chunk_size=4)
    with torch.no_grad():
        clean, canvas_hw = pipe.encode_condition(pipe.prepare_frames(request))
    assert canvas_hw == (544, 736) and prepared[9].tolist() == [544.0, 736.0, 48.0, 64.0]
    torch.testing.assert_close(clean, prepared[0][0, :, :1], rtol=0, atol=1e-5)


def test_bad_noise_and_frames_are_refused_by_field(pipe):
    video = frames((1, 64, 64, 3))
    with pytest.raises(InvalidNoise, match=r"noise.vision: is torch.float32 \(8, 2, 3, 3\); expected finite float32"):
        ours(pipe, "policy", video, "pusht", 4,
             noise=InitialNoise(vision=torch.zeros(8, 2, 3, 3), actions=torch.zeros(4, 32)))
    with pytest.raises(InvalidNoise, match=r"noise.actions"):
        ours(pipe, "policy", video, "pusht", 4,
             noise=InitialNoise(vision=torch.zeros(8, 2, 4, 4), actions=torch.full((4, 32), float("nan"))))
    with pytest.raises(InvalidImage, match=r"expected uint8 RGB \[H >= 16, W >= 16, 3\]"):
        ours(pipe, "policy", frames((1, 8, 64, 3)), "pusht", 4)


def test_embodiment_and_policy_overrides(folder, tmp_path):
    """`policy.json` changes sampler fields; `embodiments.json` declares what is served, may add stats (physical
    units) and may serve libero with its dataset's width; neither is needed."""
    model_space_folder, physical_folder = tmp_path / "model_space", tmp_path / "physical"
    shutil.copytree(folder, model_space_folder)
    (model_space_folder / "policy.json").write_text(json.dumps({"num_steps": 4, "canvases": [[64, 64]]}))
    shutil.copytree(model_space_folder, physical_folder)
    (physical_folder / "stats.json").write_text(json.dumps({"action": {"min": [-2.0, -1.0], "max": [2.0, 1.0]}}))
    (physical_folder / "embodiments.json").write_text(json.dumps({"embodiments": [
        {"name": "pusht", "normalization": {"method": "minmax", "stats_path": "stats.json"}},
        {"name": "libero", "raw_action_dim": 7},
    ]}))
    model_space, physical = (PolicyPipeline.from_pretrained(f) for f in (model_space_folder, physical_folder))
    assert physical.config.num_steps == 4 and physical.config.canvases == ((64, 64),)
    assert physical.config.resolution_tier is None and physical.config.sigma_schedule == "karras"
    assert physical.served_embodiments == ["pusht", "libero"] and "libero" not in model_space.served_embodiments
    request = dict(images={"image": frames((64, 64, 3))}, instruction=INSTRUCTION, embodiment="pusht", chunk_size=4)
    normalised = model_space(PolicyRequest(**request)).actions.astype(np.float64)
    # minmax: physical = (model + 1) / 2 * (max - min) + min
    expected = (normalised + 1) / 2 * np.array([4.0, 2.0]) + np.array([-2.0, -1.0])
    np.testing.assert_allclose(physical(PolicyRequest(**request)).actions, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("edit,message", [
    (lambda root: (root / "model_index.json").write_text(json.dumps(
        {**json.loads((root / "model_index.json").read_text()), "vae": ["diffusers", "AutoencoderKL"]})),
     r"model_index.json: vae=\['diffusers', 'AutoencoderKL'\]; expected \['diffusers', 'AutoencoderKLWan'\]"),
    (lambda root: shutil.rmtree(root / "scheduler"), r"lists scheduler but .*scheduler is not a directory"),
    (lambda root: (root / "model_index.json").write_text(json.dumps(
        {**json.loads((root / "model_index.json").read_text()), "use_native_flow_schedule": True})),
     r"use_native_flow_schedule=true"),
    (lambda root: (root / "policy.json").write_text('{"num_stepz": 3}'), r"policy.json: .*num_stepz"),
    (lambda root: (root / "embodiments.json").write_text(json.dumps(
        {"embodiments": [{"name": "hand_pose"}]})),
     r"embodiments.json: \['hand_pose'\] have more action or state channels than the transformer's action_dim=32"),
])
def test_bad_folders_are_refused_in_one_line(folder, tmp_path, edit, message):
    copy = tmp_path / "pipe"
    shutil.copytree(folder, copy)
    edit(copy)
    with pytest.raises(CheckpointLoadError, match=message) as raised:
        PolicyPipeline.from_pretrained(copy)
    assert "\n" not in str(raised.value)


def test_a_folder_is_named_after_itself_and_a_hub_snapshot_after_its_hub_id(pipe, folder, monkeypatch):
    assert pipe.config.name == folder.name
    monkeypatch.chdir(folder / "transformer")  # `policy-server --checkpoint ..` was named '..', and `.` ''
    assert PolicyPipeline.from_pretrained("..").config.name == folder.name
    # A Hub id resolves to a snapshot folder named after its commit (tests/test_hub.py fetches one for real).
    monkeypatch.setattr("policy_server.pipeline.policy.checkpoint_folder", lambda reference: folder)
    assert PolicyPipeline.from_pretrained("nvidia/Cosmos3-Tiny@main").config.name == "nvidia/Cosmos3-Tiny@main"


def test_the_server_process_serves_the_folder_with_diffusers_actions(folder, tmp_path):
    """`policy-server --checkpoint DIR` on the folder (overrides only to keep the warmup short: tier 256, 3 steps,
    one embodiment with chunks up to its default 5, the one the test asks for: the warmup times no 8-action shape);
    camera-native frames over gRPC give diffusers' actions."""
    served = tmp_path / "pipe"
    shutil.copytree(folder, served)
    (served / "policy.json").write_text(json.dumps({"resolution_tier": 256, "num_steps": STEPS}))
    (served / "embodiments.json").write_text(json.dumps(
        {"embodiments": [{"name": "bridge_orig_lerobot", "default_chunk_size": 5, "max_chunk_size": 5}]}))
    log = open(tmp_path / "server.log", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "policy_server.cli", "--checkpoint", str(served), "--port", "0",
         "--device", "cpu", "--latency-budget-ms", "30000"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    client = PolicyClient(bound_listeners(tmp_path / "server.log", process, 120)["gRPC"], timeout_s=60)
    try:
        for _ in range(60):
            try:
                client.wait_until_serving(timeout_s=5)
                break
            except TimeoutError:
                if process.poll() is not None:
                    break
        else:
            process.kill()
        if process.poll() is not None:
            log.seek(0)
            raise AssertionError("server did not become SERVING:\n" + log.read())
        info = client.server_info()
        assert [e.name for e in info.embodiments] == ["bridge_orig_lerobot"]
        session = client.open_session("bridge_orig_lerobot", INSTRUCTION, chunk_size=5, seed=11, rate_hz=0)
        for tick, size in enumerate([(64, 64), (50, 70), (300, 400)]):
            image = frames((*size, 3), seed=tick)
            chunk = client.act(session, {"image": image}, encoding="png", step_index=tick)
            ref = diffusers_action_call(folder, "policy", image[None], INSTRUCTION, "bridge_orig_lerobot", 5, STEPS,
                                        seed=11 + tick, fps=5.0, view_point="ego_view", resolution_tier=256)
            np.testing.assert_allclose(chunk.actions, ref.actions, atol=ATOL, rtol=0)
        # No action limits are declared (normalised actions): committed ones the model would overflow on are refused.
        with pytest.raises(PolicyServerError) as refused:
            client.act(session, {"image": image}, committed_actions=np.full((2, 10), 3e38, np.float32))
        assert (refused.value.reason, refused.value.field) == ("OUT_OF_RANGE", "observation.committed_actions")
        committed = np.full((2, 10), 0.5, np.float32)
        chunk = client.act(session, {"image": image}, committed_actions=committed)
        assert np.array_equal(chunk.actions[:2], committed) and np.isfinite(chunk.actions).all()
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=30)
        log.close()


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_seacache_at_diffusers_defaults_decides_as_diffusers_hook(folder, pipe, guidance):
    """SeaCache on with diffusers' default knobs on both sides: the same full/skip sequence per CFG branch, and
    the same actions and latents (the skipped steps extrapolate the same residuals)."""
    from diffusers.hooks import SeaCacheConfig as DiffusersSeaCacheConfig

    from policy_server.cache.seacache import SeaCache, SeaCacheConfig

    steps, embodiment, chunk = 12, "bridge_orig_lerobot", 8
    video = frames((1, 96, 128, 3), seed=12)
    reference_pipe = load_pipeline(folder, cache=False)
    transformer = reference_pipe.transformer
    transformer.enable_cache(DiffusersSeaCacheConfig())
    # A call ran full when decoder layer 0 ran; the branch is the name of the call's cache context.
    decisions, ran, branch = {"cond": "", "uncond": ""}, [], []
    transformer.layers[0].register_forward_hook(lambda *_: ran.append(True))
    transformer.register_forward_pre_hook(lambda *_: ran.clear())
    transformer.register_forward_hook(lambda *_: decisions.__setitem__(
        branch[-1], decisions[branch[-1]] + ("F" if ran else "S")))
    context = transformer.cache_context

    @contextlib.contextmanager
    def named_context(name, **kwargs):
        branch.append(name)
        with context(name, **kwargs):
            yield

    transformer.cache_context = named_context
    e = pipe.embodiments.get(embodiment)
    ref = diffusers_action_call(folder, "policy", video, INSTRUCTION, embodiment, chunk, steps, seed=2, fps=e.fps,
                                view_point=e.viewpoint, resolution_tier=480, guidance_scale=guidance,
                                pipe=reference_pipe)
    request = PolicyRequest(images={"image": video[0]}, instruction=INSTRUCTION, embodiment=embodiment,
                            chunk_size=chunk, num_steps=steps, seed=2, guidance=guidance)
    out = pipe(request, cache=SeaCache(SeaCacheConfig()))
    ours_decisions = {branch: out.cache.sequence(branch) for branch in out.cache.branches}
    expected = {branch: seq for branch, seq in decisions.items() if seq}
    assert ours_decisions == expected
    assert "S" in expected["cond"], "no skips: the comparison would be trivial"
    np.testing.assert_allclose(out.actions, ref.actions, atol=ATOL, rtol=0)
    np.testing.assert_allclose(out.latents.numpy(), ref.latents[0], atol=ATOL, rtol=0)


def test_sigterm_during_the_warmup_of_the_unchanged_folder_exits_cleanly(folder, tmp_path):
    """The folder's warmup runs long VAE passes (640x640 canvases, seconds each) that a stop cannot interrupt;
    SIGTERM in the middle of one still ends the process with status 0 and no abort."""
    log = open(tmp_path / "server.log", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "policy_server.cli", "--checkpoint", str(folder), "--port", "0", "--device", "cpu"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        log.seek(0)
        for _ in range(600):  # until the server listens: its warmup starts then
            if "listening on" in log.read() or process.poll() is not None:
                break
            log.seek(0)
            time.sleep(0.1)
        time.sleep(3)  # into the warmup's long VAE passes: on 2 cores they run from about 2 s to past 12 s
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
        log.seek(0)
        output = log.read()
        log.close()
    assert "terminate called" not in output and "Traceback" not in output, output
