"""SeaCache at the ``gen_stack`` boundary: accumulate-and-refresh gate on SEA-filtered noisy vision latents.

Per CFG branch the cache keeps an accumulator, the previous indicator, the last ``order + 1`` full-step
residuals ``gen_out - gen_in`` with their step indices, and a consecutive-skip counter. On a skip it returns
``gen_in + R(step)``, the Newton extrapolation of the stored residuals. The indicator depends only on the
noisy latents and sigma, so it is computed once per step and shared by the branches. Spec:
../shared/reference/seacache.md §0 and §1.11; contract: docs/ARCHITECTURE.md ("Step controller").
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .controller import (
    FAIL_OPEN_REASONS,
    CacheRecord,
    StepDecision,
    check_num_steps,
    check_step_call,
)
from .extrapolation import MAX_RESIDUAL_ORDER, newton_extrapolate
from .sea_filter import SeaFilter, rel_l1

logger = logging.getLogger(__name__)
_WARNED_FAIL_OPENS: set[str] = set()  # fail-open reasons already warned about in this process

# A threshold for every step: one number, one number per step, or f(step, num_steps) -> number.
ThresholdSpec = float | Sequence[float] | Callable[[int, int], float]
ForceSkip = Callable[[int, str], bool]
DecisionObserver = Callable[[StepDecision], None]


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def _check_threshold(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"threshold {where} must be a finite number >= 0, got {value!r}")
    return float(value)


def resolve_thresholds(spec: ThresholdSpec, num_steps: int) -> tuple[float, ...]:
    """Expand a threshold spec to one finite, non-negative threshold per step: ``tuple[num_steps]``."""
    if callable(spec):
        return tuple(_check_threshold(spec(i, num_steps), f"for step {i}") for i in range(num_steps))
    if isinstance(spec, int | float) and not isinstance(spec, bool):
        value = _check_threshold(spec, "")
        return (value,) * num_steps
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        if len(spec) != num_steps:
            raise ValueError(
                f"threshold schedule has {len(spec)} entries, expected one per step ({num_steps})"
            )
        return tuple(_check_threshold(v, f"for step {i}") for i, v in enumerate(spec))
    raise TypeError(
        f"threshold must be a number, a sequence of numbers or a callable (step, num_steps) -> number, "
        f"got {type(spec).__name__}"
    )


@dataclass(frozen=True)
class SeaCacheConfig:
    """SeaCache knobs (Cosmos3 defaults).

    threshold: accumulated rel-L1 budget; 0 disables skipping (bit-identical to no cache). May be a per-step
        schedule (sequence of N numbers) or a callable ``(step, num_steps) -> float``.
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

    def __post_init__(self) -> None:
        if isinstance(self.threshold, int | float) and not isinstance(self.threshold, bool):
            _check_threshold(self.threshold, "")
        elif isinstance(self.threshold, Sequence) and not isinstance(self.threshold, str):
            checked = tuple(_check_threshold(v, f"for step {i}") for i, v in enumerate(self.threshold))
            object.__setattr__(self, "threshold", checked)
        elif not callable(self.threshold):
            raise TypeError(
                "threshold must be a number, a sequence of numbers or a callable (step, num_steps) -> "
                f"number, got {type(self.threshold).__name__}"
            )
        order = _check_count("residual_order", self.residual_order)
        if order > MAX_RESIDUAL_ORDER:
            raise ValueError(f"residual_order must be 0, 1 or 2, got {order}")
        _check_count("retention_steps", self.retention_steps)
        _check_count("cache_end_steps", self.cache_end_steps)
        _check_count("max_consecutive_cached", self.max_consecutive_cached)
        p = self.power_exp
        if isinstance(p, bool) or not isinstance(p, int | float) or not math.isfinite(p) or p <= 0:
            raise ValueError(f"power_exp must be a finite number > 0, got {p!r}")


@dataclass
class _BranchState:
    """Gate and residual state of one CFG branch within one request."""

    accumulated: float = 0.0
    prev_indicator: list[torch.Tensor] | None = None
    history: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (step, residual [N_gen, D])
    consecutive_cached: int = 0
    last_step: int | None = None


def _sigma_value(sigma: object) -> float | None:
    """The step's sigma as a float, or None when it is not finite or outside [0, 1] (the cache fails open)."""
    if isinstance(sigma, torch.Tensor) and sigma.numel() == 1:
        sigma = sigma.item()
    if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real):
        raise TypeError(f"sigma must be a real number in [0, 1], got {type(sigma).__name__}")
    value = float(sigma)
    return value if math.isfinite(value) and 0.0 <= value <= 1.0 else None


def _history_matches(history: list[tuple[int, torch.Tensor]], gen_in: torch.Tensor) -> bool:
    return all(
        r.shape == gen_in.shape and r.dtype == gen_in.dtype and r.device == gen_in.device for _, r in history
    )


