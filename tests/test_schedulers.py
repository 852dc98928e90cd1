"""Flow samplers: schedule and UniPC numerics against diffusers, Euler against the closed form."""

import copy

import numpy as np
import pytest
import torch

from policy_server.pipeline.errors import InvalidSamplerSettings, PolicyInputError
from policy_server.pipeline.schedulers import (
    EulerSampler,
    UniPCSampler,
    flow_schedule,
    karras_flow_schedule,
    make_sampler,
    scheduler_settings,
    unipc_update,
    widest_update,
)

diffusers = pytest.importorskip("diffusers")
from diffusers import UniPCMultistepScheduler  # noqa: E402


def reference_scheduler(num_steps: int, shift: float, solver_order: int = 2, sigmas=None):
    scheduler = UniPCMultistepScheduler(
        use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=shift, solver_order=solver_order
    )
    scheduler.set_timesteps(num_steps, sigmas=sigmas)
    return scheduler


@pytest.mark.parametrize("num_steps,shift", [(4, 5.0), (10, 3.0), (1, 10.0), (2, 1.0), (30, 10.0), (7, 1.5)])
def test_schedule_matches_diffusers(num_steps, shift):
    ref = reference_scheduler(num_steps, shift)
    schedule = flow_schedule(num_steps, shift)
    assert schedule.num_steps == num_steps
    assert list(schedule.timesteps) == ref.timesteps.tolist()
    assert np.array_equal(np.array(schedule.sigmas, dtype=np.float32), ref.sigmas.numpy())
    assert schedule.sigmas[-1] == 0.0
    assert all(a > b for a, b in zip(schedule.sigmas, schedule.sigmas[1:], strict=False))


def test_schedule_formula_by_hand():
    # 4 steps, shift 5: base 1, 0.75025, 0.5005, 0.25075 -> s*σ/(1+(s-1)σ); first one nudged below 1.
    base = np.linspace(1.0, 0.001, 5)[:-1]
    expected = 5 * base / (1 + 4 * base)
    expected[0] -= 1e-6
    schedule = flow_schedule(4, 5)
    np.testing.assert_allclose(schedule.sigmas[:-1], expected, rtol=1e-7)
    assert schedule.timesteps == tuple(int(s * 1000) for s in expected)


def run_trajectories(sampler, ref, shape, seed, modalities=("",)):
    """Step both with the same random velocities; return the max abs difference per step."""
    gen = torch.Generator().manual_seed(seed)
    samples = {k: torch.randn(shape, generator=gen) for k in modalities}
    ref_samples = {k: s.clone() for k, s in samples.items()}
    # one scheduler copy per modality, as diffusers' pipeline does
    refs = {k: ref if i == 0 else copy.deepcopy(ref) for i, k in enumerate(modalities)}
    diffs = []
    for i, t in enumerate(ref.timesteps):
        velocity = {k: torch.randn(shape, generator=gen) * 2 for k in modalities}
        if modalities == ("",):
            out = {"": sampler.step(velocity[""], samples[""], step_index=i)}
        else:
            out = sampler.step(velocity, samples)
        for k in modalities:
            ref_samples[k] = refs[k].step(
                velocity[k].unsqueeze(0), t, ref_samples[k].unsqueeze(0), return_dict=False
            )[0].squeeze(0)
        diffs.append(max(float((out[k] - ref_samples[k]).abs().max()) for k in modalities))
        samples = out
    return diffs, samples


@pytest.mark.parametrize("num_steps,shift", [(4, 5.0), (10, 3.0), (1, 5.0), (2, 10.0), (30, 10.0)])
def test_unipc_matches_diffusers_every_step(num_steps, shift):
    sampler = make_sampler("unipc", num_steps, shift)
    assert isinstance(sampler, UniPCSampler)
    ref = reference_scheduler(num_steps, shift)
    assert sampler.timesteps == ref.timesteps.tolist()
    diffs, _ = run_trajectories(sampler, ref, (3, 5, 4), seed=num_steps)
    assert len(diffs) == num_steps
    assert max(diffs) <= 1e-6, diffs


@pytest.mark.parametrize("solver_order", [1, 3])
def test_unipc_other_orders_match_diffusers(solver_order):
    sampler = make_sampler("unipc", 8, 5.0, solver_order=solver_order)
    ref = reference_scheduler(8, 5.0, solver_order=solver_order)
    diffs, _ = run_trajectories(sampler, ref, (16,), seed=solver_order)
    assert max(diffs) <= 1e-6, diffs


def test_unipc_custom_base_sigmas_match_diffusers():
    # The pipeline's "native" schedule: linspace(1 - 1/1000, 0, N + 1)[:-1], then shifted.
    base = np.linspace(1.0 - 1.0 / 1000, 0.0, 6)[:-1]
    sampler = make_sampler("unipc", 5, 4.0, base_sigmas=base.tolist())
    ref = reference_scheduler(5, 4.0, sigmas=base)
    assert sampler.timesteps == ref.timesteps.tolist()
    diffs, _ = run_trajectories(sampler, ref, (10,), seed=3)
    assert max(diffs) <= 1e-6, diffs


