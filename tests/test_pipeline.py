"""End to end through `PolicyPipeline` on an untrained embedded-size model: modes, masking, determinism,
CFG records, prompt reuse, cache equivalence and input validation."""

import numpy as np
import pytest
import torch

from policy_server.cache.controller import NoCache
from policy_server.cache.seacache import SeaCache, SeaCacheConfig
from policy_server.pipeline import conditioning, policy, schedulers
from policy_server.pipeline.embodiments import Embodiment
from policy_server.pipeline.errors import InvalidImage, InvalidSamplerSettings, PolicyInputError
from policy_server.pipeline.packing import ActionLayout
from policy_server.pipeline.policy import (
    DenoiseState,
    FixedSteps,
    InitialNoise,
    PolicyPipeline,
    PolicyRequest,
    run_steps,
)
from policy_server.pipeline.tick_work import TickWork
from robots.embedded import build_random_pipeline

STEPS = 4


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    torch.manual_seed(0)
    return build_random_pipeline(tmp_path_factory.mktemp("pipeline"), seed=0)


def _image(seed=0):
    return np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)


def _request(**overrides):
    fields = dict(images={"image": _image()}, instruction="reach the red circle", embodiment="pusht",
                  state=np.array([0.1, 0.2], np.float32), num_steps=STEPS, seed=3)
    fields.update(overrides)
    return PolicyRequest(**fields)


def test_policy_mode_shapes_and_determinism(pipe):
    out = pipe(_request())
    again = pipe(_request())
    other_seed = pipe(_request(seed=4))
    assert out.actions.shape == (8, 2) and out.actions.dtype == np.float32
    assert np.all(np.isfinite(out.actions))
    assert out.latents.shape == (16, 3, 8, 8)
    assert np.array_equal(out.actions, again.actions)
    assert torch.equal(out.latents, again.latents)
    assert not np.array_equal(out.actions, other_seed.actions)
    assert set(out.timings_ms) == {"encode", "prefill", "denoise", "decode", "total"}


def test_a_warmed_schedule_leaves_its_first_tick_nothing_to_make(pipe, monkeypatch):
    made, real, embed = [], schedulers._uni_coefficients, pipe.transformer.timestep_embedding
    monkeypatch.setattr(schedulers, "_uni_coefficients", lambda *args, **kw: made.append(args) or real(*args, **kw))
    monkeypatch.setattr(pipe.transformer, "timestep_embedding", lambda t: made.append(t) or embed(t))
    pipe.warm_schedule(7)
    assert made  # the schedule's coefficients and time embeddings
    made.clear()
    out = pipe(_request(num_steps=7))
    assert len(out.steps) == 7 and made == []


def test_conditioning_frame_stays_clean(pipe):
    request = _request()
    out = pipe(request)
    clean, _ = pipe.encode_condition(pipe.prepare_frames(request))
    assert torch.equal(out.latents[:, 0], clean[:, 0])


def test_every_step_puts_the_conditioning_back_exactly():
    # Two history/state rows and latent frame 0 are given; channels from 2 on are padding.
    vision = torch.randn(4, 3, 2, 2)
    clean_actions = torch.zeros(5, 6)
    clean_actions[:2, :2] = torch.randn(2, 2)
    actions = torch.cat((clean_actions[:2], torch.randn(3, 6)))
    actions[:, 2:] = 0
    state = DenoiseState.start(vision, actions, [0], clean_actions, 2, ActionLayout(3, 2, (0, 1), domain_id=0))
    assert torch.equal(state.vision, vision) and torch.equal(state.actions, actions)
    stepped = torch.randn_like(state.sample)
    state.advance(stepped, 0.5)
    stepped_vision, stepped_actions = stepped[: vision.numel()].view(4, 3, 2, 2), stepped[vision.numel():].view(5, 6)
    assert torch.equal(state.vision[:, 0], vision[:, 0]) and torch.equal(state.vision[:, 1:], stepped_vision[:, 1:])
    assert torch.equal(state.actions[:2], clean_actions[:2]) and not state.actions[:, 2:].any()
    assert torch.equal(state.actions[2:, :2], stepped_actions[2:, :2])


