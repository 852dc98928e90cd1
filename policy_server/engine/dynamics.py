"""Forward and inverse dynamics calls: background work between ticks, one sampler step at a time.

A dynamics call runs uncached at the configured step count as background work that the model worker steps
piece by piece (`DynamicsCall`): the prefill, the encode, each sampler step, the frames' decode. So it never
overlaps a tick, and a tick waits for at most one piece. At most `max_dynamics_calls` run at once, each
within the caller's deadline and `MAX_DYNAMICS_MS`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import numpy as np

from policy_server.engine import api
from policy_server.engine.call_end import CallEnd
from policy_server.engine.served import ServedModel
from policy_server.engine.sessions import SessionState
from policy_server.engine.tick import PREPARE_STAGE, branch_records
from policy_server.engine.worker import ModelWorker
from policy_server.limits import MAX_DYNAMICS_MS
from policy_server.pipeline.embodiments import Embodiment
from policy_server.pipeline.policy import CanvasClip, PolicyOutput, PolicyRequest, PromptState, stepwise


class DynamicsCall:
    """One dynamics call as background work (a `worker.BackgroundJob`), one piece per `step()`: the prefill
    (unless `prompt`, the session's text K/V, fits), the encode, each sampler step, the frames' decode
    (`decode_frames`). `frames`: the request's, on their canvas (`prepare_frames`, on the caller's thread).
    `result` gets the pipeline output, the frames (or None) and the ms per stage, the waits since `arrived_ms`
    before and between its pieces as "queue"; or what ended the call (`end`, which the worker checks before each
    piece)."""

    def __init__(self, served: ServedModel, embodiment: Embodiment, request: PolicyRequest, frames: CanvasClip,
                 decode_frames: bool, prompt: PromptState | None, arrived_ms: float, end: CallEnd | None):
        self.served = served
        self.end = end
        self.result: Future = Future()
        self._waited_ms = 0.0  # between its pieces, while the worker ran other work
        self._paused_at: float | None = None
        self._pieces = self._run(embodiment, request, frames, decode_frames, prompt, arrived_ms)

    def step(self) -> bool:
        clock = self.served.clock
        if self._paused_at is not None:
            self._waited_ms += clock() - self._paused_at
        try:
            next(self._pieces)
        except StopIteration as done:
            self.result.set_result(done.value)
            return True
        self._paused_at = clock()
        return False

    def fail(self, error: BaseException) -> None:
        """It will not be stepped again (shutdown, its caller went away, or a piece raised `error`)."""
        self._pieces.close()
        self.result.set_exception(error)

    def _run(self, embodiment: Embodiment, request: PolicyRequest, frames: CanvasClip, decode_frames: bool,
             prompt: PromptState | None, arrived_ms: float):
        """The pieces: each `yield` hands the worker back until the next `step()`."""
        served = self.served
        pipeline, clock = served.pipeline, served.clock
        stage_ms = {"queue": clock() - arrived_ms}
        canvas_hw = frames.placement.canvas_hw
        text, stage_ms["prefill"] = served.prompt(request.instruction, embodiment, request.chunk_size, canvas_hw,
                                                  prompt)
        if text is not prompt:  # the prefill was a piece of its own
            yield
        steps = pipeline.steps(request, text, served.fixed_steps(request.num_steps or served.num_steps),
                               served.tick_work, frames)
        waited_before_steps = self._waited_ms  # the waits between sampler steps fall inside the denoise time
        out = yield from stepwise(steps, served.gen_stack)
        denoise_ms = out.timings_ms["denoise"] - (self._waited_ms - waited_before_steps)
        stage_ms.update(encode=out.timings_ms["encode"], denoise=denoise_ms, decode=out.timings_ms["decode"])
        stage_ms["prefill"] += out.timings_ms["prefill"]
        frames = None
        if decode_frames:
            yield
            started = clock()
            frames = pipeline.decode_video(out.latents)
            stage_ms["video_decode"] = clock() - started
        stage_ms["queue"] += self._waited_ms
        return out, frames, stage_ms


class Dynamics:
    """The dynamics calls of one engine, run as background work on its model worker."""

    def __init__(self, served: ServedModel, worker: ModelWorker):
        self.served, self.worker = served, worker
        self._calls = threading.Semaphore(served.settings.max_dynamics_calls)

    @contextlib.contextmanager
    def place(self, session: SessionState, inverse: bool) -> Iterator[None]:
        """One of the `max_dynamics_calls` places for a call of `session` (an `inverse` one: a session whose chunk
        the model sees whole), held while the context lasts: the caller takes it before its frames are decoded and
        keeps it until its call has ended (a call ends before its caller returns)."""
        if not self.served.settings.max_dynamics_calls:
            raise api.DynamicsOff()
        if inverse:
            self._check_inverse_chunk(session.opening.chunk_size)
        if not self._calls.acquire(blocking=False):
            raise api.TooManyDynamicsCalls(self.served.settings.max_dynamics_calls)
        try:
            yield
        finally:
            self._calls.release()

    def forward(self, session: SessionState, observation: api.Observation, actions: np.ndarray, seed: int | None,
                deadline_s: float | None, should_abort: Callable[[], bool] | None) -> api.PredictedVideo:
        opening = session.opening
        embodiment = self.served.embodiments[opening.embodiment]
        instruction = self._instruction(session, observation.instruction, "observation.instruction")
        request = PolicyRequest(images=observation.images, instruction=instruction, embodiment=opening.embodiment,
                                state=observation.state, mode="forward_dynamics", chunk_size=opening.chunk_size,
                                seed=opening.seed if seed is None else seed, actions=actions)
        out, frames, tick = self._run(session, embodiment, request, True, deadline_s, should_abort)
        return api.PredictedVideo(frames=frames, latents_shape=tuple(out.latents.shape), tick=tick)

    def inverse(self, session: SessionState, clip: api.VideoClip, seed: int | None, deadline_s: float | None,
                should_abort: Callable[[], bool] | None) -> api.ActResult:
        opening = session.opening
        embodiment = self.served.embodiments[opening.embodiment]
        request = PolicyRequest(images={}, instruction=self._instruction(session, clip.instruction, "instruction"),
                                embodiment=opening.embodiment, state=clip.state, mode="inverse_dynamics",
                                chunk_size=opening.chunk_size, seed=opening.seed if seed is None else seed,
                                video=clip.frames)
        out, _, tick = self._run(session, embodiment, request, False, deadline_s, should_abort)
        if not np.all(np.isfinite(out.actions)):
            raise api.NonFiniteOutput("the model produced NaN or Inf actions")
        clipped = int(np.count_nonzero(embodiment.out_of_limits(out.actions)))
        tick = dataclasses.replace(tick, knobs={**tick.knobs, "clipped_actions": float(clipped)})
        return api.ActResult(actions=embodiment.clip_to_limits(out.actions).astype(np.float32),
                             first_step_index=clip.step_index, tick=tick)

    def _check_inverse_chunk(self, chunk: int) -> None:
        """InvalidArgument unless the model sees all `chunk` + 1 frames of an inverse-dynamics clip."""
        seen = self.served.pipeline.num_video_frames(chunk)
        if seen != chunk + 1:  # the VAE takes frame 0 and whole groups of t frames after it
            t = self.served.pipeline.vae.temporal_compression
            raise api.InvalidArgument("session.chunk_size", f"a session whose chunk is a multiple of {t}, so that the "
                                      "model sees every frame", f"chunks of {chunk}: the model would see {seen} of the "
                                      f"{chunk + 1} frames", reason="BAD_VALUE")

    def _instruction(self, session: SessionState, instruction: str, field: str) -> str:
        """The call's instruction (checked against the token limit), else the session's."""
        if instruction:
            self.served.instruction_tokens(instruction, field)
        return instruction or session.instruction

    def _run(self, session: SessionState, embodiment: Embodiment, request: PolicyRequest, decode_frames: bool,
             deadline_s: float | None, should_abort: Callable[[], bool] | None,
             ) -> tuple[PolicyOutput, np.ndarray | None, api.TickRecord]:
        """Run a dynamics request within the caller's deadline and `MAX_DYNAMICS_MS`, its frames put on their
        canvas on this (the caller's) thread, within the call's time. Returns the pipeline output, the decoded frames
        (`decode_frames`) and the record."""
        served = self.served
        arrived_ms = served.clock()
        bound_s = time.monotonic() + MAX_DYNAMICS_MS / 1e3
        deadline_s = bound_s if deadline_s is None else min(deadline_s, bound_s)
        deadline_ms = (deadline_s - time.monotonic()) * 1e3
        end = CallEnd(served.closing, deadline_s, should_abort,
                      late=f"the call's deadline passed (the caller's, or the server's bound of "
                           f"{MAX_DYNAMICS_MS / 1e3:g} s)")
        if (reason := end.reason()) is not None:  # gone, or late, once its frames are decoded: no canvas for them
            raise reason
        frames = served.pipeline.prepare_frames(request)
        prepared_ms = served.clock()
        job = DynamicsCall(served, embodiment, request, frames, decode_frames, session.prompt, prepared_ms, end)
        try:
            self.worker.submit(job)
        except api.ShuttingDown as error:
            job.fail(error)
            raise
        out, frames, stage_ms = self.worker.wait(job, end)
        tick = api.TickRecord(
            budget_ms=MAX_DYNAMICS_MS, deadline_ms=deadline_ms,
            actual_ms={**stage_ms, PREPARE_STAGE: prepared_ms - arrived_ms, "total": served.clock() - arrived_ms},
            knobs={"num_steps": float(len(out.steps)), "batch_size": 1.0}, branches=branch_records(out.cache),
            setting="none",
        )
        return out, frames, tick
