"""SeaCache: extrapolation, the gate state machine, CFG branches, reset, fail-open, forced skips (spec §5)."""

import logging

import pytest
import torch
from cache_calls import run_stack

from policy_server.cache import seacache
from policy_server.cache.controller import NoCache, StepController
from policy_server.cache.extrapolation import newton_extrapolate
from policy_server.cache.sea_filter import SeaFilter
from policy_server.cache.seacache import SeaCache, SeaCacheConfig

N_GEN, DIM = 6, 4


def latents_with_distances(distances, sigma_steps, seed=0):
    """Noisy latents [C, T, H, W] per step whose SEA indicators are ``distances[i]`` rel-L1 apart.

    The filter is linear and, at a fixed sigma, the same at every step, so scaling one latent by
    ``1 + d`` scales its indicator by ``1 + d``: rel-L1 between consecutive steps is exactly ``d``.
    """
    base = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(seed))
    out, scale = [base], 1.0
    for d in distances[: sigma_steps - 1]:
        scale *= 1.0 + d
        out.append(base * scale)
    return out


def residual_full(sign=1.0, calls=None):
    """Fake GEN stack whose residual is linear in the step: ``gen_in + sign * step``."""

    def make(step, gen_in, branch):
        def full():
            if calls is not None:
                calls.append((step, branch))
            return gen_in + sign * float(step)

        return full

    return make


def apply(cache, gate, gen_in, full, force_skip=False):
    """Carry out `gate` as the deadline guard's wrapper does: ``skip``, else run ``full()`` and hand it to ``ran``.
    Returns the output and the decision recorded."""
    out = cache.skip(gate, gen_in, force_skip)
    if out is None:
        out = full()
        cache.ran(gate.branch, out)
    return out, cache.record().decisions[-1]


def drive(cache, latents, sigma=0.5, branches=("cond",), make_full=None, gen_in=None, force=None):
    """Run one request through ``cache``; returns outputs {(step, branch): tensor}.

    Without ``force`` every call goes through ``run_stack``; with it, through ``gate`` then ``skip`` / ``ran`` with
    ``force_skip=force(step, branch)`` on every call (also those the gate already skips, which it must ignore).
    """
    make_full = make_full or residual_full()
    gen_in = gen_in if gen_in is not None else torch.ones(N_GEN, DIM)
    outs = {}
    with torch.no_grad():
        for step in range(len(latents)):
            for branch in branches:
                full = make_full(step, gen_in, branch)
                if force is None:
                    outs[(step, branch)] = run_stack(
                        cache, step=step, branch=branch, sigma=sigma, noisy_vision=[latents[step]], gen_in=gen_in,
                        full=full,
                    )
                else:
                    gate = cache.gate(step, branch, sigma, [latents[step]])
                    outs[(step, branch)], _ = apply(cache, gate, gen_in, full, force_skip=force(step, branch))
    return outs


# ---------------------------------------------------------------- extrapolation (§5.4)


def test_order1_from_steps_0_and_3_at_4():
    r0, r3 = torch.randn(3, 2), torch.randn(3, 2)
    got = newton_extrapolate([(0, r0), (3, r3)], 4, 1)
    torch.testing.assert_close(got, r3 + (r3 - r0) / 3)


def test_order0_returns_last_residual_as_a_copy():
    r0, r1 = torch.randn(3), torch.randn(3)
    got = newton_extrapolate([(0, r0), (1, r1)], 5, 0)
    assert torch.equal(got, r1)
    got += 1
    assert not torch.equal(got, r1)


def test_order2_on_collinear_residuals_equals_order1():
    a, b = torch.randn(4), torch.randn(4)
    hist = [(s, a + b * s) for s in (0, 2, 3)]
    torch.testing.assert_close(newton_extrapolate(hist, 6, 2), newton_extrapolate(hist, 6, 1))
    torch.testing.assert_close(newton_extrapolate(hist, 6, 2), a + 6 * b)


def test_order2_is_exact_on_quadratics_at_uneven_steps():
    a, b, c = torch.randn(4), torch.randn(4), torch.randn(4)
    hist = [(s, a + b * s + c * s * s) for s in (0, 1, 2, 5)]  # the oldest entry is ignored
    torch.testing.assert_close(newton_extrapolate(hist, 7, 2), a + 7 * b + 49 * c, rtol=1e-5, atol=1e-4)


