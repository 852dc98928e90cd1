"""SeaCache at the ``gen_stack`` boundary: accumulate-and-refresh gate on SEA-filtered noisy vision latents.

Per CFG branch the cache keeps an accumulator, the previous indicator, the last ``order + 1`` full-step
residuals ``gen_out - gen_in`` with their step indices, and a consecutive-skip counter. On a skip it returns
``gen_in + R(step)``, the Newton extrapolation of the stored residuals. The indicator depends only on the
noisy latents and sigma, so it is computed once per step and shared by the branches. Spec:
../shared/reference/seacache.md §0 and §1.11; contract: docs/ARCHITECTURE.md ("Step controller").

The pipeline is the only caller, and it guarantees what diffusers' hook has to check: no grad, sigma in
[0, 1], each branch's steps one apart, and one layout per request. So the cache fails open only on what a
real request can produce (no residual yet, no noisy vision, no previous indicator, a non-finite distance).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .controller import FAIL_OPEN_REASONS, CacheRecord, StepController, StepDecision
from .extrapolation import newton_extrapolate
from .sea_filter import SeaFilter, rel_l1

logger = logging.getLogger(__name__)
_WARNED_FAIL_OPENS: set[str] = set()  # fail-open reasons already warned about in this process

# A threshold for every step: one number, or one number per step (the budget planner's schedule).
ThresholdSpec = float | Sequence[float]


@dataclass(frozen=True)
class SeaCacheConfig:
    """SeaCache knobs (Cosmos3 defaults), validated where a user sets them (`policy_server.config`).

    threshold: accumulated rel-L1 budget; 0 disables skipping (bit-identical to no cache). May be a per-step
        schedule (a sequence of N numbers).
    residual_order: 0 reuse, 1 linear, 2 quadratic extrapolation of the stored residuals.
    retention_steps / cache_end_steps: first / last steps that always run full.
    max_consecutive_cached: skips in a row per branch before a forced refresh; 0 = unlimited.
    power_exp: exponent of the SEA clean-signal prior (3 for video).
    """

    threshold: ThresholdSpec = 0.25
    residual_order: int = 1
    retention_steps: int = 1
    cache_end_steps: int = 1
    max_consecutive_cached: int = 2
    power_exp: float = 3.0


@dataclass(frozen=True)
class Gate:
    """The accumulate-and-refresh rule's choice for one call. `full_reason`: why it runs FULL, None for SKIP;
    `accumulated`: the accumulator should the call be skipped."""

    step: int
    branch: str
    full_reason: str | None
    distance: float | None
    accumulated: float
    threshold: float

    @property
    def full(self) -> bool:
        return self.full_reason is not None


@dataclass
class _BranchState:
    """Gate and residual state of one CFG branch within one request."""

    accumulated: float = 0.0
    prev_indicator: list[torch.Tensor] | None = None
    history: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (step, residual [N_gen, D])
    consecutive_cached: int = 0


class SeaCache(StepController):
    """Step controller implementing SeaCache; see the module docstring and ``StepController``.

    ``estimate`` gates a call and skips it or says it must run (its output then goes to ``ran``). A deadline
    guard goes between the gate and the skip instead: ``gate``, then ``skip`` with ``force_skip`` when the
    guard wants a call the gate chose FULL skipped. ``sea_filter``:
    share one filter (and its gain cache) between controllers; default: a private one.
    """

    def __init__(self, config: SeaCacheConfig | None = None, sea_filter: SeaFilter | None = None) -> None:
        self.config = config if config is not None else SeaCacheConfig()
        self.sea_filter = sea_filter if sea_filter is not None else SeaFilter(self.config.power_exp)
        assert self.sea_filter.power_exp == float(self.config.power_exp)
        self._num_steps = 0
        self._thresholds: tuple[float, ...] = ()
        self._gate_active = True
        self._states: dict[str, _BranchState] = {}
        self._record = CacheRecord(num_steps=0)
        self._indicator_step: int | None = None
        self._indicator: list[torch.Tensor] | None = None
        self._distances: dict[tuple[int, int], float] = {}
        self._pending: dict[str, tuple[Gate, str, torch.Tensor]] = {}  # by branch: gate, reason, gen_in of a run

    # ------------------------------------------------------------------ per request

    def begin(self, num_steps: int) -> None:
        """Reset all state for a request of ``num_steps`` steps."""
        self._num_steps = num_steps
        threshold = self.config.threshold
        self._thresholds = tuple(threshold) if isinstance(threshold, Sequence) else (float(threshold),) * num_steps
        assert len(self._thresholds) == num_steps, "one threshold per step"
        # With every threshold 0 the gate can never choose SKIP, so the indicator is not needed.
        self._gate_active = any(t > 0 for t in self._thresholds)
        self._states = {}
        self._indicator_step = None
        self._indicator = None
        self._distances = {}
        self._pending = {}
        self._record = CacheRecord(
            num_steps=num_steps, thresholds=self._thresholds,
            max_consecutive_cached=self.config.max_consecutive_cached,
        )

    def record(self) -> CacheRecord:
        return self._record

    # ------------------------------------------------------------------ the step

    def estimate(self, step: int, branch: str, sigma: float, noisy_vision: Sequence[torch.Tensor],
                 gen_in: torch.Tensor) -> torch.Tensor | None:
        return self.skip(self.gate(step, branch, sigma, noisy_vision), gen_in)

    def gate(self, step: int, branch: str, sigma: float, noisy_vision: Sequence[torch.Tensor]) -> Gate:
        """What the accumulate-and-refresh rule chooses for this call; carry it out with ``skip``."""
        threshold = self._thresholds[step]
        state = self._states.setdefault(branch, _BranchState())
        indicator = None
        if self._gate_active and noisy_vision:
            indicator = self._shared_indicator(step, sigma, noisy_vision)
        reason, distance, accumulated = self._gate(step, state, indicator, noisy_vision, threshold)
        # prev follows every step, forced or not, so the accumulator sums the step-to-step drift.
        state.prev_indicator = indicator
        return Gate(step, branch, reason, distance, accumulated, threshold)

    def skip(self, gate: Gate, gen_in: torch.Tensor, force_skip: bool = False) -> torch.Tensor | None:
        """The call's estimate ``gen_in`` plus the extrapolated residual when ``gate`` skips it, or when
        ``force_skip`` (the deadline guard's) turns its FULL into a SKIP and the branch has a residual; None when
        it runs (fail-open ``no_history`` when forced without one), and then ``ran`` gets its output."""
        state = self._states[gate.branch]
        reason, skip_reason = gate.full_reason, "gate"
        if reason is not None and force_skip:
            # The gate skips only after a full call of this branch, so only a forced skip can lack a residual.
            if state.history:
                # Forced SKIP: the gate's drift stays accumulated, so the next step wants a refresh again.
                reason, skip_reason = None, "forced"
            else:
                reason = "no_history"
        if reason is not None:
            self._pending[gate.branch] = (gate, reason, gen_in)
            return None
        state.accumulated = gate.accumulated
        state.consecutive_cached += 1
        self._record.add(StepDecision(gate.step, gate.branch, False, skip_reason, gate.distance, gate.accumulated,
                                      gate.threshold))
        return gen_in + newton_extrapolate(state.history, gate.step, self.config.residual_order)

    def ran(self, branch: str, out: torch.Tensor) -> None:
        gate, reason, gen_in = self._pending.pop(branch)
        state = self._states[branch]
        state.accumulated = 0.0
        state.consecutive_cached = 0
        state.history.append((gate.step, (out - gen_in).detach()))
        del state.history[: -(self.config.residual_order + 1)]
        self._record.add(StepDecision(gate.step, gate.branch, True, reason, gate.distance, 0.0, gate.threshold))
        if reason in FAIL_OPEN_REASONS:
            self._warn_fail_open(reason, gate.step, gate.branch)

    # ------------------------------------------------------------------ helpers

    def _gate(
        self,
        step: int,
        state: _BranchState,
        indicator: list[torch.Tensor] | None,
        noisy_vision: Sequence[torch.Tensor],
        threshold: float,
    ) -> tuple[str | None, float | None, float]:
        """The accumulate-and-refresh rule: ``(full reason or None for SKIP, distance, accumulator if SKIP)``."""
        if step < self.config.retention_steps:
            return "retention", None, 0.0
        if step >= self._num_steps - self.config.cache_end_steps:
            return "cache_end", None, 0.0
        if not noisy_vision:
            return "no_noisy_vision", None, 0.0
        if not self._gate_active:
            return "threshold", None, 0.0
        cap = self.config.max_consecutive_cached
        if cap > 0 and state.consecutive_cached >= cap:
            return "cap", None, state.accumulated
        if state.prev_indicator is None:
            return "no_previous_indicator", None, 0.0
        distance = self._distance(indicator, state.prev_indicator)
        if not math.isfinite(distance):
            return "nonfinite_distance", distance, 0.0
        accumulated = state.accumulated + distance
        return ("threshold" if accumulated >= threshold else None), distance, accumulated

    def _shared_indicator(
        self, step: int, sigma: float, noisy_vision: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """SEA indicators of this step, computed once and reused by the other CFG branches of the step.

        The branches of one step see the same latents (the sampler updates them only after every branch
        ran), so the step index identifies them.
        """
        if step != self._indicator_step:
            self._indicator_step = step
            self._indicator = [self.sea_filter.indicator(t, sigma) for t in noisy_vision]
            self._distances = {}
        return self._indicator

    def _distance(self, current: list[torch.Tensor], previous: list[torch.Tensor]) -> float:
        """Mean per-item rel-L1 between indicator lists, kept for the other CFG branches of the step."""
        key = (id(current), id(previous))
        if key not in self._distances:
            pairs = list(zip(current, previous, strict=True))
            self._distances[key] = sum(rel_l1(c, p) for c, p in pairs) / len(pairs)
        return self._distances[key]

    def _warn_fail_open(self, reason: str, step: int, branch: str) -> None:
        # Every fail-open shows in its tick's record. Only a non-finite indicator is news to an operator (the
        # model's output went bad); the others follow from a request's shape (no noisy vision: inverse dynamics,
        # a chunk inside one latent frame, which warmup itself runs) or from the guard. The warning comes once
        # per process: a bad model would flood the log.
        if reason != "nonfinite_distance" or reason in _WARNED_FAIL_OPENS:
            logger.debug("SeaCache fail-open (%s) at step %d branch %s", reason, step, branch)
            return
        _WARNED_FAIL_OPENS.add(reason)
        logger.warning("SeaCache ran full (fail-open: %s) at step %d branch %r; further ones are logged at "
                       "debug level", reason, step, branch)
