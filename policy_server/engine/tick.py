"""`Tick`: one control tick on the model worker, and its say in the pipeline's step loop (`StepControl`).

    plan -> arm the guard -> step control -> run the pipeline -> clip -> record

A tick is planned against the smallest of its session's slot, its budget less the time it queued, and the
caller's deadline. The budget planner picks its cache setting; the deadline guard, wrapped around SeaCache,
paces its steps (`before_step`) and may force a call to skip (`estimate`). The finished tick feeds the cost
model and the session's history, and its `api.TickRecord`, built once here, says why it was as fast as it was.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from policy_server.budget.cost_model import CostModel, step_samples
from policy_server.budget.planner import TickPlan
from policy_server.budget.tick import PREFILL_STAGE, PREVIEW_STAGE, GuardedSteps
from policy_server.cache.controller import CacheRecord
from policy_server.cache.seacache import SeaCache, SeaCacheConfig
from policy_server.engine import api
from policy_server.engine.call_end import CallEnd
from policy_server.engine.served import ServedModel
from policy_server.engine.sessions import SessionState
from policy_server.pipeline.policy import (
    Aborted,
    CanvasClip,
    FixedSteps,
    PolicyOutput,
    PolicyRequest,
    StackCall,
    StepRecord,
)

STAGES = ("encode", "prefill", "denoise", "decode")
PREPARE_STAGE = "prepare"  # the camera frames put on their canvas, on the caller's thread before the tick queues


@dataclass(frozen=True)
class TickRequest:
    """What a queued tick carries. `instruction_tokens`: of `observation.instruction`, when it sets one.
    `budget_ms`, `slot_ms`: the session's at arrival, which the tick is planned on (a SetBudget while it waits or
    runs is for the next one); `deadline_ms`: from arrival, the smaller of that budget and the caller's deadline;
    `end`: what ends the tick early (the caller's deadline, not the budget: a late chunk still reaches the robot).
    `frames`: the observation's frames on their canvas, which the caller's thread puts there (in `prepare_ms`)
    before the tick is queued; None until then."""

    epoch: int
    observation: api.Observation
    instruction_tokens: int
    arrived_ms: float
    budget_ms: float
    slot_ms: float
    deadline_ms: float
    end: CallEnd
    frames: CanvasClip | None = None
    prepare_ms: float = 0.0


def branch_records(cache: CacheRecord) -> dict[str, api.BranchRecord]:
    """The record's view of what the step cache decided, per CFG branch."""
    return {name: api.BranchRecord(full=c.full, skipped=c.skipped, forced_skip=c.forced_skip, fail_open=c.fail_open,
                                   sequence=cache.sequence(name), fail_open_reasons=dict(c.fail_open_reasons))
            for name, c in cache.branches.items()}


class Tick:
    """One control tick of `session`, run by the model worker through `steps()`: alone, or in a micro-batch of
    `batch_size` ticks whose full GEN-stack calls the worker runs together; `batch_slot_ms`: their slots summed
    (its own alone), how long the batch may hold the worker."""

    def __init__(self, served: ServedModel, session: SessionState, request: TickRequest, batch_size: int,
                 batch_slot_ms: float):
        self.served, self.session, self.request = served, session, request
        self._batch_size, self._batch_slot_ms = batch_size, batch_slot_ms
        # The history of the episode it runs in, taken before its first epoch check: a reset gives the session a new
        # one, which a tick answered across the reset (it passed its last check first) must not teach.
        self._history = session.history
        self._steps: GuardedSteps | FixedSteps | None = None

    # ------------------------------------------------------------------ the pipeline's collaborator

    def before_step(self, step: int) -> tuple[tuple[str, ...], bool]:
        """The CFG branches of sampler step `step` and whether it is the last; `Aborted` when the tick must stop
        (the engine shuts down, the caller's deadline passed or it went away), UnknownSession when its session
        closed."""
        if self.session.closed:  # while it ran: the session's place and its share of the worker are others' now
            raise self.session.closure.error(self.session.session_id)
        if self.request.end.reason() is not None:
            raise Aborted(f"abandoned before step {step}")
        return self._steps.before_step(step)

    def estimate(self, step: int, branch: str, sigma: float, noisy_vision: list[torch.Tensor],
                 gen_in: torch.Tensor) -> torch.Tensor | None:
        return self._steps.estimate(step, branch, sigma, noisy_vision, gen_in)

    def ran(self, outs: Mapping[str, torch.Tensor]) -> None:
        self._steps.ran(outs)

    @property
    def batch_branches(self) -> bool:
        return self._steps.batch_branches

    def record(self) -> CacheRecord:
        return self._steps.record()

    # ------------------------------------------------------------------ the tick

    def steps(self) -> Generator[StackCall | None, torch.Tensor | None, api.ActResult]:
        """The tick as the pipeline's `TickSteps`, returning the answer."""
        served, session, request = self.served, self.session, self.request
        opening = session.opening
        pipeline = served.pipeline
        observation = request.observation
        if session.closed:  # while it queued, or as its caller reserved it
            raise session.closure.error(session.session_id)
        served.check_epoch(session, request.epoch)  # at the start: a reset may have come while it queued
        if (reason := request.end.reason()) is not None:
            raise reason
        started_ms = served.clock()
        left_ms = request.deadline_ms - (started_ms - request.arrived_ms)
        if observation.instruction and observation.instruction != session.instruction:
            session.instruction = observation.instruction
            session.cost_key = served.cost_key(opening.embodiment, opening.chunk_size, request.instruction_tokens)
        embodiment = served.embodiments[opening.embodiment]
        placement = request.frames.placement
        canvas_hw = placement.canvas_hw
        prefill = not served.prompt_fits(session.prompt, session.instruction, embodiment, opening.chunk_size, canvas_hw)
        unused = {stage for stage, used in ((PREFILL_STAGE, prefill), (PREVIEW_STAGE, opening.preview)) if not used}
        learn_key, key = served.grid_keys(session.cost_key,
                                          placement.latent_content_hw(pipeline.vae.spatial_compression),
                                          unused)

        plan = self._plan(key, left_ms, prefill, started_ms)
        session.prompt, prefill_ms = served.prompt(session.instruction, embodiment, opening.chunk_size, canvas_hw,
                                                   session.prompt)
        pipeline_request = PolicyRequest(
            images=observation.images, instruction=session.instruction, embodiment=opening.embodiment,
            state=observation.state, chunk_size=opening.chunk_size, committed_actions=observation.committed_actions,
            num_steps=served.num_steps if plan is None else plan.num_steps,
            seed=(opening.seed + session.ticks) % 2**64,  # each tick of an episode its own noise; a uint64, as sent
        )
        try:
            out = yield from pipeline.steps(pipeline_request, session.prompt, self, served.tick_work, request.frames)
        except Aborted:  # before_step found a reason, which stays
            raise request.end.reason() from None
        # A reset while it ran: its chunk is for a finished episode, which a robot must not merge into the next one.
        served.check_epoch(session, request.epoch)
        session.ticks += 1

        actions = out.actions
        if not np.all(np.isfinite(actions)):
            raise api.NonFiniteOutput("the model produced NaN or Inf actions; nothing is sent to the robot")
        clipped = int(np.count_nonzero(embodiment.out_of_limits(actions)))
        actions = embodiment.clip_to_limits(actions)

        stage_ms = {stage: out.timings_ms[stage] for stage in STAGES}
        stage_ms["prefill"] += prefill_ms
        stage_ms["queue"] = started_ms - request.arrived_ms - request.prepare_ms
        frames = None
        if opening.preview:  # inside the tick: the plan reserved this stage, the guard kept time for it
            clock = served.clock()
            frames = pipeline.decode_video(out.latents)
            stage_ms[PREVIEW_STAGE] = served.clock() - clock
        total_ms = served.clock() - request.arrived_ms
        self._learn(learn_key, out, stage_ms, prefill)
        # The frames' preparation is not learned: it ran on the caller's thread, at whatever size this caller sent.
        tick = self._record(plan, out, {**stage_ms, PREPARE_STAGE: request.prepare_ms, "total": total_ms}, clipped)
        return api.ActResult(actions=actions.astype(np.float32), first_step_index=observation.step_index,
                             tick=tick, preview_frames=frames)

    def _plan(self, key: tuple, left_ms: float, prefill: bool, started_ms: float) -> TickPlan | None:
        """Plan the tick and set up its step control: guarded SeaCache, or every call full when the budget does
        not control ticks (cache off, or too few steps to skip any)."""
        served, session, slot_ms = self.served, self.session, self.request.slot_ms
        if not served.budget_controlled:
            self._steps = served.fixed_steps(served.num_steps)
            return None
        # Within its slot, however long its budget: the ticks queued behind it were admitted on that (a slot holds
        # at least the uncached tick, `assign_slots`, where admission found room for it).
        plan = served.budget.plan(key, max(min(left_ms, slot_ms), 1e-3), served.num_steps, served.passes,
                                  self._history, prefill=prefill, preview=session.opening.preview,
                                  frontier=served.frontier(session.opening.embodiment))
        order = served.settings.residual_order if plan.residual_order is None else plan.residual_order
        config = SeaCacheConfig(threshold=plan.thresholds, residual_order=order, max_consecutive_cached=plan.cap)
        cache = SeaCache(config, sea_filter=served.sea_filter)
        # Planned for its own slot, as alone; but a micro-batch's calls cost about what its ticks' cost one by one
        # (on a CPU), so each of its ticks advances at a share of the worker while the others run: each may end
        # as late as the batch's slots allow, as the ticks one after another would, and never past its own
        # budget. Held to its own slot from the batch's start, each got a share of it and cut its steps.
        deadline_ms = max(min(left_ms, self._batch_slot_ms), 1e-3)
        self._steps = served.budget.guarded_steps(plan, key, started_ms, cache, deadline_ms)
        return plan

    def _learn(self, key: tuple, out: PolicyOutput, stage_ms: dict[str, float], prefilled: bool) -> None:
        """Feed the tick's costs under `key` (a tick that ran in a micro-batch does not teach single-tick costs)
        and, when planned, its full-call count to the session's history."""
        alone = self._batch_size == 1
        if isinstance(self._steps, GuardedSteps):
            stages = {k: v for k, v in stage_ms.items() if k != "queue"}
            self.served.budget.learn(key, self._steps, self._history, stages, learn_costs=alone,
                                     prefilled=prefilled)
        elif alone:
            observe_output(self.served.cost_model, key, out, stage_ms, prefilled)

    def _record(self, plan: TickPlan | None, out: PolicyOutput, actual_ms: dict[str, float],
                clipped: int) -> api.TickRecord:
        request = self.request
        knobs = {"num_steps": float(len(out.steps)), "clipped_actions": float(clipped),
                 "batch_size": float(self._batch_size), "slot_ms": request.slot_ms}
        branches = branch_records(out.cache)
        if plan is None:
            return api.TickRecord(
                budget_ms=request.budget_ms, deadline_ms=request.deadline_ms, actual_ms=actual_ms, knobs=knobs,
                branches=branches, setting="uncacheable" if self.served.settings.diffusion_cache else "disabled")
        knobs.update(cap=float(plan.cap), cfg_steps=float(plan.cfg_steps),
                     threshold=max(plan.thresholds, default=0.0), expected_full_calls=float(plan.expected_full_calls))
        if plan.expected_error is not None:  # planned on a quality profile's frontier: `setting` names the point
            knobs["expected_error"] = plan.expected_error
        return api.TickRecord(
            budget_ms=request.budget_ms,
            deadline_ms=request.deadline_ms,
            actual_ms=actual_ms,
            knobs=knobs,
            branches=branches,
            setting=plan.setting,
            predicted_ms={**plan.predicted_stage_ms, "total": plan.predicted_ms},
            fallbacks=self._steps.fallbacks,
            thresholds=tuple(plan.thresholds),
            feasible=plan.feasible,
            best_achievable_ms=plan.best_achievable_ms,
        )


def step_calls(steps: list[StepRecord]) -> list[tuple[str, float]]:
    """The calls of a tick run without the guard, `(kind, ms)` as `CostModel.observe_tick` takes them, from its
    steps' wall times (`step_samples`; a step with one branch full and one skipped cannot be split, and is
    left out)."""
    return [sample for step in steps
            for sample in step_samples(len(step.full), len(step.branches) - len(step.full), step.batched, step.ms)]


def observe_output(cost_model: CostModel, key: tuple, out: PolicyOutput, stage_ms: dict[str, float],
                   prefilled: bool) -> None:
    """Feed a tick run without the guard (warmup, cache disabled) to `cost_model`."""
    calls = step_calls(out.steps)
    stages = ("encode", "prefill", "decode", PREVIEW_STAGE) if prefilled else ("encode", "decode", PREVIEW_STAGE)
    cost_model.observe_tick(key, calls, {stage: stage_ms[stage] for stage in stages if stage in stage_ms})