def test_extrapolation_falls_back_with_short_history_and_equal_steps():
    r = torch.randn(3)
    assert torch.equal(newton_extrapolate([(2, r)], 5, 2), r)
    assert torch.equal(newton_extrapolate([(2, r - 1), (2, r)], 5, 1), r)


# ---------------------------------------------------------------- the gate (§5.3)


def test_default_decisions_with_distance_0_05_are_FSSFSSFSSF():
    cache = SeaCache(SeaCacheConfig())
    cache.begin(10)
    drive(cache, latents_with_distances([0.05] * 9, 10))
    rec = cache.record()
    assert rec.sequence("cond") == "FSSFSSFSSF"
    full_reasons = [d.reason for d in rec.decisions if d.full]
    assert full_reasons == ["retention", "cap", "cap", "cache_end"]
    assert rec.branches["cond"].full == 4 and rec.branches["cond"].skipped == 6
    assert rec.branches["cond"].fail_open == 0
    assert [round(d.distance, 4) for d in rec.decisions[1:3]] == [0.05, 0.05]
    assert rec.decisions[2].accumulated == pytest.approx(0.10, abs=1e-5)


def test_threshold_crossings_refresh_without_cap():
    cache = SeaCache(SeaCacheConfig(threshold=0.35, max_consecutive_cached=0))
    cache.begin(10)
    drive(cache, latents_with_distances([0.1] * 9, 10))
    rec = cache.record()
    assert rec.sequence("cond") == "FSSSFSSSFF"
    assert [d.reason for d in rec.decisions if d.full] == ["retention", "threshold", "threshold", "cache_end"]


def test_large_distances_refresh_every_step():
    cache = SeaCache()
    cache.begin(6)
    drive(cache, latents_with_distances([0.3] * 5, 6))
    assert cache.record().sequence("cond") == "FFFFFF"


def test_per_step_threshold_schedule():
    schedule = [0.0] * 5 + [1.0] * 5
    cache = SeaCache(SeaCacheConfig(threshold=schedule))
    cache.begin(10)
    drive(cache, latents_with_distances([0.05] * 9, 10))
    assert cache.record().sequence("cond") == "FFFFFSSFSF"
    assert cache.record().thresholds == tuple(schedule)


def test_skipped_output_is_gen_in_plus_extrapolated_residual():
    # The fake stack's residual is exactly linear in the step, so once two full steps exist, order 1
    # reproduces every full output; before that (steps 1, 2) only the step-0 residual can be reused.
    gen_in = torch.randn(N_GEN, DIM)
    lat = latents_with_distances([0.05] * 9, 10)
    cache = SeaCache()
    cache.begin(10)
    outs = drive(cache, lat, gen_in=gen_in)
    assert cache.record().sequence("cond") == "FSSFSSFSSF"
    for step in range(10):
        expected = gen_in if step in (1, 2) else gen_in + step
        torch.testing.assert_close(outs[(step, "cond")], expected)

    cache0 = SeaCache(SeaCacheConfig(residual_order=0))
    cache0.begin(10)
    outs0 = drive(cache0, lat, gen_in=gen_in)
    torch.testing.assert_close(outs0[(1, "cond")], gen_in + 0.0)  # reuse of the step-0 residual
    torch.testing.assert_close(outs0[(5, "cond")], gen_in + 3.0)


def test_residual_order_2_uses_three_full_steps():
    gen_in = torch.zeros(N_GEN, DIM)

    def make_full(step, g, branch):
        return lambda: g + float(step * step)

    cache = SeaCache(SeaCacheConfig(residual_order=2))
    cache.begin(10)
    outs = drive(cache, latents_with_distances([0.05] * 9, 10), gen_in=gen_in, make_full=make_full)
    # Full at 0, 3, 6: quadratic through them is exact for step**2 at 7 and 8.
    torch.testing.assert_close(outs[(7, "cond")], gen_in + 49.0)
    torch.testing.assert_close(outs[(8, "cond")], gen_in + 64.0)


