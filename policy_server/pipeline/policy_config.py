"""`policy.json`: the sampler defaults and conditioning geometry of a policy checkpoint folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    Strict,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from policy_server.json_file import read_json
from policy_server.limits import MAX_FRAME_SIDE
from policy_server.pipeline.conditioning import RESOLUTION_TIERS
from policy_server.pipeline.embodiments import NUM_EMBODIMENT_DOMAINS
from policy_server.pipeline.schedulers import SAMPLER_NAMES, flow_schedule, karras_flow_schedule

# Canvases a checkpoint may declare: warmup and admission time a tick on each, and a resolution tier has 5.
MAX_CANVASES = 16
# Canvas sides, px. A frame is at most MAX_FRAME_SIDE px a side at the boundary and is never enlarged: a taller canvas
# is all padding below it. Cameras go side by side, so a canvas may be wider: the pipeline bounds it by those served.
CanvasHeight = Annotated[StrictInt, Field(ge=1, le=MAX_FRAME_SIDE)]
CanvasWidth = Annotated[StrictInt, Field(ge=1)]


class PolicyConfigError(ValueError):
    """`policy.json` is missing or invalid; the message names the file and the field."""


class PolicyConfig(BaseModel):
    """Defaults a tick uses unless the request overrides them.

    canvases: the conditioning canvases (height, width) in pixels; a frame goes on the one closest to its
        aspect ratio, downscaled and padded (`policy_server.pipeline.conditioning`).
    resolution_tier: Cosmos3's action resolution tier (256, 480, 704, 720): sets `canvases` to its bins.
    sigma_schedule: "shifted" (flow sigmas shifted by ``shift``) or "karras" (Karras spacing of
        [sigma_min, sigma_max] mapped to flow sigmas, unshifted); final_sigma: "zero" or "sigma_min".
    guidance_interval: CFG applies only while lo < timestep < hi (timestep = int(sigma * 1000)); None = always. It
        must hold a timestep of the sampler at ``num_steps``, else guidance would never run (`guided_steps`).
    embodiments_file: JSON file (relative to the folder) declaring the served embodiments.
    trained_domain_ids: the action domains (rows of the transformer's domain-aware action projections) the weights
        were trained on, as `robots.train_policy` records them; None: not recorded. An embodiment served on
        another row gets random projections: the server warns at start (`PolicyPipeline.untrained_embodiments`).
    Numbers are strict: a string is refused, not converted (nor a float where an integer is expected).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "cosmos3-policy"
    sampler: str = "unipc"
    num_steps: int = Field(10, ge=1, le=1000, strict=True)
    guidance: float = Field(1.0, ge=1.0, allow_inf_nan=False, strict=True)
    shift: float = Field(5.0, gt=0.0, allow_inf_nan=False, strict=True)
    solver_order: int = Field(2, ge=1, le=3, strict=True)
    sigma_schedule: Literal["shifted", "karras"] = "shifted"
    sigma_min: float = Field(0.0, ge=0.0, allow_inf_nan=False, strict=True)
    sigma_max: float = Field(0.0, ge=0.0, allow_inf_nan=False, strict=True)
    final_sigma: Literal["zero", "sigma_min"] = "zero"
    guidance_interval: tuple[Annotated[FiniteFloat, Strict()], Annotated[FiniteFloat, Strict()]] | None = None
    canvases: tuple[tuple[CanvasHeight, CanvasWidth], ...] = ((64, 64),)
    resolution_tier: StrictInt | None = None
    pad_mode: Literal["reflect", "replicate"] = "reflect"
    use_system_prompt: bool = True
    embodiments_file: str = "embodiments.json"
    trained_domain_ids: tuple[Annotated[StrictInt, Field(ge=0, lt=NUM_EMBODIMENT_DOMAINS)], ...] | None = None

    @field_validator("sampler")
    @classmethod
    def _known_sampler(cls, value: str) -> str:
        if value not in SAMPLER_NAMES:
            raise ValueError(f"unknown sampler {value!r}; expected one of {SAMPLER_NAMES}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _tier_canvases(cls, data: object) -> object:
        tier = data.get("resolution_tier") if isinstance(data, dict) else None
        if not isinstance(tier, int):
            return data  # no tier, or not an integer: the field says so
        if tier not in RESOLUTION_TIERS:
            raise ValueError(f"resolution_tier {tier!r} is unknown; expected one of {sorted(RESOLUTION_TIERS)}")
        if "canvases" in data and [tuple(c) for c in data["canvases"]] != list(RESOLUTION_TIERS[tier]):
            raise ValueError("give resolution_tier or canvases, not both")
        return {**data, "canvases": RESOLUTION_TIERS[tier]}

    @field_validator("canvases")
    @classmethod
    def _some_canvases(cls, value: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        if not 1 <= len(value) <= MAX_CANVASES:
            raise ValueError(f"{len(value)} canvases; expected 1 to {MAX_CANVASES}")
        return value

    @field_validator("guidance_interval")
    @classmethod
    def _some_guided_timesteps(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and not value[0] < value[1]:  # no timestep inside: guidance would never run
            raise ValueError(f"[{value[0]}, {value[1]}] holds no timestep; expected [lo, hi] with lo < hi (CFG runs "
                             "while lo < sigma * 1000 < hi)")
        return value

    @model_validator(mode="after")
    def _karras_bounds(self) -> PolicyConfig:
        if self.sigma_schedule == "karras" and not 0 < self.sigma_min < self.sigma_max:
            raise ValueError(
                f"the karras schedule needs 0 < sigma_min < sigma_max, got {self.sigma_min}, {self.sigma_max}"
            )
        return self

    @model_validator(mode="after")
    def _guidance_interval_holds_a_step(self) -> PolicyConfig:
        """After `_karras_bounds`: the schedule's timesteps need them."""
        if not self.guided_steps(self.num_steps):
            lo, hi = self.guidance_interval
            below, above = nearest_timesteps(self.timesteps(self.num_steps), lo, hi)
            ways = [f"lo below {below}" if below is not None else "", f"hi above {above}" if above is not None else ""]
            raise ValueError(f"{unguided(self, self.num_steps)}; expected an interval holding one of them "
                             f"({' or '.join(way for way in ways if way)}), or null for CFG on every step")
        return self

    def timesteps(self, num_steps: int) -> tuple[int, ...]:
        """The model timesteps (int(sigma * 1000), falling) of a `num_steps` tick's sampler."""
        if self.karras:
            return karras_flow_schedule(num_steps, *self.karras).timesteps
        return flow_schedule(num_steps, self.shift).timesteps

    def guided_steps(self, num_steps: int) -> range:
        """The sampler steps of a `num_steps` tick on which the uncond pass runs when guidance is on: those
        whose timestep lies inside the guidance interval (all of them without one). Timesteps fall step by
        step, so they are one run of steps. Empty at the config's `num_steps` is refused at load; at fewer steps
        (the server's planner may choose them) such a tick runs without the uncond pass."""
        if self.guidance_interval is None:
            return range(num_steps)
        lo, hi = self.guidance_interval
        inside = [i for i, t in enumerate(self.timesteps(num_steps)) if lo < t < hi]
        return range(inside[0], inside[-1] + 1) if inside else range(0)

    @property
    def karras(self) -> tuple[float, float, str] | None:
        """``(sigma_min, sigma_max, final_sigma)`` for ``make_sampler`` when the schedule is Karras."""
        return (self.sigma_min, self.sigma_max, self.final_sigma) if self.sigma_schedule == "karras" else None

    @property
    def canvas_hw(self) -> tuple[int, int]:
        """The largest canvas (by area): what warmup and admission plan a tick for."""
        return max(self.canvases, key=lambda hw: hw[0] * hw[1])

    @classmethod
    def load(cls, path: str | Path) -> PolicyConfig:
        path = Path(path)
        if not path.is_file():
            raise PolicyConfigError(f"{path}: no policy config; expected a JSON file with the sampler defaults")
        try:
            return cls.model_validate(read_json(path, PolicyConfigError))
        except ValidationError as error:
            raise PolicyConfigError(describe(error, path)) from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2) + "\n")


def nearest_timesteps(timesteps: tuple[int, ...], lo: float, hi: float) -> tuple[int | None, int | None]:
    """Of `timesteps`, the highest at or below `lo` and the lowest at or above `hi` (None where there is none)."""
    return max((t for t in timesteps if t <= lo), default=None), min((t for t in timesteps if t >= hi), default=None)


def unguided(config: PolicyConfig, num_steps: int) -> str:
    """Why guidance never runs at `num_steps`: the interval, the count of timesteps, and those nearest it."""
    lo, hi = config.guidance_interval
    timesteps = config.timesteps(num_steps)
    below, above = nearest_timesteps(timesteps, lo, hi)
    nearest = [f"{below} (at or below lo)" if below is not None else "",
               f"{above} (at or above hi)" if above is not None else ""]
    return (f"guidance_interval [{lo:g}, {hi:g}] holds none of the {len(timesteps)} sampler timesteps (int(sigma * "
            f"1000), {timesteps[0]} down to {timesteps[-1]}) at num_steps={num_steps}, so guidance would never run; "
            f"nearest: {', '.join(n for n in nearest if n)}")


def describe(error: ValidationError, path: Path) -> str:
    """A pydantic error on one line: `path: field: message; ...`."""
    problems = []
    for problem in error.errors():
        location = ".".join(str(part) for part in problem["loc"])
        problems.append(f"{location}: {problem['msg']}" if location else problem["msg"])
    return f"{path}: " + "; ".join(problems)
