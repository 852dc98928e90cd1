"""`policy-rollout`: closed-loop episodes of a built-in Reach task driven by the policy.

    policy-rollout --server 127.0.0.1:50051 --episodes 100 --num-envs 4
    policy-rollout --in-process --episodes 100 --latency-budget-ms 60 --out runs/reach.json --videos 4
    policy-rollout --in-process --ray 8 --episodes 1000                       # 8 Ray workers, an engine each
    policy-rollout --server 10.0.0.5:9000 --serve-application policy --ray 16 --episodes 1000

`--num-envs` episodes run at once in a gymnasium vector env (asynchronous, a process per environment, when
more than one), each with its own session; a tick sends the camera frame and effector state, and the
robot executes the first `--execute` actions of the returned chunk before asking again. Episodes use
held-out seeds (never seen in the demonstrations): episode i has seed `HELDOUT_SEED_OFFSET + i`, whatever
`--num-envs`. The JSON report holds the success rate, episode lengths, per-tick latency (p50/p99),
deadline misses, cache decisions and each episode's ticks; a PNG summary sits beside it, and `--videos N`
writes MP4s (H.264, browser-playable) of the first N episodes with the predicted future frames (the session's
preview frames, from a server or in-process) beside the real ones. An episode whose session the server lost (restarted
or redeployed) runs again from its seed once the server serves (`restarted_episodes`); one whose session a CloseSession
call closed (an operator, another client) ends there, is not run again, and is reported apart (`closed_episodes`, exit
2). Ctrl-C or the server's error part way still writes the report, of the episodes that had ended (`stopped_by`,
`unfinished_seeds`); with `--ray`, every worker's, as when a worker fails (building its policy included) or its process
dies (exit 2).

`--ray N` spreads the episodes over N Ray workers (`robots/ray_rollout.py`), each with its own in-process engine
(on `--device`, with `--ray-gpus-per-worker` GPUs) or its own client of `--server` (a policy-server, or with
`--serve-application` Ray Serve's gRPC proxy), each streaming its episodes to this process as they end; the report is
the one a local run of the same episodes gives, all workers' ticks merged.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import sys
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import gymnasium
import numpy as np
from tqdm import tqdm

from policy_server import __version__
from policy_server.client.cli_flags import add_tls_flags, server_address, tls_options, token_file
from policy_server.client.errors import PolicyServerError
from policy_server.client.sync_client import SERVING_WAIT_S
from policy_server.engine.api import EngineError
from policy_server.limits import MAX_BUDGET_MS
from policy_server.output_file import report_file
from robots.envs import EMBODIMENT, ENV_IDS, HELDOUT_SEED_OFFSET, REACH_ID, ReachScene


class RolloutError(ValueError):
    """Options the rollout cannot run with; the message says which."""


class EpisodeLost(Exception):
    """An episode's session was lost once more than `MAX_EPISODE_RESTARTS` allows, or as many of its openings got no
    answer in a row; the message says which, and the last loss."""


class RolloutStopped(Exception):
    """The episodes ended before all had run: by `cause` (Ctrl-C, or the server's or engine's error); `finished`
    holds the episodes that had ended, in the order asked for."""

    def __init__(self, cause: BaseException, finished: list[EpisodeResult]):
        super().__init__(cause, finished)  # the arguments Ray's pickling rebuilds it from
        self.cause, self.finished = cause, finished

    def __str__(self) -> str:
        return "interrupted (Ctrl-C)" if isinstance(self.cause, KeyboardInterrupt) else str(self.cause)


SERVING_NOTICE_S = 5.0  # a --server not serving after this is said to be waited for, SERVING_WAIT_S more
# An episode whose session is lost more often than this, or whose opening gets no answer more often in a row, stops the
# rollout
MAX_EPISODE_RESTARTS = 3


@dataclass
class TickStats:
    latency_ms: float
    budget_ms: float
    deadline_met: bool
    full_calls: int
    skipped_calls: int
    forced_skips: int
    setting: str
    batch_size: int = 1  # ticks of other sessions it ran with, itself included
    # What the planner or the in-tick guard gave up, in order (e.g. "late_drop_uncond_from_step=10"): why a tick ran
    # fewer calls than its setting's steps and CFG steps
    fallbacks: tuple[str, ...] = ()

    @classmethod
    def of(cls, tick) -> TickStats:
        """From a tick record (the client's `ActionChunk.tick` or the engine's `TickRecord`)."""
        return cls(tick.actual_ms["total"], tick.budget_ms, tick.deadline_met, tick.full_calls, tick.skipped_calls,
                   tick.forced_skips, tick.setting, int(tick.knobs["batch_size"]), tuple(tick.fallbacks))


@dataclass
class EpisodeResult:
    seed: int
    instruction: str
    success: bool
    steps: int
    target_color: str = ""
    final_distance_m: float = 0.0  # effector to target at the end
    nearest_color: str = ""  # the object the effector ended closest to: tells a wrong choice from imprecision
    collided: bool = False  # ended on the blocker (ReachEither)
    # |a[t + 1] - a[t]| of the executed actions: where a new chunk takes over, and between a chunk's own actions
    switch_jumps: list[float] = field(default_factory=list)
    chunk_steps: list[float] = field(default_factory=list)
    ticks: list[TickStats] = field(default_factory=list)
    frames: list[np.ndarray] = field(default_factory=list)  # side-by-side video frames, when recorded
    # The tries of this episode abandoned before it ran through, their session lost: {"reason", "error",
    # "ticks_discarded"} each. An opening that got no answer, sent again, abandons no try: not among them.
    restarts: list[dict] = field(default_factory=list)
    # The server's error where a CloseSession call (an operator, another client) closed its session under it: the
    # episode stopped there, `steps` and `ticks` in, neither a success nor a failure of the policy, and is not run again
    closed: str = ""


def check_drives(model: object, chunk_sizes: dict[str, int], execute: int, delay: int) -> None:
    """The built-in Reach task is driven as `EMBODIMENT` (an `image` camera, 2-D state and velocity actions):
    RolloutError where `model` (a server's address, a checkpoint) does not serve it, or where its chunks (`chunk_sizes`:
    each served embodiment's default chunk size) cannot hold the `delay` and `execute` actions, rather than a session
    or a chunk refused after the warmup."""
    if EMBODIMENT not in chunk_sizes:
        raise RolloutError(f"{model} serves {list(chunk_sizes)}, not {EMBODIMENT!r}, the embodiment policy-rollout "
                           "drives the built-in Reach task as (a checkpoint trained on its demonstrations, "
                           "robots.datagen's)")
    check_execute(execute, delay, chunk_sizes[EMBODIMENT])


def check_execute(execute: int, delay: int, chunk: int) -> None:
    """RolloutError where a chunk of `chunk` actions cannot hold the `delay` stale ones and the `execute` run after."""
    if delay + execute > chunk:
        flags = f"--delay-steps {delay} and --execute {execute}" if delay else f"--execute {execute}"
        raise RolloutError(f"{flags}: the chunks hold {chunk} actions")


class ServerPolicy:
    """Talks to a running server through the client library."""

    def __init__(self, target: str, budget_ms: float | None, token_file: Path | None,
                 serve_application: str | None, tls: dict, execute: int, delay: int):
        """`tls`: `PolicyClient`'s TLS arguments (`tls_options`); `execute`, `delay`: as `check_drives` takes them."""
        from policy_server.client import PolicyClient

        # A client of the same server, made anywhere: a Ray driver closes the sessions of a worker it ended
        self.connect = functools.partial(PolicyClient, target, token_file=token_file,
                                         serve_application=serve_application, **tls)
        self.client = self.connect(timeout_s=60)
        self.model = None  # the served model's pb.ModelInfo, once it serves
        self.execute, self.delay = execute, delay
        self.wait_until_serving()
        self.budget_ms = budget_ms

    def wait_until_serving(self) -> None:
        """Until the server serves, saying so on stderr after `SERVING_NOTICE_S`; TimeoutError after `SERVING_WAIT_S`
        more. RolloutError where it serves other weights than before (redeployed with a new model): one report holds
        one model's episodes."""
        try:
            self.client.wait_until_serving(timeout_s=SERVING_NOTICE_S)
        except TimeoutError as waited:  # it names what it saw: no answer, a connection closed before a word, ...
            print(f"policy-rollout: waiting up to {SERVING_WAIT_S:g} s for {self.client.target} to serve (starting, "
                  f"warming up, or nothing listening there; {waited})", file=sys.stderr, flush=True)
            self.client.wait_until_serving(timeout_s=SERVING_WAIT_S)
        info = self.client.server_info()
        check_drives(self.client.target, {embodiment.name: embodiment.default_chunk_size
                                          for embodiment in info.embodiments}, self.execute, self.delay)
        model = info.model
        if self.model is not None and model.digest != self.model.digest:
            raise RolloutError(f"{self.client.target} now serves {model.name} ({model.digest}), not the "
                               f"{self.model.name} ({self.model.digest}) the episodes so far ran on")
        self.model = model

    def open(self, instruction: str, seed: int, preview: bool, request_id: str):
        # A simulation asks again as soon as it is answered: a closed loop (rate 0), not a declared rate.
        return self.client.open_session(EMBODIMENT, instruction, budget_ms=self.budget_ms, seed=seed, rate_hz=0.0,
                                        preview=preview, request_id=request_id)

    def act(self, session, obs: dict, step: int, want_video: bool = False, committed: np.ndarray | None = None):
        chunk = self.client.act(session, {"image": obs["image"]}, obs["state"], step_index=step,
                                committed_actions=committed, encoding="png")
        return chunk.actions, TickStats.of(chunk.tick), chunk.preview_frames if want_video else None

    def close(self, session) -> None:
        self.client.close_session(session)


class InProcessPolicy:
    """Runs the engine in this process (no network); sessions of recorded episodes get the predicted video
    as preview frames. `sampler_overrides` (`num_steps`, `guidance`) replace the checkpoint's sampler
    settings: the pipeline is built with the validated overridden config. `quality_profile` is the server's
    setting ("auto", "off" or a file); a profile holds cached ticks at the checkpoint's own sampler settings."""

    def __init__(self, checkpoint: Path | None, budget_ms: float, cache: bool, num_envs: int,
                 sampler_overrides: dict, quality_profile: str, execute: int, delay: int, device: str = "cpu",
                 compile_gen_stack: bool | None = None):
        import torch
        from pydantic import ValidationError

        from policy_server.engine.calibration import resolve_profile
        from policy_server.engine.engine import EngineSettings, ModelEngine, resolve_device, resolve_dtype
        from policy_server.pipeline.policy import PolicyPipeline
        from policy_server.pipeline.policy_config import PolicyConfig

        device = resolve_device(device)
        if device == "cpu":
            torch.set_num_threads(1)
        pipeline = PolicyPipeline.from_pretrained(checkpoint, device=device, dtype=resolve_dtype("auto", device))
        chunk_sizes = {name: pipeline.embodiments.get(name).default_chunk_size for name in pipeline.served_embodiments}
        check_drives(checkpoint or "the embedded model", chunk_sizes, execute, delay)  # before the warmup
        if sampler_overrides:
            try:  # against the checkpoint's own settings (its guidance_interval may hold no step of --num-steps)
                config = PolicyConfig.model_validate({**pipeline.config.model_dump(), **sampler_overrides})
            except ValidationError as error:
                flags = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in sampler_overrides.items())
                raise RolloutError(f"{flags} with the sampler settings of {checkpoint or 'the embedded model'}: "
                                   + "; ".join(problem["msg"].removeprefix("Value error, ")
                                               for problem in error.errors())) from None
            pipeline = PolicyPipeline(pipeline.transformer, pipeline.vae, pipeline.tokenizer, pipeline.embodiments,
                                      config, pipeline.served_embodiments, pipeline.digest)
        profile, calibrate = resolve_profile(quality_profile, pipeline.folder, pipeline.digest,
                                             pipeline.served_embodiments, pipeline.config)
        self.engine = ModelEngine(pipeline, EngineSettings(default_budget_ms=budget_ms, diffusion_cache=cache,
                                                           max_sessions=max(4, num_envs), quality_profile=profile,
                                                           calibrate_at_warmup=calibrate,
                                                           compile_gen_stack=compile_gen_stack))
        self.engine.start()
        self.engine.wait_ready()

    def open(self, instruction: str, seed: int, preview: bool, request_id: str):
        return self.engine.open_session(EMBODIMENT, instruction, seed=seed, rate_hz=0.0, preview=preview,
                                        request_id=request_id)

    def act(self, session, obs: dict, step: int, want_video: bool = False, committed: np.ndarray | None = None):
        from policy_server.engine.api import Observation

        observation = Observation(images={"image": obs["image"]}, state=obs["state"], step_index=step,
                                  committed_actions=committed)
        result = self.engine.act(session.session_id, session.epoch, observation)
        return result.actions, TickStats.of(result.tick), result.preview_frames if want_video else None

    def close(self, session) -> None:
        self.engine.close_session(session.session_id)