def test_committed_rows_follow_the_noise_level_and_end_exactly_committed():
    # No state; chunk rows 0 and 1 of 3 are committed, their noise the initial rows' values there.
    vision, committed = torch.randn(4, 2, 2, 2), torch.randn(2, 2)
    clean_actions = torch.zeros(3, 4)
    clean_actions[:2, :2] = committed
    actions = torch.randn(3, 4)
    actions[:, 2:] = 0
    state = DenoiseState.start(vision, actions, [0], clean_actions, 2, ActionLayout(3, 0, (), domain_id=0),
                               committed_rows=range(2))
    stepped = torch.randn_like(state.sample)
    state.advance(stepped, 0.25)
    assert torch.equal(state.actions[:2, :2], torch.lerp(committed, actions[:2, :2], 0.25))
    assert torch.equal(state.actions[2, :2], stepped[vision.numel():].view(3, 4)[2, :2])
    assert torch.equal(state.vision[:, 0], vision[:, 0]) and not state.actions[:, 2:].any()
    state.advance(torch.randn_like(state.sample), 0.0)
    assert torch.equal(state.actions[:2, :2], committed)


def test_committed_actions_lead_the_chunk_the_rest_continues_them(pipe):
    committed = np.array([[0.3, -0.2], [0.25, -0.15], [0.2, -0.1]], np.float32)
    out = pipe(_request(committed_actions=committed))
    plain = pipe(_request())
    assert out.actions.shape == (8, 2)
    assert np.array_equal(out.actions[:3], committed)  # exactly as sent
    assert not np.array_equal(out.actions[3:], plain.actions[3:])  # the model saw them
    assert np.array_equal(pipe(_request(committed_actions=committed)).actions, out.actions)


def test_the_model_sees_the_committed_rows_at_each_steps_noise_level(pipe):
    class Recording(TickWork):  # the sampler state each step's rows are embedded from
        def __init__(self, transformer):
            super().__init__(transformer)
            self.samples = []

        def embed(self, layout, sample, time_embedding):
            self.samples.append(sample.clone())
            return super().embed(layout, sample, time_embedding)

        def advance(self, layout, cond, uncond, guidance, sampler, state, time_embedding):
            hidden = super().advance(layout, cond, uncond, guidance, sampler, state, time_embedding)
            self.samples.append(state.sample.clone())
            return hidden

    committed = np.array([[0.1, -0.05], [0.15, 0.0]], np.float32)
    noise = InitialNoise(torch.randn(16, 3, 8, 8), torch.randn(8, pipe.transformer.config.action_dim))
    work = Recording(pipe.transformer)
    request = _request(committed_actions=committed, noise=noise)
    run_steps(pipe.steps(request, None, pipe.fixed_steps(STEPS, 2.0), work), pipe.transformer.gen_stack)
    normalized = torch.from_numpy(pipe.normalizers(pipe.embodiments.get("pusht")).action.normalize(
        committed.astype(np.float64))).float()
    sigmas = pipe._sampler(STEPS).sigmas
    assert len(work.samples) == STEPS + 1  # the first step's rows, then each step's result
    for sample, sigma in zip(work.samples, sigmas, strict=True):
        rows = sample[noise.vision.numel():].view(-1, noise.actions.shape[1])[1:3, :2]  # after the state row
        assert torch.equal(rows, torch.lerp(normalized, noise.actions[:2, :2], sigma))
    assert sigmas[-1] == 0.0


class ScriptedSteps(FixedSteps):
    """Stands in for the engine's tick: drops the uncond pass from `drop_from`, ends the loop at `last`."""

    def __init__(self, pipe, drop_from=None, last=None):
        super().__init__(STEPS, pipe.guided_steps(STEPS))
        self.drop_from, self.last, self.asked = drop_from, last, []

    def before_step(self, step):
        branches, _ = super().before_step(step)
        self.asked.append(step)
        if self.drop_from is not None and step >= self.drop_from:
            branches = branches[:1]
        return branches, step == self.last


def test_cfg_records_and_drop_uncond_fallback(pipe):
    out = pipe(_request(guidance=2.0))
    assert [s.branches for s in out.steps] == [("cond", "uncond")] * STEPS
    sigmas = [s.sigma for s in out.steps]
    assert sigmas == sorted(sigmas, reverse=True)
    late = pipe.run(_request(guidance=2.0), None, ScriptedSteps(pipe, drop_from=1))
    assert [s.branches for s in late.steps] == [("cond", "uncond")] + [("cond",)] * (STEPS - 1)
    assert late.cache.full_calls == STEPS + 1
    single = pipe(_request(guidance=1.0))
    assert all(s.branches == ("cond",) for s in single.steps)


