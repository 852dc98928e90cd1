"""Calibration: a quality profile measured on a tiny model, its observations file, the command that writes it,
and an engine that plans its ticks on it (loaded, or measured at warmup)."""

import hashlib
import json
import logging
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from safetensors.numpy import save_file

from policy_server.budget.cost_model import CallCosts
from policy_server.budget.planner import expected_error
from policy_server.budget.profile import PROFILE_FILE, ProfileError, QualityProfile, frontier
from policy_server.cache.sea_filter import SeaFilter
from policy_server.engine import api
from policy_server.engine.calibration import (
    CUT_FRACTIONS,
    DEFAULT_OBSERVATIONS,
    CalibrationError,
    CalibrationTick,
    Observation,
    TickRunner,
    cache_dir,
    calibrate,
    configurations,
    default_config,
    load_observations,
    main,
    observations_source,
    resolve_profile,
    run_cut,
    save_observations,
)
from policy_server.engine.engine import ModelEngine
from policy_server.engine.served import EngineSettings
from policy_server.pipeline.embodiments import Embodiment
from policy_server.pipeline.policy import PolicyPipeline, default_model_path
from robots import calibration_set
from robots.embedded import build_random_pipeline

STEPS = 6


def _short(pipe):
    """`pipe` at STEPS sampler steps: the configuration space of a quick calibration."""
    config = pipe.config.model_validate({**pipe.config.model_dump(), "num_steps": STEPS})
    return PolicyPipeline(pipe.transformer, pipe.vae, pipe.tokenizer, pipe.embodiments, config,
                          pipe.served_embodiments, pipe.digest)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    return _short(build_random_pipeline(tmp_path_factory.mktemp("calibration"), seed=4))


@pytest.fixture(scope="module")
def observations(pipe):
    return load_observations(DEFAULT_OBSERVATIONS, pipe)[:2]


@pytest.fixture(scope="module")
def profile(pipe, observations):
    return calibrate(pipe, observations, configurations(pipe, EngineSettings()), source="test")


def test_the_space_spans_steps_cfg_schedules_and_cache_settings(pipe):
    configs = configurations(pipe, EngineSettings())
    assert sorted({c.num_steps for c in configs}) == [2, 3, 4, 6]
    assert {c.cfg_steps for c in configs if c.num_steps == 6} == {6, 3, 1}
    assert {(c.threshold, c.cap) for c in configs if c.num_steps == 2} == {(0.0, 0)}  # nothing to skip
    assert len({(c.threshold, c.cap) for c in configs if c.num_steps == 6}) == 7  # uncached + the ladder
    assert len(set(configs)) == len(configs)
    assert {c.residual_order for c in configurations(pipe, EngineSettings(), residual_orders=(1, 2))} == {1, 2}
    assert not any(c.threshold for c in configurations(pipe, EngineSettings(diffusion_cache=False)))
    coarse = configurations(pipe, EngineSettings(), coarse=True)  # the warmup's bounded grid
    assert set(coarse) < set(configs) and len(coarse) < len(configs) / 2
    assert coarse[0] == configs[0]  # the uncached default, the reference, is always measured
    assert min(c.num_steps for c in coarse) == min(c.num_steps for c in configs)  # the same floor
    assert (1e6, 0) in {(c.threshold, c.cap) for c in coarse}  # maximal caching


def test_calibration_measures_every_configuration_against_the_uncached_default(pipe, profile):
    assert profile.digest == pipe.digest and profile.calibration.observations == 2
    assert [p.config for p in profile.embodiments["pusht"]] == configurations(pipe, EngineSettings())
    points = frontier(profile.embodiments["pusht"])
    best = points[0]
    assert best.config == profile.default and best.error == 0.0 and best.pairs == STEPS  # the reference itself
    assert not any(p.dominates(q) for p in points for q in points)
    assert any(p.config.num_steps < STEPS for p in points) and any(p.config.threshold > 0 for p in points)
    assert all(p.error_p90 >= 0 and p.full_calls + 2 * p.pairs + p.skipped_calls > 0 for p in points)


def test_an_observation_is_encoded_and_prefilled_once_a_pass_not_once_a_tick(pipe, observations, monkeypatch):
    calls = Counter()

    def counted(name, method):
        def call(*args, **kwargs):
            calls[name] += 1
            return method(*args, **kwargs)
        return call

    monkeypatch.setattr(pipe.vae, "encode", counted("encode", pipe.vae.encode))
    monkeypatch.setattr(pipe, "encode_prompt", counted("prefill", pipe.encode_prompt))
    calibrate(pipe, observations, configurations(pipe, EngineSettings(), coarse=True)[:4], source="test")
    assert calls == {"encode": 4, "prefill": 4}  # once per observation and pass, not per tick