@dataclass
class _Running:
    """A sub-environment's episode in progress: its session and what is left of its last chunk (with a delay, the
    actions it executes while its next tick runs lead)."""

    position: int  # in the order of the episodes asked for
    index: int  # its held-out seed index
    result: EpisodeResult
    session: object
    record_video: bool
    actions: deque = field(default_factory=deque)  # the last chunk's actions not executed yet, [action_dim] each
    predicted: np.ndarray | None = None  # the last chunk's predicted frames, when recording
    executed: int = 0  # actions executed from the last chunk
    last_action: np.ndarray | None = None  # the action executed last, [action_dim]


def run_episodes(policy, env_id: str, indices: Sequence[int], num_envs: int, execute: int,
                 videos: int = 0, progress=None, delay: int = 0, commit: bool = False) -> list[EpisodeResult]:
    """The episodes of `episodes_as_they_end`, in the order of `indices`."""
    results: list[EpisodeResult | None] = [None] * len(indices)
    episodes = episodes_as_they_end(policy, env_id, indices, num_envs, execute, videos, progress, delay, commit)
    try:
        for position, result in episodes:
            results[position] = result
    except KeyboardInterrupt as interrupt:  # here, between two of its episodes: they stop as on a Ctrl-C within
        episodes.throw(interrupt)  # raises RolloutStopped with the episodes that had ended, their sessions closed
    return results