class SeaCache:
    """Step controller implementing SeaCache; see the module docstring and ``StepController``.

    force_skip(step, branch) -> bool: asked whenever a call would run FULL; True turns it into a SKIP if
        this branch has a usable residual history (counted as ``forced``), otherwise the call runs FULL and
        is counted as fail-open ``no_history``. The deadline guard answers False on the final step.
    on_decision(decision): called after each call completes (after ``full()`` returned, or after the skip),
        so a deadline guard can time the calls.
    sea_filter: share one filter (and its gain cache) between controllers; default: a private one.
    """

    def __init__(
        self,
        config: SeaCacheConfig | None = None,
        force_skip: ForceSkip | None = None,
        *,
        on_decision: DecisionObserver | None = None,
        sea_filter: SeaFilter | None = None,
    ) -> None:
        self.config = config if config is not None else SeaCacheConfig()
        self.force_skip = force_skip
        self.on_decision = on_decision
        self.sea_filter = sea_filter if sea_filter is not None else SeaFilter(self.config.power_exp)
        if self.sea_filter.power_exp != float(self.config.power_exp):
            raise ValueError(
                f"sea_filter.power_exp {self.sea_filter.power_exp} differs from config.power_exp "
                f"{self.config.power_exp}"
            )
        self._num_steps: int | None = None
        self._thresholds: tuple[float, ...] = ()
        self._cap = self.config.max_consecutive_cached
        self._gate_active = True
        self._states: dict[str, _BranchState] = {}
        self._record = CacheRecord(num_steps=0)
        self._indicator_key: tuple | None = None
        self._indicator: list[torch.Tensor] | None = None
        self._distances: dict[tuple[int, int], float] = {}

    # ------------------------------------------------------------------ per request

    def begin(
        self,
        num_steps: int,
        *,
        threshold: ThresholdSpec | None = None,
        max_consecutive_cached: int | None = None,
    ) -> None:
        """Reset all state for a request of ``num_steps`` steps.

        threshold / max_consecutive_cached override the config for this request only (the budget planner's
        per-tick schedule and cap).
        """
        self._num_steps = check_num_steps(num_steps)
        spec = self.config.threshold if threshold is None else threshold
        self._thresholds = resolve_thresholds(spec, num_steps)
        self._cap = (
            self.config.max_consecutive_cached
            if max_consecutive_cached is None
            else _check_count("max_consecutive_cached", max_consecutive_cached)
        )
        # With every threshold 0 the gate can never choose SKIP, so the indicator (FFTs) is not needed.
        self._gate_active = any(t > 0 for t in self._thresholds)
        self._states = {}
        self._indicator_key = None
        self._indicator = None
        self._distances = {}
        self._record = CacheRecord(
            num_steps=num_steps, thresholds=self._thresholds, max_consecutive_cached=self._cap
        )

    def record(self) -> CacheRecord:
        return self._record

    # ------------------------------------------------------------------ the step

    def run_stack(
        self,
        step: int,
        branch: str,
        sigma: float,
        noisy_vision: Sequence[torch.Tensor],
        gen_in: torch.Tensor,
        full: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        check_step_call(step, branch, self._num_steps)
        noisy_vision = self._check_noisy_vision(noisy_vision)
        sigma_value = _sigma_value(sigma)
        threshold = self._thresholds[step]

        state = self._states.setdefault(branch, _BranchState())
        non_adjacent = state.last_step is not None and step != state.last_step + 1
        if non_adjacent:
            state = self._states[branch] = _BranchState()
        state.last_step = step

        indicator = None
        if self._gate_active and sigma_value is not None and noisy_vision:
            indicator = self._shared_indicator(step, sigma_value, noisy_vision)
        if non_adjacent:
            reason, distance, accumulated = "non_adjacent_step", None, 0.0
        else:
            reason, distance, accumulated = self._gate(
                step, state, indicator, sigma_value, noisy_vision, threshold
            )
        # prev follows every step, forced or not, so the accumulator sums the step-to-step drift.
        state.prev_indicator = indicator

        history_ok = bool(state.history) and _history_matches(state.history, gen_in)
        if state.history and not history_ok:
            state.history.clear()
            state.consecutive_cached = 0
            if reason is None:
                reason = "shape_change"
        if reason is None and not history_ok:
            reason = "no_history"
        skip_reason = "gate"
        if reason is not None and self.force_skip is not None and self.force_skip(step, branch):
            if history_ok:
                # Forced SKIP: the gate's drift stays accumulated, so the next step wants a refresh again.
                reason, skip_reason = None, "forced"
            else:
                reason = "no_history"

        if reason is None:
            state.accumulated = accumulated
            state.consecutive_cached += 1
            out = gen_in + newton_extrapolate(state.history, step, self.config.residual_order)
            decision = StepDecision(step, branch, False, skip_reason, distance, accumulated, threshold)
        else:
            state.accumulated = 0.0
            state.consecutive_cached = 0
            out = full()
            if out.shape != gen_in.shape:
                raise ValueError(
                    f"full() returned shape {tuple(out.shape)}; the GEN stack must keep gen_in's shape "
                    f"{tuple(gen_in.shape)}"
                )
            if self._gate_active or self.force_skip is not None:
                state.history.append((step, (out - gen_in).detach()))
                del state.history[: -(self.config.residual_order + 1)]
            decision = StepDecision(step, branch, True, reason, distance, 0.0, threshold)
            if reason in FAIL_OPEN_REASONS:
                self._warn_fail_open(reason, step, branch)

        self._record.add(decision)
        if self.on_decision is not None:
            self.on_decision(decision)
        return out

    # ------------------------------------------------------------------ helpers

    def _gate(
        self,
        step: int,
        state: _BranchState,
        indicator: list[torch.Tensor] | None,
        sigma: float | None,
        noisy_vision: list[torch.Tensor],
        threshold: float,
    ) -> tuple[str | None, float | None, float]:
        """The accumulate-and-refresh rule: ``(full reason or None for SKIP, distance, accumulator if SKIP)``."""
        if torch.is_grad_enabled():
            return "grad_enabled", None, 0.0
        if sigma is None:
            return "sigma_out_of_range", None, 0.0
        if step < self.config.retention_steps:
            return "retention", None, 0.0
        if step >= self._num_steps - self.config.cache_end_steps:
            return "cache_end", None, 0.0
        if not noisy_vision:
            return "no_noisy_vision", None, 0.0
        if not self._gate_active:
            return "threshold", None, 0.0
        if self._cap > 0 and state.consecutive_cached >= self._cap:
            return "cap", None, state.accumulated
        if state.prev_indicator is None:
            return "no_previous_indicator", None, 0.0
        distance = self._distance(indicator, state.prev_indicator)
        if distance is None:
            return "shape_change", None, 0.0
        if not math.isfinite(distance):
            return "nonfinite_distance", distance, 0.0
        accumulated = state.accumulated + distance
        return ("threshold" if accumulated >= threshold else None), distance, accumulated

    @staticmethod
    def _check_noisy_vision(noisy_vision: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if isinstance(noisy_vision, torch.Tensor) or not isinstance(noisy_vision, Sequence):
            raise TypeError(
                "noisy_vision must be a list of noisy latents [C, T, H, W] (empty for inverse dynamics), "
                f"got {type(noisy_vision).__name__}"
            )
        for i, item in enumerate(noisy_vision):
            if not isinstance(item, torch.Tensor) or item.ndim != 4 or not item.is_floating_point():
                is_tensor = isinstance(item, torch.Tensor)
                got = f"shape {tuple(item.shape)} {item.dtype}" if is_tensor else type(item).__name__
                raise ValueError(f"noisy_vision[{i}] must be a float tensor [C, T, H, W], got {got}")
        return list(noisy_vision)

    def _shared_indicator(
        self, step: int, sigma: float, noisy_vision: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """SEA indicators of this step, computed once and reused by the other CFG branches of the step.

        The branches of one step see the same latent tensors (the sampler updates them only after every
        branch ran), so storage, shape, dtype and device identify them within a step. Version counters are
        not used: inference-mode tensors have none.
        """
        key = (
            step,
            sigma,
            tuple((t.data_ptr(), tuple(t.shape), t.dtype, str(t.device)) for t in noisy_vision),
        )
        if key != self._indicator_key:
            self._indicator_key = key
            self._indicator = [self.sea_filter.indicator(t, sigma) for t in noisy_vision]
            self._distances = {}
        return self._indicator

    def _distance(self, current: list[torch.Tensor], previous: list[torch.Tensor]) -> float | None:
        """Mean per-item rel-L1 between indicator lists; None when their shapes/dtypes/devices differ."""
        key = (id(current), id(previous))
        if key in self._distances:
            return self._distances[key]
        if len(current) != len(previous):
            return None
        pairs = list(zip(current, previous, strict=True))
        if any(c.shape != p.shape or c.dtype != p.dtype or c.device != p.device for c, p in pairs):
            return None
        d = sum(rel_l1(c, p) for c, p in pairs) / len(pairs)
        self._distances[key] = d
        return d

    def _warn_fail_open(self, reason: str, step: int, branch: str) -> None:
        # A fail-open that repeats every request (inverse dynamics, a guard asking to skip before the first
        # residual) would flood the log: warn once per reason and process, then only at debug level.
        if reason in _WARNED_FAIL_OPENS:
            logger.debug("SeaCache fail-open (%s) at step %d branch %s", reason, step, branch)
            return
        _WARNED_FAIL_OPENS.add(reason)
        logger.warning("SeaCache ran full (fail-open: %s) at step %d branch %r; further ones are logged at "
                       "debug level", reason, step, branch)