# ---------------------------------------------------------------- threshold 0 (§5.1)


class _TinyStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.w = torch.nn.Parameter(torch.randn(DIM, DIM, generator=g) * 0.3)

    def forward(self, h, text):
        for _ in range(3):
            h = h + torch.tanh(h @ self.w + text)
        return h


def _sample(controller, num_steps=6, guidance=2.0):
    """A small flow sampler: the noisy latent drives gen_in, CFG over two branches, Euler steps."""
    stack = _TinyStack()
    x = torch.randn(1, 1, 3, 2, generator=torch.Generator().manual_seed(5))  # [C, T, H, W], 6 values = N_GEN
    texts = {"cond": torch.ones(DIM) * 0.2, "uncond": torch.zeros(DIM)}
    sigmas = torch.linspace(1.0, 0.0, num_steps + 1)
    controller.begin(num_steps)
    with torch.no_grad():
        for i in range(num_steps):
            gen_in = x.reshape(N_GEN, 1).expand(N_GEN, DIM) * (1 + float(sigmas[i]))
            v = {}
            for b in ("cond", "uncond"):
                out = run_stack(controller, i, b, float(sigmas[i]), [x], gen_in,
                                           lambda b=b, g=gen_in: stack(g, texts[b]))
                v[b] = out.mean(dim=1).reshape(x.shape)
            vel = v["uncond"] + guidance * (v["cond"] - v["uncond"])
            x = x + (sigmas[i + 1] - sigmas[i]) * vel
    return x


def test_threshold_zero_is_bit_identical_to_no_cache(monkeypatch):
    ref = _sample(NoCache())
    cache = SeaCache(SeaCacheConfig(threshold=0.0))

    def no_indicator(*_):
        raise AssertionError("threshold 0 turns the gate off: no SEA indicator should be computed")

    monkeypatch.setattr(cache.sea_filter, "indicator", no_indicator)
    got = _sample(cache)
    assert torch.equal(got, ref)
    rec = cache.record()
    assert rec.full_calls == 6 * 2 and rec.skipped_calls == 0


def test_caching_changes_the_sample_when_threshold_is_large():
    ref = _sample(NoCache())
    cache = SeaCache(SeaCacheConfig(threshold=10.0))
    got = _sample(cache)
    assert cache.record().skipped_calls > 0
    assert not torch.equal(got, ref)


def test_controllers_satisfy_the_protocol():
    assert isinstance(SeaCache(), StepController)
    assert isinstance(NoCache(), StepController)


# ---------------------------------------------------------------- CFG branches (§5.5)


def test_cfg_branches_keep_separate_residuals():
    gen_in = torch.zeros(N_GEN, DIM)

    def make_full(step, g, branch):
        sign = 1.0 if branch == "cond" else -1.0
        return lambda: g + sign * step

    cache = SeaCache()
    cache.begin(10)
    outs = drive(cache, latents_with_distances([0.05] * 9, 10), branches=("cond", "uncond"),
                 gen_in=gen_in, make_full=make_full)
    rec = cache.record()
    assert rec.sequence("cond") == rec.sequence("uncond") == "FSSFSSFSSF"
    for step in range(3, 10):
        torch.testing.assert_close(outs[(step, "cond")], gen_in + step)
        torch.testing.assert_close(outs[(step, "uncond")], gen_in - step)


def test_indicator_is_computed_once_per_step_and_shared():
    class CountingFilter(SeaFilter):
        calls = 0

        def indicator(self, latent, sigma):
            CountingFilter.calls += 1
            return super().indicator(latent, sigma)

    cache = SeaCache(sea_filter=CountingFilter())
    cache.begin(10)
    drive(cache, latents_with_distances([0.05] * 9, 10), branches=("cond", "uncond"))
    assert CountingFilter.calls == 10