def episodes_as_they_end(policy, env_id: str, indices: Sequence[int], num_envs: int, execute: int, videos: int = 0,
                         progress=None, delay: int = 0, commit: bool = False) -> Iterator[tuple[int, EpisodeResult]]:
    """One episode per held-out seed index in `indices` (seed `HELDOUT_SEED_OFFSET + index`), up to `num_envs` at
    once in a gymnasium vector env of `env_id`; the first `videos` episodes record side-by-side frames. Yields each
    episode as it ends, before its session is closed: its position in `indices` and its result. `progress`: a tqdm
    bar, advanced by one as each episode ends.

    Each chunk's first `execute` actions run, but for `delay`: a tick's inference time in control steps, simulated.
    A tick is asked for while `delay` actions of the last chunk are left; they run while it is computed, so its
    chunk's first `delay` actions are stale and the next `execute` run after them (the first tick of an episode has
    none left, and runs from its chunk's first action). `commit`: send those `delay` actions as the observation's
    committed actions, which the chunk then starts with and continues (real-time chunking).

    As in LeRobot's evaluation, several environments run asynchronously (a process each, observations in shared
    memory) and a single one in this process. A sub-environment whose episode ends starts the next pending one
    before the next step (a masked reset on that episode's seed), so an episode does not depend on `num_envs`;
    gymnasium's next-step autoreset only reaches sub-environments left without an episode at the end, and their
    steps are discarded.

    A session lost to the server (`lost_server`: restarted, redeployed, down) abandons its episode's try, whose ticks
    and frames are dropped: once `policy.wait_until_serving()` returns, the episode runs again from its seed in a new
    session, and its result lists the tries abandoned (`EpisodeResult.restarts`); an opening that failed so is sent
    again under its request id once the server serves, so that a server that had opened the session answers with it (no
    try abandoned: not a restart). A session a CloseSession call closed (`PolicyServerError.session_closed`: an
    operator, another client; not the server losing it) ends its episode where it was, as `EpisodeResult.closed` says,
    yielded as the others,
    and the next pending episode takes its sub-environment: the client library never reopens such a session.
    Ctrl-C, another error of the server or engine (a refusal), a server not serving again in time (TimeoutError) or an
    episode lost more than `MAX_EPISODE_RESTARTS` times, or whose opening failed so more often in a row
    (`EpisodeLost`), raises `RolloutStopped` with the episodes that had ended. A session the server
    may have opened under an episode whose openings all got no answer stays open until the server's idle timeout: the
    client has no session id to close it by, and asking again under its request id is what got no answer.
    """
    num_envs = min(num_envs, len(indices))
    parallel = num_envs > 1
    envs = gymnasium.make_vec(
        env_id, num_envs, vectorization_mode="async" if parallel else "sync",
        # Workers start from a clean process, not as forks of one running model threads.
        vector_kwargs={"context": "forkserver"} if parallel else {},
        render_mode="rgb_array", render_size=128)
    no_action = np.zeros(envs.single_action_space.shape, envs.single_action_space.dtype)
    # (position, seed index, its tries abandoned so far); an episode run again goes first
    pending = deque((position, index, []) for position, index in enumerate(indices))
    running: list[_Running | None] = [None] * num_envs
    results: list[EpisodeResult | None] = [None] * len(indices)
    serving = True  # False from a lost session until the server serves again: nothing to close meanwhile

    def start(slots: list[int], obs: dict | None) -> dict | None:
        """Start the next pending episodes on sub-environments `slots`; the batch's observations after."""
        starting = {slot: pending.popleft() for slot in slots[:len(pending)]}  # fewer when the episodes run out
        if not starting:
            return obs
        seeds = [HELDOUT_SEED_OFFSET + starting[i][1] if i in starting else None for i in range(num_envs)]
        obs, _ = envs.reset(seed=seeds, options={"reset_mask": np.array([i in starting for i in range(num_envs)])})
        instructions = envs.call("task_description")
        for i, (position, index, restarts) in starting.items():
            record = position < videos
            result = EpisodeResult(seed=seeds[i], instruction=instructions[i], success=False, steps=0,
                                   restarts=restarts)
            running[i] = _Running(position, index, result, open_session(result, record), record)
        return obs

    def open_session(result: EpisodeResult, record: bool):
        nonlocal serving
        # One request id for every try: a session the server opened while its answer was lost (no answer within the
        # call's deadline) would hold a place until it idled out. A session lost later is opened anew, under a new id.
        request_id = uuid.uuid4().hex
        failed = 0  # openings that got no answer: no try of the episode abandoned, so not among its restarts
        while True:
            try:
                return policy.open(result.instruction, result.seed, record, request_id)
            except PolicyServerError as error:
                if not lost_server(error):
                    raise
                failed += 1
                if failed > MAX_EPISODE_RESTARTS:
                    raise EpisodeLost(f"episode seed {result.seed} got no session in {failed} openings, the last: "
                                      f"{error}") from error
                print(f"policy-rollout: episode seed {result.seed}: opening its session failed ({error}); opening it "
                      f"again under its request id once the server serves (try {failed + 1} of "
                      f"{MAX_EPISODE_RESTARTS + 1})", file=sys.stderr, flush=True)
                serving = False
                await_server()

    def lose(result: EpisodeResult, error: PolicyServerError) -> None:
        """Count a lost try of `result`'s episode, or raise EpisodeLost where it has had its restarts."""
        nonlocal serving
        serving = False
        if len(result.restarts) == MAX_EPISODE_RESTARTS:
            raise EpisodeLost(f"episode seed {result.seed} lost its session {MAX_EPISODE_RESTARTS + 1} times, the "
                              f"last: {error}") from error
        result.restarts.append({"reason": error.reason, "error": str(error), "ticks_discarded": len(result.ticks)})
        print(f"policy-rollout: episode seed {result.seed} lost its session after {len(result.ticks)} ticks ({error});"
              f" running it again from its seed (restart {len(result.restarts)} of {MAX_EPISODE_RESTARTS})",
              file=sys.stderr, flush=True)

    def await_server() -> None:
        nonlocal serving
        policy.wait_until_serving()
        serving = True

    def restart(lost: list[tuple[int, PolicyServerError]], obs: dict) -> dict:
        """Abandon the episodes of sub-environments `lost` and start them again, in new sessions, once the server
        serves; the batch's observations after."""
        for i, error in lost:
            lose(running[i].result, error)
        await_server()
        for i, _ in lost:
            close(running[i].session)  # gone with a restarted server; a live one frees its place
        pending.extendleft(reversed([(running[i].position, running[i].index, running[i].result.restarts)
                                     for i, _ in lost]))
        for i, _ in lost:
            running[i] = None
        return start([i for i, _ in lost], obs)

    def close(session) -> None:
        """Close `session`; one the server lost (an episode may end on the actions it had) or that was closed under
        it needs no closing."""
        try:
            policy.close(session)
        except PolicyServerError as error:
            if not (lost_server(error) or error.session_closed):
                raise

    def end_closed(slots: list[tuple[int, PolicyServerError]]) -> Iterator[tuple[int, EpisodeResult]]:
        """End the episodes of sub-environments `slots`, whose sessions a CloseSession call closed, where they were:
        each is yielded as one that ended (its position and result), a line on stderr saying so."""
        for i, error in slots:
            run = running[i]
            run.result.closed = str(error)
            print(f"policy-rollout: episode seed {run.result.seed}: its session was closed under it after "
                  f"{len(run.result.ticks)} ticks ({error}); it ends there and is not run again (closed_episodes)",
                  file=sys.stderr, flush=True)
            results[run.position] = run.result
            if progress is not None:
                progress.update(1)
            yield run.position, run.result
            close(run.session)  # closed already: tells a Ray worker's mailbox it need not close it
            running[i] = None

    def ask(slot: int):
        run = running[slot]
        committed = np.array(run.actions) if commit and run.actions else None
        return policy.act(run.session, {"image": obs["image"][slot], "state": obs["state"][slot]}, run.result.steps,
                          want_video=run.record_video, committed=committed)

    def take(run: _Running, actions: np.ndarray, stats: TickStats, predicted: np.ndarray | None) -> None:
        """Queue the `execute` actions of a chunk that run."""
        check_execute(execute, delay, len(actions))
        run.result.ticks.append(stats)
        stale = len(run.actions)
        before = run.actions[-1] if stale else run.last_action  # the action the new chunk's first follows
        if before is not None:
            run.result.switch_jumps.append(float(np.linalg.norm(actions[stale] - before)))
        run.actions.extend(actions[stale: stale + execute])
        run.result.chunk_steps.extend(np.linalg.norm(np.diff(actions[stale: stale + execute], axis=0), axis=1).tolist())
        run.predicted, run.executed = predicted, 0

    try:
        obs = start(list(range(num_envs)), None)
        with ThreadPoolExecutor(max_workers=num_envs) as pool:
            while any(run is not None for run in running):
                # Sessions whose chunk is spent ask at once, so that the engine can batch their ticks; those that
                # lost their session ask again in new ones.
                asking = [i for i, run in enumerate(running) if run is not None and len(run.actions) <= delay]
                while asking:  # those that lost their session ask again, in new ones, as do the episodes that
                    # take the places of those closed
                    lost, closed = [], []
                    for i, future in [(i, pool.submit(ask, i)) for i in asking]:
                        try:
                            take(running[i], *future.result())
                        except PolicyServerError as error:
                            if error.session_closed:
                                closed.append((i, error))
                            elif lost_server(error):
                                lost.append((i, error))
                            else:
                                raise
                    if closed:
                        yield from end_closed(closed)
                        obs = start([i for i, _ in closed], obs)
                    if lost:
                        obs = restart(lost, obs)
                    asking = [i for i, _ in lost + closed if running[i] is not None]
                for run in running:
                    if run is not None:
                        run.last_action = run.actions.popleft()
                obs, _, terminated, truncated, _ = envs.step(
                    np.stack([no_action if run is None else run.last_action for run in running]))
                recording = any(run is not None and run.record_video for run in running)
                frames = envs.call("render") if recording else None
                ended = []
                for i, run in enumerate(running):
                    if run is None:
                        continue
                    run.result.steps += 1
                    run.executed += 1
                    if run.record_video:
                        run.result.frames.append(_side_by_side(frames[i], run.predicted, run.executed))
                    if terminated[i] or truncated[i]:
                        ended.append(i)
                if ended:
                    scenes = envs.call("scene")  # still the final ones: an autoreset would come with the next step
                    for i in ended:
                        run = running[i]
                        _score(run.result, scenes[i])
                        results[run.position] = run.result
                        if progress is not None:
                            progress.update(1)
                        # Before its session is closed: a consumer that keeps it elsewhere (a Ray worker's mailbox)
                        # has it though the close does not return (the process ended there).
                        yield run.position, run.result
                        close(run.session)
                        running[i] = None
                    obs = start(ended, obs)
    except BaseException as error:  # whatever stops the episodes, their sessions do not hold the server's places
        for run in running:
            if run is not None and serving:  # not while the server is away: each close would wait for it
                with contextlib.suppress(PolicyServerError, EngineError):  # e.g. lost with a restarted server
                    policy.close(run.session)
        # A Ctrl-C reached the environments' processes too: stopped, they are ended, not asked to close (they are gone).
        envs.close(terminate=True)
        if isinstance(error, (KeyboardInterrupt, PolicyServerError, EngineError, RolloutError, TimeoutError,
                              EpisodeLost)):
            raise RolloutStopped(error, [result for result in results if result is not None]) from error
        raise
    envs.close()


