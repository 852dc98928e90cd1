"""The embedded model and the engine on a CUDA device (skipped without one; `.ci/device` runs them on a GPU
machine): fp32 on the GPU gives the CPU's actions, the engine serves bf16 ticks, its default there, and the GEN
stack replayed from CUDA graphs gives the eager stack's outputs."""

import dataclasses
import time

import numpy as np
import pytest
import torch

from policy_server.budget.planner import MAX_CACHING
from policy_server.cache.seacache import SeaCache, SeaCacheConfig
from policy_server.engine import api
from policy_server.engine.engine import EngineSettings, ModelEngine, resolve_dtype
from policy_server.pipeline.cuda_graphs import GraphedGenStack
from policy_server.pipeline.policy import PolicyPipeline, PolicyRequest, run_steps
from robots.bench import model_inputs
from robots.envs import HELDOUT_SEED_OFFSET
from robots.expert import expert_observations

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _request(pipeline: PolicyPipeline, index: int = 0) -> PolicyRequest:
    embodiment = pipeline.embodiments.get(pipeline.served_embodiments[0])
    inputs = model_inputs(expert_observations(index + 1, HELDOUT_SEED_OFFSET)[index], embodiment, None)
    return PolicyRequest(images=inputs["images"], instruction=inputs["instruction"], embodiment=embodiment.name,
                         state=inputs["state"], seed=index)


@pytest.fixture
def no_tf32(monkeypatch):
    """TF32 would round the GPU's matmuls and convolutions to 10 mantissa bits: compare fp32 with fp32."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def test_fp32_on_the_gpu_gives_the_cpu_actions(no_tf32):
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
    engine = ModelEngine(pipeline, EngineSettings(warmup_ticks=2, default_budget_ms=10_000.0, cuda_graphs=False,
                                                  compile_gen_stack=False))
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


def _max_caching() -> SeaCache:
    return SeaCache(SeaCacheConfig(threshold=MAX_CACHING.threshold, max_consecutive_cached=MAX_CACHING.cap))


def test_the_graphed_gen_stack_gives_the_eager_stacks_outputs(no_tf32):
    pipeline = PolicyPipeline.from_pretrained(None, device="cuda", dtype=torch.float32)
    config = pipeline.config
    graphs = GraphedGenStack(pipeline.transformer.gen_stack)

    def tick(request, stack, cache=None, batch_branches=True):
        control = pipeline.fixed_steps(config.num_steps, config.guidance, cache, batch_branches)
        return run_steps(pipeline.steps(request, None, control), stack)

    first, second = _request(pipeline, 0), _request(pipeline, 1)
    eager = tick(first, pipeline.transformer.gen_stack)
    uncaptured = tick(first, graphs)  # a shape never captured runs eagerly
    assert graphs.num_graphs == 0
    np.testing.assert_array_equal(uncaptured.actions, eager.actions)

    # Both branches as one batch (text K/V padded), then each branch alone: one graph per shape.
    captured = tick(first, graphs.capture)
    singles = tick(first, graphs.capture, _max_caching(), batch_branches=False)
    assert graphs.num_graphs == 3 and graphs.capture_ms > 0
    np.testing.assert_allclose(captured.actions, eager.actions, rtol=0, atol=1e-5)
    np.testing.assert_allclose(singles.actions, tick(first, pipeline.transformer.gen_stack, _max_caching(),
                                                     batch_branches=False).actions, rtol=0, atol=1e-5)
    # Another observation replays the same graphs on its own inputs.
    replayed = tick(second, graphs)
    assert graphs.num_graphs == 3
    expected = tick(second, pipeline.transformer.gen_stack).actions
    assert not np.allclose(expected, eager.actions)
    np.testing.assert_allclose(replayed.actions, expected, rtol=0, atol=1e-5)


def test_the_graphed_gen_stack_keeps_the_warmups_graphs_and_the_later_shapes_used_last(no_tf32):
    pipeline = PolicyPipeline.from_pretrained(None, device="cuda", dtype=torch.float32)
    config = pipeline.config
    graphs = GraphedGenStack(pipeline.transformer.gen_stack)

    def tick(stack, cache=None, batch_branches=True):
        control = pipeline.fixed_steps(config.num_steps, config.guidance, cache, batch_branches)
        return run_steps(pipeline.steps(_request(pipeline), None, control), stack)

    eager = tick(pipeline.transformer.gen_stack)
    tick(graphs.capture)  # as the warmup does: the branches as one batch, kept for good
    graphs.max_later = 1  # as the warmup's end sets it
    singles = tick(graphs.capture, _max_caching(), batch_branches=False)  # each branch alone: the last used stays
    assert graphs.num_graphs == 2
    captured_ms = graphs.capture_ms
    np.testing.assert_allclose(tick(graphs).actions, eager.actions, rtol=0, atol=1e-5)  # the warmup's graph replays
    # One branch replays its graph, the other runs eagerly.
    np.testing.assert_allclose(tick(graphs, _max_caching(), batch_branches=False).actions, singles.actions,
                               rtol=0, atol=1e-5)
    assert graphs.num_graphs == 2 and graphs.capture_ms == captured_ms


def test_the_engine_captures_graphs_at_warmup_and_session_opening_and_ticks_replay_them(no_tf32, compiles):
    """The CUDA default: the GEN stack compiled at warmup and replayed from CUDA graphs."""
    pipeline = PolicyPipeline.from_pretrained(None, device="cuda", dtype=torch.float32)
    request = _request(pipeline)
    embodiment = pipeline.embodiments.get(request.embodiment)
    config = pipeline.config
    engine = ModelEngine(pipeline, EngineSettings(warmup_ticks=2, default_budget_ms=10_000.0))
    engine.start()
    try:
        assert engine.wait_ready(timeout_s=600)
        assert engine.served.compiled
        graphs = engine.served.graphs
        after_warmup = graphs.num_graphs
        assert after_warmup > 0
        assert graphs.max_later == 3 * engine.settings.max_sessions  # besides the warmup's: 3 a session
        # An instruction of a length warmup did not run: its graphs are captured when the session opens.
        instruction = request.instruction + " and then stop there"
        session = engine.open_session(request.embodiment, instruction, seed=request.seed, rate_hz=0)
        after_opening = graphs.num_graphs
        assert after_opening > after_warmup
        observation = api.Observation(images=request.images, state=request.state, step_index=0)
        result = engine.act(session.session_id, session.epoch, observation)
        assert graphs.num_graphs == after_opening  # the tick replayed what the opening captured
        assert result.tick.skipped_calls == 0
        expected = pipeline.run(PolicyRequest(images=request.images, instruction=instruction,
                                              embodiment=request.embodiment, state=request.state, seed=request.seed),
                                None, pipeline.fixed_steps(config.num_steps, config.guidance, None, True)).actions
        np.testing.assert_allclose(result.actions, embodiment.clip_to_limits(expected), rtol=0, atol=1e-5)

        # A new instruction mid-session: its tick runs eagerly, then its graphs are captured in the background.
        changed = api.Observation(images=request.images, state=request.state, step_index=1,
                                  instruction=instruction + " slowly, please, and carefully")
        engine.act(session.session_id, session.epoch, changed)
        deadline = time.monotonic() + 60
        while engine.stats().queue_depth and time.monotonic() < deadline:
            time.sleep(0.05)
        after_change = graphs.num_graphs
        assert after_change > after_opening
        engine.act(session.session_id, session.epoch, dataclasses.replace(changed, step_index=2))
        assert graphs.num_graphs == after_change
    finally:
        engine.close()