def test_branch_state_is_independent_when_one_branch_is_forced():
    cache = SeaCache(SeaCacheConfig())
    cache.begin(10)
    drive(cache, latents_with_distances([0.05] * 9, 10), branches=("cond", "uncond"),
          force=lambda step, branch: branch == "uncond")
    rec = cache.record()
    assert rec.sequence("cond") == "FSSFSSFSSF"
    # uncond: step 0 has no history (fail-open); steps 1-2 skip by the gate (the force on them is no forced
    # skip); from step 3 on the cap (and at step 9 the cache end) wants a refresh and the force overrides it.
    assert rec.sequence("uncond") == "FSSSSSSSSS"
    assert [d.reason for d in rec.decisions if d.branch == "uncond"][:4] == ["no_history", "gate", "gate", "forced"]
    assert rec.branches["uncond"].forced_skip == 7
    assert rec.branches["uncond"].fail_open_reasons == {"no_history": 1}
    assert rec.branches["cond"].forced_skip == 0


# ---------------------------------------------------------------- reset (§5.6)


def test_second_request_starts_fresh():
    lat = latents_with_distances([0.05] * 9, 10)
    cache = SeaCache()
    cache.begin(10)
    drive(cache, lat, make_full=residual_full(sign=5.0))
    first = cache.record()
    cache.begin(10)
    gen_in = torch.zeros(N_GEN, DIM)
    outs = drive(cache, lat, gen_in=gen_in)
    second = cache.record()
    assert first is not second and len(second.decisions) == 10
    assert second.sequence("cond") == "FSSFSSFSSF"
    # Residuals leaked from request 1 (5 * step) would show up in the skips.
    torch.testing.assert_close(outs[(1, "cond")], gen_in)
    torch.testing.assert_close(outs[(4, "cond")], gen_in + 4.0)


# ---------------------------------------------------------------- fail-open (§5.7)


def test_no_noisy_vision_never_skips():
    cache = SeaCache(SeaCacheConfig(threshold=100.0))
    cache.begin(6)
    with torch.no_grad():
        for s in range(6):
            g = torch.zeros(N_GEN, DIM)
            run_stack(cache, s, "cond", 0.5, [], g, lambda g=g, s=s: g + s)
    rec = cache.record()
    assert rec.sequence("cond") == "FFFFFF"
    assert rec.branches["cond"].fail_open_reasons == {"no_noisy_vision": 4}


def test_only_a_nonfinite_indicator_is_logged_as_a_warning_and_once(caplog, monkeypatch):
    # A fail-open from a request's shape (every warmup runs one) stays in the records and at debug level.
    monkeypatch.setattr(seacache, "_WARNED_FAIL_OPENS", set())
    caplog.set_level(logging.DEBUG, logger="policy_server.cache.seacache")
    bad = latents_with_distances([0.05] * 5, 6)
    bad[3] = torch.full_like(bad[3], float("nan"))
    for noisy_vision in ([], bad, bad):
        cache = SeaCache(SeaCacheConfig(threshold=100.0))
        cache.begin(6)
        with torch.no_grad():
            for s in range(6):
                g = torch.zeros(N_GEN, DIM)
                run_stack(cache, s, "cond", 0.5, [noisy_vision[s]] if noisy_vision else [], g, lambda g=g: g)
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "fail-open: nonfinite_distance" in warnings[0]
    assert "no_noisy_vision" in caplog.text  # at debug level


def test_branch_that_starts_late_gates_from_its_second_step():
    # The guidance interval can start the uncond pass after step 0: its first call has nothing to compare.
    lat = latents_with_distances([0.05] * 9, 10)
    cache = SeaCache()
    cache.begin(10)
    with torch.no_grad():
        for s in range(10):
            for b in ("cond", "uncond") if s >= 3 else ("cond",):
                g = torch.zeros(N_GEN, DIM)
                run_stack(cache, s, b, 0.5, [lat[s]], g, lambda g=g, s=s: g + s)
    rec = cache.record()
    assert rec.sequence("cond") == "FSSFSSFSSF"
    assert rec.sequence("uncond") == "FSSFSSF"
    assert rec.branches["uncond"].fail_open_reasons == {"no_previous_indicator": 1}


# ---------------------------------------------------------------- forced skips