def lost_server(error: PolicyServerError) -> bool:
    """Whether a call failed for want of the server that held its session (restarted, redeployed, down: the session
    is gone or unreachable), not refused by it: the episode may run again in a new session once the server serves.
    SESSION_NOT_FOUND of a session the server does not know or that expired (as the client library, which reopens
    those), a lost connection (UNAVAILABLE, or INTERNAL with no server reason), or no answer before the call's
    deadline; not one a CloseSession call closed (`PolicyServerError.session_closed`)."""
    lost_session = error.reason == "SESSION_NOT_FOUND" and not error.session_closed
    return lost_session or error.connection_lost or error.no_answer



def _score(result: EpisodeResult, scene: ReachScene) -> None:
    """Fill in how the episode ended from its final scene."""
    nearest = int(np.argmin(np.linalg.norm(scene.object_xy - scene.effector_xy, axis=1)))
    result.success = scene.success
    result.target_color, result.nearest_color = scene.target_color, scene.object_colors[nearest]
    result.final_distance_m = scene.distance_to_target()
    result.collided = scene.collided


def _side_by_side(real: np.ndarray, predicted: np.ndarray | None, offset: int) -> np.ndarray:
    """Real frame (left) and the model's predicted frame for the same instant (right), 128 px each."""
    size = real.shape[0]
    right = np.zeros_like(real)
    if predicted is not None:
        frame = predicted[min(offset, len(predicted) - 1)]
        right = cv2.resize(frame, (size, size), interpolation=cv2.INTER_NEAREST)
    return np.concatenate([real, right], axis=1)


