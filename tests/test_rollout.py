"""`policy-rollout`'s vector-env loop: episodes run `--num-envs` at a time come out as they do one by one, against
a scripted policy in this process and through `--server` against a real gRPC server, one killed and restarted mid-run
included; bad flags are usage errors."""

import dataclasses
import functools
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import gymnasium as gym
import numpy as np
import pytest
from fake_engine import LIBERO, FakeEngine, free_port, serve_fake
from tqdm import tqdm

from policy_server.client.errors import PolicyServerError
from policy_server.v1 import policy_server_pb2 as pb
from robots import rollout
from robots.envs import COLORS, ENV_IDS, HELDOUT_SEED_OFFSET, REACH_ID
from robots.rollout import MAX_EPISODE_RESTARTS, EpisodeLost, RolloutStopped, TickStats, main, run_episodes

CHUNK, EXECUTE, EPISODES = 8, 4, 5


class SeekerPolicy:
    """The rollout's policy protocol, scripted: on even seeds it heads for the pixels of the colour the instruction
    names (reaching it in a varying number of steps), on odd seeds it stands still until the time limit."""

    def __init__(self):
        self.lock = threading.Lock()
        self.opened, self.closed = [], []
        self.request_ids: dict[int, list[str]] = {}  # seed -> the request id of each session opened for it
        self.steps: dict[int, list[int]] = {}  # seed -> step indices it was asked at
        self.committed: dict[int, list[np.ndarray | None]] = {}  # seed -> the committed actions of each ask
        self.chunks: dict[int, list[np.ndarray]] = {}  # seed -> the chunks it answered

    def open(self, instruction: str, seed: int, preview: bool, request_id: str):
        with self.lock:
            self.request_ids.setdefault(seed, []).append(request_id)
            self.opened.append((seed, instruction))
            self.steps[seed], self.committed[seed], self.chunks[seed] = [], [], []
        return {"seed": seed, "color": instruction.split()[2]}

    def act(self, session, obs: dict, step: int, want_video: bool = False, committed: np.ndarray | None = None):
        with self.lock:
            self.steps[session["seed"]].append(step)
            self.committed[session["seed"]].append(committed)
        velocity = np.zeros(2, np.float32)
        if session["seed"] % 2 == 0:
            image = obs["image"].astype(np.int32)
            rows, cols = np.nonzero(np.abs(image - COLORS[session["color"]]).sum(-1) < 60)
            size, table = image.shape[0], 0.5
            target = np.array([(cols.mean() + 0.5) / size, 1 - (rows.mean() + 0.5) / size]) * table
            velocity = np.clip(4.0 * (target - obs["state"]), -0.2, 0.2).astype(np.float32)
        stats = TickStats(1.0, 100.0, True, 1, 0, 0, "scripted")
        chunk = np.repeat(velocity[None], CHUNK, 0) + np.arange(CHUNK, dtype=np.float32)[:, None] * 1e-3
        if committed is not None:  # as a server: the chunk starts with them
            chunk[: len(committed)] = committed
        with self.lock:
            self.chunks[session["seed"]].append(chunk)
        return chunk, stats, None

    def close(self, session) -> None:
        with self.lock:
            self.closed.append(session["seed"])

    def wait_until_serving(self) -> None:
        pass  # always serving


def one_by_one(index: int) -> tuple:
    """The episode on held-out seed index `index` in a plain environment: (seed, instruction, success, steps,
    ticks)."""
    policy, env = SeekerPolicy(), gym.make(REACH_ID)
    seed = HELDOUT_SEED_OFFSET + index
    obs, _ = env.reset(seed=seed)
    instruction = env.unwrapped.task_description
    session = policy.open(instruction, seed, False, "one-by-one")
    steps, ticks, done = 0, 0, False
    while not done:
        actions, _, _ = policy.act(session, obs, steps)
        ticks += 1
        for action in actions[:EXECUTE]:
            obs, _, terminated, truncated, info = env.step(action)
            steps += 1
            done = terminated or truncated
            if done:
                break
    return seed, instruction, bool(info["is_success"]), steps, ticks


@pytest.fixture(scope="module")
def expected():
    episodes = [one_by_one(i) for i in range(EPISODES)]
    assert len({steps for *_, steps, _ in episodes}) > 2  # episodes end out of step: restarts interleave
    assert {success for _, _, success, *_ in episodes} == {True, False}
    return episodes


@pytest.mark.parametrize("num_envs", [1, 3, 7])  # 7: more environments than episodes
def test_vector_episodes_match_one_by_one(expected, num_envs):
    policy = SeekerPolicy()
    with tqdm(total=EPISODES, file=io.StringIO()) as progress:
        results = run_episodes(policy, REACH_ID, range(EPISODES), num_envs, EXECUTE, progress=progress)
        assert progress.n == EPISODES  # one step per ended episode
    got = [(r.seed, r.instruction, r.success, r.steps, len(r.ticks)) for r in results]
    assert got == expected
    for r in results:
        assert policy.steps[r.seed] == list(range(0, r.steps, EXECUTE))  # no reset step counted
        assert len(r.switch_jumps) == len(r.ticks) - 1  # every chunk but the first takes over from another
        assert r.target_color in r.instruction and r.nearest_color in COLORS and r.final_distance_m >= 0
        assert r.success == (r.final_distance_m <= 0.03)
    assert sorted(policy.closed) == sorted(seed for seed, _ in policy.opened) == [r.seed for r in results]


@pytest.mark.parametrize("commit", [False, True])
def test_a_delayed_tick_runs_its_chunk_after_the_actions_left_from_the_last(commit):
    """With --delay-steps 2 a tick is asked for while 2 actions are left, which run first; its chunk's first 2 are
    stale, its next 4 run. Committed, those 2 go with the observation."""
    policy = SeekerPolicy()
    (result,) = run_episodes(policy, REACH_ID, [0], 1, EXECUTE, delay=2, commit=commit)  # seed 0 heads for it
    asked, chunks = policy.steps[result.seed], policy.chunks[result.seed]
    assert asked == [0, *range(EXECUTE - 2, result.steps, EXECUTE)][: len(asked)] and len(asked) > 2
    for i, committed in enumerate(policy.committed[result.seed]):
        if not commit or i == 0:  # the first tick of an episode has none left
            assert committed is None
        else:
            np.testing.assert_array_equal(committed, chunks[i - 1][EXECUTE - 2 + (i > 1) * 2:][:2])
    assert len(result.switch_jumps) == len(asked) - 1 and len(result.chunk_steps) == len(asked) * (EXECUTE - 1)