def test_a_guidance_interval_runs_the_uncond_pass_only_inside_it(pipe):
    timesteps = [s.timestep for s in pipe(_request(guidance=2.0)).steps]
    interval = (timesteps[2] - 1.0, 1001.0)  # the first three steps
    config = pipe.config.model_validate({**pipe.config.model_dump(), "guidance_interval": interval})
    gated = PolicyPipeline(pipe.transformer, pipe.vae, pipe.tokenizer, pipe.embodiments, config,
                           pipe.served_embodiments, pipe.digest)
    assert gated.guided_steps(STEPS) == range(0, 3)
    out = gated(_request(guidance=2.0))
    assert [s.branches for s in out.steps] == [("cond", "uncond")] * 3 + [("cond",)] * (STEPS - 3)


def test_a_num_steps_whose_timesteps_the_guidance_interval_misses_is_refused_when_guidance_is_asked_for(pipe):
    """The interval holds a timestep of the checkpoint's step count (else the config is refused at load), but none of
    a request's fewer steps: the uncond pass never ran, and the chunk came back unguided with guidance=2 asked for."""
    default, shift = pipe.config.num_steps, pipe.config.shift  # a shifted schedule
    few = schedulers.flow_schedule(STEPS, shift).timesteps
    inside = next(t for t in schedulers.flow_schedule(default, shift).timesteps if t not in few)
    config = pipe.config.model_validate({**pipe.config.model_dump(), "guidance_interval": (inside - 0.5, inside + 0.5)})
    gated = PolicyPipeline(pipe.transformer, pipe.vae, pipe.tokenizer, pipe.embodiments, config,
                           pipe.served_embodiments, pipe.digest)
    assert len(gated.guided_steps(default)) == 1 and gated.guided_steps(STEPS) == range(0)
    with pytest.raises(InvalidSamplerSettings) as refused:
        gated(_request(guidance=2.0))
    assert refused.value.field == "num_steps"
    assert str(refused.value).startswith(
        f"num_steps: num_steps={STEPS} with guidance=2: guidance_interval [{inside - 0.5:g}, {inside + 0.5:g}] holds "
        f"none of the {STEPS} sampler timesteps (int(sigma * 1000), {few[0]} down to {few[-1]}) at num_steps={STEPS}, "
        "so guidance would never run; nearest: ")
    assert str(refused.value).endswith(f"expected a num_steps whose timesteps the interval holds (the checkpoint's "
                                       f"{default} has 1 guided), or guidance=1 (no CFG)")
    assert all(s.branches == ("cond",) for s in gated(_request(guidance=1.0)).steps)  # no guidance asked: served


def test_step_control_that_never_intervenes_changes_nothing(pipe):
    steps = ScriptedSteps(pipe)
    controlled, plain = pipe.run(_request(), None, steps), pipe(_request())
    assert steps.asked == list(range(STEPS))
    assert np.array_equal(controlled.actions, plain.actions) and torch.equal(controlled.latents, plain.latents)


def test_step_control_drops_uncond_then_ends_the_loop_on_a_clean_estimate(pipe):
    out = pipe.run(_request(), None, ScriptedSteps(pipe, drop_from=1, last=2))
    assert [record.branches for record in out.steps] == [("cond", "uncond"), ("cond",), ("cond",)]
    assert out.cache.sequence("uncond") == "F" and out.cache.sequence("cond") == "FFF"
    full = pipe(_request())
    assert np.all(np.isfinite(out.actions)) and not np.array_equal(out.actions, full.actions)
    assert torch.equal(out.latents[:, 0], full.latents[:, 0])  # the conditioning frame is kept exactly


class RecordedStacks:
    """The transformer's `gen_stack`, recording each call's `[B, N_gen]`."""

    def __init__(self, pipe):
        self.pipe, self.shapes = pipe, []

    def __call__(self, gen, und_kv):
        self.shapes.append(tuple(gen.hidden.shape[:-1]))
        return self.pipe.transformer.gen_stack(gen, und_kv)