def test_force_skip_overrides_gate_full_when_history_exists():
    # The deadline guard's wiring: ask for a forced skip only when the gate chose FULL.
    lat = latents_with_distances([0.5] * 5, 6)  # the gate wants FULL every step
    cache = SeaCache(SeaCacheConfig())
    cache.begin(6)
    gates, decisions = [], []
    with torch.no_grad():
        for step in range(6):
            gen_in = torch.zeros(N_GEN, DIM)
            gate = cache.gate(step, "cond", 0.5, [lat[step]])
            gates.append(gate)
            out, decision = apply(cache, gate, gen_in, lambda g=gen_in, s=step: g + s,
                                        force_skip=gate.full and step in (0, 2, 3))
            decisions.append(decision)
            # A forced skip extrapolates the stored residuals (order 1 through steps 0 and 1: exactly the step).
            torch.testing.assert_close(out, gen_in + step)
    assert all(g.full for g in gates)
    assert [g.full_reason for g in gates] == ["retention", "threshold", "threshold", "threshold", "cap", "cache_end"]
    rec = cache.record()
    assert rec.sequence("cond") == "FFSSFF"
    reasons = [d.reason for d in rec.decisions]
    assert reasons == ["no_history", "threshold", "forced", "forced", "cap", "cache_end"]
    assert [d.forced for d in decisions] == [False, False, True, True, False, False]
    assert decisions[0].full and decisions[0].fail_open  # forced without a residual: runs FULL
    counts = rec.branches["cond"]
    assert (counts.forced_skip, counts.skipped, counts.fail_open) == (2, 2, 1)


def test_skip_and_ran_record_the_decision_of_every_call():
    cache = SeaCache()
    cache.begin(4)
    lat = latents_with_distances([0.05] * 3, 4)
    seen = []
    with torch.no_grad():
        for step in range(4):
            for branch in ("cond", "uncond"):
                gen_in = torch.zeros(N_GEN, DIM)
                gate = cache.gate(step, branch, 0.5, [lat[step]])
                assert len(cache.record().decisions) == len(seen)  # gating records nothing
                _, decision = apply(cache, gate, gen_in, lambda g=gen_in: g + 1.0)
                assert (decision.step, decision.branch, decision.full) == (step, branch, gate.full)
                assert decision.reason == (gate.full_reason if gate.full else "gate")
                seen.append(decision)
    assert [(d.step, d.branch) for d in seen] == [(s, b) for s in range(4) for b in ("cond", "uncond")]
    assert seen == cache.record().decisions
    assert all(a is b for a, b in zip(seen, cache.record().decisions, strict=True))


def test_run_stack_is_gate_then_skip_or_ran():
    lat = latents_with_distances([0.05] * 9, 10)
    by_run, by_parts = SeaCache(), SeaCache()
    by_run.begin(10)
    by_parts.begin(10)
    outs_run = drive(by_run, lat, branches=("cond", "uncond"))
    outs_parts = drive(by_parts, lat, branches=("cond", "uncond"), force=lambda step, branch: False)
    assert by_run.record().sequence("cond") == "FSSFSSFSSF"
    assert by_run.record().decisions == by_parts.record().decisions
    for key, out in outs_run.items():
        assert torch.equal(out, outs_parts[key])


# ---------------------------------------------------------------- the record


def test_record_counts_and_sequences_per_branch():
    cache = SeaCache()
    cache.begin(4)
    drive(cache, latents_with_distances([0.05] * 3, 4), branches=("cond", "uncond"))
    rec = cache.record()
    assert {b: rec.sequence(b) for b in rec.branches} == {"cond": "FSSF", "uncond": "FSSF"}
    for branch in ("cond", "uncond"):
        counts = rec.branches[branch]
        assert (counts.full, counts.skipped, counts.forced_skip, counts.fail_open) == (2, 2, 0, 0)
        assert [d.reason for d in rec.decisions if d.branch == branch and d.full] == ["retention", "cache_end"]
    assert (rec.full_calls, rec.skipped_calls, rec.forced_skips) == (4, 4, 0)
    assert len(rec.decisions) == 8 and rec.num_steps == 4
    assert rec.thresholds == (0.25,) * 4 and rec.max_consecutive_cached == 2


def test_runs_under_inference_mode():
    with torch.inference_mode():
        lat = latents_with_distances([0.05] * 9, 10)
        cache = SeaCache()
        cache.begin(10)
        drive(cache, lat, branches=("cond", "uncond"))
    assert cache.record().sequence("uncond") == "FSSFSSFSSF"
