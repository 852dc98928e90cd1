"""The embedded model and the engine on a CUDA device (skipped without one; `.ci/device` runs them on a GPU
machine): fp32 on the GPU gives the CPU's actions, and the engine serves bf16 ticks, its default there."""

import numpy as np
import pytest
import torch

from policy_server.engine import api
from policy_server.engine.engine import EngineSettings, ModelEngine, resolve_dtype
from policy_server.pipeline.policy import PolicyPipeline, PolicyRequest
from robots.bench import model_inputs
from robots.envs import HELDOUT_SEED_OFFSET
from robots.expert import expert_observations

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _request(pipeline: PolicyPipeline, index: int = 0) -> PolicyRequest:
    embodiment = pipeline.embodiments.get(pipeline.served_embodiments[0])
    inputs = model_inputs(expert_observations(index + 1, HELDOUT_SEED_OFFSET)[index], embodiment, None)
    return PolicyRequest(images=inputs["images"], instruction=inputs["instruction"], embodiment=embodiment.name,
                         state=inputs["state"], seed=index)


def test_fp32_on_the_gpu_gives_the_cpu_actions(monkeypatch):
    # TF32 would round the GPU's matmuls and convolutions to 10 mantissa bits: compare fp32 with fp32.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    cpu = PolicyPipeline.from_pretrained(None, device="cpu")
    gpu = PolicyPipeline.from_pretrained(None, device="cuda", dtype=torch.float32)
    for index in range(2):
        expected, got = cpu(_request(cpu, index)).actions, gpu(_request(gpu, index)).actions
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_the_engine_serves_bf16_ticks_on_the_gpu():
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    pipeline = PolicyPipeline.from_pretrained(None, device="cuda", dtype=torch.bfloat16)
    request = _request(pipeline)
    embodiment = pipeline.embodiments.get(request.embodiment)
    config = pipeline.config
    expected = pipeline.run(request, None, pipeline.fixed_steps(config.num_steps, config.guidance, None, True)).actions
    engine = ModelEngine(pipeline, EngineSettings(warmup_ticks=2, default_budget_ms=10_000.0))
    engine.start()
    try:
        assert engine.wait_ready(timeout_s=600)
        session = engine.open_session(request.embodiment, request.instruction, seed=request.seed, rate_hz=0)
        observation = api.Observation(images=request.images, state=request.state, step_index=0)
        result = engine.act(session.session_id, session.epoch, observation)
        assert result.tick.skipped_calls == 0  # a generous budget runs uncached, as the pipeline call above
        assert np.all(np.isfinite(result.actions))
        np.testing.assert_allclose(result.actions, embodiment.clip_to_limits(expected), rtol=0, atol=1e-6)
    finally:
        engine.close()