@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_batched_cfg_equals_the_branches_one_by_one(pipe, threshold):
    """A step's cond and uncond calls (prompts of different lengths) run as one stack, each against its own
    text K/V, each branch keeping its own SeaCache state: the same decisions and, within 1e-5, the same
    tick as running them one by one."""
    request = _request(guidance=2.0, num_steps=8)
    outs, stacks = [], []
    for batch in (True, False):
        stack = RecordedStacks(pipe)
        steps = pipe.fixed_steps(8, 2.0, SeaCache(SeaCacheConfig(threshold=threshold)), batch_branches=batch)
        outs.append(run_steps(pipe.steps(request, None, steps), stack))
        stacks.append(stack.shapes)
    batched, one_by_one = outs
    prompt = pipe.encode_prompt(request.instruction, pipe.embodiments.get("pusht"), 8, cfg=True, canvas_hw=(64, 64))
    assert len(prompt.input_ids["cond"]) != len(prompt.input_ids["uncond"])
    def decided(out):
        return [(d.step, d.branch, d.full, d.reason) for d in out.cache.decisions]

    assert decided(batched) == decided(one_by_one)
    if threshold:
        assert 0 < batched.cache.skipped_calls < batched.cache.full_calls
    pairs = [s for s in batched.steps if len(s.full) == 2]
    assert pairs and all(s.batched for s in pairs) and not any(s.batched for s in one_by_one.steps)
    n_gen = stacks[1][0][0]
    assert stacks[0] == [(2, n_gen) if len(s.full) == 2 else (n_gen,) for s in batched.steps if s.full]
    assert stacks[1] == [(n_gen,)] * one_by_one.cache.full_calls
    assert np.abs(batched.actions - one_by_one.actions).max() <= 1e-5
    assert (batched.latents - one_by_one.latents).abs().max().item() <= 1e-5


def test_prompt_state_reuse_is_exact(pipe):
    request = _request(guidance=2.0)
    prompt = pipe.encode_prompt(request.instruction, pipe.embodiments.get("pusht"), 8, cfg=True, canvas_hw=(64, 64))
    assert torch.equal(
        torch.from_numpy(pipe(request, prompt=prompt).actions), torch.from_numpy(pipe(request).actions)
    )


def test_the_layouts_kept_are_the_most_recent_shapes_and_an_evicted_one_is_built_again(tmp_path, monkeypatch):
    """Each instruction length is a shape of its own: the GEN layouts kept stay within MAX_LAYOUT_SHAPES, a pair of
    cond and uncond layouts goes with its layouts, and a shape whose layouts went is served as before."""
    monkeypatch.setattr(policy, "MAX_LAYOUT_SHAPES", 4)
    pipe = build_random_pipeline(tmp_path, seed=0)
    instructions = [f"reach the {'red ' * words}circle" for words in range(1, 7)]  # 6 cond shapes, 1 uncond
    first = pipe(_request(instruction=instructions[0], guidance=2.0))
    for instruction in instructions[1:]:
        pipe(_request(instruction=instruction, guidance=2.0))
        assert len(pipe._gen_layouts) <= 4
        assert all(shape in pipe._gen_layouts for pair in pipe._branch_layouts for shape in pair)
    assert len(pipe._gen_layouts) == 4 and len(pipe._branch_layouts) == 3
    again = pipe(_request(instruction=instructions[0], guidance=2.0))
    assert np.array_equal(first.actions, again.actions)
    assert torch.equal(first.latents, again.latents)


def test_seacache_threshold_zero_is_bit_identical(pipe):
    request = _request(guidance=2.0, num_steps=6)
    plain = pipe(request, cache=NoCache())
    cached = pipe(request, cache=SeaCache(SeaCacheConfig(threshold=0.0)))
    assert np.array_equal(plain.actions, cached.actions)
    assert torch.equal(plain.latents, cached.latents)
    skipping = pipe(request, cache=SeaCache(SeaCacheConfig(threshold=10.0)))
    assert skipping.cache.skipped_calls > 0
    assert not np.array_equal(plain.actions, skipping.actions)


def test_instruction_changes_the_answer(pipe):
    red = pipe(_request(guidance=2.0))
    blue = pipe(_request(guidance=2.0, instruction="reach the blue circle"))
    assert not np.array_equal(red.actions, blue.actions)


def test_history_rows_are_clean_conditioning(pipe):
    history = np.array([[0.1, -0.1], [0.05, 0.0]], np.float32)
    out = pipe(_request(history_actions=history, guidance=1.0))
    plain = pipe(_request(guidance=1.0))
    assert out.actions.shape == (8, 2)
    assert not np.array_equal(out.actions, plain.actions)
    with pytest.raises(PolicyInputError) as error:
        pipe(_request(history_actions=np.zeros((2, 3), np.float32)))
    assert error.value.field == "history_actions"


def test_forward_dynamics_keeps_given_actions(pipe):
    given = np.linspace(-0.15, 0.15, 16, dtype=np.float32).reshape(8, 2)
    out = pipe(_request(mode="forward_dynamics", actions=given, guidance=1.0))
    np.testing.assert_allclose(out.actions, given, atol=1e-5)
    assert out.cache.full_calls == STEPS  # future frames are still generated


