"""The GEN stack compiled whole, as a CPU server runs it by default: it gives the eager stack's outputs (one branch,
both CFG branches as one batch, a batch of one layout through the latter's graph), one graph serves every instruction
and request shape, and an engine compiles only at warmup, then serves ticks, a new instruction's included, without
compiling. The rest of a tick's model work, compiled with it, gives the eager outputs: the prefill within 1e-5, each
step bit for bit given the same text K/V. Where torch cannot compile, an engine runs the eager stack, and asking for
the compiled one is an error that names what is missing. A server process compiles and serves. The per-layer compiled
stack a GPU runs gives the eager stack's outputs too. (The rest of the suite runs eagerly: `conftest.py`.)"""

import json
import shutil
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from policy_server import cli
from policy_server.client import PolicyClient
from policy_server.engine import api, calibration
from policy_server.engine.engine import EngineSettings, ModelEngine
from policy_server.model import Cosmos3OmniTransformer, GenInput, UndKV, save_transformer
from policy_server.pipeline.compiled_stack import CompileUnavailableError, PrecompiledGenStack, compile_unavailable
from policy_server.pipeline.policy import FixedSteps, PolicyPipeline, PolicyRequest, run_steps
from policy_server.pipeline.tick_work import CompiledTickWork
from robots import bench
from robots.bench import warmup_summary
from robots.embedded import build_random_pipeline, transformer_config
from robots.soak import bound_listeners

