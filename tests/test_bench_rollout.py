"""`policy-server bench` and `policy-rollout` at toy size on an untrained embedded-size model: the files
they promise exist and hold the documented keys."""

import importlib
import json
import shutil
import sys
import threading

import numpy as np
import pytest
import torch
from video_checks import assert_browser_playable

from policy_server.budget.profile import PROFILE_FILE
from policy_server.cache.seacache import SeaCache, SeaCacheConfig
from policy_server.engine import api
from policy_server.engine.calibration import calibrate, configurations, warmup_observations
from policy_server.engine.engine import EngineSettings, ModelEngine
from policy_server.pipeline.policy import PolicyPipeline, PolicyRequest, run_steps
from robots import bench
from robots.bench import main as bench_main
from robots.embedded import build_random_pipeline
from robots.rollout import main as rollout_main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The toy model, sampling in 10 steps rather than 20: the bench's engines, configurations and episodes run its
    ticks by the hundred."""
    directory = tmp_path_factory.mktemp("bench-model")
    build_random_pipeline(directory, seed=3)
    policy = directory / "policy.json"
    policy.write_text(json.dumps({**json.loads(policy.read_text()), "num_steps": 10}))
    return directory


def test_bench_writes_the_documented_report(profiled_checkpoint, tmp_path, compiles, capsys):
    """The report's documented keys; and `--quality-profile auto` (the default) plans, as the server, on the profile
    beside the checkpoint, not a new one."""
    checkpoint, profile = profiled_checkpoint
    out = tmp_path / "bench.json"
    # Compiling on (`compiles`), and --no-compile-gen-stack: nothing compiles, the tick profile's compiled variant
    # included (test_compiled_stack.py checks that one).
    assert bench_main(["--checkpoint", str(checkpoint), "--ticks", "4", "--warmup", "2", "--out", str(out),
                       "--no-compile-gen-stack",
                       "--forward-repeats", "2", "--closed-loop", "1",
                       "--env", "PolicyServer/ReachEitherTimed-v0", "--profile-ticks", "1",
                       "--budget-fractions", "0.9", "0.8"]) == 0  # above the floor however loaded CI is
    assert "calibrating" not in capsys.readouterr().err
    assert not (tmp_path / "bench_profile.json").exists()
    report = json.loads(out.read_text())
    # Budgets run tightest first, whatever order they were given in: the slowdown run is at the tightest (it ran at
    # the first given).
    budgets = [row["budget_ms"] for row in report["sweep"]]
    assert budgets == sorted(budgets) and report["slowdown"]["config"] == f"budget_{budgets[0]:g}_slowdown"
    errors = {point.config.name: point.error for point in profile.embodiments["pusht"]}
    fixed = [c for c in report["configs"] if "point" in c]
    assert fixed and all(c["point_error"] == errors[c["point"]] for c in fixed)  # that profile's figures
    assert report["schema"] == 1 and report["infeasible_budgets"] == []
    assert {"device", "torch", "threads", "gpu"} <= set(report["machine"])
    assert {"name", "params", "steps", "cfg", "guidance", "text_tokens", "gen_tokens"} <= set(report["model"])
    assert report["machine"]["peak_rss_mb"] > 0
    assert report["machine"]["peak_cuda_mb"] is report["machine"]["peak_cuda_reserved_mb"] is None  # CPU
    assert report["model"]["dtype"] == "float32"  # --dtype auto on CPU
    assert report["model"]["param_bytes"] == 4 * report["model"]["params"]
    assert report["model"]["latent_shape"] == [16, 3, 8, 8] and report["model"]["canvas_hw"] == [64, 64]
    assert {"full_ms", "gen_only_ms", "reference_full_ms", "ratio_gen_only_vs_reference"} <= set(report["forward"])
    # the step timed is one of the ticks the model section describes (it lacked the state row: 56 against 57)
    assert [report["forward"][k] for k in ("text_tokens", "gen_tokens")] == \
        [report["model"][k] for k in ("text_tokens", "gen_tokens")]
    profile = report["tick_profile"]
    assert profile["matmul_ms"] > 0 and profile["attention_ms"] > 0 and profile["ops_per_tick"] > 0
    assert profile["ticks"] == 1 and profile["wall_vs_arithmetic"] > 0
    assert profile["full_call_ms"] > profile["skipped_call_ms"] > 0  # a skip runs no GEN stack
    assert profile["batched_cfg_call_ms"] > 0  # two calls as one batch (whether slower than one: a figure, not a test)
    assert profile["wall_branches_one_by_one_ms"] > 0
    assert profile["compiled"] is None
    assert report["warmup"]["seconds"] > 0 and report["warmup"]["compiled"] is None  # --no-compile-gen-stack
    names = [c["name"] for c in report["configs"]]
    assert names[:3] == ["uncached", "seacache_default", "max_caching"]
    assert any(n.startswith("fewer_steps_") for n in names)
    assert any(n.startswith("budget_") and n.endswith("_slowdown") for n in names)
    keys = {"p50_ms", "p99_ms", "full_calls", "skipped_calls", "forced_skips", "action_rel_l2", "latent_psnr_db",
            "budget_ms", "miss_rate", "success_rate", "collision_rate", "episode_steps", "cut_rate",
            "action_rel_l2_cut", "action_rel_l2_uncut"}
    for config in report["configs"]:
        assert keys <= set(config)
        cut, uncut = config["action_rel_l2_cut"], config["action_rel_l2_uncut"]
        assert (cut is None) == (config["cut_rate"] == 0) and (uncut is None) == (config["cut_rate"] == 1)
        split = config["cut_rate"] * (cut or 0.0) + (1 - config["cut_rate"]) * (uncut or 0.0)
        assert split == pytest.approx(config["action_rel_l2"])  # the split covers every tick once
    assert report["env_id"] == "PolicyServer/ReachEitherTimed-v0"
    uncached = report["configs"][0]
    assert uncached["action_rel_l2"] == 0.0 and uncached["skipped_calls"] == 0
    by_name = {c["name"]: c for c in report["configs"]}
    budgets = sorted({c["budget_ms"] for c in report["configs"] if c["family"] == "controller"})
    for b in budgets:  # at every budget: the controller, the ladder, each family guarded and not
        families = {(by_name[n]["family"], by_name[n]["guarded"]) for n in by_name if by_name[n]["budget_ms"] == b}
        assert {("controller", True), ("ladder", True)} <= families
        assert {(f, g) for f in ("fewer_steps", "seacache", "fewer_steps_seacache") for g in (True, False)} <= families
        assert by_name[f"budget_{b:g}"]["utilisation"] == by_name[f"budget_{b:g}"]["p50_ms"] / b
        assert by_name[f"guarded_fewer_steps_{b:g}"]["point"].startswith("n")
    for name in ("uncached", "max_caching", f"budget_{budgets[0]:g}", f"guarded_seacache_{budgets[0]:g}"):
        assert by_name[name]["success_rate"] is not None and by_name[name]["episodes"] == 1
        assert 1 <= by_name[name]["episode_steps"] <= 80  # an episode ends on success, collision or its cycle time
        assert 0 <= by_name[name]["collision_rate"] <= 1 - by_name[name]["success_rate"]
    assert by_name[f"seacache_{budgets[0]:g}"]["success_rate"] is None  # no guard: a robot could not run it
    closed = report["closed_loop"]
    assert closed["env_id"] == "PolicyServer/ReachEitherTimed-v0" and closed["episodes"] == 1
    assert closed["controller"]["name"] == f"budget_{budgets[0]:g}"  # the budget nearest half the uncached p50
    assert closed["episode_steps"]["max_caching"] == by_name["max_caching"]["episode_steps"]
    assert closed["collision_rate"]["uncached"] == by_name["uncached"]["collision_rate"]
    assert set(closed["targets"]) == {"uncached_at_least_90pct", "max_caching_loses_10_points",
                                      "controller_within_3_points"}
    assert [row["budget_ms"] for row in report["sweep"]] == budgets
    assert set(report["sweep"][0]["targets"]) == {"miss_rate_at_most_1pct", "p99_within_budget",
                                                  "beats_guarded_holding_1pct", "beats_best_unguarded_fitting"}
    assert (tmp_path / "bench_latency.png").stat().st_size > 0
    assert (tmp_path / "bench_error_vs_latency.png").stat().st_size > 0


@pytest.fixture(scope="module")
def model_profile(model_dir):
    """The toy model's quality profile, measured once for the module's tests on the coarse grid a server's warmup
    calibrates (every family the bench reports has points there)."""
    pipeline = PolicyPipeline.from_pretrained(model_dir)
    return calibrate(pipeline, warmup_observations(pipeline, 1),
                     configurations(pipeline, EngineSettings(), coarse=True), source="test")


@pytest.fixture
def profiled_checkpoint(model_dir, model_profile, tmp_path, monkeypatch):
    """A copy of the toy model with its quality profile beside it (and an empty cache): `(folder, profile)`."""
    monkeypatch.setenv("POLICY_SERVER_CACHE", str(tmp_path / "cache"))
    checkpoint = tmp_path / "model"
    shutil.copytree(model_dir, checkpoint)
    model_profile.save(checkpoint / PROFILE_FILE)
    return checkpoint, model_profile


def test_bench_refuses_a_broken_profile_beside_the_checkpoint(profiled_checkpoint, tmp_path, capsys):
    """A broken profile beside the checkpoint is an error, not a silent recalibration (the bench plans on a good one:
    `test_bench_writes_the_documented_report`)."""
    checkpoint, _ = profiled_checkpoint
    out = tmp_path / "bench.json"
    (checkpoint / PROFILE_FILE).write_text("{}")
    assert bench_main(["--checkpoint", str(checkpoint), "--out", str(out)]) == 2
    assert f"{checkpoint / PROFILE_FILE}: version None" in capsys.readouterr().err


def test_the_slowdown_delays_each_full_call_of_a_bench_pipelines_ticks_and_changes_nothing_else(model_dir,
                                                                                                  monkeypatch):
    pipeline = bench.BenchPipeline.over(PolicyPipeline.from_pretrained(model_dir))
    calls, sleeps = [], []

    def stack(gen, und_kv):
        calls.append(gen.hidden.shape)
        return pipeline.transformer.gen_stack(gen, und_kv)

    def tick():
        request = PolicyRequest(images={"image": np.zeros((64, 64, 3), np.uint8)}, instruction="reach the red circle",
                                embodiment="pusht", state=np.array([0.2, 0.3], np.float32), seed=1)
        control = pipeline.fixed_steps(pipeline.config.num_steps, pipeline.config.guidance, SeaCache(SeaCacheConfig()))
        return run_steps(pipeline.steps(request, None, control), stack)

    expected = tick()
    monkeypatch.setattr(bench.time, "sleep", sleeps.append)
    pipeline.slowdown_ms = 2.5
    calls.clear()
    out = tick()
    assert sleeps == [0.0025] * len(calls) and 0 < len(calls) < pipeline.config.num_steps  # some steps skipped
    assert pipeline.last is out
    np.testing.assert_array_equal(out.actions, expected.actions)


def test_bench_on_a_diffusers_folder_reports_its_shapes(tmp_path, monkeypatch):
    """A `Cosmos3OmniPipeline` folder (overrides: 3 steps, one embodiment; Cosmos3's guidance 1, so no CFG and no
    profile point with fewer steps) driven with camera-sized frames; with no profile stored, calibrated first."""
    monkeypatch.setenv("POLICY_SERVER_CACHE", str(tmp_path / "cache"))
    from cosmos3_folder import build_tiny_cosmos3_folder

    folder = build_tiny_cosmos3_folder(tmp_path / "pipe")
    (folder / "policy.json").write_text(json.dumps({"resolution_tier": 256, "num_steps": 3}))
    (folder / "embodiments.json").write_text(json.dumps(
        {"embodiments": [{"name": "bridge_orig_lerobot", "default_chunk_size": 8, "max_chunk_size": 8}]}))
    out = tmp_path / "bench.json"
    assert bench_main(["--checkpoint", str(folder), "--frame-size", "240x320", "--ticks", "2", "--warmup", "2",
                       "--out", str(out), "--no-reference", "--profile-ticks", "1", "--calibration-observations", "1",
                       "--budgets-ms", "20000"]) == 0
    assert (tmp_path / "bench_profile.json").is_file()  # where the bench writes the profile it calibrated
    report = json.loads(out.read_text())
    assert [c["budget_ms"] for c in report["configs"] if c["name"].startswith("budget_")] == [20000, 20000]
    assert not any(c["family"] == "fewer_steps_seacache" for c in report["configs"])  # the profile has none
    profile = report["tick_profile"]
    assert profile["batched_cfg_call_ms"] is None and profile["full_call_ms"] > 0  # one branch: no batched pair
    assert profile["compiled"] is None  # the tests run with compiling off
    model = report["model"]
    assert (model["vae"], model["embodiment"], model["action_dim"]) == ("WanVideoVAE", "bridge_orig_lerobot", 32)
    # 240x320 (ratio 0.75) goes on the 256x320 canvas unscaled: 15x20 latent cells, 3 latent frames for chunk 8.
    assert (model["frame_hw"], model["canvas_hw"], model["latent_shape"]) == ([240, 320], [256, 320], [8, 3, 15, 20])
    assert model["sigma_schedule"] == "karras" and model["gen_tokens"] == 3 * 8 * 10 + 8


def test_bench_refuses_what_it_cannot_drive(tmp_path, capsys):
    from cosmos3_folder import build_tiny_cosmos3_folder

    folder = build_tiny_cosmos3_folder(tmp_path / "pipe")
    assert bench_main(["--checkpoint", str(folder), "--embodiment", "libero", "--out", str(tmp_path / "b.json")]) == 2
    assert "--embodiment 'libero' is not served" in capsys.readouterr().err
    assert bench_main(["--checkpoint", str(folder), "--embodiment", "pusht", "--closed-loop", "2",
                       "--out", str(tmp_path / "b.json")]) == 2
    assert "--closed-loop drives the built-in Reach task" in capsys.readouterr().err
    for size in ("5x5", "3000x300"):  # before any engine warms up
        assert bench_main(["--checkpoint", str(folder), "--frame-size", size, "--out", str(tmp_path / "b.json")]) == 2
        assert f"--frame-size {size}: sides from 16 to 2048 px, as the server takes" in capsys.readouterr().err
    with torch._dynamo.config.patch(disable=True):  # TORCH_COMPILE_DISABLE=1
        assert bench_main(["--checkpoint", str(folder), "--compile-gen-stack", "--out", str(tmp_path / "b.json")]) == 2
    assert "--compile-gen-stack: torch.compile is disabled" in capsys.readouterr().err
    # Without diffusers (the [dev] or [cosmos3] extra), the run ended in an ImportError traceback and no report.
    with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit) as exit_:
        for module in ("diffusers", "diffusers.models.transformers.transformer_cosmos3"):  # even if imported
            patch.setitem(sys.modules, module, None)  # as if not installed: importing it raises ImportError
        bench_main(["--ticks", "2", "--warmup", "2", "--profile-ticks", "0", "--budgets-ms", "1",
                    "--out", str(tmp_path / "b.json")])  # refused at its start, not only once run: exit 2 then
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--reference: diffusers' Cosmos3OmniTransformer cannot be imported (" in err
    assert err.rstrip().endswith("install the [dev] extra (pip install -e '.[dev]') or pass --no-reference")
    # Each names the flag that was wrong, what it takes and what it got: one message named three flags, no value
    for option, value, least in (("--profile-ticks", "-1", 0), ("--forward-repeats", "0", 1), ("--threads", "0", 1),
                                 ("--ticks", "1", 2), ("--warmup", "0", 2), ("--closed-loop", "-2", 0),
                                 ("--execute", "0", 1), ("--calibration-observations", "0", 1)):
        with pytest.raises(SystemExit) as exit_:
            bench_main([option, value, "--out", str(tmp_path / "b.json")])
        assert exit_.value.code == 2
        assert f"{option} must be at least {least}, got {value}\n" in capsys.readouterr().err
    for flags, message in ((["--slowdown-ms", "-50"], "--slowdown-ms must be >= 0, got -50.0"),
                           # --budgets-ms silently won; a negative seed drew the demonstrations' scenes
                           (["--budgets-ms", "100", "--budget-fractions", "0.5"],
                            "argument --budget-fractions: not allowed with argument --budgets-ms"),
                           (["--seed", "-1"], "--seed must be >= 0 (held-out scenes), got -1"),
                           (["--budget-fractions", "0.5", "1.5"],
                            "--budget-fractions must lie in (0, 1], budgets up to the uncached latency; got 1.5"),
                           (["--budgets-ms", "50", "nan"], "--budgets-ms must lie in (0, 60000], got nan"),
                           (["--device", "tpu"], "--device 'tpu': expected auto, cpu, cuda or cuda:N"),
                           (["--out", str(tmp_path)], "is a folder; expected a file path")):
        with pytest.raises(SystemExit) as exit_:
            bench_main([*flags, "--out", str(tmp_path / "b.json")] if flags[0] != "--out" else flags)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_bench_help_gives_each_options_default(capsys):
    """--ticks, --seed and --forward-repeats had no help, --out, --profile-ticks and others no default: a user sizing
    a short run read neither how long the default one is nor where it writes."""
    with pytest.raises(SystemExit) as exit_:
        bench_main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # as one line: argparse wraps the help
    for option, default in (("--out OUT", "(bench.json)"), ("--ticks TICKS", "(500)"), ("--warmup WARMUP", "(4)"),
                            ("--threads THREADS", "(1)"), ("--seed SEED", "(0)"), ("--profile-ticks", "20)"),
                            ("--forward-repeats FORWARD_REPEATS", "(50)"), ("--execute EXECUTE", "(4)")):
        help_text = text.split(f" {option} ", 1)[1].split(" --", 1)[0]
        assert default in help_text, (option, help_text)


def test_bench_refuses_a_closed_loop_execute_past_the_chunk_before_it_runs(model_dir, tmp_path, capsys):
    """It ran every configuration open loop, then ended in a traceback at the closed loop's first chunk."""
    assert bench_main(["--checkpoint", str(model_dir), "--closed-loop", "1", "--execute", "9",
                       "--out", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert err == "policy-server bench: --execute 9: the chunks hold 8 actions\n"


@pytest.fixture
def engine_lifetimes(monkeypatch):
    """The bench's engines as they start and close: `(started, closed)`, lists of the real engines."""
    started, closed = [], []
    start, close = ModelEngine.start, ModelEngine.close

    def starting(engine):
        started.append(engine)
        start(engine)

    def closing(engine):
        closed.append(engine)
        close(engine)

    monkeypatch.setattr(ModelEngine, "start", starting)
    monkeypatch.setattr(ModelEngine, "close", closing)
    return started, closed


def test_bench_ends_with_the_message_of_a_budget_the_engine_refuses(profiled_checkpoint, tmp_path, monkeypatch,
                                                                   capsys, engine_lifetimes):
    """With every budget refused it writes nothing, says what this machine achieves and what to ask for instead, and
    starts no engine beyond the first, whose admission refuses them (a user's run spent two minutes, many of them on
    the warmups of engines started for a budget then refused)."""
    checkpoint, _ = profiled_checkpoint
    args = ["--checkpoint", str(checkpoint), "--ticks", "2", "--warmup", "2", "--closed-loop", "0",
            "--profile-ticks", "0", "--no-reference", "--budgets-ms", "1", "2", "--out", str(tmp_path / "b.json")]
    assert bench_main(args) == 2
    err = capsys.readouterr().err
    assert "budget_1: budget 1 ms is below the best achievable latency" in err
    assert "budget_2: budget 2 ms is below the best achievable latency" in err
    last = err.splitlines()[-1]
    assert last.startswith("policy-server bench: no budget is feasible on this machine: every budget (1, 2 ms) is "
                           "below the best achievable latency (up to ") and "; choose --budgets-ms of at least " in last
    assert not (tmp_path / "b.json").exists()
    started, closed = engine_lifetimes
    assert len(started) == 1 and closed == started

    def overloaded(_args):  # admission's refusal, which depends on the machine's blocking pieces
        raise api.Overloaded("a tick could wait 42 ms against the tightest budget of 41.8 ms", sessions_fit=0)

    monkeypatch.setattr(bench, "run", overloaded)
    assert bench_main(args) == 2
    assert "a tick could wait 42 ms against the tightest budget of 41.8 ms; choose larger" in capsys.readouterr().err


def test_bench_reports_the_budgets_it_cannot_meet_and_measures_the_others(profiled_checkpoint, tmp_path, monkeypatch,
                                                                         capsys, engine_lifetimes):
    """A budget below what the machine achieves refused the whole run and wrote nothing; now it is reported, with the
    best achievable latency its refusal gave, and the others run. 1 ms is below any tick (the first engine's
    admission refuses it); 30000 ms is refused by the ladder's engine, as a busy moment during that engine's warmup
    can make one engine refuse a budget another took (its timings are its own)."""
    checkpoint, _ = profiled_checkpoint
    open_session = ModelEngine.open_session

    def ladder_refusing(engine, embodiment, instruction, budget_ms=None, **kwargs):
        if engine.settings.quality_profile is None and budget_ms == 30000:
            raise api.BudgetInfeasible(budget_ms, 30123.4)
        return open_session(engine, embodiment, instruction, budget_ms=budget_ms, **kwargs)

    monkeypatch.setattr(ModelEngine, "open_session", ladder_refusing)
    out = tmp_path / "b.json"
    assert bench_main(["--checkpoint", str(checkpoint), "--ticks", "2", "--warmup", "2", "--closed-loop", "0",
                       "--profile-ticks", "0", "--no-reference", "--no-compile-gen-stack",
                       "--budgets-ms", "60000", "1", "30000", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    err = printed.err
    assert set(json.loads(printed.out)["infeasible_budgets"]) == {"1", "30000"}
    assert "policy-server bench: budget_1: budget 1 ms is below the best achievable latency" in err
    assert "policy-server bench: ladder_30000: budget 30000 ms is below the best achievable latency 30123.4 ms; " \
           "budget 30000 ms skipped" in err
    report = json.loads(out.read_text())
    first, second = report["infeasible_budgets"]
    assert first["budget_ms"] == 1 and first["refused_by"] == "budget_1" and first["best_achievable_ms"] > 1
    assert first["fraction"] == 1 / report["uncached_p50_before_run_ms"]
    assert first["message"].startswith("budget 1 ms is below the best achievable latency ")
    assert second == {"budget_ms": 30000, "fraction": 30000 / report["uncached_p50_before_run_ms"],
                      "refused_by": "ladder_30000", "best_achievable_ms": 30123.4,
                      "message": "budget 30000 ms is below the best achievable latency 30123.4 ms"}
    # Only the budget every engine took ran, with every configuration it runs at; the slowdown run at it
    assert {c["budget_ms"] for c in report["configs"]} == {None, 60000}
    assert {"budget_60000", "ladder_60000", "guarded_seacache_60000", "seacache_60000",
            "budget_60000_slowdown"} <= {c["name"] for c in report["configs"]}
    assert [row["budget_ms"] for row in report["sweep"]] == [60000]
    assert report["slowdown"]["config"] == "budget_60000_slowdown"
    assert (tmp_path / "b_latency.png").stat().st_size > 0 and (tmp_path / "b_error_vs_latency.png").stat().st_size
    # The first engine (run at 60000 ms), the ladder's refusing 30000 ms, and at 60000 ms the ladder's and the
    # slowdown run's: each closed
    started, closed = engine_lifetimes
    assert len(started) == 4 and sorted(map(id, closed)) == sorted(map(id, started))


def test_rollout_in_process_writes_report_plot_and_video(model_dir, tmp_path):
    out = tmp_path / "rollout.json"
    # A budget far above the ticks: this test is about the report, not admission (a fresh CI machine once timed
    # this engine's warmup at 760 ms a tick, where 39 ms is usual).
    assert rollout_main(["--in-process", "--checkpoint", str(model_dir), "--episodes", "2", "--num-steps", "2",
                         "--latency-budget-ms", "5000", "--videos", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["episodes"] == 2 and len(report["per_episode"]) == 2
    assert {"success_rate", "latency_p50_ms", "latency_p99_ms", "miss_rate", "cache_settings"} <= set(report)
    assert report["budget_ms"] == report["config"]["latency_budget_ms"] == 5000.0
    assert report["ticks_by_batch_size"] == {"1": report["ticks"]}  # one environment: every tick ran alone
    assert all(e["nearest_color"] and e["final_distance_m"] >= 0 for e in report["per_episode"])
    ticks = [e["ticks"] for e in report["per_episode"]]  # each episode's ticks in order, a column per field
    assert sum(len(t["latency_ms"]) for t in ticks) == report["ticks"]
    assert all(set(map(len, t.values())) == {len(range(0, e["steps"], 4))}
               for t, e in zip(ticks, report["per_episode"], strict=True))
    assert {b for t in ticks for b in t["budget_ms"]} == {5000.0} and all(all(t["deadline_met"]) for t in ticks)
    assert out.with_suffix(".png").stat().st_size > 0
    videos = list(tmp_path.glob("rollout_episode*.mp4"))
    assert [v.name for v in videos] == [f"rollout_episode{report['per_episode'][0]['seed']}.mp4"]
    assert_browser_playable(videos[0], frames=report["per_episode"][0]["steps"])


def test_an_uncached_rollout_reports_no_budget_it_did_not_have(model_dir, tmp_path):
    out = tmp_path / "uncached.json"
    assert rollout_main(["--in-process", "--checkpoint", str(model_dir), "--episodes", "1", "--num-steps", "2",
                         "--no-diffusion-cache", "--no-compile-gen-stack", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["latency_budget_ms"] is None
    assert (report["budget_ms"], report["deadline_misses"], report["miss_rate"]) == (None, None, None)
    assert not {"budget_ms", "deadline_met"} & set(report["per_episode"][0]["ticks"])


def test_rollout_in_process_with_a_vector_env(model_dir, tmp_path):
    """Three episodes two at a time (an async vector env) against one engine: each episode has its held-out seed,
    and the recorded one its video."""
    out = tmp_path / "rollout.json"
    assert rollout_main(["--in-process", "--checkpoint", str(model_dir), "--episodes", "3", "--num-envs", "2",
                         "--num-steps", "2", "--latency-budget-ms", "500", "--videos", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["num_envs"] == 2
    assert [e["seed"] for e in report["per_episode"]] == [1_000_000, 1_000_001, 1_000_002]
    assert set(report["ticks_by_batch_size"]) <= {"1", "2"} and sum(report["ticks_by_batch_size"].values()) == \
        report["ticks"]
    videos = list(tmp_path.glob("rollout_episode*.mp4"))
    assert [v.name for v in videos] == ["rollout_episode1000000.mp4"]
    assert_browser_playable(videos[0], frames=report["per_episode"][0]["steps"])


def test_rollout_in_process_plans_on_the_profile_the_server_would_use(profiled_checkpoint, tmp_path, capsys):
    """Without sampler overrides an in-process rollout plans each tick on the profile beside the checkpoint (its
    points name the ticks' settings), as the server would; `off` plans on the ladder; a broken profile is refused."""
    checkpoint, profile = profiled_checkpoint
    points = {point.config.name for point in profile.embodiments["pusht"]}
    settings = {}
    for choice in ("auto", "off"):
        out = tmp_path / f"{choice}.json"
        assert rollout_main(["--in-process", "--checkpoint", str(checkpoint), "--episodes", "1", "--execute", "8",
                             "--env-id", "PolicyServer/ReachEitherTimed-v0", "--latency-budget-ms", "300",
                             "--quality-profile", choice, "--out", str(out)]) == 0
        report = json.loads(out.read_text())
        assert report["config"]["quality_profile"] == choice
        settings[choice] = set(report["cache_settings"])
    assert settings["auto"] <= points
    assert not settings["off"] & points  # ladder rungs ("t0.25-c2", "max", ...) or "none"
    (checkpoint / PROFILE_FILE).write_text("{}")
    assert rollout_main(["--in-process", "--checkpoint", str(checkpoint), "--episodes", "1",
                         "--out", str(tmp_path / "broken.json")]) == 2
    assert f"{checkpoint / PROFILE_FILE}: version None" in capsys.readouterr().err
    for pinned in (["--num-steps", "4"], ["--no-diffusion-cache"]):  # a profile would not describe these ticks
        with pytest.raises(SystemExit):
            rollout_main(["--in-process", *pinned, "--quality-profile", str(checkpoint / PROFILE_FILE)])
        assert "--quality-profile plans cached ticks at the checkpoint's own" in capsys.readouterr().err


@pytest.mark.parametrize(("module", "argv", "default"), [
    ("robots.rollout", ["--in-process", "--num-envs", "0"], "rollout.json"),
    ("robots.bench", ["--ticks", "0"], "bench.json"),
    ("robots.soak", ["--server-pid", "1"], "soak.json"),
    ("robots.serve_overhead", ["--ticks", "0"], "serve_overhead.json"),
])
def test_a_default_report_path_is_checked_before_the_command_runs(module, argv, default, tmp_path, monkeypatch,
                                                                   capsys):
    """argparse converts a default only when it is a string: the default --out, a Path, went unchecked, and the
    compose file's robot (its working folder not the user's) ran all its episodes, then ended in a traceback."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / default).mkdir()
    command = importlib.import_module(module)
    with pytest.raises(SystemExit) as exit_:
        getattr(command, "parse_args", command.main)(argv)
    assert exit_.value.code == 2
    assert f"argument --out: {default} is a folder; expected a file path" in capsys.readouterr().err


def _model_workers() -> int:
    return sum(thread.name == "model-worker" and thread.is_alive() for thread in threading.enumerate())


@pytest.mark.parametrize("failure", ["overloaded", "error"])
def test_the_engines_the_bench_started_are_closed_whatever_ends_it(profiled_checkpoint, tmp_path, monkeypatch, capsys,
                                                                    engine_lifetimes, failure):
    """Only a BudgetInfeasible closed the engines started for a budget: another refusal (the ladder's admission
    answering Overloaded) or any error mid-run (here in the ticks' bookkeeping) left every engine started so far
    running, its worker thread and its share of the device, to the process's end: for good in an in-process caller."""
    checkpoint, _ = profiled_checkpoint
    workers = _model_workers()
    if failure == "overloaded":
        open_session = ModelEngine.open_session

        def ladder_overloaded(engine, embodiment, instruction, budget_ms=None, **kwargs):
            if engine.settings.quality_profile is None:
                raise api.Overloaded("a tick could wait 42 ms against the tightest budget of 41.8 ms", sessions_fit=0)
            return open_session(engine, embodiment, instruction, budget_ms=budget_ms, **kwargs)

        monkeypatch.setattr(ModelEngine, "open_session", ladder_overloaded)
    else:
        def failing_add(run, *args, **kwargs):
            raise RuntimeError("a bug in the bench's bookkeeping")

        monkeypatch.setattr(bench.ConfigRun, "add", failing_add)
    args = ["--checkpoint", str(checkpoint), "--ticks", "2", "--warmup", "2", "--closed-loop", "0",
            "--profile-ticks", "0", "--no-reference", "--no-compile-gen-stack", "--budgets-ms", "60000",
            "--out", str(tmp_path / "b.json")]
    if failure == "overloaded":
        assert bench_main(args) == 2
        assert "a tick could wait 42 ms against the tightest budget of 41.8 ms" in capsys.readouterr().err
    else:
        with pytest.raises(RuntimeError, match="a bug in the bench's bookkeeping"):
            bench_main(args)
    started, closed = engine_lifetimes
    # The first engine and the ladder's (refusing), or with the slowdown run's (the ticks failing)
    assert len(started) == (2 if failure == "overloaded" else 3)
    assert sorted(map(id, closed)) == sorted(map(id, started))
    assert _model_workers() == workers
    assert not (tmp_path / "b.json").exists()