def test_rollout_through_a_server_with_a_vector_env(tmp_path):
    engine = FakeEngine()
    out = tmp_path / "rollout.json"
    with serve_fake(engine) as server:
        assert main(["--server", server.target, "--env-id", "PolicyServer/ReachHard-v0",
                     "--num-envs", "2", "--episodes", "3", "--first-episode", "7", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["config"]["env_id"], report["config"]["num_envs"]) == ("PolicyServer/ReachHard-v0", 2)
    episodes = report["per_episode"]
    assert [e["seed"] for e in episodes] == [HELDOUT_SEED_OFFSET + i for i in (7, 8, 9)]
    hard = gym.make("PolicyServer/ReachHard-v0")
    for e in episodes:
        hard.reset(seed=e["seed"])
        assert e["instruction"] == hard.unwrapped.task_description
    assert sorted(engine.instructions.values()) == sorted(e["instruction"] for e in episodes)
    steps = {}
    for session_id, _, step in engine.acts:
        steps.setdefault(session_id, []).append(step)
    assert sorted(len(s) for s in steps.values()) == sorted(len(range(0, e["steps"], EXECUTE)) for e in episodes)
    assert all(s == list(range(0, len(s) * EXECUTE, EXECUTE)) for s in steps.values())
    assert report["ticks"] == len(engine.acts)
    assert report["fallback_ticks"] == {} and all(e["ticks"]["fallbacks"] == [[]] * len(e["ticks"]["setting"])
                                                   for e in episodes)


def test_a_report_says_what_each_tick_gave_up(tmp_path):
    """A tick the guard cut runs fewer calls than its setting names (n20-cfg20 with 7 calls, say): the report said so
    nowhere, so its counts looked wrong. Each tick now lists its fallbacks, and the report counts ticks by kind."""
    engine = FakeEngine()  # its ticks under a budget below 10 ms give up the CFG pass late
    out = tmp_path / "rollout.json"
    with serve_fake(engine) as server:
        assert main(["--server", server.target, "--latency-budget-ms", "5", "--episodes", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["fallback_ticks"] == {"drop_cfg_late": report["ticks"]} and report["ticks"] == len(engine.acts)
    for episode in report["per_episode"]:
        assert episode["ticks"]["fallbacks"] == [["drop_cfg_late"]] * len(episode["ticks"]["setting"])


@pytest.mark.parametrize("flags, message", [
    (["--env-id", "CartPole-v1"], f"invalid choice: 'CartPole-v1' (choose from {', '.join(map(repr, ENV_IDS))})"),
    (["--num-envs", "0"], "--num-envs must be a positive integer, got 0"),
    (["--ray", "0"], "--ray must be a positive integer, got 0"),
    (["--ray-address", "auto"], "--ray-address, --ray-gpus-per-worker and --ray-cpus-per-worker need --ray N"),
    (["--ray", "2", "--ray-gpus-per-worker", "1"], "--ray-gpus-per-worker needs --in-process --device cuda"),
    (["--serve-application", "policy"], "--serve-application needs --server"),
    # Each names the flag that was wrong and its value: one message named three flags, no value
    (["--first-episode", "-1"], "--first-episode must be >= 0, got -1\n"),
    (["--videos", "-1"], "--videos must be >= 0, got -1\n"),
    (["--delay-steps", "-2"], "--delay-steps must be >= 0, got -2\n"),
    (["--num-steps", "0"], "--num-steps: input should be greater than or equal to 1, got 0\n"),
    (["--guidance", "0.5"], "--guidance: input should be greater than or equal to 1, got 0.5\n"),
    # these two passed the flags' checks, and pydantic's ValidationError ended the run in a traceback after the load
    (["--num-steps", "100000"], "--num-steps: input should be less than or equal to 1000, got 100000\n"),
    (["--guidance", "inf"], "--guidance: input should be a finite number, got inf\n"),
    (["--ray", "2", "--ray-cpus-per-worker", "-1"], "--ray-cpus-per-worker must be >= 0, got -1.0\n"),
    (["--ray", "2", "--ray-cpus-per-worker", "nan"], "--ray-cpus-per-worker must be >= 0, got nan\n"),
    (["--commit-actions"], "--commit-actions needs --delay-steps N"),
    # a session's seed is a uint64: against a server, the client's ValueError ended the run in a traceback
    (["--first-episode", str(2**64 - HELDOUT_SEED_OFFSET - 99), "--episodes", "100"],
     f"--first-episode {2**64 - HELDOUT_SEED_OFFSET - 99}: episode i runs on seed {HELDOUT_SEED_OFFSET} + i, below "
     f"2^64; expected at most {2**64 - HELDOUT_SEED_OFFSET - 100} for 100 episodes\n"),
    (["--latency-budget-ms", "0"], "--latency-budget-ms must lie in (0, 60000], got 0.0"),
    (["--latency-budget-ms", "nan"], "--latency-budget-ms must lie in (0, 60000], got nan"),
    (["--out", "/"], "argument --out: / is a folder; expected a file path"),
    # the PNG summary, written to --out with .png, overwrote the report: a run that exited 0 left no JSON
    (["--out", f"{tempfile.gettempdir()}/r.png"],
     f"argument --out: {tempfile.gettempdir()}/r.png: the JSON report's path, whose PNG summary goes beside it as "
     "r.png; expected another suffix, such as .json\n"),
])
def test_bad_flags_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--in-process", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--no-diffusion-cache", "--compile-gen-stack", "--no-compile-gen-stack"])
def test_in_process_settings_are_refused_with_a_server(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--server", "127.0.0.1:1", flag])
    assert exit_info.value.code == 2
    assert "--no-diffusion-cache and --compile-gen-stack need --in-process" in capsys.readouterr().err


def test_a_checkpoint_is_refused_with_a_server(capsys):
    """It was ignored: the rollout drove whatever the server served, and its report named no checkpoint."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--server", "127.0.0.1:1", "--checkpoint", "/models/mine"])
    assert exit_info.value.code == 2
    assert "--checkpoint needs --in-process (a server serves its own checkpoint)" in capsys.readouterr().err


def test_more_actions_executed_than_a_chunk_holds_end_the_rollout_with_one_line(tmp_path, capsys):
    with serve_fake(FakeEngine()) as server:
        code = main(["--server", server.target, "--execute", "9", "--episodes", "1",
                     "--out", str(tmp_path / "rollout.json")])
    assert code == 2 and capsys.readouterr().err == "policy-rollout: --execute 9: the chunks hold 8 actions\n"


def test_an_in_process_rollout_checks_its_execute_and_delay_before_the_warmup(tmp_path, capsys, monkeypatch):
    """It warmed the engine up (a minute with the compiled stack) before the first chunk showed them too many."""
    import policy_server.engine.engine

    class NoWarmup:
        def __init__(self, *args, **kwargs):
            raise AssertionError("the engine was built: the check came after the warmup")

    monkeypatch.setattr(policy_server.engine.engine, "ModelEngine", NoWarmup)
    code = main(["--in-process", "--no-compile-gen-stack", "--delay-steps", "2", "--execute", "7", "--episodes", "1",
                 "--out", str(tmp_path / "rollout.json")])
    assert code == 2 and capsys.readouterr().err == (
        "policy-rollout: --delay-steps 2 and --execute 7: the chunks hold 8 actions\n")


def test_a_server_or_checkpoint_without_the_tasks_embodiment_ends_the_rollout_with_one_line(tmp_path, capsys):
    """A rollout of a folder trained for another robot warmed the engine up (and calibrated), then ended on
    'embodiment: expected one of ['my_arm'], got 'pusht'', an embodiment the user never named."""
    from robots.embedded import build_random_pipeline

    with serve_fake(FakeEngine(embodiments=(LIBERO,))) as server:
        code = main(["--server", server.target, "--episodes", "1", "--out", str(tmp_path / "rollout.json")])
    assert code == 2 and capsys.readouterr().err == (
        f"policy-rollout: {server.target} serves ['libero'], not 'pusht', the embodiment policy-rollout drives the "
        "built-in Reach task as (a checkpoint trained on its demonstrations, robots.datagen's)\n")
    folder = tmp_path / "my-arm"
    build_random_pipeline(folder, seed=0)
    (folder / "embodiments.json").write_text(json.dumps(
        {"embodiments": [{"name": "my_arm", "domain_id": 10, "raw_action_dim": 2, "state_dim": 2}]}))
    code = main(["--in-process", "--checkpoint", str(folder), "--no-compile-gen-stack", "--episodes", "1",
                 "--out", str(tmp_path / "rollout.json")])
    assert code == 2 and capsys.readouterr().err.endswith(
        f"policy-rollout: {folder} serves ['my_arm'], not 'pusht', the embodiment policy-rollout drives the built-in "
        "Reach task as (a checkpoint trained on its demonstrations, robots.datagen's)\n")
    assert not (tmp_path / "rollout.json").exists()


def test_a_server_that_never_serves_ends_the_rollout_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(rollout, "SERVING_NOTICE_S", 0.2)
    monkeypatch.setattr(rollout, "SERVING_WAIT_S", 0.5)
    code = main(["--server", "127.0.0.1:1", "--episodes", "1", "--out", str(tmp_path / "rollout.json")])
    error = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "rollout.json").exists()
    assert error.startswith("policy-rollout: waiting up to 0.5 s for 127.0.0.1:1 to serve (starting, warming up, or "
                            "nothing listening there; 127.0.0.1:1 not SERVING after 0.2 s (last: no answer))\n")
    assert error.endswith("\npolicy-rollout: 127.0.0.1:1 not SERVING after 0.5 s (last: no answer)\n")


def test_a_refused_session_ends_the_rollout_with_one_line(tmp_path, capsys):
    with serve_fake(FakeEngine()) as server:
        code = main(["--server", server.target, "--latency-budget-ms", "1", "--episodes", "1",
                     "--out", str(tmp_path / "rollout.json")])
    error = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "rollout.json").exists()
    assert error.startswith("policy-rollout: FAILED_PRECONDITION BUDGET_INFEASIBLE: budget 1 ms is below")
    assert "Traceback" not in error and error.count("\n") == 1


def test_an_in_process_compile_torch_cannot_do_ends_the_rollout_with_one_line(tmp_path, capsys):
    # torch.compile is off in the suite (conftest.py): asking for the compiled stack names why it cannot run.
    code = main(["--in-process", "--compile-gen-stack", "--episodes", "1", "--out", str(tmp_path / "rollout.json")])
    error = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "rollout.json").exists()
    assert error == "policy-rollout: the GEN stack cannot run compiled: torch.compile is disabled " \
                    "(TORCH_COMPILE_DISABLE=1)\n"


def test_the_bench_and_rollouts_load_pyav_only_to_write_videos():
    """PyAV, with its FFmpeg, is imported where a video is written: the bench and the CUDA tests run where it is not
    installed (the GPU image `.ci/device` runs on; its 36 MB wheel would not fit what that run can carry)."""
    code = "import sys, robots.bench, robots.rollout, robots.expert; sys.exit('av' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


class FailingPolicy(SeekerPolicy):
    """SeekerPolicy whose session of seed index `failing` fails at its third tick with `error`, `times` times over
    (each in a new session)."""

    def __init__(self, failing: int, error: Exception, times: int = 1):
        super().__init__()
        self.failing_seed, self.error, self.times = HELDOUT_SEED_OFFSET + failing, error, times

    def act(self, session, obs: dict, step: int, want_video: bool = False, committed: np.ndarray | None = None):
        if session["seed"] == self.failing_seed and len(self.steps[self.failing_seed]) == 2 and self.times:
            self.times -= 1
            raise self.error
        return super().act(session, obs, step, want_video, committed)


LOST = PolicyServerError(grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND", "no open session")
GONE = PolicyServerError(grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE", "Socket closed")  # no server reason
REFUSED = PolicyServerError(grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED", "no place")
NO_ANSWER = PolicyServerError(grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED", "no answer within 60 s")


@pytest.mark.parametrize("num_envs", [1, 2])
@pytest.mark.parametrize("error", [LOST, GONE], ids=["session_not_found", "unavailable"])
def test_an_episode_whose_session_is_lost_runs_again_from_its_seed(expected, num_envs, error):
    policy = FailingPolicy(failing=2, error=error, times=MAX_EPISODE_RESTARTS)
    results = run_episodes(policy, REACH_ID, range(EPISODES), num_envs, EXECUTE)
    # Its lost tries' ticks are not counted: every episode is as in a run that lost none.
    assert [(r.seed, r.instruction, r.success, r.steps, len(r.ticks)) for r in results] == expected
    restart = {"reason": error.reason, "error": str(error), "ticks_discarded": 2}
    assert [r.restarts for r in results] == [[restart] * MAX_EPISODE_RESTARTS if i == 2 else []
                                             for i in range(EPISODES)]
    assert [seed for seed, _ in policy.opened].count(HELDOUT_SEED_OFFSET + 2) == MAX_EPISODE_RESTARTS + 1
    assert sorted(policy.closed) == sorted(seed for seed, _ in policy.opened)  # the lost sessions' too
    # Each new session is a new opening: a server still holding the lost one must not answer with it.
    assert len(set(policy.request_ids[HELDOUT_SEED_OFFSET + 2])) == MAX_EPISODE_RESTARTS + 1


class UnansweredOpenPolicy(SeekerPolicy):
    """SeekerPolicy that opens sessions as a server does, one per request id (a try with the id of an open session
    gets that session), where the first `times` tries to open one for seed index `unanswered` get no answer: the
    session is opened, the call ends DEADLINE_EXCEEDED (a server that hung past the call's deadline, a link that
    dropped)."""

    def __init__(self, unanswered: int, times: int = 1):
        super().__init__()
        self.unanswered_seed, self.times = HELDOUT_SEED_OFFSET + unanswered, times
        self.tries: list[str] = []  # the request id of each try to open a session for that seed
        self.sessions: dict[str, dict] = {}  # request id -> the session it opened

    def open(self, instruction: str, seed: int, preview: bool, request_id: str):
        if seed == self.unanswered_seed:
            self.tries.append(request_id)
        if request_id not in self.sessions:
            self.sessions[request_id] = super().open(instruction, seed, preview, request_id)
        if seed == self.unanswered_seed and len(self.tries) <= self.times:
            raise NO_ANSWER
        return self.sessions[request_id]


@pytest.mark.parametrize("num_envs", [1, 2])
def test_an_opening_that_got_no_answer_is_tried_again_under_its_request_id(expected, num_envs, capsys):
    """The try after an OpenSession that got no answer sent a new request id: the session the server had opened held
    one of its places, unused, until it idled out (300 s), and the episode ran in a second one. Then that opening was
    counted as a restart (`restarts`, `restarted_episodes`), though no try of the episode was abandoned."""
    policy = UnansweredOpenPolicy(unanswered=2)
    results = run_episodes(policy, REACH_ID, range(EPISODES), num_envs, EXECUTE)
    assert [(r.seed, r.instruction, r.success, r.steps, len(r.ticks)) for r in results] == expected
    assert [r.restarts for r in results] == [[]] * EPISODES
    # One session per episode, every one closed: none left holding a place.
    assert sorted(policy.closed) == sorted(seed for seed, _ in policy.opened) == [r.seed for r in results]
    assert len(policy.tries) == 2 and policy.tries[0] == policy.tries[1]
    assert capsys.readouterr().err == (
        f"policy-rollout: episode seed {HELDOUT_SEED_OFFSET + 2}: opening its session failed ({NO_ANSWER}); opening it "
        f"again under its request id once the server serves (try 2 of {MAX_EPISODE_RESTARTS + 1})\n")


def test_openings_that_keep_getting_no_answer_stop_the_run():
    policy = UnansweredOpenPolicy(unanswered=2, times=MAX_EPISODE_RESTARTS + 1)
    with pytest.raises(RolloutStopped) as stopped:
        run_episodes(policy, REACH_ID, range(EPISODES), 1, EXECUTE)
    assert str(stopped.value.cause) == (f"episode seed {HELDOUT_SEED_OFFSET + 2} got no session in "
                                        f"{MAX_EPISODE_RESTARTS + 1} openings, the last: {NO_ANSWER}")
    assert [r.seed for r in stopped.value.finished] == [HELDOUT_SEED_OFFSET + i for i in (0, 1)]
    assert len(policy.tries) == MAX_EPISODE_RESTARTS + 1 and len(set(policy.tries)) == 1


@pytest.mark.parametrize("num_envs", [1, 2])
@pytest.mark.parametrize("error, cause", [(REFUSED, PolicyServerError), (LOST, EpisodeLost)],
                         ids=["refused", "lost_too_often"])
def test_a_refusal_or_a_session_lost_too_often_stops_the_run_keeping_the_episodes_that_ended(expected, num_envs,
                                                                                              error, cause):
    policy = FailingPolicy(failing=2, error=error, times=MAX_EPISODE_RESTARTS + 1)
    with pytest.raises(RolloutStopped) as stopped:
        run_episodes(policy, REACH_ID, range(EPISODES), num_envs, EXECUTE)
    assert type(stopped.value.cause) is cause
    if cause is EpisodeLost:
        assert str(stopped.value.cause) == (f"episode seed {HELDOUT_SEED_OFFSET + 2} lost its session "
                                            f"{MAX_EPISODE_RESTARTS + 1} times, the last: {error}")
    finished = [(r.seed, r.instruction, r.success, r.steps, len(r.ticks)) for r in stopped.value.finished]
    assert finished and all(episode in expected for episode in finished)
    assert HELDOUT_SEED_OFFSET + 2 not in [seed for seed, *_ in finished]


class _InterruptedBar:
    def update(self, count: int) -> None:
        raise KeyboardInterrupt  # Ctrl-C as the bar redraws for an episode that ended


@pytest.mark.parametrize("num_envs", [1, 2])
def test_ctrl_c_between_two_episodes_keeps_those_that_ended(num_envs):
    """A Ctrl-C as the progress bar redraws for an episode that ended (outside the episodes' loop, once) raised a bare
    KeyboardInterrupt: the report of the episodes that had ended was lost, and the sessions stayed open."""
    policy = SeekerPolicy()
    with pytest.raises(RolloutStopped) as stopped:
        run_episodes(policy, REACH_ID, range(EPISODES), num_envs, EXECUTE, progress=_InterruptedBar())
    assert isinstance(stopped.value.cause, KeyboardInterrupt) and len(stopped.value.finished) == 1
    assert sorted(policy.closed) == sorted(seed for seed, _ in policy.opened)


@pytest.mark.parametrize("num_envs", [1, 2])
def test_any_error_mid_run_closes_the_sessions_it_held(num_envs):
    """An error the rollout does not report on (here a ValueError of the policy; a dead environment process, a bug)
    left its sessions holding the server's places until they idle-expired: the next sweep was refused OVERLOADED."""
    policy = FailingPolicy(failing=2, error=ValueError("not a server's error"))
    with pytest.raises(ValueError):
        run_episodes(policy, REACH_ID, range(EPISODES), num_envs, EXECUTE)
    assert sorted(policy.closed) == sorted(seed for seed, _ in policy.opened)


class LosingEngine(FakeEngine):
    """Loses every session (as a server restarted over and over) at every tick from tick `acts_before` on."""

    def __init__(self, acts_before: int):
        super().__init__()
        self.acts_before = acts_before

    def act(self, session_id, *args, **kwargs):
        if len(self.acts) >= self.acts_before:
            self.close()
        return super().act(session_id, *args, **kwargs)


def test_a_server_that_keeps_losing_sessions_stops_the_run_with_the_episodes_that_ended(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    with serve_fake(LosingEngine(acts_before=50)) as server:
        code = main(["--server", server.target, "--episodes", "6", "--videos", "6", "--out", str(out)])
    error = capsys.readouterr().err
    report = json.loads(out.read_text())
    ended = [e["seed"] for e in report["per_episode"]]
    assert code == 2 and 0 < len(ended) < 6 and report["episodes"] == len(ended)
    lost = next(seed for seed in range(HELDOUT_SEED_OFFSET, HELDOUT_SEED_OFFSET + 6) if seed not in ended)
    assert report["stopped_by"].startswith(f"episode seed {lost} lost its session {MAX_EPISODE_RESTARTS + 1} times, "
                                           "the last: NOT_FOUND SESSION_NOT_FOUND: ")
    assert report["unfinished_seeds"] == [HELDOUT_SEED_OFFSET + i for i in range(6) if HELDOUT_SEED_OFFSET + i
                                          not in ended]
    # The figures are the ended episodes': the lost episode's ticks are not among them.
    assert report["ticks"] == sum(len(e["ticks"]["latency_ms"]) for e in report["per_episode"]) < 50
    assert report["success_rate"] == np.mean([e["success"] for e in report["per_episode"]])
    assert (report["restarted_episodes"], report["restarts_by_reason"]) == (0, {})
    assert sorted(p.name for p in tmp_path.glob("*.mp4")) == [f"rollout_episode{seed}.mp4" for seed in ended]
    *restarts, last = error.splitlines()
    assert len(restarts) == MAX_EPISODE_RESTARTS and all(
        line.startswith(f"policy-rollout: episode seed {lost} lost its session after ") for line in restarts)
    assert last == (f"policy-rollout: {report['stopped_by']}; {out} reports the {len(ended)} episodes that had "
                    f"ended, not the {6 - len(ended)} others (unfinished_seeds)")



def _server_process(port: int, *die_at_tick: int) -> subprocess.Popen:
    helper = os.path.join(os.path.dirname(__file__), "fake_server_process.py")
    return subprocess.Popen([sys.executable, helper, str(port), *map(str, die_at_tick)])


def test_a_server_killed_and_restarted_mid_run_loses_no_episode(tmp_path, capsys):
    """A sweep against a server process that is killed (SIGKILL, a tick in flight) and started again on the same port:
    the episodes in progress run again from their seeds in new sessions, and the report is an uninterrupted run's."""
    flags = ["--episodes", "6", "--num-envs", "2"]
    with serve_fake(FakeEngine()) as server:
        assert main(["--server", server.target, *flags, "--out", str(tmp_path / "uninterrupted.json")]) == 0
    uninterrupted = json.loads((tmp_path / "uninterrupted.json").read_text())
    port = free_port()
    first = _server_process(port, 40)
    servers = [first]

    def restart():
        first.wait()
        servers.append(_server_process(port))

    restarter = threading.Thread(target=restart)
    restarter.start()
    try:
        code = main(["--server", f"127.0.0.1:{port}", *flags, "--out", str(tmp_path / "rollout.json")])
    finally:
        restarter.join(60)
        for server in servers:
            server.kill()
            server.wait()
    report = json.loads((tmp_path / "rollout.json").read_text())
    assert code == 0 and first.returncode == -signal.SIGKILL and report["stopped_by"] is None
    restarts = [e.pop("restarts") for e in report["per_episode"]]
    [e.pop("restarts") for e in uninterrupted["per_episode"]]
    assert report["per_episode"] == uninterrupted["per_episode"]
    assert report["ticks"] == uninterrupted["ticks"]
    # The tick in flight lost its connection; another episode may have found its session gone once the server was back.
    reasons = report["restarts_by_reason"]
    assert reasons.get("UNAVAILABLE") and set(reasons) <= {"UNAVAILABLE", "SESSION_NOT_FOUND"}
    assert report["restarted_episodes"] == sum(bool(r) for r in restarts)
    assert sum(len(r) for r in restarts) == sum(reasons.values())
    assert capsys.readouterr().err.count("lost its session after") == sum(reasons.values())


class KilledPolicy(rollout.ServerPolicy):
    """A client of the server at `target` whose process kills itself (SIGKILL, as the OOM killer does) at the third
    tick of seed index `dying`, two seconds after that tick is asked for (its session open): time for the episodes that
    ended before to reach Ray's driver."""

    def __init__(self, target: str, dying: int):
        super().__init__(target, None, None, None, {}, EXECUTE, 0)
        self.dying_seed, self.dying_ticks = HELDOUT_SEED_OFFSET + dying, 0
        self.seeds: dict[str, int] = {}  # session id -> its seed

    def open(self, instruction: str, seed: int, preview: bool, request_id: str):
        session = super().open(instruction, seed, preview, request_id)
        self.seeds[session.session_id] = seed
        return session

    def act(self, session, obs: dict, step: int, want_video: bool = False, committed: np.ndarray | None = None):
        if self.seeds[session.session_id] == self.dying_seed:
            self.dying_ticks += 1
            if self.dying_ticks == 3:
                time.sleep(2)
                os.kill(os.getpid(), signal.SIGKILL)
        return super().act(session, obs, step, want_video, committed)


class CtrlCPolicy(SeekerPolicy):
    """SeekerPolicy that, closing the session of its process's first episode where it is on seed index `ending`,
    gives the process `driver` SIGUSR1 (there, a Ctrl-C) and holds the close `hold_s` (`stuck`: unmoved by a cancel,
    as a call that does not return); each tick of seed index `ending` before that takes `slow_s` more, each tick after
    it a second (the worker still runs when the Ctrl-C comes)."""

    def __init__(self, driver: int, ending: int, hold_s: float, stuck: bool = False, slow_s: float = 0.0):
        super().__init__()
        self.driver, self.ending_seed, self.hold_s, self.stuck = driver, HELDOUT_SEED_OFFSET + ending, hold_s, stuck
        self.slow_s, self.signalled = slow_s, False

    def close(self, session) -> None:
        super().close(session)
        if session["seed"] == self.ending_seed and len(self.closed) == 1:
            self.signalled = True
            os.kill(self.driver, signal.SIGUSR1)
            end = time.monotonic() + self.hold_s
            while (left := end - time.monotonic()) > 0:
                try:
                    time.sleep(left)
                except KeyboardInterrupt:
                    if not self.stuck:
                        raise

    def act(self, session, obs: dict, step: int, want_video: bool = False, committed: np.ndarray | None = None):
        time.sleep(1 if self.signalled else self.slow_s if session["seed"] == self.ending_seed else 0)
        return super().act(session, obs, step, want_video, committed)


def test_a_stopped_ray_rollout_reports_every_workers_ended_episodes(expected, tmp_path):
    """`tests/ray_rollout_session.py`, in a network namespace of its own (Ray listens on every interface), as the Ray
    Serve tests, one Ray session for every check. A worker refused part way kept its ended episodes, and the other
    worker's were dropped. A worker whose process died (OOM-killed) ended the run with a traceback and no report. A
    worker that could not build its policy (its token file missing) ended the run with its error alone (here a
    traceback), the other worker's episodes dropped. Ctrl-C under --ray wrote no report, the episodes of every worker
    lost; then it waited for the workers without limit (one in a call that does not return: until it did). Run as
    `python -m robots.rollout`, a worker's error was not caught (the module runs as `__main__`, whose classes are not
    those the workers raise): a traceback, not one line."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'policy-server[ray]')")
    if subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode:
        pytest.skip("no network namespace can be made here (unshare -rn)")
    tests = os.path.dirname(__file__)
    # Ray's sockets live in RAY_TMPDIR, whose path must stay short (108 bytes at most for a Unix socket's).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), tests]),
           "RAY_TMPDIR": tempfile.mkdtemp(prefix="ray")}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(["unshare", "-rn", sys.executable, os.path.join(tests, "ray_rollout_session.py"),
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=400)
    checks = [line[line.index("ray_rollout_session: "):] for line in done.stderr.splitlines()
              if "ray_rollout_session: " in line]
    assert done.returncode == 0, "\n".join(checks) + "\n...\n" + done.stderr[-8000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    # A worker's RolloutStopped, of a Ctrl-C that came mid-episode, was logged by Ray as 'Unhandled error', with its
    # traceback ("sent").
    assert "Unhandled error" not in done.stderr, done.stderr[done.stderr.index("Unhandled error") - 4000:][:8000]

    cause, finished = seen["refused"]
    assert cause == str(REFUSED) and [tuple(episode) for episode in finished] == expected[:3]
    # Its session, open, held a place until it idled out: the driver closes it.
    cause, finished, sessions_open = seen["killed"]
    assert cause.startswith("Ray worker 1 died (WorkerCrashedError: The worker died unexpectedly")
    assert [episode[0] for episode in finished] == [HELDOUT_SEED_OFFSET + i for i in range(3)] and sessions_open == 0
    # Which worker builds its policy first is the race's; the other's error names it, its own episodes are reported.
    cause, finished = seen["unbuilt"]
    unbuilt = 0 if cause.startswith("Ray worker 0: ") else 1
    assert cause == (f"Ray worker {unbuilt}: ValueError: cannot read auth token file {tmp_path}/missing_token: No "
                     "such file or directory")
    assert [tuple(episode) for episode in finished] == (expected[2:4] if unbuilt == 0 else expected[:2])
    # A Ctrl-C as a worker's episode reached the driver, not taken yet (a cancel dropped it from the stream), or as the
    # worker closed its session, the episode ended, in a close that the cancel did not end (the worker, ended there
    # after the grace, never sent it): it is reported, in its place (seed index 0 came again at position 3: a handed
    # over episode was placed by its seed, there).
    for case in ("sent", "ending"):
        cause, finished = seen[case]
        assert cause == "interrupted (Ctrl-C)" and tuple(finished[0]) == expected[0], (case, finished)
        assert all(tuple(episode) in expected for episode in finished), (case, finished)
    assert tuple(seen["ending"][1][1]) == expected[2], seen["ending"]

    code, error = seen["execute"]
    assert code == 2 and "Traceback" not in error, error
    assert "\npolicy-rollout: --execute 9: the chunks hold 8 actions\n" in error  # among Ray's log lines

    # Each worker had ended its first episode and was in its second, when a Ctrl-C came, and another in the grace:
    # worker 1, its tick unanswered, was ended then (worker 0 too, unless its cancel had stopped it), and the driver
    # closed the sessions left open (one held a place until it idled out).
    code, error, sessions_open, exit_s = seen["ctrl_c"]
    report = json.loads((tmp_path / "ctrl_c.json").read_text())
    assert code == 130 and "Traceback" not in error and sessions_open == 0, error
    assert exit_s < 8.0, exit_s  # the second Ctrl-C ended worker 1 at once, not at the 10 s grace's end
    assert report["stopped_by"] == "interrupted (Ctrl-C)"
    assert [e["seed"] - HELDOUT_SEED_OFFSET for e in report["per_episode"]] == [0, 2]
    assert report["unfinished_seeds"] == [HELDOUT_SEED_OFFSET + 1, HELDOUT_SEED_OFFSET + 3]
    # What the grace waits for, then one line, after Ray's own (and the escapes that redraw the progress bars of the
    # workers ended)
    waiting, line = [line for line in error.splitlines() if "policy-rollout: " in line]
    assert waiting.endswith("policy-rollout: interrupted; waiting up to 10 s for the Ray workers to end their ticks "
                            "and close their sessions (Ctrl-C again to end them at once)"), error
    assert line.endswith(f"policy-rollout: interrupted (Ctrl-C); {tmp_path}/ctrl_c.json reports the 2 episodes that "
                         "had ended, not the 2 others (unfinished_seeds)"), error


def test_the_summary_plot_counts_whole_episodes_and_ticks():
    """Two episodes of a few ticks were drawn on axes ticked at episode -0.25, 0.25, ... and 0.2 ticks."""
    results = [rollout.EpisodeResult(seed=HELDOUT_SEED_OFFSET + i, instruction="reach the red circle",
                                     success=bool(i), steps=7 + 3 * i,
                                     ticks=[TickStats(60.0 + 5 * i + t, 85.0, True, 40, 0, 0, "n20-cfg20-nocache")
                                            for t in range(2 + i)])
               for i in range(2)]
    report = rollout.summarize(results, 1.0, {}, budgeted=True)
    left, right = rollout.summary_figure(report, [t.latency_ms for r in results for t in r.ticks]).axes
    for axis, (low, high) in ((left.yaxis, left.get_ylim()), (right.xaxis, right.get_xlim()),
                              (right.yaxis, right.get_ylim())):
        shown = [tick for tick in axis.get_majorticklocs() if low <= tick <= high]
        assert len(shown) >= 2 and all(float(tick).is_integer() for tick in shown), shown


def test_a_ctrl_c_while_the_plot_and_videos_are_written_keeps_the_report(tmp_path, monkeypatch, capsys):
    """Videos take a while to encode after the episodes (after a Ctrl-C too): a Ctrl-C then was a traceback."""
    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(rollout, "plot_summary", interrupted)
    out = tmp_path / "rollout.json"
    with serve_fake(FakeEngine()) as server:
        try:
            code = main(["--server", server.target, "--episodes", "2", "--out", str(out)])
        except KeyboardInterrupt:  # raised on, it would end the test session
            pytest.fail("the Ctrl-C left main()")
    assert code == 130 and json.loads(out.read_text())["episodes"] == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"policy-rollout: interrupted (Ctrl-C) writing the plot and "
                                                        f"videos, which may be missing or cut short; {out} reports "
                                                        "the 2 episodes that had ended")


def test_the_sessions_ray_workers_left_open_are_closed_by_the_driver_or_left_to_the_idle_timeout(tmp_path, capsys):
    """`ray_rollout._close_left_open`: the driver closes what the workers it ended, or that died, left open; one gone
    already is no failure; where it cannot (the server does not answer, or no client can be made on the driver's
    node: a token file it lacks), one line says the server closes them once idle, and the run's report stands."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'policy-server[ray]')")
    from policy_server.client import PolicyClient
    from robots.ray_rollout import _close_left_open

    engine = FakeEngine()
    with serve_fake(engine) as server:
        connect = functools.partial(PolicyClient, server.target)
        with connect() as client:
            session = client.open_session("pusht", "reach the red circle", rate_hz=0.0)
        left_open = {1: (connect, {session.session_id: "r" * 16})}
        _close_left_open(left_open)
        assert engine.stats().sessions == 0
        _close_left_open(left_open)  # SESSION_NOT_FOUND: gone already
        assert capsys.readouterr().err == ""
        _close_left_open({1: (functools.partial(PolicyClient, server.target, token_file=tmp_path / "missing"),
                              {"s" * 32: "r" * 16})})
    _close_left_open({0: (functools.partial(PolicyClient, server.target), {"s" * 32: "r" * 16})})
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == (f"policy-rollout: could not close the 1 session(s) Ray worker 1 left open (ValueError: cannot "
                        f"read auth token file {tmp_path}/missing: No such file or directory); the server closes them "
                        "once idle")
    assert lines[1].startswith(f"policy-rollout: could not close the 1 session(s) Ray worker 0 left open "
                               f"(PolicyServerError: DEADLINE_EXCEEDED: no answer from {server.target} within 2 s")
    assert lines[1].endswith("); the server closes them once idle") and len(lines) == 2, lines


class RedeployedEngine(FakeEngine):
    """Loses every session as its `at_tick`th tick comes, and serves other weights from then on: a server redeployed
    with a new model."""

    def __init__(self, at_tick: int):
        super().__init__()
        self.at_tick = at_tick

    def act(self, session_id, *args, **kwargs):
        if len(self.acts) + 1 == self.at_tick and self._info.model_digest == "sha256:fake":
            self._info = dataclasses.replace(self._info, model_digest="sha256:redeployed")
            with self._lock:
                self._sessions.clear()
        return super().act(session_id, *args, **kwargs)


def test_a_server_redeployed_with_other_weights_stops_the_run_rather_than_mixing_two_models(tmp_path):
    """A lost session runs again once the server serves, unless the server now serves other weights: one report
    holds one model's episodes (their seeds and instructions alike, a redeploy mid-sweep averaged two models)."""
    with serve_fake(RedeployedEngine(at_tick=40)) as server:
        code = main(["--server", server.target, "--episodes", "6", "--out", str(tmp_path / "rollout.json")])
    report = json.loads((tmp_path / "rollout.json").read_text())
    assert code == 2 and 0 < report["episodes"] < 6 and report["restarted_episodes"] == 0
    assert report["stopped_by"] == (f"{server.target} now serves fake-policy (sha256:redeployed), not the fake-policy "
                                    "(sha256:fake) the episodes so far ran on")


class GatedEngine(FakeEngine):
    """Holds every tick from the `acts_before`th on until `gate` is set; `reached` says one is held."""

    def __init__(self, acts_before: int):
        super().__init__()
        self.acts_before, self.reached, self.gate = acts_before, threading.Event(), threading.Event()

    def act(self, session_id, *args, **kwargs):
        if len(self.acts) >= self.acts_before:
            self.reached.set()
            self.gate.wait(30)
        return super().act(session_id, *args, **kwargs)


def test_ctrl_c_mid_run_ends_cleanly_and_reports_the_episodes_that_ended(tmp_path):
    """A terminal's Ctrl-C reaches the rollout and its environments' processes (one process group)."""
    out = tmp_path / "rollout.json"
    engine = GatedEngine(acts_before=50)
    with serve_fake(engine) as server:
        rollout_process = subprocess.Popen(
            [sys.executable, "-m", "robots.rollout", "--server", server.target, "--episodes", "8", "--num-envs", "2",
             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        assert engine.reached.wait(120)
        os.killpg(rollout_process.pid, signal.SIGINT)
        time.sleep(0.5)  # the signal is taken before the tick held is answered
        engine.gate.set()
        _, error = rollout_process.communicate(timeout=60)
    report = json.loads(out.read_text())
    assert rollout_process.returncode == 130 and report["stopped_by"] == "interrupted (Ctrl-C)"
    assert 0 < report["episodes"] < 8 and len(report["unfinished_seeds"]) == 8 - report["episodes"]
    assert error.startswith("policy-rollout: interrupted (Ctrl-C);") and error.count("\n") == 1, error


CLOSED = PolicyServerError.from_detail(pb.ErrorDetail(
    code="NOT_FOUND", reason="SESSION_NOT_FOUND", metadata={"session_id": "s1", "session_end": "closed"},
    message="session 's1' was closed 0 s ago: a CloseSession call closed it"))


@pytest.mark.parametrize("num_envs", [1, 2])
def test_an_episode_whose_session_was_closed_under_it_ends_there_and_is_not_run_again(expected, num_envs, capsys):
    """A session a CloseSession call closed (an operator's, another client's) was taken for one the server lost: its
    episode ran again from its seed in a new session, as after a restart, undoing the close. It now ends where it was,
    as the client library treats such a session, and the next episode takes its sub-environment."""
    policy = FailingPolicy(failing=2, error=CLOSED)
    results = run_episodes(policy, REACH_ID, range(EPISODES), num_envs, EXECUTE)
    closed = results[2]
    assert (closed.seed, closed.closed, closed.success, closed.steps, len(closed.ticks), closed.restarts) == (
        HELDOUT_SEED_OFFSET + 2, str(CLOSED), False, 2 * EXECUTE, 2, [])
    others = [(r.seed, r.instruction, r.success, r.steps, len(r.ticks)) for r in results if not r.closed]
    assert others == expected[:2] + expected[3:]
    assert [seed for seed, _ in policy.opened].count(HELDOUT_SEED_OFFSET + 2) == 1  # not opened again
    assert sorted(policy.closed) == sorted(seed for seed, _ in policy.opened)
    assert capsys.readouterr().err == (
        f"policy-rollout: episode seed {HELDOUT_SEED_OFFSET + 2}: its session was closed under it after 2 ticks "
        f"({CLOSED}); it ends there and is not run again (closed_episodes)\n")


class ClosingEngine(FakeEngine):
    """Ends the session of seed index `index` before its third tick as `how` says: "closed" as an operator's
    CloseSession call closes it, "expired" as the idle timeout does (a rollout stalled past it), "lost" as a restart
    loses it (the server no longer knows it)."""

    def __init__(self, index: int, how: str):
        super().__init__()
        self.seed, self.how, self.ticks = HELDOUT_SEED_OFFSET + index, how, 0

    def act(self, session_id, *args, **kwargs):
        if self.session(session_id).seed == self.seed:
            self.ticks += 1
            if self.ticks == 3:
                if self.how == "closed":
                    self.close_session(session_id)
                elif self.how == "expired":
                    self.expire(session_id)
                else:
                    with self._lock:
                        del self._sessions[session_id]
        return super().act(session_id, *args, **kwargs)


@pytest.mark.parametrize("how", ["closed", "expired", "lost"])
def test_a_session_closed_by_a_close_session_call_is_reported_and_one_the_server_lost_runs_again(tmp_path, capsys,
                                                                                                 how):
    """Through a real server: the error of a call on a session that a CloseSession call closed says so
    (`session_end` closed), and the rollout ends that episode, names it (`closed_episodes`, stderr) and exits 2, its
    figures over the episodes that ran through. An expired session, or one the server does not know (restarted), runs
    again from its seed as before."""
    out = tmp_path / "rollout.json"
    engine = ClosingEngine(index=1, how=how)
    with serve_fake(engine) as server:
        code = main(["--server", server.target, "--episodes", "3", "--num-envs", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    err = capsys.readouterr().err
    seed = HELDOUT_SEED_OFFSET + 1
    opened = sorted(engine.request_ids)
    if how == "closed":
        assert code == 2 and report["stopped_by"] is None and report["unfinished_seeds"] == []
        (closed,) = report["closed_episodes"]
        assert closed == {"seed": seed, "steps": 2 * EXECUTE, "ticks": 2, "restarts": [], "error": closed["error"]}
        assert closed["error"].startswith("NOT_FOUND SESSION_NOT_FOUND: session 's") and closed["error"].endswith(
            "' was closed 0 s ago: a CloseSession call closed it")
        assert [e["seed"] for e in report["per_episode"]] == [HELDOUT_SEED_OFFSET, HELDOUT_SEED_OFFSET + 2]
        assert report["episodes"] == 2 and report["restarted_episodes"] == 0
        assert report["ticks"] == sum(len(e["ticks"]["latency_ms"]) for e in report["per_episode"])
        assert len(opened) == 3  # one session per episode: the closed one is not opened again
        lines = err.splitlines()
        assert lines[0] == (f"policy-rollout: episode seed {seed}: its session was closed under it after 2 ticks "
                            f"({closed['error']}); it ends there and is not run again (closed_episodes)")
        assert lines[-1] == (f"policy-rollout: the sessions of 1 episodes (seeds {seed}) were closed under them, the "
                             f"first: {closed['error']}; {out} reports the 2 episodes that had ended, and apart the 1 "
                             "closed under them (closed_episodes)")
    else:
        assert code == 0 and report["closed_episodes"] == [] and report["episodes"] == 3
        assert report["restarts_by_reason"] == {"SESSION_NOT_FOUND": 1} and len(opened) == 4
        assert f"policy-rollout: episode seed {seed} lost its session after 2 ticks" in err
