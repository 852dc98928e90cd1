"""Quality profile of one checkpoint: what each tick configuration costs and how far its actions stray.

A configuration (`TickConfig`) sets every lever a tick has: sampler steps, the CFG schedule (the uncond
pass on the guided steps before `cfg_steps`) and the SeaCache setting (threshold, cap, residual order).
Calibration (`policy-server calibrate`, `engine/calibration.py`) runs a set of observations through many
of them and keeps, per served embodiment, each configuration's mean action error against the uncached
default (rel-L2) and its calls: full calls alone, steps whose two branches ran full as one batch (pairs),
skipped calls (means, and the 90th percentiles of the full ones: the gate refreshes more on some
observations than on others). A tick's latency is linear in those counts with positive per-call costs, so a
configuration no better in error and no cheaper in any count than another can never be the better pick on
any machine: the planner chooses among the others only (`frontier`). The profile keeps every point measured
(the bench compares fixed configurations with the planner's choice). A point on the frontier also keeps its
error on slow ticks (`Cut`): calls slower than expected, the in-tick guard skips refreshes the gate wants to
hold the deadline, and cached points lose more to that than uncached ones.

The profile is JSON, keyed by the weights digest: a profile of other weights is rejected, not used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from policy_server.json_file import read_json

from .cost_model import CallCosts

PROFILE_VERSION = 3
PROFILE_FILE = "quality_profile.json"  # beside a checkpoint


# Every figure is finite: a hand-edited Infinity in an error or a call count loaded, and made the planner's latencies
# NaN (`predicted_at_ms` divides by the calls).
_FIELDS = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and what is wrong."""


# Calls are means over the calibration's ticks, each a whole count: only float rounding separates them from one.
_CALLS_TOLERANCE = 1e-6


class TickConfig(BaseModel):
    """Every lever of one tick. `cfg_steps`: the uncond pass runs on the guided steps before it (`num_steps`:
    all; 0 with guidance off). `threshold` 0: no caching (bit-identical to uncached at these steps)."""

    model_config = _FIELDS

    num_steps: int = Field(ge=1, le=1000)
    cfg_steps: int = Field(ge=0, le=1000)
    threshold: float = Field(ge=0.0, le=1e6)
    cap: int = Field(ge=0, le=1000)
    residual_order: int = Field(ge=0, le=2)

    @model_validator(mode="after")
    def _cfg_within_steps(self) -> TickConfig:
        if self.cfg_steps > self.num_steps:
            raise ValueError(f"cfg_steps {self.cfg_steps} is more than num_steps {self.num_steps}")
        return self

    @property
    def name(self) -> str:
        cache = "nocache" if self.threshold == 0 else f"t{self.threshold:g}-c{self.cap}-o{self.residual_order}"
        return f"n{self.num_steps}-cfg{self.cfg_steps}-{cache}"


class Cut(BaseModel):
    """A configuration planned to fit, on a tick whose calls run `1 / fraction` times slower than expected: its
    step loop gets `fraction` of the time they take, the guard cutting refreshes to hold the deadline
    (`engine/calibration.py` runs the guard on a simulated clock), and the error that cost."""

    model_config = _FIELDS

    fraction: float = Field(gt=0.0, lt=1.0)
    error: float = Field(ge=0.0)


class ProfilePoint(BaseModel):
    """One configuration as calibration measured it (means over the calibration set)."""

    model_config = _FIELDS

    config: TickConfig
    error: float = Field(ge=0.0)  # action rel-L2 against the uncached default
    error_p90: float = Field(ge=0.0)
    full_calls: float = Field(ge=0.0)  # full calls that ran alone
    pairs: float = Field(ge=0.0)  # steps whose cond and uncond ran full as one batch
    skipped_calls: float = Field(ge=0.0)
    full_calls_p90: float = Field(ge=0.0)
    pairs_p90: float = Field(ge=0.0)
    cuts: tuple[Cut, ...] = ()  # largest fraction first

    @field_validator("cuts")
    @classmethod
    def _largest_first(cls, cuts: tuple[Cut, ...]) -> tuple[Cut, ...]:
        if any(a.fraction <= b.fraction for a, b in zip(cuts, cuts[1:], strict=False)):
            raise ValueError(f"cut fractions must decrease, got {[cut.fraction for cut in cuts]}")
        return cuts

    @property
    def calls(self) -> float:
        """Calls per tick: fixed by the configuration (each pair is two)."""
        return self.full_calls + 2 * self.pairs + self.skipped_calls

    def predicted_ms(self, costs: CallCosts) -> float:
        """The tick's expected latency at `costs` (fixed stages included)."""
        return (costs.fixed_total_ms + self.full_calls * costs.full_ms + self.pairs * costs.pair_ms
                + self.skipped_calls * costs.skip_ms)

    def predicted_p90_ms(self, costs: CallCosts) -> float:
        """The latency at `costs` of a tick whose gate refreshes as often as on 90% of the calibration set."""
        return self._latency_ms(costs, self.full_calls_p90, self.pairs_p90)

    def predicted_at_ms(self, costs: CallCosts, full_calls: float) -> float:
        """The latency at `costs` of a tick whose gate wants `full_calls` full calls in all (a pair is two), shared
        between calls alone and pairs as on the calibration set."""
        full = min(full_calls, self.calls)
        paired = 2 * self.pairs / max(self.full_calls + 2 * self.pairs, 1e-9)  # the share of full calls in pairs
        return self._latency_ms(costs, full * (1 - paired), full * paired / 2)

    def error_at(self, fraction: float) -> float:
        """The expected error when the step loop gets `fraction` of the time its calls take (1: all of it),
        interpolated between the measured cuts; below the smallest one measured, that one's error."""
        if fraction >= 1.0 or not self.cuts:
            return self.error
        measured = [(1.0, self.error), *((cut.fraction, cut.error) for cut in self.cuts)]
        for (high, high_error), (low, low_error) in zip(measured, measured[1:], strict=False):
            if fraction >= low:
                return low_error + (high_error - low_error) * (fraction - low) / (high - low)
        return measured[-1][1]

    def _latency_ms(self, costs: CallCosts, alone: float, pairs: float) -> float:
        skipped = max(self.calls - alone - 2 * pairs, 0.0)
        return costs.fixed_total_ms + alone * costs.full_ms + pairs * costs.pair_ms + skipped * costs.skip_ms

    def _ranked(self) -> tuple[float, ...]:
        return (self.error, self.full_calls, self.pairs, self.skipped_calls, self.full_calls_p90, self.pairs_p90)

    def dominates(self, other: ProfilePoint) -> bool:
        """No worse in error and in every call count, and better in one of them."""
        mine, theirs = self._ranked(), other._ranked()
        return all(a <= b for a, b in zip(mine, theirs, strict=True)) and mine != theirs