RED, BLUE = "reach the red circle", "reach the blue square at the far end of the table and stay there"
STATE = np.array([0.2, 0.3], np.float32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The random model, its embodiment serving chunks up to its default (8 actions, 1 to 3 latent frames): an engine
    compiles the tick work of 3 latent shapes rather than 5, and compiling is what this module spends its time on.
    6 sampler steps rather than 20: the module's ticks cost a third, and every step runs the one step graph of its
    latent shape, through the sampler's every order (1, 2, then 1 on the last step) as at 20. 2 layers rather than 4:
    a graph inlines every layer, and the module took a fifth less with inductor's cache empty (each layer still
    attends to its own text K/V)."""
    folder = tmp_path_factory.mktemp("compiled-stack-model")
    build_random_pipeline(folder, seed=3)
    torch.manual_seed(3)
    save_transformer(Cosmos3OmniTransformer(replace(transformer_config(), num_hidden_layers=2)), folder / "transformer")
    path = folder / "embodiments.json"
    entries = json.loads(path.read_text())
    for entry in entries["embodiments"]:
        entry["max_chunk_size"] = entry["default_chunk_size"]
    path.write_text(json.dumps(entries))
    policy = folder / "policy.json"
    policy.write_text(json.dumps({**json.loads(policy.read_text()), "num_steps": 6}))
    return folder


@pytest.fixture(scope="module")
def pipeline(folder):
    torch.set_num_threads(1)
    return PolicyPipeline.from_pretrained(folder)


def _images(seed=0):
    return {"image": np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)}


def _request(instruction: str) -> PolicyRequest:
    return PolicyRequest(images=_images(), instruction=instruction, embodiment="pusht", state=STATE, seed=5)


def _tick(pipeline, request, stack, batch_branches=True, tick_work=None):
    config = pipeline.config
    control = pipeline.fixed_steps(config.num_steps, config.guidance, None, batch_branches)
    return run_steps(pipeline.steps(request, None, control, tick_work), stack)


def _first_call(pipeline, request) -> tuple[GenInput, UndKV]:
    """The first GEN-stack call of a tick that runs its branches one by one."""
    config = pipeline.config
    steps = pipeline.steps(request, None, pipeline.fixed_steps(config.num_steps, config.guidance, None, False))
    call = None
    while call is None:
        call = steps.send(None)
    steps.close()
    return call.gen, call.und_kv


def test_the_whole_compiled_stack_gives_the_eager_stacks_outputs(pipeline, compiles):
    compiled, eager = PrecompiledGenStack(pipeline.transformer), pipeline.transformer.gen_stack
    for batch_branches in (True, False):  # both branches as one batch (text K/V padded), each alone
        expected = _tick(pipeline, _request(RED), eager, batch_branches)
        _tick(pipeline, _request(RED), compiled.compile, batch_branches)
        got = _tick(pipeline, _request(RED), compiled, batch_branches)
        np.testing.assert_allclose(got.actions, expected.actions, rtol=0, atol=1e-5)
        torch.testing.assert_close(got.latents, expected.latents, rtol=0, atol=1e-5)
    assert compiled.num_patterns == 2 and compiled.eager_calls == 0
    # Another text length, and another request shape (history rows: more generated rows), run the graphs compiled
    # above: text lengths and generated rows are dynamic.
    history = replace(_request(RED), history_actions=np.full((3, 2), 0.1, np.float32))
    for request in (_request(BLUE), history):
        got = _tick(pipeline, request, compiled)
        np.testing.assert_allclose(got.actions, _tick(pipeline, request, eager).actions, rtol=0, atol=1e-5)
    assert compiled.num_patterns == 2 and compiled.eager_calls == 0
    # Two calls of one layout as one batch (a micro-batch of two ticks), each item against its own K/V: they share a
    # rotary table, which goes in repeated, so the CFG branches' graph serves them.
    gen, und_kv = _first_call(pipeline, _request(RED))
    batch, batch_kv = GenInput.stack([gen, gen]), UndKV.stack([und_kv, und_kv])
    assert batch.layout.rotary.cos.ndim == 2
    with torch.no_grad():
        torch.testing.assert_close(compiled(batch, batch_kv), eager(batch, batch_kv), rtol=0, atol=1e-5)
    assert compiled.num_patterns == 2 and compiled.eager_calls == 0


def test_the_per_layer_compiled_stack_a_gpu_runs_gives_the_eager_stacks_outputs(pipeline, compiles):
    """The GEN stack CUDA runs by default (`compiled_gen_stack`: each layer compiled around its eager attention,
    shapes dynamic), checked on the CPU so that it is tested where no GPU is."""
    compiled, eager = pipeline.transformer.compiled_gen_stack(), pipeline.transformer.gen_stack
    for instruction, batch_branches in ((RED, True), (RED, False), (BLUE, True)):  # another text length last
        expected = _tick(pipeline, _request(instruction), eager, batch_branches)
        got = _tick(pipeline, _request(instruction), compiled, batch_branches)
        np.testing.assert_allclose(got.actions, expected.actions, rtol=0, atol=1e-5)
        torch.testing.assert_close(got.latents, expected.latents, rtol=0, atol=1e-5)


def test_a_step_graph_serves_every_embodiment_of_its_latent_shape(folder, tmp_path, compiles):
    """Another embodiment (its own domain, so its own action projections, and its own control rate) runs the step
    graph compiled on the first's ticks, bit for bit."""
    two = tmp_path / "two"
    shutil.copytree(folder, two)
    entries = json.loads((two / "embodiments.json").read_text())
    first = entries["embodiments"][0]
    entries["embodiments"].append({**first, "name": "pusht_b", "domain_id": first["domain_id"] + 1,
                                   "fps": first["fps"] / 2})
    (two / "embodiments.json").write_text(json.dumps(entries))
    pipeline = PolicyPipeline.from_pretrained(two)
    work, eager, stack = CompiledTickWork(pipeline.transformer), pipeline.tick_work, pipeline.transformer.gen_stack
    # An eager tick first, as before the other compiles of this model's tick work (the tests' below, the bench's):
    # the prefill graph traced after one is theirs, which inductor's cache then serves; traced first, its lifted
    # tensors come in another order and it compiles anew (seconds).
    first = _tick(pipeline, _request(RED), stack, tick_work=eager)
    _tick(pipeline, _request(RED), stack, tick_work=work.compiling())
    assert work.num_shapes == 1
    eager_calls = work.eager_calls
    other, embodiment = replace(_request(RED), embodiment="pusht_b"), pipeline.embodiments.get("pusht_b")
    prompt = pipeline.encode_prompt(RED, embodiment, embodiment.default_chunk_size, True,
                                    pipeline.canvas_for(embodiment, _images()), eager)  # bit for bit given these
    control = pipeline.fixed_steps(pipeline.config.num_steps, pipeline.config.guidance, None, True)
    got, want = (run_steps(pipeline.steps(other, prompt, control, tick_work), stack) for tick_work in (work, eager))
    assert work.num_shapes == 1 and work.eager_calls == eager_calls
    np.testing.assert_array_equal(got.actions, want.actions)
    torch.testing.assert_close(got.latents, want.latents, rtol=0, atol=0)
    assert not np.array_equal(got.actions, first.actions)


