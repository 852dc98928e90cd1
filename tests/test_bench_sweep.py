"""The bench's comparison rules on hand-made figures: which configurations the controller is held against; and what its
report's `forward` holds without diffusers' reference."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from policy_server.benchmarks import forward
from policy_server.budget.guard import LATE_DROP_UNCOND
from policy_server.budget.profile import ProfilePoint, TickConfig
from policy_server.pipeline.policy import PolicyPipeline
from robots.bench import ConfigRun, family_members, forward_summary, paired_difference, sweep


def summary(name, error, p50, p99=None, budget=None, family=None, guarded=None, miss=0.0):
    return {"name": name, "action_rel_l2": error, "p50_ms": p50, "p99_ms": p99 or p50, "budget_ms": budget,
            "family": family, "guarded": guarded, "miss_rate": None if budget is None else miss,
            "utilisation": None if budget is None else p50 / budget}


def test_sweep_holds_the_controller_to_guarded_families_that_hold_and_unguarded_ones_that_fit_and_to_eager():
    summaries = [
        summary("uncached", 0.0, 99.0),  # the reference: never a candidate, though its p50 fits at 100
        summary("seacache_default", 0.02, 80.0, family="seacache"),
        summary("max_caching", 0.3, 40.0, family="seacache"),
        summary("budget_100", 0.01, 90.0, 99.0, 100, "controller", True),
        summary("budget_100_eager", 0.012, 92.0, 99.0, 100, "controller_eager", True),  # compared, never a pick
        summary("guarded_fewer_steps_100", 0.015, 90.0, 99.0, 100, "fewer_steps", True),
        summary("guarded_seacache_100", 0.005, 95.0, 120.0, 100, "seacache", True, miss=0.02),  # misses: not held
        summary("fewer_steps_100", 0.008, 101.0, 130.0, 100, "fewer_steps", False, miss=0.6),  # p50 does not fit
        summary("budget_50", 0.2, 45.0, 49.0, 50, "controller", True),
        summary("guarded_fewer_steps_50", 0.25, 45.0, 49.0, 50, "fewer_steps", True),
        summary("fewer_steps_50", 0.22, 48.0, 60.0, 50, "fewer_steps", False, miss=0.3),
    ]
    errors = {s["name"]: [s["action_rel_l2"]] * 3 for s in summaries}  # the same error on each of 3 ticks
    rows = {row["budget_ms"]: row for row in sweep(summaries, [50, 100], 100.0, errors)}
    assert rows[100]["best_guarded"]["name"] == "guarded_fewer_steps_100"
    assert rows[100]["best_unguarded_fitting"]["name"] == "seacache_default"
    assert all(rows[100]["targets"].values())
    lead = rows[100]["paired_difference"]  # controller minus the best of each side, tick by tick
    assert set(lead) == {"guarded_fewer_steps_100", "seacache_default", "budget_100_eager"}
    assert lead["budget_100_eager"]["mean"] == pytest.approx(0.01 - 0.012)  # what the compiled stack buys
    assert rows[100]["eager_controller"]["name"] == "budget_100_eager" and rows[50]["eager_controller"] is None
    assert lead["seacache_default"]["mean"] == pytest.approx(0.01 - 0.02)
    assert lead["seacache_default"]["ci95"] == pytest.approx([0.01 - 0.02] * 2)  # no spread: no doubt
    assert rows[50]["best_unguarded_fitting"]["name"] == "fewer_steps_50"  # its p50 fits though it misses 30%
    assert rows[50]["targets"]["beats_guarded_holding_1pct"] and rows[50]["targets"]["beats_best_unguarded_fitting"]
    summaries[-3]["action_rel_l2"] = 0.3  # budget_50 now loses to the guarded family and to max caching
    targets = sweep(summaries, [50], 100.0, errors)[0]["targets"]
    assert not targets["beats_guarded_holding_1pct"] and not targets["beats_best_unguarded_fitting"]


def point(steps, threshold, cap):
    config = TickConfig(num_steps=steps, cfg_steps=steps, threshold=threshold, cap=cap, residual_order=1)
    return ProfilePoint(config=config, error=0.0, error_p90=0.0, full_calls=0.0, pairs=steps, skipped_calls=0.0,
                        full_calls_p90=0.0, pairs_p90=steps)


def test_fixed_families_are_fewer_steps_the_published_seacache_default_and_both():
    points = (point(20, 0.0, 0), point(15, 0.0, 0), point(20, 0.25, 2), point(15, 0.25, 2), point(20, 0.1, 1))
    families = {name: [p.config.name for p in members] for name, members in family_members(points, 20, True).items()}
    assert families == {"fewer_steps": ["n15-cfg15-nocache"],  # the default's own steps are the reference
                        "seacache": ["n20-cfg20-t0.25-c2-o1"], "fewer_steps_seacache": ["n15-cfg15-t0.25-c2-o1"]}


def test_paired_difference_is_the_mean_gap_with_an_interval_that_widens_with_a_few_flipped_ticks():
    steady = paired_difference([0.12] * 100, [0.10] * 100)
    assert steady["mean"] == pytest.approx(0.02) and steady["ci95"] == pytest.approx([0.02, 0.02])
    # The same mean gap made of two ticks where the controller flipped the mode (+1.0 each): the interval
    # reaches below zero, so this run could not say which side is better.
    flips = paired_difference([1.0, 1.0] + [0.0] * 98, [0.0] * 100)
    assert flips["mean"] == pytest.approx(0.02)
    low, high = flips["ci95"]
    assert low <= 0.0 < 0.02 < high


def tick_output(scale: float, forced_skips: int = 0) -> SimpleNamespace:
    """What `ConfigRun.add` reads of a tick's output: actions `scale` times the reference's, its call counts."""
    cache = SimpleNamespace(full_calls=8, skipped_calls=forced_skips, forced_skips=forced_skips)
    return SimpleNamespace(actions=scale * np.ones((4, 2)), latents=torch.ones(2, 3, 2, 2), cache=cache)


def test_a_tick_is_cut_when_its_guard_forced_a_skip_or_gave_up_part_of_it_late():
    reference = tick_output(1.0)
    run = ConfigRun("guarded", budget_ms=50.0, guarded=True)
    run.add(10.0, tick_output(1.1), reference)  # rel. L2 0.1, as planned
    run.add(10.0, tick_output(1.5, forced_skips=2), reference)  # 0.5, two calls forced to skip
    run.add(10.0, tick_output(1.3), reference, (LATE_DROP_UNCOND,))  # 0.3, uncond given up late
    summary = run.summary()
    assert summary["cut_rate"] == pytest.approx(2 / 3)
    assert summary["action_rel_l2_cut"] == pytest.approx(0.4) and summary["action_rel_l2_uncut"] == pytest.approx(0.1)
    assert summary["action_rel_l2"] == pytest.approx(0.3)


def test_without_the_reference_the_bench_times_our_calls_and_nulls_only_the_references(monkeypatch):
    """--no-reference made the report's whole `forward` null, our own calls' times with it, where only diffusers'
    reference goes unmeasured. Nor is it built: the bench needs no diffusers then."""
    def no_diffusers():
        raise ImportError("no diffusers here")

    monkeypatch.setattr(forward, "_reference_class", no_diffusers)
    pipeline = PolicyPipeline.from_pretrained(None, device="cpu", dtype=torch.float32)  # the embedded model
    summary = forward_summary(pipeline, pipeline.embodiments.get("pusht"), (16, 3, 8, 8),
                              SimpleNamespace(reference=False, forward_repeats=2))
    assert summary["reference_full_ms"] is None and summary["ratio_gen_only_vs_reference"] is None
    assert summary["full_ms"] > 0 and summary["gen_only_ms"] > 0
    assert summary["text_tokens"] > 0 and summary["gen_tokens"] > 0