class Calibration(BaseModel):
    """Where a profile's figures come from."""

    model_config = _FIELDS

    observations: int = Field(ge=1)
    # Each observations file by name and sha256 (`calibration.observations_source`), the embedded set's too; where an
    # embodiment was calibrated on the embedded set's frames resized to its cameras, "<embodiment>: <file> (sha256:...)
    # (resized, zero state)" (the bench's without "<embodiment>: "); or "warmup (bounded)".
    source: str
    seconds: float = Field(ge=0.0)

    def describe(self) -> str:
        plural = "" if self.observations == 1 else "s"
        return f"calibrated on {self.observations} observation{plural} of {self.source}"


class QualityProfile(BaseModel):
    """Per served embodiment, every tick configuration of one checkpoint as calibration measured it."""

    model_config = _FIELDS

    version: int = PROFILE_VERSION
    digest: str  # `PolicyPipeline.digest` of the weights it was measured on
    default: TickConfig  # the uncached reference every error is measured against
    embodiments: dict[str, tuple[ProfilePoint, ...]]
    calibration: Calibration

    def save(self, path: Path) -> None:
        """Write the profile whole or not at all: a write cut short (a full disk, Ctrl-C) leaves the file that was at
        `path` (a profile a server takes), not a truncated one that stops the next start. OSError if it cannot."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")  # beside it: os.replace is atomic there
        try:
            partial.write_text(self.model_dump_json(indent=1) + "\n")
            os.replace(partial, path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path, digest: str) -> QualityProfile:
        """The profile at `path`, which must be of the weights `digest`; `ProfileError` names what is wrong."""
        data = read_json(path, ProfileError)
        if not isinstance(data, dict):
            raise ProfileError(f"{path}: expected a JSON object (`policy-server calibrate` writes one), got "
                               f"{json.dumps(data)[:40]}")
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(f"{path}: version {data.get('version')!r}; expected {PROFILE_VERSION} "
                               "(run `policy-server calibrate`)")
        try:
            profile = cls.model_validate(data)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ProfileError(f"{path}: {where}: {first['msg']}") from error
        if profile.digest != digest:
            raise ProfileError(f"{path}: measured on weights {profile.digest[:12]}, not these ({digest[:12]}); "
                               "recalibrate with `policy-server calibrate`")
        default = profile.default
        for name, points in profile.embodiments.items():
            if not points:
                raise ProfileError(f"{path}: embodiments.{name}: no configurations")
            for index, point in enumerate(points):
                # Calibration measures no more than its reference; a tick runs what the config says, and is predicted
                # at the counts: a hand edit where they differ ran 50 steps on a 20-step model, or planned one short.
                config, where = point.config, f"{path}: embodiments.{name}.{index}"
                if config.num_steps > default.num_steps or config.cfg_steps > default.cfg_steps:
                    raise ProfileError(f"{where}.config: {config.num_steps} sampler steps, {config.cfg_steps} guided; "
                                       f"more than the default's {default.num_steps}, {default.cfg_steps} guided, "
                                       "the reference its error is measured against")
                # A step makes one call, and a second where it is guided: of the first cfg_steps, those inside the
                # checkpoint's guidance interval, which the profile does not know (all of them without one).
                most = config.num_steps + config.cfg_steps
                if not config.num_steps - _CALLS_TOLERANCE <= point.calls <= most + _CALLS_TOLERANCE:
                    raise ProfileError(f"{where}: {point.calls:g} calls (full_calls + 2 pairs + skipped_calls); "
                                       f"expected {config.num_steps} to {most} for its config (num_steps, and one "
                                       "more per guided step of cfg_steps): its ticks would be planned on other work")
        return profile


def frontier(points: Sequence[ProfilePoint]) -> tuple[ProfilePoint, ...]:
    """The points no other point dominates, best error first. Of points that measured alike (a threshold the
    gate never reached runs as uncached), the first one given stays."""
    alike: dict[tuple[float, ...], ProfilePoint] = {}
    for point in points:
        alike.setdefault(point._ranked(), point)
    kept = [p for p in alike.values() if not any(q.dominates(p) for q in alike.values())]
    return tuple(sorted(kept, key=lambda p: (p.error, p.predicted_ms(_UNIT_COSTS))))


_UNIT_COSTS = CallCosts(full_ms=1.0, skip_ms=0.25, pair_ms=1.75)  # a tie-break only: cheap-looking first