def summarize(results: list[EpisodeResult], seconds: float, config: dict, budgeted: bool,
              stopped_by: str | None = None, unfinished_seeds: Sequence[int] = ()) -> dict:
    """The rollout's report; `budgeted` False: its ticks ran without a budget (uncached, none asked for), which
    neither `budget_ms` nor the misses then pretend. Each episode lists its ticks in order, a column per field.
    `stopped_by`: what ended the run before the episodes of `unfinished_seeds` had (the figures are over `results`,
    the episodes that ended, but for those whose session a CloseSession call closed: `closed_episodes` lists them,
    each with its seed, steps, ticks, restarts and the server's error). `restarted_episodes`: how many of them ran
    again after a session lost to the server (an opening sent again, no try abandoned, is not counted),
    `restarts_by_reason` the losses by reason (each episode's `restarts` lists its own)."""
    closed = [r for r in results if r.closed]
    results = [r for r in results if not r.closed]
    ticks = [t for r in results for t in r.ticks]
    latency = np.array([t.latency_ms for t in ticks])
    settings: dict[str, int] = {}
    batch_sizes: dict[int, int] = {}
    fallback_ticks: dict[str, int] = {}  # ticks per fallback kind, its step or count left out
    for t in ticks:
        settings[t.setting] = settings.get(t.setting, 0) + 1
        batch_sizes[t.batch_size] = batch_sizes.get(t.batch_size, 0) + 1
        for kind in {fallback.split("=")[0] for fallback in t.fallbacks}:
            fallback_ticks[kind] = fallback_ticks.get(kind, 0) + 1
    success = [r.success for r in results]
    failures = [r for r in results if not r.success]
    restart_reasons: dict[str, int] = {}
    for restart in (restart for r in results + closed for restart in r.restarts):
        restart_reasons[restart["reason"]] = restart_reasons.get(restart["reason"], 0) + 1
    return {
        "config": config,
        "stopped_by": stopped_by,
        "episodes": len(results),
        "unfinished_seeds": list(unfinished_seeds),
        "closed_episodes": [{"seed": r.seed, "steps": r.steps, "ticks": len(r.ticks), "restarts": r.restarts,
                             "error": r.closed} for r in closed],
        "restarted_episodes": sum(bool(r.restarts) for r in results + closed),
        "restarts_by_reason": restart_reasons,
        "success_rate": float(np.mean(success)),
        "episode_length_mean": float(np.mean([r.steps for r in results])),
        "episode_length_success_mean": float(np.mean([r.steps for r in results if r.success])) if any(success)
        else None,
        # Of the failed episodes: how many ended nearest a wrong object, and how far from the target.
        "failures_nearest_wrong_object": sum(r.nearest_color != r.target_color for r in failures),
        "failures_on_the_blocker": sum(r.collided for r in failures),
        "failures_final_distance_m_median": float(np.median([r.final_distance_m for r in failures]))
        if failures else None,
        # Jerk at the seams: how far the action moves where a new chunk takes over, against within a chunk.
        "switch_jump_mean": _mean([jump for r in results for jump in r.switch_jumps]),
        "chunk_step_mean": _mean([step for r in results for step in r.chunk_steps]),
        "ticks": len(ticks),
        "latency_p50_ms": float(np.percentile(latency, 50)),
        "latency_p99_ms": float(np.percentile(latency, 99)),
        "budget_ms": float(np.median([t.budget_ms for t in ticks])) if budgeted else None,
        "deadline_misses": int(sum(not t.deadline_met for t in ticks)) if budgeted else None,
        "miss_rate": float(np.mean([not t.deadline_met for t in ticks])) if budgeted else None,
        "full_calls_per_tick": float(np.mean([t.full_calls for t in ticks])),
        "skipped_calls_per_tick": float(np.mean([t.skipped_calls for t in ticks])),
        "forced_skips_per_tick": float(np.mean([t.forced_skips for t in ticks])),
        "cache_settings": settings,
        "ticks_by_batch_size": dict(sorted(batch_sizes.items())),
        "fallback_ticks": dict(sorted(fallback_ticks.items())),
        "wall_s": seconds,
        "per_episode": [{"seed": r.seed, "instruction": r.instruction, "success": r.success, "steps": r.steps,
                         "final_distance_m": round(r.final_distance_m, 4), "nearest_color": r.nearest_color,
                         "collided": r.collided, "restarts": r.restarts, "ticks": _tick_columns(r.ticks, budgeted)}
                        for r in results],
    }


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _tick_columns(ticks: list[TickStats], budgeted: bool) -> dict[str, list]:
    """`{field: [value per tick]}`, latencies to 0.01 ms; no budget or deadline columns where none was set."""
    columns = {"latency_ms": [round(t.latency_ms, 2) for t in ticks]}
    if budgeted:
        columns |= {"budget_ms": [t.budget_ms for t in ticks], "deadline_met": [t.deadline_met for t in ticks]}
    for name in ("setting", "full_calls", "skipped_calls", "forced_skips", "batch_size"):
        columns[name] = [getattr(t, name) for t in ticks]
    columns["fallbacks"] = [list(t.fallbacks) for t in ticks]
    return columns