def test_a_precompiled_stack_runs_eagerly_what_warmup_did_not_compile(pipeline, compiles):
    stack, eager = PrecompiledGenStack(pipeline.transformer), pipeline.transformer.gen_stack
    gen, und_kv = _first_call(pipeline, _request(RED))
    four, four_kv = GenInput.stack([gen] * 4), UndKV.stack([und_kv] * 4)  # a micro-batch: never compiled
    short = pipeline.transformer.prefill_und(torch.tensor([7]), torch.zeros((3, 1)))  # one text row: not either
    short_gen = GenInput(gen.hidden, replace(gen.layout, und_len=1))
    with torch.no_grad():
        torch.testing.assert_close(stack(gen, und_kv), eager(gen, und_kv), rtol=0, atol=0)
        assert stack.eager_calls == 1 and stack.num_patterns == 0
        stack.compile(gen, und_kv)
        stack(gen, und_kv)
        assert stack.eager_calls == 1 and stack.num_patterns == 1
        for call in ((four, four_kv), (short_gen, short)):
            torch.testing.assert_close(stack.compile(*call), eager(*call), rtol=0, atol=0)
            torch.testing.assert_close(stack(*call), eager(*call), rtol=0, atol=0)
    assert stack.eager_calls == 3 and stack.num_patterns == 1