def test_cameras_of_different_heights_go_side_by_side_as_if_the_robot_had_scaled_them(pipe, monkeypatch):
    pipe.embodiments.register(Embodiment(name="scene_and_wrist", domain_id=30, raw_action_dim=2,
                                         cameras=("scene", "wrist")), replace=True)
    rng = np.random.default_rng(7)
    scene, wrist = (rng.integers(0, 256, (*hw, 3), dtype=np.uint8) for hw in ((48, 64), (24, 24)))
    scaled = conditioning.resize(wrist[None], (48, 48))[0]  # what a robot does today, with the server's resize

    mixed = pipe.prepare_images("scene_and_wrist", {"scene": scene, "wrist": wrist})
    monkeypatch.setattr(conditioning, "resize", lambda *args: pytest.fail("frames of one height were resized"))
    robot_scaled = pipe.prepare_images("scene_and_wrist", {"scene": scene, "wrist": scaled})
    assert torch.equal(mixed.clip, robot_scaled.clip) and mixed.placement == robot_scaled.placement
    # Cameras of one height go side by side untouched, as before the server took different heights.
    before = conditioning.prepare_clip(np.concatenate([scene, scaled], axis=1)[None], 1, pipe.config.canvases,
                                       pipe.vae.spatial_compression, pipe.config.pad_mode)
    assert torch.equal(robot_scaled.clip, before[0]) and robot_scaled.placement == before[1]
    embodiment = pipe.embodiments.get("scene_and_wrist")
    assert pipe.canvas_for(embodiment, {"scene": scene, "wrist": wrist}) == mixed.placement.canvas_hw


def test_inverse_dynamics_generates_actions_from_clean_video(pipe):
    video = np.stack([_image(i) for i in range(9)])
    request = _request(mode="inverse_dynamics", video={"image": video}, images={})
    out = pipe(request)
    assert out.actions.shape == (8, 2) and np.all(np.isfinite(out.actions))
    clean, _ = pipe.encode_condition(pipe.prepare_frames(request))
    assert torch.equal(out.latents, clean)
    # No noisy vision: SeaCache fails open and runs every step full.
    cached = pipe(request, cache=SeaCache(SeaCacheConfig(threshold=10.0)))
    assert cached.cache.skipped_calls == 0 and np.array_equal(cached.actions, out.actions)
    # A video per camera, as images: exactly the embodiment's cameras, each [K + 1, H, W, 3].
    wrong = (({"wrist": video}, r"cameras \['wrist'\]; expected exactly \['image'\]"),
             ({"image": video[0]}, r"video 'image' is uint8 \(64, 64, 3\); expected uint8 RGB \[K \+ 1"))
    for videos, message in wrong:
        with pytest.raises(InvalidImage, match=message):
            pipe(_request(mode="inverse_dynamics", video=videos, images={}))


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(images={"image": _image().astype(np.float32)}), "images[image]"),
        (dict(images={"image": _image()[..., :2]}), "images[image]"),
        (dict(images={"image": _image()[:0]}), "images[image]"),
        (dict(images={"wrist": _image()}), "images"),
        (dict(state=np.array([np.nan, 0.1], np.float32)), "state"),
        (dict(state=np.array([0.1, 0.2, 0.3], np.float32)), "state"),
        (dict(state=None), "state"),
        (dict(embodiment="unicycle"), "embodiment"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(chunk_size=17), "chunk_size"),
        (dict(instruction="   "), "instruction"),
        (dict(mode="dream"), "mode"),
        (dict(guidance=0.5), "guidance"),
        (dict(mode="forward_dynamics", actions=np.zeros((3, 2), np.float32)), "actions"),
        (dict(committed_actions=np.zeros((2, 3), np.float32)), "committed_actions"),
        (dict(committed_actions=np.zeros((8, 2), np.float32)), "committed_actions"),
        (dict(committed_actions=np.array([[0.1, np.inf]], np.float32)), "committed_actions"),
        (dict(mode="forward_dynamics", actions=np.zeros((8, 2), np.float32),
              committed_actions=np.zeros((1, 2), np.float32)), "committed_actions"),
    ],
)
def test_bad_input_names_the_field(pipe, overrides, field):
    with pytest.raises(PolicyInputError) as error:
        pipe(_request(**overrides))
    assert error.value.field == field
    assert str(error.value).startswith(field.split("[")[0])