def test_frontier_points_are_also_measured_on_slow_ticks(pipe, profile, observations):
    points = profile.embodiments["pusht"]
    on_frontier = {p.config for p in frontier(points)}
    for point in points:  # two steps have no call between the first and the last to cut
        cut = point.config in on_frontier and point.config.num_steps > 2
        assert tuple(c.fraction for c in point.cuts) == (CUT_FRACTIONS if cut else ())
    # A slow tick on the simulated clock: planned to fit, its calls 1 / 0.6 times slower, the guard holds it.
    costs = CallCosts(full_ms=10.0, skip_ms=1.0, pair_ms=15.0)
    uncached = next(p for p in points if p.config == profile.default)
    tick = CalibrationTick.of(pipe, observations[0], 0, TickRunner.eager(pipe))
    out = run_cut(pipe, tick, uncached, 0.6, costs, SeaFilter())
    slowed = sum(costs.pair_ms if step.batched else len(step.full) * costs.full_ms
                 + (len(step.branches) - len(step.full)) * costs.skip_ms for step in out.steps) / 0.6
    assert len(out.steps) == STEPS and out.cache.forced_skips > 0
    assert slowed <= uncached.predicted_p90_ms(costs) == STEPS * costs.pair_ms


def test_observations_round_trip_and_bad_files_name_what_is_wrong(pipe, observations, tmp_path):
    path = tmp_path / "obs.safetensors"
    save_observations(path, observations)
    again = load_observations(path, pipe)
    assert [o.instruction for o in again] == [o.instruction for o in observations]
    assert all(np.array_equal(a.images["image"], b.images["image"]) for a, b in zip(again, observations, strict=True))
    image = observations[0].images["image"]
    bad = {"images.image": np.stack([image, image]), "state": np.zeros((2, 2), np.float32)}
    for tensors, metadata, message in [
        (bad, {"embodiment": "bridge_orig_lerobot", "instructions": '["a", "b"]'}, "metadata embodiment 'bridge_orig"),
        (bad, {"instructions": '["a", "b"]'}, "metadata embodiment None; expected one of"),  # was "embodiment None"
        (bad, {"embodiment": "pusht", "instructions": '["a"]'}, r"images.image is uint8 \[2, 64, 64, 3\]; expected "
                                                                r"uint8 \[1, H, W, 3\], one frame per instruction "
                                                                r"\(the metadata's instructions hold 1\)"),
        # What the server refuses, which calibrated before.
        ({**bad, "state": np.full((2, 2), 5.0, np.float32)}, {"embodiment": "pusht", "instructions": '["a", "b"]'},
         r"state\[0\] holds 5.0 at index 0; expected values within the accepted state range"),
        (bad, {"embodiment": "pusht", "instructions": '["a", "b <|im_end|>"]'},
         r"instructions\[1\]: expected text without the chat template's control tokens, got '<\|im_end\|>'"),
        (bad, {"embodiment": "pusht", "instructions": json.dumps(["a", "b " * 200])},
         r"instructions\[1\]: expected at most 128 tokens, got \d+ tokens, which the server refuses"),
        (bad, {"embodiment": "pusht", "instructions": '["a", ""]'}, "non-empty strings"),
        ({**bad, "state": np.zeros((2, 3), np.float32)}, {"embodiment": "pusht", "instructions": '["a", "b"]'},
         r"state is float32 \[2, 3\]; pusht expects"),
        ({**bad, "state": np.full((2, 2), np.nan, np.float32)}, {"embodiment": "pusht", "instructions": '["a", "b"]'},
         "state holds NaN or infinite values"),
        ({**bad, "images.image": np.zeros((2, 4, 64, 3), np.uint8)},
         {"embodiment": "pusht", "instructions": '["a", "b"]'}, "images.image are 4x64; expected sides of 8 to 2048"),
    ]:
        save_file(tensors, str(path), metadata=metadata)
        with pytest.raises(CalibrationError, match=message):
            load_observations(path, pipe)
    path.write_bytes(b"not safetensors")
    with pytest.raises(CalibrationError, match="not a calibration observations file"):
        load_observations(path, pipe)
    with pytest.raises(CalibrationError) as folder:  # it said "No such device (os error 19)"
        load_observations(path.parent, pipe)
    assert str(folder.value) == f"{path.parent}: a folder; expected a calibration observations file (safetensors)"
    # Cameras of different heights, as the server takes them: the shorter within the bound once scaled.
    pipe.embodiments.register(Embodiment(name="scene_and_wrist", domain_id=30, raw_action_dim=2, state_dim=2,
                                         cameras=("scene", "wrist")), replace=True)
    metadata = {"embodiment": "scene_and_wrist", "instructions": '["a"]'}
    two = {"images.scene": np.zeros((1, 64, 80, 3), np.uint8), "images.wrist": np.zeros((1, 32, 32, 3), np.uint8),
           "state": np.zeros((1, 2), np.float32)}
    save_file(two, str(path), metadata=metadata)
    assert load_observations(path, pipe, served=False)[0].images["wrist"].shape == (32, 32, 3)
    save_file({**two, "images.scene": np.zeros((1, 1024, 8, 3), np.uint8),
               "images.wrist": np.zeros((1, 8, 32, 3), np.uint8)}, str(path), metadata=metadata)
    with pytest.raises(CalibrationError, match=r"images.wrist are 8x32, 4096 px wide once scaled to the height of "
                                               r"images.scene \(1024 px\) to sit beside them; expected at most 2048"):
        load_observations(path, pipe, served=False)