def test_compiled_tick_work_gives_the_eager_outputs(pipeline, compiles, monkeypatch):
    work, eager, stack = CompiledTickWork(pipeline.transformer), pipeline.tick_work, pipeline.transformer.gen_stack
    config, embodiment = pipeline.config, pipeline.embodiments.get("pusht")

    def tick(instruction, batch_branches, tick_work, prompt=None, guided=True, **request):
        """guided=False: the uncond pass on the first half of the steps, the cond branch alone after. `request`:
        fields of the request other than the default's."""
        control = FixedSteps(config.num_steps, range(config.num_steps if guided else config.num_steps // 2), None,
                             batch_branches)
        return run_steps(pipeline.steps(replace(_request(instruction), **request), prompt, control, tick_work), stack)

    expected = tick(RED, True, eager)  # its negative prompt's K/V are kept: later prompts prefill their cond text
    np.testing.assert_array_equal(tick(RED, True, work).actions, expected.actions)  # no graphs yet: eagerly
    eager_calls = 1 + config.num_steps  # the prefill and every step (a first step's embedding is always eager)
    assert work.num_shapes == 0 and work.eager_calls == eager_calls
    compiled_prefill = tick(RED, True, work.compiling())  # its guided step serves the cond branch alone too
    assert work.num_shapes == 1
    np.testing.assert_allclose(compiled_prefill.actions, expected.actions, rtol=0, atol=1e-5)
    for instruction in (RED, BLUE):  # one graph serves every text length, one shape's every instruction
        prompts = [pipeline.encode_prompt(instruction, embodiment, embodiment.default_chunk_size, True,
                                          pipeline.canvas_for(embodiment, _images()), tick_work)
                   for tick_work in (eager, work)]
        for got, want in zip(prompts[1].und_kv["cond"].keys + prompts[1].und_kv["cond"].values,
                             prompts[0].und_kv["cond"].keys + prompts[0].und_kv["cond"].values, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        for batch_branches, guided in ((True, True), (False, False)):  # bit for bit, given the same text K/V
            got, want = (tick(instruction, batch_branches, tick_work, prompts[0], guided)
                         for tick_work in (work, eager))
            np.testing.assert_array_equal(got.actions, want.actions)
            torch.testing.assert_close(got.latents, want.latents, rtol=0, atol=0)
    assert work.num_shapes == 1 and work.eager_calls == eager_calls
    # A latent shape's graphs serve every count of action rows: history actions add rows; of the chunks of 2 latent
    # frames (4 to 7 actions), the one compiled serves the others; committed actions are set back as the eager step
    # sets them.
    history = {"history_actions": np.full((3, 2), 0.1, np.float32)}
    committed = {"committed_actions": np.array([[0.2, -0.1], [0.1, 0.0]], np.float32)}
    tick(BLUE, True, work.compiling(), chunk_size=7)
    for request in ({"chunk_size": 8, **history}, {"chunk_size": 5, **committed}, {"chunk_size": 4, **history}):
        prompt = pipeline.encode_prompt(BLUE, embodiment, request["chunk_size"], True,
                                        pipeline.canvas_for(embodiment, _images()), eager)
        for guided in (True, False):
            got, want = (tick(BLUE, True, tick_work, prompt, guided, **request) for tick_work in (work, eager))
            np.testing.assert_array_equal(got.actions, want.actions)
            torch.testing.assert_close(got.latents, want.latents, rtol=0, atol=0)
    assert work.num_shapes == 2 and work.eager_calls == eager_calls
    # A chunk of one action is not traced on (export would fix its count at 1: it runs eagerly), but the graphs
    # traced on a longer chunk of its latent shape serve it, within 1e-5 (one noisy row takes another matmul path).
    one = {"chunk_size": 1}
    tick(BLUE, True, work.compiling(), **one)
    assert work.num_shapes == 2 and work.eager_calls == eager_calls + config.num_steps
    tick(BLUE, True, work.compiling(), chunk_size=3)
    eager_calls = work.eager_calls
    prompt = pipeline.encode_prompt(BLUE, embodiment, 1, True, pipeline.canvas_for(embodiment, _images()), eager)
    got, want = (tick(BLUE, True, tick_work, prompt, **one) for tick_work in (work, eager))
    np.testing.assert_allclose(got.actions, want.actions, rtol=0, atol=1e-5)
    assert work.num_shapes == 3 and work.eager_calls == eager_calls
    # A step the guard makes the last jumps to its step graph's x0 prediction, guided or not (BLUE's prompts).
    for guided in (range(config.num_steps), range(2)):
        got, want = (run_steps(pipeline.steps(_request(BLUE), prompts[0], _EndsAt(config.num_steps, guided, 3),
                                              tick_work), stack) for tick_work in (work, eager))
        assert len(got.steps) == 4 and work.eager_calls == eager_calls
        np.testing.assert_array_equal(got.actions, want.actions)
        torch.testing.assert_close(got.latents, want.latents, rtol=0, atol=0)
    # No graph serves an Euler sampler's steps: they run eagerly.
    monkeypatch.setattr(pipeline, "config", config.model_copy(update={"sampler": "euler"}))
    got, want = (tick(BLUE, True, tick_work, prompts[0]) for tick_work in (work, eager))
    assert work.eager_calls == eager_calls + config.num_steps
    np.testing.assert_array_equal(got.actions, want.actions)


class _EndsAt(FixedSteps):
    """The uncond pass on the `guided` steps, and step `last` the tick's last, as the deadline guard ends a late
    tick."""

    def __init__(self, num_steps: int, guided: range, last: int):
        super().__init__(num_steps, guided)
        self.last = last

    def before_step(self, step: int) -> tuple[tuple[str, ...], bool]:
        return super().before_step(step)[0], step == self.last


def test_an_engine_compiles_at_warmup_and_serves_without_compiling(pipeline, compiles, monkeypatch):
    expected = _tick(pipeline, _request(RED), pipeline.transformer.gen_stack).actions
    calibration_stacks = []

    def recording_run_steps(steps, gen_stack):
        calibration_stacks.append(gen_stack)
        return run_steps(steps, gen_stack)

    monkeypatch.setattr(calibration, "run_steps", recording_run_steps)
    engine = ModelEngine(pipeline, EngineSettings(warmup_ticks=1, default_budget_ms=10_000.0,  # the default
                                                  calibrate_at_warmup=True))
    engine.start()
    try:
        assert engine.wait_ready(timeout_s=600)
        stack, work = engine.served.gen_stack, engine.served.tick_work
        # Its warmup calibration ran its ticks as the live ones run (compiled), after compiling.
        assert engine.served.profile is not None and calibration_stacks
        assert all(each is stack for each in calibration_stacks)
        patterns, compile_ms, eager_calls = stack.num_patterns, stack.compile_ms, stack.eager_calls
        shapes, work_eager_calls = work.num_shapes, work.eager_calls
        # One CFG branch, and both as one batch (a micro-batch of two ticks goes through that graph too).
        assert patterns == 2 and shapes == 3
        assert warmup_summary(engine, 1.0)["compiled"] == {  # what the bench reports of its first engine
            "gen_stack_patterns": 2, "gen_stack_compile_ms": compile_ms, "tick_work_latent_shapes": 3,
            "tick_work_compile_ms": work.compile_ms}
        session = engine.open_session("pusht", RED, seed=5, rate_hz=0)
        results = [engine.act(session.session_id, session.epoch,
                              api.Observation(images=_images(), state=STATE, instruction=instruction,
                                              step_index=step))
                   for step, instruction in enumerate((RED, BLUE))]
        # Warmup measures 1 and 3 latent frames (chunks 3 and 8); it compiled the tick work of 2 (chunks 4-7) too.
        other = engine.open_session("pusht", RED, seed=5, rate_hz=0, chunk_size=5)
        engine.act(other.session_id, other.epoch, api.Observation(images=_images(), state=STATE))
        assert (stack.num_patterns, stack.compile_ms, stack.eager_calls) == (patterns, compile_ms, eager_calls)
        assert (work.num_shapes, work.eager_calls) == (shapes, work_eager_calls)
        assert all(result.tick.skipped_calls == 0 for result in results)  # a generous budget runs uncached
        embodiment = pipeline.embodiments.get("pusht")
        np.testing.assert_allclose(results[0].actions, embodiment.clip_to_limits(expected), rtol=0, atol=1e-5)
    finally:
        engine.close()


def test_where_torch_cannot_compile_an_engine_runs_eagerly_and_asking_for_a_compile_fails(pipeline, compiles,
                                                                                           monkeypatch, capsys, caplog):
    assert ModelEngine(pipeline, EngineSettings()).served.compiled  # the default, where torch can compile
    assert not ModelEngine(pipeline, EngineSettings(compile_gen_stack=False)).served.compiled
    with torch._dynamo.config.patch(disable=True):  # TORCH_COMPILE_DISABLE=1
        assert compile_unavailable(torch.device("cpu")) == "torch.compile is disabled (TORCH_COMPILE_DISABLE=1)"
        engine = ModelEngine(pipeline, EngineSettings())
        assert not engine.served.compiled and engine.served.gen_stack == pipeline.transformer.gen_stack
        assert "the GEN stack runs eagerly, slower: torch.compile is disabled" in caplog.text
        with pytest.raises(CompileUnavailableError, match="cannot run compiled: torch.compile is disabled"):
            ModelEngine(pipeline, EngineSettings(compile_gen_stack=True))
        assert cli.main(["--compile-gen-stack", "--device", "cpu", "--port", "0"]) == 2
        assert "TORCH_COMPILE_DISABLE" in capsys.readouterr().err
    with torch._inductor.config.patch({"cpp.cxx": (None, "no-such-c++")}):
        assert compile_unavailable(torch.device("cpu")) == "no working C++ compiler (tried no-such-c++; install g++ " \
                                                           "or set CXX)"
        monkeypatch.setenv("CC", "no-such-cc")
        monkeypatch.setenv("PATH", "")
        assert compile_unavailable(torch.device("cuda")).startswith("no C compiler for Triton: neither no-such-cc")


def test_an_engine_that_does_not_compile_never_imports_the_compiler():
    """Importing dynamo (inductor imports it) took a third of the start of a server that runs eagerly, on 2 cores:
    neither `--no-compile-gen-stack` nor TORCH_COMPILE_DISABLE=1 imports it, loading the weights included (a
    checkpoint's model is built on the meta device, where torch's `normal_` imports dynamo)."""
    code = """if True:
        import os, sys
        from policy_server.config import build_config
        from policy_server.engine import build_engine
        os.environ.pop("TORCH_COMPILE_DISABLE", None)
        for compile_gen_stack in (False, None):  # None: wherever torch can compile; the variable says it cannot
            engine = build_engine(build_config(overrides={"device": "cpu", "compile_gen_stack": compile_gen_stack}))
            assert not engine.served.compiled and "torch._dynamo" not in sys.modules, compile_gen_stack
            os.environ["TORCH_COMPILE_DISABLE"] = "1"
    """
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_a_server_process_compiles_the_stack_and_serves_the_eager_stacks_actions(pipeline, folder, tmp_path,
                                                                                  compiles):
    # The module's model: its compiles above are in torch's disk cache.
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "policy_server.cli", "--checkpoint", str(folder),
                                    "--port", "0", "--device", "cpu", "--latency-budget-ms", "10000",
                                    "--quality-profile", "off"],  # compiles, and no warmup calibration
                                   stdout=out, stderr=subprocess.STDOUT)
    client = PolicyClient(bound_listeners(log, process, 120)["gRPC"], timeout_s=30)
    try:
        client.wait_until_serving(timeout_s=600)
        assert "compiled the GEN stack for" in log.read_text()
        session = client.open_session("pusht", RED, seed=5)
        chunk = client.act(session, _images(), STATE, instruction=RED, encoding="png")
        expected = _tick(pipeline, _request(RED), pipeline.transformer.gen_stack).actions
        np.testing.assert_allclose(chunk.actions, pipeline.embodiments.get("pusht").clip_to_limits(expected),
                                   rtol=0, atol=1e-5)
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=60)


def test_the_bench_tick_profile_runs_the_stack_and_tick_work_compiled_as_the_server_does(pipeline, compiles):
    """`policy-server bench`'s tick profile on a CPU (last in this module: inductor's cache holds its graphs)."""
    inputs = {"images": _images(), "instruction": RED, "state": STATE}
    compiled = bench.tick_profile(pipeline, pipeline.embodiments.get("pusht"), inputs, 1)["compiled"]
    assert compiled["patterns"] == 2 and compiled["compile_ms"] > 0  # one branch, both
    assert compiled["tick_work_shapes"] == 1 and compiled["tick_work_compile_ms"] > 0
    assert compiled["full_call_ms"] > compiled["skipped_call_ms"] > 0 and compiled["wall_vs_arithmetic"] > 0
