"""The step-controller contract between the sampler loop and the step cache, and the per-request record.

For each step ``i`` and CFG branch ``b`` ("cond", "uncond") the sampler asks::

    gen_out = controller.estimate(step=i, branch=b, sigma=sigma_i, noisy_vision=[x_t [C, T, H, W], ...],
                                  gen_in=gen.hidden)
    if gen_out is None:                                   # the call runs (alone, or batched with others)
        gen_out = model.gen_stack(gen, und_kv[b])
        controller.ran(b, gen_out)

A step's branches may all be estimated before any of them runs (their full calls then run as one batch), so
a controller keeps what it needs for ``ran`` per branch.

``begin(num_steps)`` is called once per request before the first step; ``record()`` after the last.
``noisy_vision`` holds every vision item with at least one noisy frame, whole (its clean conditioning frames
included), and leaves out fully conditioned items; it is empty for packs without noisy vision (inverse
dynamics), which makes SeaCache fail open. This matches diffusers' Cosmos3 SeaCache hook.

Controllers rely on the sampler and do not check it: calls run under no grad, sigma is in [0, 1], a branch's
steps come one apart (it may start late or stop early), and the shapes stay fixed within a request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # keep this module importable without torch (the budget layer reads records)
    import torch

# Why a call ran FULL although the cache was allowed to skip: it had nothing to gate or extrapolate on.
FAIL_OPEN_REASONS = frozenset(
    {
        "no_history",  # the guard asked for a skip but no residual is stored for this branch yet
        "no_previous_indicator",  # first indicator seen on this branch; nothing to compare against
        "no_noisy_vision",  # pack without noisy vision (inverse dynamics, action-only)
        "nonfinite_distance",  # the indicator distance was NaN or inf
    }
)
# The planned reasons for a FULL call are "no_cache", "retention", "cache_end", "cap" and "threshold"; a SKIP
# is the gate's ("gate") or the deadline guard's ("forced").


@dataclass
class StepDecision:
    """One GEN-stack call: what was decided and why.

    distance: the gate's rel-L1 distance to the previous indicator (None when the gate did not measure).
    accumulated: the accumulator after this step. threshold: the gate threshold in force at this step.
    """

    step: int
    branch: str
    full: bool
    reason: str
    distance: float | None = None
    accumulated: float | None = None
    threshold: float = 0.0

    @property
    def forced(self) -> bool:
        """A skip forced by the deadline guard against the gate's choice."""
        return not self.full and self.reason == "forced"

    @property
    def fail_open(self) -> bool:
        return self.full and self.reason in FAIL_OPEN_REASONS


@dataclass
class BranchCounts:
    """Per-CFG-branch call counts. ``skipped`` includes ``forced_skip``; ``full`` includes ``fail_open``."""

    full: int = 0
    skipped: int = 0
    forced_skip: int = 0
    fail_open: int = 0
    fail_open_reasons: dict[str, int] = field(default_factory=dict)

    def add(self, decision: StepDecision) -> None:
        if decision.full:
            self.full += 1
            if decision.fail_open:
                self.fail_open += 1
                self.fail_open_reasons[decision.reason] = self.fail_open_reasons.get(decision.reason, 0) + 1
        else:
            self.skipped += 1
            if decision.forced:
                self.forced_skip += 1


@dataclass
class CacheRecord:
    """What the step controller did in one request: decisions in call order and counts per branch."""

    num_steps: int
    decisions: list[StepDecision] = field(default_factory=list)
    branches: dict[str, BranchCounts] = field(default_factory=dict)
    thresholds: tuple[float, ...] = ()
    max_consecutive_cached: int = 0

    def add(self, decision: StepDecision) -> None:
        self.decisions.append(decision)
        self.branches.setdefault(decision.branch, BranchCounts()).add(decision)

    def sequence(self, branch: str) -> str:
        """Decisions of one branch in step order as a string: ``F`` full, ``S`` skip (e.g. ``FSSFSSFSSF``)."""
        return "".join("F" if d.full else "S" for d in self.decisions if d.branch == branch)

    @property
    def full_calls(self) -> int:
        return sum(c.full for c in self.branches.values())

    @property
    def skipped_calls(self) -> int:
        return sum(c.skipped for c in self.branches.values())

    @property
    def forced_skips(self) -> int:
        return sum(c.forced_skip for c in self.branches.values())

    @property
    def wanted_full_calls(self) -> int:
        """Full calls the gate would have run without the deadline guard: those that ran, and one per run of
        consecutive forced skips of a branch. A denied refresh leaves the gate asking again on the next steps
        (its distance and its cap count keep growing), so the rest of a run is the denial's echo, not a want."""
        wanted, forced_before = 0, set()
        for decision in self.decisions:
            if decision.full or (decision.forced and decision.branch not in forced_before):
                wanted += 1
            if decision.forced:
                forced_before.add(decision.branch)
            else:
                forced_before.discard(decision.branch)
        return wanted


class StepController(ABC):
    """Decides, per sampler step and CFG branch, whether the GEN stack runs or its residual is reused.

    A call is two halves, so that the stack itself can run elsewhere (batched with other ticks'):
    ``estimate`` returns the skipped call's output, or None when the call must run; its output then goes to
    ``ran`` under the same branch.
    """

    @abstractmethod
    def begin(self, num_steps: int) -> None:
        """Reset all state for a new request of ``num_steps`` sampler steps."""

    @abstractmethod
    def estimate(self, step: int, branch: str, sigma: float, noisy_vision: Sequence[torch.Tensor],
                 gen_in: torch.Tensor) -> torch.Tensor | None:
        """``gen_in`` plus the estimated residual ``[N_gen, D]`` when this call is skipped; None when it runs."""

    @abstractmethod
    def ran(self, branch: str, out: torch.Tensor) -> None:
        """The GEN stack output ``[N_gen, D]`` of ``branch``'s call that ``estimate`` said must run."""

    @abstractmethod
    def record(self) -> CacheRecord:
        """Decisions and counts of the current (or last) request."""


class NoCache(StepController):
    """Always runs the full stack; records every call as FULL with reason ``no_cache``."""

    def __init__(self) -> None:
        self._record = CacheRecord(num_steps=0)
        self._pending: dict[str, StepDecision] = {}

    def begin(self, num_steps: int) -> None:
        self._record = CacheRecord(num_steps=num_steps, thresholds=(0.0,) * num_steps)

    def estimate(self, step, branch, sigma, noisy_vision, gen_in) -> None:
        self._pending[branch] = StepDecision(step=step, branch=branch, full=True, reason="no_cache")
        return None

    def ran(self, branch: str, out: torch.Tensor) -> None:
        self._record.add(self._pending.pop(branch))

    def record(self) -> CacheRecord:
        return self._record