def test_the_calibration_set_rebuilds_the_shipped_file_byte_for_byte(tmp_path):
    """`python -m robots.calibration_set` writes the shipped set's bytes every time, so the digest the shipped profile
    names holds for a rebuild. safetensors writes the metadata's two keys in an order that changes from call to call:
    a rebuild had one of two digests, the shipped one half the time."""
    shipped = hashlib.sha256(DEFAULT_OBSERVATIONS.read_bytes()).hexdigest()
    out = tmp_path / "reach_either.safetensors"
    for _ in range(8):
        assert calibration_set.main(["--out", str(out)]) == 0
        assert hashlib.sha256(out.read_bytes()).hexdigest() == shipped


def test_the_server_finds_a_profile_beside_the_checkpoint_else_calibrates(pipe, profile, tmp_path, monkeypatch,
                                                                          caplog):
    caplog.set_level(logging.INFO, logger="policy_server.engine.calibration")
    monkeypatch.setenv("POLICY_SERVER_CACHE", str(tmp_path / "cache"))
    assert resolve_profile("off", tmp_path, pipe.digest, pipe.served_embodiments, pipe.config) == (None, False)
    assert resolve_profile("auto", tmp_path, pipe.digest, pipe.served_embodiments, pipe.config) == (None, True)
    profile.save(tmp_path / PROFILE_FILE)
    assert resolve_profile("auto", tmp_path, pipe.digest, pipe.served_embodiments, pipe.config) == (profile, False)
    assert caplog.messages[-1] == f"planning ticks on the quality profile {tmp_path / PROFILE_FILE} (calibrated on " \
                                  f"{profile.calibration.observations} observations of {profile.calibration.source})"
    assert resolve_profile(str(tmp_path / PROFILE_FILE), None, pipe.digest, pipe.served_embodiments, pipe.config) == \
        (profile, False)
    with pytest.raises(ProfileError, match="no configurations for aloha .it has pusht.; calibrate the served"):
        resolve_profile("auto", tmp_path, pipe.digest, ["pusht", "aloha"], pipe.config)


@pytest.mark.parametrize("change,checkpoint", [({"num_steps": 2 * STEPS}, f"{2 * STEPS}, {2 * STEPS} guided"),
                                               ({"guidance": 1.0}, f"{STEPS}, 0 guided")],
                         ids=["steps", "guidance"])
def test_a_profile_whose_default_is_not_the_checkpoints_tick_is_refused(pipe, profile, tmp_path, change, checkpoint):
    """The digest covers the weights, not policy.json: a profile measured before its sampler settings changed
    describes other ticks, its errors measured against another reference."""
    path = tmp_path / PROFILE_FILE
    profile.save(path)
    assert pipe.config.guidance != 1.0 and profile.default.cfg_steps == STEPS
    with pytest.raises(ProfileError) as info:
        resolve_profile(str(path), None, pipe.digest, pipe.served_embodiments, pipe.config.model_copy(update=change))
    assert str(info.value).startswith(f"{path}: its default configuration has {STEPS} sampler steps, {STEPS} of them "
                                      f"guided; the checkpoint's {checkpoint}; recalibrate with `policy-server "
                                      "calibrate`")