def test_modalities_in_lockstep_match_separate_scheduler_copies():
    # diffusers' pipeline steps one scheduler copy per modality; a dict of tensors must match that.
    sampler = make_sampler("unipc", 6, 5.0)
    ref = reference_scheduler(6, 5.0)
    diffs, out = run_trajectories(sampler, ref, (2, 3), seed=11, modalities=("action", "vision"))
    assert set(out) == {"action", "vision"}
    assert max(diffs) <= 1e-6, diffs


@pytest.mark.parametrize("solver_order", [1, 2, 3])
def test_an_update_in_the_widest_form_gives_every_step_bit_for_bit(solver_order):
    # The compiled tick work traces one update of a sampler's widest step (`widest_update`) for all of its steps.
    for num_steps in (1, 2, 3, 5, 12):
        stepped, widest = (make_sampler("unipc", num_steps, 3.0, solver_order=solver_order) for _ in range(2))
        x = y = torch.randn(64)
        for _ in range(num_steps):
            v = torch.randn(64)
            x = stepped.step(v, x)

            def update(sample, sigma, *step, velocity=v):
                history, last_sample, corrector, predictor = widest_update(solver_order, sample, *step)
                assert len(history) == solver_order and len(corrector.rks) == len(predictor.rks) == solver_order - 1
                return unipc_update(velocity, sample, sigma, history, last_sample, corrector, predictor)

            y, = widest.step_with(update, y)
            assert torch.equal(x, y)
    with pytest.raises(RuntimeError, match="steps of this sampler are done"):
        widest.step_with(update, y)


@pytest.mark.parametrize("name", ["unipc", "euler"])
def test_rows_with_zero_velocity_stay_clean(name):
    # Conditioning rows get their velocity masked to zero; the update must leave them in place.
    sampler = make_sampler(name, 5, 5.0)
    x = torch.randn(4, 8)
    clean = x[0].clone()
    for _ in range(sampler.num_steps):
        v = torch.randn(4, 8)
        v[0] = 0
        x = sampler.step(v, x)
    torch.testing.assert_close(x[0], clean, atol=1e-6, rtol=0)


def test_exact_rectified_flow_is_recovered():
    # For a straight path the velocity is constant (ε − x0); every solver must land on x0.
    x0 = torch.randn(5, 7)
    eps = torch.randn(5, 7)
    for name in ("unipc", "euler"):
        sampler = make_sampler(name, 5, 3.0)
        x = (1 - sampler.sigmas[0]) * x0 + sampler.sigmas[0] * eps
        for _ in range(sampler.num_steps):
            x = sampler.step(eps - x0, x)
        torch.testing.assert_close(x, x0, atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_steps,shift", [(4, 5.0), (10, 3.0)])
def test_euler_matches_closed_form(num_steps, shift):
    sampler = make_sampler("euler", num_steps, shift)
    assert isinstance(sampler, EulerSampler)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, generator=gen)
    expected = x.double()
    sigmas = np.array(sampler.sigmas, dtype=np.float64)
    for i in range(num_steps):
        v = torch.randn(6, generator=gen)
        x = sampler.step(v, x)
        expected = expected + (sigmas[i + 1] - sigmas[i]) * v.double()
        torch.testing.assert_close(x.double(), expected, atol=1e-6, rtol=0)
    assert x.dtype == torch.float32


def test_sampler_state_is_fp32_and_per_instance():
    a = make_sampler("unipc", 4, 5.0)
    b = make_sampler("unipc", 4, 5.0)
    x = torch.randn(3, dtype=torch.bfloat16)
    v = torch.randn(3, dtype=torch.bfloat16)
    out_a = a.step(v, x)
    assert out_a.dtype == torch.float32
    assert b.step_index == 0 and a.step_index == 1
    out_b = b.step(v, x)
    assert torch.equal(out_a, out_b)