def plot_summary(report: dict, latencies: list[float], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = summary_figure(report, latencies)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_figure(report: dict, latencies: list[float]):
    """The report's PNG: tick latencies (ms) against the budget, and each episode's steps, in the report's order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for axis in (left.yaxis, right.xaxis, right.yaxis):  # counts: no tick at episode 0.25 or 0.2 ticks
        axis.set_major_locator(MaxNLocator(integer=True))
    left.hist(latencies, bins=40, color="#3b6ea8")
    budget = report["budget_ms"]
    if budget is not None:
        left.axvline(budget, color="r", label=f"budget {budget:g} ms")
        left.legend()
    left.set_xlabel("tick latency (ms)")
    left.set_ylabel("ticks")
    misses = "no budget" if budget is None else f"misses {report['miss_rate']:.1%}"
    left.set_title(f"p50 {report['latency_p50_ms']:.0f} ms, p99 {report['latency_p99_ms']:.0f} ms, {misses}")
    lengths = [e["steps"] for e in report["per_episode"]]
    colours = ["#2e8b57" if e["success"] else "#c0392b" for e in report["per_episode"]]
    right.bar(range(len(lengths)), lengths, color=colours)
    right.set_xlabel("episode")
    right.set_ylabel("steps (green: success)")
    right.set_title(f"success {report['success_rate']:.0%} over {report['episodes']} episodes")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="policy-rollout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {__version__}")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", type=server_address,
                       help="host:port of a running policy-server (waited for up to 10 min)")
    where.add_argument("--in-process", action="store_true", help="run the engine in this process")
    parser.add_argument("--checkpoint", type=Path, default=None, help="in-process: pipeline folder")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"),
                        help="in-process: where the engine runs (cpu; auto: cuda when there is one)")
    parser.add_argument("--latency-budget-ms", type=float, default=None,
                        help="per-tick budget (server: per session; in-process default 120, or none uncached)")
    parser.add_argument("--no-diffusion-cache", action="store_true", help="in-process: run uncached")
    parser.add_argument("--compile-gen-stack", action=argparse.BooleanOptionalAction, default=None,
                        help="in-process: the GEN stack compiled at warmup, as the server's flag (default: as the "
                             "server: wherever torch can compile)")
    parser.add_argument("--num-steps", type=int, default=None, help="in-process: sampler steps (policy.json)")
    parser.add_argument("--guidance", type=float, default=None, help="in-process: CFG scale (policy.json)")
    parser.add_argument("--quality-profile", default=None,
                        help="in-process: auto (default: beside the checkpoint, else the cache, else calibrate at "
                        "warmup, as the server), off (plan on the SeaCache ladder) or a profile file; always off "
                        "with --no-diffusion-cache, --num-steps or --guidance")
    parser.add_argument("--episodes", type=int, default=100, help="episodes to run (100)")
    parser.add_argument("--env-id", default=REACH_ID, choices=ENV_IDS, help=f"gymnasium id (default {REACH_ID})")
    parser.add_argument("--num-envs", type=int, default=1,
                        help="episodes at once, each in a sub-environment of one vector env with its own session; "
                        "they share one model worker, so queueing counts against each tick's budget")
    parser.add_argument("--execute", type=int, default=4, help="actions executed per chunk before replanning (4)")
    parser.add_argument("--delay-steps", type=int, default=0,
                        help="a tick's inference time in control steps, simulated: the robot runs that many actions "
                             "of its last chunk while the next is computed, whose first ones are then stale (0)")
    parser.add_argument("--commit-actions", action="store_true",
                        help="send those actions as the observation's committed_actions: the chunk starts with them "
                             "and continues them (real-time chunking); needs --delay-steps")
    parser.add_argument("--first-episode", type=int, default=0, help="held-out seed index of episode 0")
    parser.add_argument("--videos", type=int, default=0, help="MP4s of the first N episodes")
    parser.add_argument("--auth-token-file", type=token_file, help="file with the server's bearer token")
    add_tls_flags(parser)
    parser.add_argument("--serve-application", default=None,
                        help="--server is Ray Serve's gRPC proxy: route to this application (policy-server ray-serve)")
    g = parser.add_argument_group("Ray (pip install 'policy-server[ray]')")
    g.add_argument("--ray", type=int, default=None, metavar="N",
                   help="spread the episodes over N Ray workers, each with its own engine or client")
    g.add_argument("--ray-address", default=None,
                   help="Ray cluster to join: its GCS HOST:PORT, auto or ray://... (default: RAY_ADDRESS, else the "
                        "cluster the last `ray start` here recorded, else a Ray started here)")
    g.add_argument("--ray-gpus-per-worker", type=float, default=0.0, help="GPUs of each in-process worker (0)")
    g.add_argument("--ray-cpus-per-worker", type=float, default=1.0, help="CPUs of each worker (1)")
    parser.add_argument("--out", type=report_file, default="rollout.json",
                        help="JSON report; its PNG summary and the videos go beside it (rollout.json)")
    args = parser.parse_args(argv)
    for flag, value in (("--episodes", args.episodes), ("--num-envs", args.num_envs), ("--execute", args.execute),
                        ("--ray", 1 if args.ray is None else args.ray)):
        if value < 1:
            parser.error(f"{flag} must be a positive integer, got {value}")
    for flag, value in (("--first-episode", args.first_episode), ("--videos", args.videos),
                        ("--delay-steps", args.delay_steps)):
        if value < 0:
            parser.error(f"{flag} must be >= 0, got {value}")
    if HELDOUT_SEED_OFFSET + args.first_episode + args.episodes > 2**64:  # a session's seed is a uint64 on the wire
        parser.error(f"--first-episode {args.first_episode}: episode i runs on seed {HELDOUT_SEED_OFFSET} + i, below "
                     f"2^64; expected at most {2**64 - HELDOUT_SEED_OFFSET - args.episodes} for {args.episodes} "
                     "episodes")
    if args.commit_actions and not args.delay_steps:
        parser.error("--commit-actions needs --delay-steps N (the actions run while a tick is computed)")
    if args.latency_budget_ms is not None and not 0 < args.latency_budget_ms <= MAX_BUDGET_MS:
        parser.error(f"--latency-budget-ms must lie in (0, {MAX_BUDGET_MS:g}], got {args.latency_budget_ms}")
    if (args.no_diffusion_cache or args.compile_gen_stack is not None) and not args.in_process:
        parser.error("--no-diffusion-cache and --compile-gen-stack need --in-process (a server uses its own settings)")
    if args.ray is None and (args.ray_address or args.ray_gpus_per_worker or args.ray_cpus_per_worker != 1.0):
        parser.error("--ray-address, --ray-gpus-per-worker and --ray-cpus-per-worker need --ray N")
    for flag, value in (("--ray-gpus-per-worker", args.ray_gpus_per_worker),
                        ("--ray-cpus-per-worker", args.ray_cpus_per_worker)):
        if not 0 <= value < math.inf:
            parser.error(f"{flag} must be >= 0, got {value}")
    if tls_options(args)["tls"] and not args.server:
        parser.error("--tls, --tls-ca and --tls-server-name need --server")
    if args.serve_application is not None and not args.server:
        parser.error("--serve-application needs --server (the address of Serve's gRPC proxy)")
    if args.device != "cpu" and not args.in_process:
        parser.error("--device needs --in-process (a server runs on its own device)")
    if args.checkpoint is not None and not args.in_process:
        parser.error("--checkpoint needs --in-process (a server serves its own checkpoint)")
    if args.ray_gpus_per_worker and args.device == "cpu":
        parser.error("--ray-gpus-per-worker needs --in-process --device cuda (or auto): a worker on the CPU uses none")
    if args.in_process and args.ray is None:  # Ray's workers may have devices this machine lacks
        from policy_server.engine.engine import DeviceUnavailable, resolve_device

        try:
            resolve_device(args.device)
        except DeviceUnavailable as error:
            parser.error(str(error))
    overrides = {k: v for k, v in (("num_steps", args.num_steps), ("guidance", args.guidance)) if v is not None}
    if overrides and not args.in_process:
        parser.error("--num-steps and --guidance need --in-process (a server uses its own settings)")
    if overrides:  # the bounds policy.json's own take: one out of them ended in pydantic's traceback after the load
        from pydantic import ValidationError

        from policy_server.pipeline.policy_config import PolicyConfig

        try:
            PolicyConfig.model_validate(overrides)
        except ValidationError as error:
            problem = error.errors()[0]
            parser.error(f"--{problem['loc'][0].replace('_', '-')}: {problem['msg'].lower()}, got {problem['input']}")
    if args.quality_profile is not None and not args.in_process:
        parser.error("--quality-profile needs --in-process (a server uses its own profile)")
    # A profile describes cached ticks at the checkpoint's own sampler settings: overridden ones plan on the ladder,
    # uncached ones plan nothing.
    profile_applies = args.in_process and not overrides and not args.no_diffusion_cache
    if args.quality_profile not in (None, "off") and not profile_applies:
        parser.error("--quality-profile plans cached ticks at the checkpoint's own sampler settings: not with "
                     "--no-diffusion-cache, --num-steps or --guidance")
    quality_profile = (args.quality_profile or "auto") if profile_applies else None

    budget = args.latency_budget_ms
    # The ticks run at the budget asked for, else the server's (or the engine's) default; uncached in-process ticks
    # without --latency-budget-ms are not budgeted (they get the largest budget there is).
    budgeted = not (args.in_process and args.no_diffusion_cache and budget is None)
    # The server's, the engine's, or a server that never turned SERVING.
    refusals: tuple[type[Exception], ...] = (PolicyServerError, EngineError, TimeoutError, RolloutError)
    if args.ray is not None:
        refusals += (ConnectionError,)  # --ray-address (or RAY_ADDRESS) names no running Ray
    if args.in_process:
        from policy_server.budget.profile import ProfileError
        from policy_server.engine.served import EngineSettings
        from policy_server.pipeline.compiled_stack import CompileUnavailableError
        from policy_server.pipeline.policy import CheckpointLoadError

        refusals += (CheckpointLoadError, ProfileError, CompileUnavailableError)
        make_policy = functools.partial(InProcessPolicy, args.checkpoint,
                                        budget or (EngineSettings.default_budget_ms if budgeted else MAX_BUDGET_MS),
                                        not args.no_diffusion_cache, args.num_envs, overrides,
                                        quality_profile or "off", args.execute, args.delay_steps, args.device,
                                        args.compile_gen_stack)
    else:
        make_policy = functools.partial(ServerPolicy, args.server, budget, args.auth_token_file,
                                        args.serve_application, tls_options(args), args.execute, args.delay_steps)

    started = time.perf_counter()
    indices = range(args.first_episode, args.first_episode + args.episodes)
    stopped: RolloutStopped | None = None
    try:
        if args.ray is None:
            policy = make_policy()
            # On a terminal only: a log or a caller reading stderr gets the report and the errors, no bar.
            with tqdm(total=len(indices), desc="episodes", unit="ep", disable=None) as progress:
                results = run_episodes(policy, args.env_id, indices, args.num_envs, args.execute, args.videos,
                                       progress, args.delay_steps, args.commit_actions)
        else:
            try:
                from robots.ray_rollout import run_on_ray
            except ImportError as exc:
                parser.error(f"--ray needs Ray ({exc}); pip install 'policy-server[ray]'")
            results = run_on_ray(make_policy, args.env_id, indices, args.ray, args.num_envs, args.execute,
                                 args.videos, args.ray_address, args.ray_gpus_per_worker, args.ray_cpus_per_worker,
                                 args.delay_steps, args.commit_actions)
    except RolloutStopped as error:  # Ctrl-C or an error mid-run: the episodes that ended are reported
        stopped, results = error, error.finished
    except KeyboardInterrupt:  # before the first episode (loading, warming up, waiting for the server)
        print("policy-rollout: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except refusals as error:  # e.g. BUDGET_INFEASIBLE, OVERLOADED, a checkpoint that cannot be served
        print(f"policy-rollout: {error}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started
    # Episodes whose session a CloseSession call closed ran part way: the report's figures leave them out, and the run,
    # which does not report every episode it was asked for, ends as a stopped one does.
    closed = [result for result in results if result.closed]
    ran = [result for result in results if not result.closed]
    exit_code = 0 if stopped is None and not closed else \
        130 if stopped is not None and isinstance(stopped.cause, KeyboardInterrupt) else 2
    closed_line = (f"the sessions of {len(closed)} episodes (seeds {', '.join(str(r.seed) for r in closed)}) were "
                   f"closed under them, the first: {closed[0].closed}") if closed else ""
    if not ran:
        print(f"policy-rollout: {'; '.join(str(why) for why in (stopped, closed_line) if why)}", file=sys.stderr)
        return exit_code

    config = {"server": args.server, "in_process": args.in_process, "latency_budget_ms": budget,
              "diffusion_cache": not args.no_diffusion_cache if args.in_process else None,
              "quality_profile": quality_profile,
              "env_id": args.env_id, "execute": args.execute, "delay_steps": args.delay_steps,
              "commit_actions": args.commit_actions, "num_envs": args.num_envs, "device": args.device,
              "first_episode": args.first_episode, "serve_application": args.serve_application,
              "ray_workers": args.ray, **overrides}
    ended = {result.seed for result in results}
    unfinished = [HELDOUT_SEED_OFFSET + i for i in indices if HELDOUT_SEED_OFFSET + i not in ended]
    report = summarize(results, seconds, config, budgeted, None if stopped is None else str(stopped), unfinished)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    reported = (f"{args.out} reports the {len(ran)} episodes that had ended"
                + (f", not the {len(unfinished)} others (unfinished_seeds)" if unfinished else "")
                + (f", and apart the {len(closed)} closed under them (closed_episodes)" if closed else ""))
    try:  # videos take a while to encode, and a stopped run's user may press Ctrl-C again: the report stays
        plot_summary(report, [t.latency_ms for r in ran for t in r.ticks], args.out.with_suffix(".png"))
        if args.videos:  # PyAV, with its FFmpeg, loads only for a rollout that writes videos
            from robots.video import write_browser_mp4
        for result in results:
            if result.frames:  # one of the first --videos episodes
                write_browser_mp4(args.out.with_name(f"{args.out.stem}_episode{result.seed}.mp4"), result.frames,
                                  fps=10)
    except KeyboardInterrupt:
        print(f"policy-rollout: interrupted (Ctrl-C) writing the plot and videos, which may be missing or cut short; "
              f"{reported}", file=sys.stderr)
        return 130
    print(json.dumps({k: v for k, v in report.items() if k not in ("per_episode", "unfinished_seeds")}, indent=2))
    if stopped is not None or closed:
        print(f"policy-rollout: {'; '.join(str(why) for why in (stopped, closed_line) if why)}; {reported}",
              file=sys.stderr)
    return exit_code


if __name__ == "__main__":
    # As `policy-rollout` runs it, from `robots.rollout`: run as a script this module is `__main__`, whose exception
    # classes are not those that Ray's workers raise (`robots.rollout.RolloutStopped`), so none of theirs was caught.
    from robots.rollout import main as rollout_main

    raise SystemExit(rollout_main())