def test_the_command_calibrates_every_served_embodiment_so_the_server_takes_the_profile(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("POLICY_SERVER_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    build_random_pipeline(folder, seed=5)
    policy = json.loads((folder / "policy.json").read_text())
    (folder / "policy.json").write_text(json.dumps({**policy, "num_steps": 2}))  # a quick space
    embodiments = json.loads((folder / "embodiments.json").read_text())
    arm = {"name": "two_camera_arm", "domain_id": 30, "raw_action_dim": 2, "state_dim": 2,
           "cameras": ["front", "wrist"]}
    (folder / "embodiments.json").write_text(json.dumps({"embodiments": [*embodiments["embodiments"], arm]}))
    assert main(["--checkpoint", str(folder), "--max-observations", "1", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "no observations of two_camera_arm: calibrating on the embedded simulator's frames" in printed
    pipeline = PolicyPipeline.from_pretrained(folder)
    profile, calibrate_at_warmup = resolve_profile("auto", folder, pipeline.digest, pipeline.served_embodiments,
                                                   pipeline.config)
    assert set(profile.embodiments) == {"pusht", "two_camera_arm"} and not calibrate_at_warmup
    # It said "pusht: the embedded set, two_camera_arm: the embedded set": not which data, so two profiles could not
    # be told apart by it. The embedded set by name and content, as a file given is and the shipped profile says.
    embedded = observations_source(DEFAULT_OBSERVATIONS)
    assert embedded.startswith("reach_either.safetensors (sha256:")
    assert profile.calibration.source == f"{embedded}, two_camera_arm: {embedded} (resized, zero state)"


def test_a_one_step_checkpoint_calibrates_its_own_tick_and_no_slower_one(tmp_path, capsys, monkeypatch):
    """The space was floored at 2 steps, `--min-steps`' default: a 1-step checkpoint's profile (the warmup's too) held
    only 2-step ticks, twice its own cost, and not its default; the command refused it over a flag not given."""
    monkeypatch.setenv("POLICY_SERVER_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    pipeline = build_random_pipeline(folder, seed=5)
    policy = json.loads((folder / "policy.json").read_text())
    (folder / "policy.json").write_text(json.dumps({**policy, "num_steps": 1}))
    one = PolicyPipeline.from_pretrained(folder)
    for coarse in (False, True):
        configs = configurations(one, EngineSettings(), coarse=coarse)
        assert configs[0] == default_config(one.config, 1) and {c.num_steps for c in configs} == {1}
    assert main(["--checkpoint", str(folder), "--max-observations", "1", "--device", "cpu"]) == 0
    profile = QualityProfile.load(folder / PROFILE_FILE, pipeline.digest)
    assert {p.config.num_steps for p in profile.embodiments["pusht"]} == {1}
    with pytest.raises(SystemExit):  # asked for: still refused, by name
        main(["--checkpoint", str(folder), "--min-steps", "2"])
    assert "--min-steps 2: above the checkpoint's 1 sampler steps" in capsys.readouterr().err


def test_a_profile_write_cut_short_leaves_the_profile_that_was_there(tmp_path, monkeypatch):
    """`calibrate` wrote the profile in place: a write cut short (here a file size limit, as a full disk) left a
    truncated profile beside the checkpoint, which stopped the server's next start ("not valid JSON"). It writes
    beside it and renames, so the old profile stays whole, and says so in one line."""
    monkeypatch.setenv("POLICY_SERVER_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    pipeline = build_random_pipeline(folder, seed=5)
    policy = json.loads((folder / "policy.json").read_text())
    (folder / "policy.json").write_text(json.dumps({**policy, "num_steps": 2}))  # a quick space
    args = ["--checkpoint", str(folder), "--max-observations", "1", "--device", "cpu"]
    assert main(args) == 0
    before = (folder / PROFILE_FILE).read_bytes()
    assert len(before) > 1024
    limited = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024)); "
               "from policy_server.engine.calibration import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", limited, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (f"policy-server calibrate: cannot write {folder / PROFILE_FILE}: "
                                                    "File too large; the profile there is unchanged")
    assert (folder / PROFILE_FILE).read_bytes() == before
    QualityProfile.load(folder / PROFILE_FILE, pipeline.digest)
    assert sorted(p.name for p in folder.iterdir() if "partial" in p.name) == []


def test_the_command_writes_the_profile_beside_the_checkpoint(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("POLICY_SERVER_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    pipeline = build_random_pipeline(folder, seed=5)
    policy = json.loads((folder / "policy.json").read_text())
    (folder / "policy.json").write_text(json.dumps({**policy, "num_steps": 3}))  # a quick space
    observations = tmp_path / "obs.safetensors"
    save_observations(observations, [Observation("pusht", {"image": np.full((64, 64, 3), 90, np.uint8)},
                                                 np.array([0.3, 0.4], np.float32), "reach the blue circle")])
    elsewhere = ["--checkpoint", str(folder), "--observations", str(observations), "--out", str(tmp_path / "p.json")]
    assert main(elsewhere) == 0  # where `auto` does not look, which the command says
    assert "`--quality-profile auto` looks beside the checkpoint and in the cache, not there" in capsys.readouterr().out
    assert main(["--checkpoint", str(folder), "--observations", str(observations), "--device", "cpu"]) == 0
    written = QualityProfile.load(folder / PROFILE_FILE, pipeline.digest)
    # The observations by name and content, not by this machine's path (the profile goes to other machines, and
    # GetServerInfo shows its source to every client).
    digest = hashlib.sha256(observations.read_bytes()).hexdigest()
    assert written.calibration.source == f"obs.safetensors (sha256:{digest})" and written.embodiments["pusht"]
    assert str(tmp_path) not in (folder / PROFILE_FILE).read_text()
    printed = capsys.readouterr().out
    assert "wrote" in printed and "--quality-profile auto" not in printed  # it finds this one
    assert main(elsewhere) == 0
    printed = capsys.readouterr().out
    assert f"`--quality-profile auto` finds {folder / PROFILE_FILE} first" in printed
    assert f"replaced {tmp_path / 'p.json'}" in printed  # the first run wrote it
    assert main(["--checkpoint", str(folder), "--observations", str(tmp_path / "missing")]) == 2
    assert "not a calibration observations file" in capsys.readouterr().err
    for bad, message in ((["--residual-orders", "1,3"], "--residual-orders '1,3': expected"),
                         (["--residual-orders", "one"], "--residual-orders 'one': expected"),
                         (["--residual-orders", ""], "--residual-orders '': expected"),  # it ran the default ones
                         (["--min-steps", "0"], "--min-steps must be at least 1, got 0\n"),
                         (["--max-observations", "-1"], "--max-observations must be at least 1, got -1\n"),
                         (["--min-steps", "4"], "--min-steps 4: above the checkpoint's 3 sampler steps"),
                         (["--device", "tpu"], "--device 'tpu': expected auto, cpu, cuda or cuda:N"),
                         (["--out", str(tmp_path)], "is a folder; expected a file path")):
        with pytest.raises(SystemExit):
            main(["--checkpoint", str(folder), *bad])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "use at most this many per embodiment (1024, as many as a file holds)" in " ".join(
        capsys.readouterr().out.split())  # it gave no default


def test_a_cache_directory_the_profile_cannot_go_to_is_refused_before_calibrating(tmp_path, capsys, monkeypatch):
    """It was found when the profile was written, after the whole calibration (30 minutes for the embedded model's
    set), as a NotADirectoryError traceback."""
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("POLICY_SERVER_CACHE", str(tmp_path / "a_file"))
    monkeypatch.setattr("policy_server.engine.calibration.calibrate",
                        lambda *args, **kwargs: pytest.fail("calibrated before checking where the profile goes"))
    assert main(["--max-observations", "1", "--min-steps", "20", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"policy-server calibrate: cannot write {tmp_path / 'a_file' / 'profiles'}/"
                   f"{PolicyPipeline.from_pretrained(None).digest.removeprefix('sha256:')}.json: Not a directory "
                   "(the cache directory: $POLICY_SERVER_CACHE, else $XDG_CACHE_HOME/policy-server); pass --out FILE")


def test_the_cache_directory_ignores_an_empty_or_relative_xdg_cache_home(tmp_path, monkeypatch):
    """An empty $XDG_CACHE_HOME (or $POLICY_SERVER_CACHE) put profiles under the working folder; the XDG spec says to
    ignore an empty or relative value."""
    monkeypatch.delenv("POLICY_SERVER_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    for xdg in ("", "relative/cache"):
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        assert cache_dir() == tmp_path / ".cache" / "policy-server"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "policy-server"
    monkeypatch.setenv("POLICY_SERVER_CACHE", "")
    assert cache_dir() == tmp_path / "xdg" / "policy-server"
    monkeypatch.setenv("POLICY_SERVER_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def _observation(step=0):
    rng = np.random.default_rng(step)
    return api.Observation(images={"image": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)},
                           state=np.array([0.2, 0.3], np.float32), step_index=step)


def test_an_engine_plans_its_ticks_on_the_profile(pipe, profile):
    engine = ModelEngine(pipe, EngineSettings(warmup_ticks=1, quality_profile=profile, default_budget_ms=10_000.0))
    engine.start()
    try:
        assert engine.wait_ready(timeout_s=300)
        points = engine.served.frontier("pusht")
        assert points == frontier(profile.embodiments["pusht"])
        session = engine.open_session("pusht", "reach the red circle", rate_hz=0)
        tick = engine.act(session.session_id, 1, _observation()).tick
        assert tick.setting == points[0].config.name and tick.knobs["expected_error"] == 0.0  # uncached fits
        engine.close_session(session.session_id)

        session = engine.open_session("pusht", "reach the red circle", rate_hz=0)
        # What this session's first tick is planned with: its prefill, no preview decode, the frontier's margin,
        # and how much slower than expected the worker's recent ticks ran.
        costs = engine.served.cost_model.costs(engine.sessions.get(session.session_id).cost_key).without("preview")
        costs = costs.cautious(engine.served.budget.config.frontier_cost_margin_devs)
        slowdowns = engine.served.budget.slowdowns
        assert slowdowns  # the warmup ticks taught them
        # Halfway between the cheapest point and uncached at this instruction's costs (admission sizes the session
        # at the longest instruction, whose uncached tick is dearer), or the least budget admission takes: its
        # floor after the longest background piece a tick may wait for.
        demand = engine.sessions.get(session.session_id).demand
        predicted = [p.predicted_p90_ms(costs) for p in points]
        budget = max(demand.floor_ms + engine._admission.blocking_ms(), (min(predicted) + predicted[0]) / 2)
        engine.set_budget(session.session_id, budget)
        tick = engine.act(session.session_id, 1, _observation(1)).tick
        # The least expected error that fits the time it had (the budget less its queue wait, or the slot
        # admission reserved when smaller), priced over the recent slowdowns.
        planned_in = min(budget - tick.actual_ms["queue"], tick.knobs["slot_ms"])
        errors = {i: expected_error(p, (planned_in - costs.fixed_total_ms) / (predicted[i] - costs.fixed_total_ms),
                                    slowdowns) for i, p in enumerate(points) if predicted[i] <= planned_in}
        best = min(errors, key=lambda i: (errors[i], predicted[i]))
        chosen = points[best]
        assert tick.setting == chosen.config.name and tick.knobs["expected_error"] == pytest.approx(errors[best])
        assert errors[best] > 0 and predicted[best] <= planned_in
        assert tick.predicted_ms["total"] == pytest.approx(predicted[best])
        # A tick running late on a loaded machine is finished early by the guard; its fallback names the planned steps.
        late = [f for f in tick.fallbacks if f.startswith("late_finish_at_step=")]
        planned_steps = int(late[0].split("/")[1]) if late else tick.knobs["num_steps"]
        assert planned_steps == chosen.config.num_steps and tick.knobs["cfg_steps"] == chosen.config.cfg_steps
    finally:
        engine.close()


def test_without_a_profile_the_engine_calibrates_at_warmup(pipe):
    engine = ModelEngine(pipe, EngineSettings(warmup_ticks=1, calibrate_at_warmup=True))
    engine.start()
    try:
        assert engine.wait_ready(timeout_s=600)
        measured = engine.served.profile
        assert measured is not None and measured.calibration.source == "warmup (bounded)"
        assert measured.digest == pipe.digest and measured.embodiments["pusht"]
    finally:
        engine.close()


def test_the_server_refuses_a_profile_of_other_weights(profile, tmp_path, capsys):
    from policy_server import cli

    path = tmp_path / "other.json"
    profile.save(path)  # measured on the tiny random model, not the embedded one the server loads
    assert cli.main(["--quality-profile", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "not these" in err and "recalibrate with `policy-server calibrate`" in err


def test_the_shipped_profile_names_its_calibration_set_as_calibrate_does():
    """It named /work/main/policy_server/assets/calibration/..., the path on the machine that calibrated it: every
    server's log and `ServerInfo.model.quality_profile` showed a path that is on no robot. It names the shipped set
    by file name and content, as `policy-server calibrate` now writes a source."""
    source = json.loads((default_model_path() / PROFILE_FILE).read_text())["calibration"]["source"]
    assert source == observations_source(DEFAULT_OBSERVATIONS)