def test_step_misuse_raises():
    sampler = make_sampler("euler", 2, 1.0)
    with pytest.raises(RuntimeError, match="at step 0"):
        sampler.step(torch.zeros(2), torch.zeros(2), step_index=1)
    sampler.step({"a": torch.zeros(2)}, {"a": torch.zeros(2)})
    with pytest.raises(ValueError, match="modalities changed"):
        sampler.step({"b": torch.zeros(2)}, {"b": torch.zeros(2)})
    sampler.step({"a": torch.zeros(2)}, {"a": torch.zeros(2)})
    with pytest.raises(RuntimeError, match="steps of this sampler are done"):
        sampler.step({"a": torch.zeros(2)}, {"a": torch.zeros(2)})
    with pytest.raises(ValueError, match="shape"):
        make_sampler("euler", 2, 1.0).step(torch.zeros(3), torch.zeros(2))


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(name="ddim", num_steps=4, shift=1.0), "sampler"),
        (dict(name="unipc", num_steps=0, shift=1.0), "num_steps"),
        (dict(name="unipc", num_steps=4, shift=0.0), "shift"),
        (dict(name="unipc", num_steps=4, shift=1.0, solver_order=4), "solver_order"),
        (dict(name="unipc", num_steps=2, shift=1.0, base_sigmas=[0.5, 0.9]), "base_sigmas"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(InvalidSamplerSettings) as info:
        make_sampler(**kwargs)
    assert isinstance(info.value, PolicyInputError)
    assert info.value.field == field
    assert "expected" in str(info.value)


def karras_reference(num_steps: int, sigma_min=0.147, sigma_max=200.0, final="zero", solver_order=2):
    scheduler = UniPCMultistepScheduler(
        use_flow_sigmas=True, prediction_type="flow_prediction", use_karras_sigmas=True, sigma_min=sigma_min,
        sigma_max=sigma_max, final_sigmas_type=final, solver_order=solver_order,
    )
    scheduler.set_timesteps(num_steps)
    return scheduler


@pytest.mark.parametrize("num_steps", [1, 2, 4, 20, 35])
def test_karras_flow_schedule_matches_diffusers(num_steps):
    ref = karras_reference(num_steps)
    schedule = karras_flow_schedule(num_steps, 0.147, 200.0)
    assert list(schedule.timesteps) == ref.timesteps.tolist()
    assert np.array_equal(np.array(schedule.sigmas, dtype=np.float32), ref.sigmas.numpy())
    last = karras_flow_schedule(num_steps, 0.147, 200.0, "sigma_min")
    reference = karras_reference(num_steps, final="sigma_min").sigmas.numpy()
    assert np.array_equal(np.array(last.sigmas, dtype=np.float32), reference)


@pytest.mark.parametrize("num_steps,solver_order", [(4, 2), (20, 2), (8, 1), (8, 3)])
def test_unipc_on_karras_sigmas_matches_diffusers_every_step(num_steps, solver_order):
    sampler = make_sampler("unipc", num_steps, 1.0, solver_order=solver_order, karras=(0.147, 200.0, "zero"))
    diffs, _ = run_trajectories(sampler, karras_reference(num_steps, solver_order=solver_order), (3, 5, 4), seed=7)
    assert max(diffs) <= 1e-6, diffs


def _scheduler_folder(tmp_path, **config):
    UniPCMultistepScheduler(**config).save_pretrained(tmp_path)
    return tmp_path / "scheduler_config.json"


def test_scheduler_settings_read_a_saved_diffusers_config(tmp_path):
    path = _scheduler_folder(tmp_path, use_flow_sigmas=True, prediction_type="flow_prediction", use_karras_sigmas=True,
                             sigma_min=0.147, sigma_max=200.0, solver_order=2)
    settings = scheduler_settings(path)
    assert settings == {"sampler": "unipc", "solver_order": 2, "final_sigma": "zero", "shift": 1.0,
                        "sigma_schedule": "karras", "sigma_min": 0.147, "sigma_max": 200.0}
    shifted = scheduler_settings(_scheduler_folder(tmp_path / "s", use_flow_sigmas=True, flow_shift=10.0,
                                                   prediction_type="flow_prediction"))
    assert (shifted["shift"], "sigma_schedule" in shifted) == (10.0, False)


@pytest.mark.parametrize(
    "config,field",
    [
        ({"prediction_type": "flow_prediction"}, "use_flow_sigmas=False"),  # not a flow scheduler
        ({"use_flow_sigmas": True}, "prediction_type='epsilon'"),
        ({"use_flow_sigmas": True, "prediction_type": "flow_prediction", "solver_type": "bh1"}, "solver_type"),
        ({"use_flow_sigmas": True, "prediction_type": "flow_prediction", "use_karras_sigmas": True}, "sigma_min"),
    ],
)
def test_scheduler_settings_name_what_this_server_does_not_implement(tmp_path, config, field):
    from policy_server.model.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=field):
        scheduler_settings(_scheduler_folder(tmp_path, **config))
    (tmp_path / "other.json").write_text('{"_class_name": "EulerDiscreteScheduler"}')
    with pytest.raises(CheckpointError, match="expected 'UniPCMultistepScheduler'"):
        scheduler_settings(tmp_path / "other.json")


def test_policy_config_carries_the_karras_schedule_to_the_sampler():
    from pydantic import ValidationError

    from policy_server.pipeline.policy_config import PolicyConfig

    config = PolicyConfig(sigma_schedule="karras", sigma_min=0.147, sigma_max=200.0)
    sampler = make_sampler(config.sampler, 6, config.shift, solver_order=config.solver_order, karras=config.karras)
    assert sampler.timesteps == karras_reference(6).timesteps.tolist()
    assert PolicyConfig().karras is None
    with pytest.raises(ValidationError, match="sigma_min < sigma_max"):
        PolicyConfig(sigma_schedule="karras", sigma_min=5.0, sigma_max=1.0)
