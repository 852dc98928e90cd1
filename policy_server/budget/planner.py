"""Per-tick plan: the SeaCache setting (threshold schedule, cap) that fits the deadline, or fallbacks.

For N steps with uncond on U of them there are ``N + U`` calls. The uncond pass runs on the steps the
pipeline's guidance interval allows (``guided(N)``: all N without an interval, none without CFG), cut at
step K by fallback 1. A step's full calls run as one batch, and the two branches see one SEA indicator, so
their gates agree: of F full calls, ``P(F) = floor(F * U / (N + U))`` are expected to pair up, each pair
saving ``2 * c_full - c_pair``. So ``T(F) = c_fixed + F * c_full + (N + U - F) * c_skip - P(F) * (2 * c_full
- c_pair)`` (ms), and ``F_max`` is the most full calls with ``T(F_max) <= D``. The plan's ``branches(step)``
is the one place that says which CFG branches a step runs.

* ``F_max >= N + K``: no caching (threshold 0: bit-identical output).
* else the least aggressive ladder setting whose expected full-call count fits. The expectation is a high
  quantile of what the setting needed on this session's previous ticks; never-tried settings get the best
  case of their cap, raised to what any more aggressive setting needed (a setting never needs fewer
  refreshes than a more aggressive one). The in-tick guard catches a wrong guess.
* if even maximal caching (only the retention and cache-end steps full) cannot fit, the plan is marked
  infeasible with the best achievable latency, and the configured fallbacks apply in this fixed order:
  1. drop the unconditional CFG pass from some step onward (as late as possible);
  2. fewer sampler steps (as many as possible).

With a quality profile (``policy_server.budget.profile``) the planner chooses on its frontier instead
(``plan_on_frontier``): the configuration of steps, CFG schedule and cache setting with the least expected
error whose latency fits at its full-call count (the calibration set's, then the session's), the error
averaged over how much slower than expected recent ticks ran: the guard cuts a slow tick, and calibration
measured what that costs each point.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .cost_model import CallCosts
from .history import SessionHistory, Structure
from .profile import ProfilePoint

ThresholdRule = float | Callable[[int, int], float]
DENOISE_STAGE = "denoise"  # the step loop, in ``TickPlan.predicted_stage_ms`` beside the fixed stages


@dataclass(frozen=True)
class CacheSetting:
    """One rung of the ladder: a threshold (number or ``f(step, num_steps)``) and a cap (0 = unlimited)."""

    name: str
    threshold: ThresholdRule
    cap: int

    def thresholds(self, num_steps: int) -> tuple[float, ...]:
        """One threshold per step: ``tuple[num_steps]``."""
        if callable(self.threshold):
            return tuple(float(self.threshold(i, num_steps)) for i in range(num_steps))
        return (float(self.threshold),) * num_steps

    @property
    def effective_cap(self) -> float:
        return math.inf if self.cap == 0 else self.cap


NO_CACHING = "none"
# Only the retention and cache-end steps refresh: the threshold is never reached and the cap is off.
MAX_CACHING = CacheSetting("max", 1e6, 0)
# Least to most aggressive. 0.25 / cap 2 is the published Cosmos3 default.
DEFAULT_LADDER = (
    CacheSetting("t0.10-c1", 0.10, 1),
    CacheSetting("t0.25-c1", 0.25, 1),
    CacheSetting("t0.25-c2", 0.25, 2),
    CacheSetting("t0.50-c2", 0.50, 2),
    CacheSetting("t1.00-c3", 1.00, 3),
    MAX_CACHING,
)


def min_full_calls(
    num_steps: int, uncond_steps: range, retention_steps: int, cache_end_steps: int, cap: int
) -> int:
    """Fewest full calls of a tick when the gate never refreshes on its own (only forced refreshes).

    The cond branch runs all ``num_steps``; uncond runs ``uncond_steps``. A branch's first call is always
    full (no residual yet), as are steps ``< retention_steps`` and ``>= num_steps - cache_end_steps``, and a
    cap > 0 forces a refresh after ``cap`` skips in a row.
    """
    total = 0
    for branch_steps in (range(num_steps), uncond_steps):
        consecutive, has_history = 0, False
        for step in branch_steps:
            forced = (
                not has_history
                or step < retention_steps
                or step >= num_steps - cache_end_steps
                or (cap > 0 and consecutive >= cap)
            )
            if forced:
                total, consecutive, has_history = total + 1, 0, True
            else:
                consecutive += 1
    return total


@dataclass(frozen=True)
class PlannerConfig:
    """Planner knobs.

    ladder: settings from least to most aggressive; ``MAX_CACHING`` is appended when absent.
    count_quantile: quantile of the session's recent full-call counts that must fit (the ladder's).
    cost_margin_devs: the ladder plans, and the guard holds every tick to, costs raised by this many mean
        absolute deviations.
    frontier_count_quantile / frontier_cost_margin_devs: the same for planning on a quality profile's frontier:
        its expected cost, since the guard's pace rule spreads a slower tick's cuts thinly over it.
    drop_uncond / min_cfg_steps: fallback 1, and the first steps that always keep the uncond pass.
    fewer_steps / min_steps: fallback 2, and the fewest sampler steps it may go down to.
    """

    ladder: tuple[CacheSetting, ...] = DEFAULT_LADDER
    retention_steps: int = 1
    cache_end_steps: int = 1
    count_quantile: float = 0.9
    cost_margin_devs: float = 1.0
    frontier_count_quantile: float = 0.5
    frontier_cost_margin_devs: float = 0.0
    drop_uncond: bool = True
    min_cfg_steps: int = 1
    fewer_steps: bool = True
    min_steps: int = 2

    def __post_init__(self) -> None:
        ladder = tuple(self.ladder)
        if MAX_CACHING.name not in {s.name for s in ladder}:
            ladder = (*ladder, MAX_CACHING)
        object.__setattr__(self, "ladder", ladder)
        names = [s.name for s in ladder]
        if len(set(names)) != len(names):
            raise ValueError(f"ladder setting names must be unique, got {names}")
        for weaker, stronger in zip(ladder, ladder[1:], strict=False):
            constant = not callable(weaker.threshold) and not callable(stronger.threshold)
            if stronger.effective_cap < weaker.effective_cap or (
                constant and stronger.threshold < weaker.threshold
            ):
                raise ValueError(
                    f"ladder must go from least to most aggressive: {stronger.name!r} (threshold "
                    f"{stronger.threshold}, cap {stronger.cap}) follows {weaker.name!r} (threshold "
                    f"{weaker.threshold}, cap {weaker.cap})"
                )
        for name in ("retention_steps", "cache_end_steps", "min_cfg_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.min_steps < 1:
            raise ValueError(f"min_steps must be >= 1, got {self.min_steps}")
        for name in ("count_quantile", "frontier_count_quantile"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("cost_margin_devs", "frontier_cost_margin_devs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class TickPlan:
    """What one tick will run, and what the planner expects (ms).

    cfg_steps: fallback 1 keeps the uncond pass on steps ``< cfg_steps`` only (``num_steps``: no cut).
    uncond_steps: the steps the uncond pass runs on: the guided ones before ``cfg_steps``.
    setting: ladder setting name, or ``"none"`` (no caching: every threshold 0).
    full_calls_max: F_max over all calls of the tick; expected_full_calls: what the chosen setting needs.
    feasible: maximal caching fits at the requested steps and passes; best_achievable_ms is its latency.
    fits: the final plan (after fallbacks) is predicted to meet the deadline.
    fallbacks: applied fallbacks in order, e.g. ``("drop_uncond_from_step=3", "num_steps=10->6")``.
    residual_order / expected_error: a point of a quality profile's frontier sets the first and predicts the
    second (``plan_on_frontier``); None for a ladder plan.
    """

    deadline_ms: float
    requested_steps: int
    num_steps: int
    cfg_steps: int
    uncond_steps: range
    setting: str
    thresholds: tuple[float, ...]
    cap: int
    full_calls_max: int
    expected_full_calls: int
    min_full_calls: int
    predicted_ms: float
    predicted_stage_ms: dict[str, float]
    feasible: bool
    best_achievable_ms: float
    fits: bool
    fallbacks: tuple[str, ...] = field(default_factory=tuple)
    residual_order: int | None = None
    expected_error: float | None = None

    @property
    def calls(self) -> int:
        return self.num_steps + len(self.uncond_steps)

    @property
    def structure(self) -> Structure:
        return (self.num_steps, self.cfg_steps)

    @property
    def caching(self) -> bool:
        """Whether the gate may skip a call: an uncached plan (every threshold 0) runs all its calls full."""
        return any(self.thresholds)

    def branches(self, step: int) -> tuple[str, ...]:
        """CFG branches the sampler runs at ``step``, in call order."""
        return ("cond", "uncond") if step in self.uncond_steps else ("cond",)

    def summary(self) -> str:
        head = (
            f"deadline {self.deadline_ms:.1f} ms: {self.setting} over {self.num_steps} steps "
            f"(uncond on {len(self.uncond_steps)}), {self.expected_full_calls}/{self.calls} full calls expected "
            f"(max {self.full_calls_max}), predicted {self.predicted_ms:.1f} ms"
        )
        if not self.feasible:
            head += f"; infeasible with caching alone (best {self.best_achievable_ms:.1f} ms)"
        if self.fallbacks:
            head += "; fallbacks " + ", ".join(self.fallbacks)
        if not self.fits:
            head += "; deadline expected to be missed"
        return head


class _Costs:
    """Latency arithmetic for one tick (ms)."""

    def __init__(self, costs: CallCosts, deadline_ms: float, uncond: Callable[[Structure], range]) -> None:
        self.full, self.skip, self.fixed = costs.full_ms, costs.skip_ms, costs.fixed_total_ms
        self.pair_saving = costs.pair_saving_ms
        self.fixed_stages = dict(costs.fixed_ms)
        self.deadline = deadline_ms
        self.uncond = uncond

    def calls(self, structure: Structure) -> int:
        return structure[0] + len(self.uncond(structure))

    def latency(self, structure: Structure, full_calls: int) -> float:
        calls = self.calls(structure)
        pairs = full_calls * len(self.uncond(structure)) // calls
        return self.fixed + full_calls * self.full + (calls - full_calls) * self.skip - pairs * self.pair_saving

    def full_calls_max(self, structure: Structure) -> int:
        """The most full calls that fit the deadline (-1: not even skipping every call does)."""
        # T(F) need not grow with every single F (one more full call may complete a pair), so count down.
        return next((f for f in range(self.calls(structure), -1, -1) if self.latency(structure, f) <= self.deadline),
                    -1)


def plan_tick(
    deadline_ms: float,
    num_steps: int,
    passes: int,
    costs: CallCosts,
    history: SessionHistory | None = None,
    config: PlannerConfig | None = None,
    guided: Callable[[int], range] = range,
) -> TickPlan:
    """Plan a tick of ``num_steps`` sampler steps and ``passes`` CFG passes (1 or 2) within ``deadline_ms`` > 0.

    deadline_ms: time left for the whole tick (fixed stages included). costs: from ``CostModel.costs``.
    history: the session's previous ticks (None: priors only). guided: the steps of an n-step tick on which
    the guidance interval allows the uncond pass (`PolicyPipeline.guided_steps`; default all).
    """
    config = config or PlannerConfig()
    requested: Structure = (num_steps, num_steps if passes == 2 else 0)

    def uncond(structure: Structure) -> range:
        window = guided(structure[0])
        return range(window.start, max(window.start, min(window.stop, structure[1])))

    def min_full(structure: Structure, cap: int) -> int:
        return min_full_calls(structure[0], uncond(structure), config.retention_steps, config.cache_end_steps, cap)

    cost = _Costs(costs.cautious(config.cost_margin_devs), deadline_ms, uncond)

    def fits_max_caching(structure: Structure) -> bool:
        return min_full(structure, 0) <= cost.full_calls_max(structure)

    best_achievable = cost.latency(requested, min_full(requested, 0))
    feasible = fits_max_caching(requested)
    structure, fallbacks = requested, []
    if not feasible:
        structure, fallbacks = _apply_fallbacks(requested, config, fits_max_caching)

    f_max = cost.full_calls_max(structure)
    calls = cost.calls(structure)
    n_steps = structure[0]
    if f_max >= calls:
        setting_name, thresholds, cap, expected = NO_CACHING, (0.0,) * n_steps, 0, calls
    else:
        chosen, expected = _choose_setting(structure, f_max, config, history, min_full)
        setting_name, thresholds, cap = chosen.name, chosen.thresholds(n_steps), chosen.cap
    predicted = cost.latency(structure, expected)
    return TickPlan(
        deadline_ms=float(deadline_ms),
        requested_steps=num_steps,
        num_steps=n_steps,
        cfg_steps=structure[1],
        uncond_steps=uncond(structure),
        setting=setting_name,
        thresholds=thresholds,
        cap=cap,
        full_calls_max=f_max,
        expected_full_calls=expected,
        min_full_calls=min_full(structure, 0),
        predicted_ms=predicted,
        predicted_stage_ms={**cost.fixed_stages, DENOISE_STAGE: predicted - cost.fixed},
        feasible=feasible,
        best_achievable_ms=best_achievable,
        fits=predicted <= deadline_ms,
        fallbacks=tuple(fallbacks),
    )


def _apply_fallbacks(
    requested: Structure, config: PlannerConfig, fits: Callable[[Structure], bool]
) -> tuple[Structure, list[str]]:
    """Fallback 1 (drop uncond late), then fallback 2 (fewer steps); the least change that fits."""
    n, k = requested
    fallbacks: list[str] = []
    can_drop = config.drop_uncond and k > 0

    def latest_cfg_steps(steps: int) -> int | None:
        """The most uncond steps that fit at ``steps`` sampler steps, or None."""
        if fits((steps, steps if k > 0 else 0)):
            return steps if k > 0 else 0
        if not can_drop:
            return None
        lowest = min(config.min_cfg_steps, steps)
        return next((c for c in range(steps - 1, lowest - 1, -1) if fits((steps, c))), None)

    if can_drop:
        best = latest_cfg_steps(n)
        k = best if best is not None else min(config.min_cfg_steps, n)
        fallbacks.append(f"drop_uncond_from_step={k}")
        if best is not None:
            return (n, k), fallbacks
    if config.fewer_steps and n > config.min_steps:
        for steps in range(n - 1, config.min_steps - 1, -1):
            cfg = latest_cfg_steps(steps)
            if cfg is not None:
                break
        else:
            steps, cfg = config.min_steps, min(k, config.min_steps)
        if fallbacks and cfg >= steps:
            fallbacks.clear()  # at the reduced step count the full uncond pass fits again
        elif fallbacks:
            fallbacks[0] = f"drop_uncond_from_step={cfg}"
        fallbacks.append(f"num_steps={n}->{steps}")
        return (steps, cfg), fallbacks
    return (n, k), fallbacks


def _choose_setting(
    structure: Structure,
    f_max: int,
    config: PlannerConfig,
    history: SessionHistory | None,
    min_full: Callable[[Structure, int], int],
) -> tuple[CacheSetting, int]:
    """The least aggressive setting whose expected full-call count fits ``f_max``, else the last one."""
    learned = [
        history.quantile(s.name, structure, config.count_quantile) if history is not None else None
        for s in config.ladder
    ]
    expected = []
    for i, setting in enumerate(config.ladder):
        if learned[i] is not None:
            expected.append(learned[i])
            continue
        stronger = [c for c in learned[i + 1:] if c is not None]
        expected.append(max([min_full(structure, setting.cap), *stronger]))
    for setting, count in zip(config.ladder, expected, strict=True):
        if count <= f_max:
            return setting, count
    return config.ladder[-1], expected[-1]


def plan_on_frontier(
    deadline_ms: float,
    points: Sequence[ProfilePoint],
    costs: CallCosts,
    history: SessionHistory | None = None,
    config: PlannerConfig | None = None,
    guided: Callable[[int], range] = range,
    slowdowns: Sequence[float] = (1.0,),
) -> TickPlan:
    """The point of a quality profile's frontier with the least expected error whose latency fits
    ``deadline_ms``: steps, CFG schedule and cache setting chosen together. A point's expected error is its mean
    over ``slowdowns``, how much slower than their expected costs the calls of recent ticks ran, and over the
    full-call counts the gate wanted on the session's recent ticks at that point (``expected_error``): on a
    machine whose ticks vary, a point that fits with little to spare is cut on the slower ticks, a tick whose
    gate wants more refreshes than planned is cut as a slower one is, and points differ in what a cut costs
    them. The gate's full-call count planned on is the calibration set's 90th percentile until the session has
    run the point; then the ``frontier_count_quantile`` of the session's own recent counts (``history``), since
    the gate refreshes on this robot's scene as often as on its last ticks, not as on the calibration set.
    When no point fits, the cheapest one, marked ``fits=False`` (fallback ``no_point_fits``): the guard then
    gives up what it must. ``costs``: from ``CostModel.costs``, raised by ``frontier_cost_margin_devs`` (by
    default none: the guard absorbs the tail); ``guided``: as for ``plan_tick``."""
    config = config or PlannerConfig()
    costs = costs.cautious(config.frontier_cost_margin_devs)
    structures = [(p.config.num_steps, p.config.cfg_steps) for p in points]
    names = [(p.config.name, s) for p, s in zip(points, structures, strict=True)]
    recent = [Counter() if history is None else history.tally(*name) for name in names]
    seen = [None if history is None else history.quantile(*name, config.frontier_count_quantile) for name in names]
    predicted = [point.predicted_p90_ms(costs) if count is None else point.predicted_at_ms(costs, count)
                 for point, count in zip(points, seen, strict=True)]
    cheapest = min(range(len(points)), key=predicted.__getitem__)
    loop_ms = deadline_ms - costs.fixed_total_ms  # what the step loop has

    def error_at(i: int, latency_ms: float) -> float:
        return expected_error(points[i], loop_ms / (latency_ms - costs.fixed_total_ms), slowdowns)

    def mean_error(i: int) -> float:
        """``points[i]``'s expected error over the session's recent counts at it (the planned one if none)."""
        if not recent[i]:
            return error_at(i, predicted[i])
        return sum(ticks * error_at(i, points[i].predicted_at_ms(costs, count))
                   for count, ticks in recent[i].items()) / recent[i].total()

    errors = {i: mean_error(i) for i in range(len(points)) if predicted[i] <= deadline_ms}
    chosen = min(errors, key=lambda i: (errors[i], predicted[i])) if errors else cheapest
    point, config = points[chosen], points[chosen].config
    window = guided(config.num_steps)
    uncond = range(window.start, max(window.start, min(window.stop, config.cfg_steps)))
    full = round(point.full_calls_p90 + 2 * point.pairs_p90 if seen[chosen] is None else seen[chosen])
    return TickPlan(
        deadline_ms=float(deadline_ms),
        requested_steps=config.num_steps,
        num_steps=config.num_steps,
        cfg_steps=config.cfg_steps,
        uncond_steps=uncond,
        setting=config.name,
        thresholds=(config.threshold,) * config.num_steps,
        cap=config.cap,
        full_calls_max=full,  # a point fixes its calls: the ladder's F_max and floor are its own counts
        expected_full_calls=full,
        min_full_calls=full,
        predicted_ms=predicted[chosen],
        predicted_stage_ms={**costs.fixed_ms, DENOISE_STAGE: predicted[chosen] - costs.fixed_total_ms},
        feasible=bool(errors),
        best_achievable_ms=predicted[cheapest],
        fits=bool(errors),
        fallbacks=() if errors else ("no_point_fits",),
        residual_order=config.residual_order,
        expected_error=errors.get(chosen, point.error),
    )


def expected_error(point: ProfilePoint, slack: float, slowdowns: Sequence[float]) -> float:
    """The mean error of ``point``, whose step loop has ``slack`` times its expected time (>= 1: it fits), over
    ticks whose calls run ``slowdowns`` times their expected costs: a tick slower than its slack allows is cut by
    the guard, at the error calibration measured for that slowdown (``ProfilePoint.error_at``; one slower than
    any measured is priced as the slowest)."""
    return sum(point.error_at(slack / slowdown) for slowdown in slowdowns) / len(slowdowns)
