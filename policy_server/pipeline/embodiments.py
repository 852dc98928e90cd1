"""Embodiments: what a robot's action and state vectors look like and how the model sees them.

The registry is seeded with Cosmos3's embodiment domains (the ``_EMBODIMENT_TO_DOMAIN_ID`` and
``_EMBODIMENT_TO_RAW_ACTION_DIM`` tables of the reference pipeline; ``libero`` takes the 10-D
width of the LIBERO recipe). The domain id picks the row of the transformer's domain-aware action
projections; the raw width is how many of the 64 padded action channels carry data.

A JSON config file adds embodiments or overrides fields of existing ones::

    {"embodiments": [
        {"name": "pusht", "fps": 10, "state_dim": 2, "action_units": ["m/s", "m/s"],
         "action_low": [-0.2, -0.2], "action_high": [0.2, 0.2],
         "normalization": {"method": "minmax", "stats_path": "stats.json"}},
        {"name": "my_arm", "domain_id": 21, "raw_action_dim": 7, "cameras": ["scene", "wrist"],
         "camera_sizes": {"scene": [480, 640], "wrist": [224, 224]}}
    ]}

Relative ``stats_path`` values are resolved against the config file's folder. Seeded embodiments
have no stats: their actions stay in the model's normalised space (units ``"normalized"``) unless a config
adds stats, which de-normalise them into the units of the data the stats came from (named only where the
config gives ``action_units`` / ``state_units``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from policy_server.json_file import read_json
from policy_server.pipeline.errors import InvalidActions, InvalidChunkSize, InvalidState, UnregisteredEmbodiment
from policy_server.pipeline.normalization import (
    NORMALIZATION_METHODS,
    FeatureNormalizers,
    NormalizationSpec,
    Normalizer,
    build_normalizers,
)
from policy_server.pipeline.prompts import DEFAULT_VIEWPOINT, VIEWPOINTS
from policy_server.specs import ActionSpec, CameraSpec, EmbodimentSpec

MAX_ACTION_DIM = 64  # padded action width of the Cosmos3 transformers (`max_action_dim`)
NUM_EMBODIMENT_DOMAINS = 32  # rows of the domain-aware action projections
NO_ACTION_DOMAIN_ID = 0  # Cosmos3's "no_action" domain (video-only samples); not an embodiment here
BASE_FPS = 24.0  # Cosmos3's base frame rate, the default where the reference gives none
DEFAULT_CHUNK_SIZE = 16
DEFAULT_MAX_CHUNK_SIZE = 64
# A state without a declared range is accepted where normalisation maps it into [-10, 10]: five
# times the span minmax training data covers, and far from float32 overflow in the state row. So are given actions
# (forward dynamics, committed) of an embodiment without declared limits (`action_range`): 3e38 in a normalised
# embodiment's committed row made every action NaN.
MODEL_INPUT_BOUND = 10.0


class EmbodimentConfigError(ValueError):
    """An embodiment config file or entry that does not validate; the message names the key."""


class Embodiment(BaseModel):
    """One robot's action/state layout and its defaults for prompts and chunking. Numbers are strict: a
    string is refused, not converted (nor a float where an integer is expected).

    Attributes:
        name: registry key (Cosmos3's ``domain_name``).
        domain_id: row of the domain-aware action projections, in [0, 32).
        raw_action_dim: unpadded action width D; channels D..63 stay zero.
        action_names, action_units: one entry per action channel (units may be left out: see
            ``channel_units``).
        action_low, action_high: physical limits per channel (None: unbounded).
        state_dim: proprio state width S (0: the policy takes no state). A state enters the sequence
            as a clean action row, so S <= 64.
        state_names, state_units: one entry per state channel.
        state_low, state_high: the accepted state range per channel, inclusive (None: the range
            that normalisation maps onto ``±MODEL_INPUT_BOUND``, see ``state_range``).
        cameras: image keys a request must carry, in the order their frames are placed side by
            side when there are several (a concatenated view).
        camera_sizes: each camera's frame size ``(height, width)`` px, as recorded and trained, which
            ServerInfo advertises (None: each camera's share of the canvas, ``frame_sizes``).
        viewpoint: camera framing named in the action prompt.
        fps: control / video frame rate, Hz, used in the prompt and the temporal positions.
        default_chunk_size, max_chunk_size: actions per request K (the clip has K + 1 frames).
        normalization: how actions and state map to model space.
        description: free text for listings.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    domain_id: int = Field(ge=0, lt=NUM_EMBODIMENT_DOMAINS, strict=True)
    raw_action_dim: int = Field(ge=1, le=MAX_ACTION_DIM, strict=True)
    action_names: tuple[str, ...] = ()
    action_units: tuple[str, ...] = ()
    action_low: tuple[StrictFloat, ...] | None = None
    action_high: tuple[StrictFloat, ...] | None = None
    state_dim: int = Field(default=0, ge=0, le=MAX_ACTION_DIM, strict=True)
    state_names: tuple[str, ...] = ()
    state_units: tuple[str, ...] = ()
    state_low: tuple[StrictFloat, ...] | None = None
    state_high: tuple[StrictFloat, ...] | None = None
    cameras: tuple[str, ...] = ("image",)
    camera_sizes: dict[str, tuple[StrictInt, StrictInt]] | None = None
    viewpoint: str = DEFAULT_VIEWPOINT
    fps: float = Field(default=BASE_FPS, gt=0, allow_inf_nan=False, strict=True)
    default_chunk_size: int = Field(default=DEFAULT_CHUNK_SIZE, ge=1, strict=True)
    max_chunk_size: int = Field(default=DEFAULT_MAX_CHUNK_SIZE, ge=1, strict=True)
    normalization: NormalizationSpec = NormalizationSpec()
    description: str = ""

    @model_validator(mode="before")
    @classmethod
    def _fill_channel_labels(cls, data: Any) -> Any:
        """Default names ``a0..`` / ``s0..`` when none are given."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        labels = (("action", "a", data.get("raw_action_dim")), ("state", "s", data.get("state_dim", 0)))
        for kind, prefix, dim in labels:
            if isinstance(dim, int) and not data.get(f"{kind}_names"):
                data[f"{kind}_names"] = tuple(f"{prefix}{i}" for i in range(dim))
        return data

    @field_validator("camera_sizes", mode="before")
    @classmethod
    def _sizes_are_pairs(cls, value: Any) -> Any:
        """Each size as a pair of integers: pydantic would say "camera_sizes.scene.1: Field required" of [480]."""
        for name, size in value.items() if isinstance(value, dict) else ():
            if not (isinstance(size, list | tuple) and len(size) == 2):  # the numbers' type: the field's check
                raise ValueError(f"camera {name!r} is {size!r}; expected [height, width], two integers (px)")
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> Embodiment:
        for kind, dim_name in (("action", "raw_action_dim"), ("state", "state_dim")):
            dim = getattr(self, dim_name)
            for label in (f"{kind}_names", f"{kind}_units", f"{kind}_low", f"{kind}_high"):
                values = getattr(self, label)
                if values is None or (label == f"{kind}_units" and not values):
                    continue  # unbounded, or units not declared
                if len(values) != dim:
                    raise ValueError(f"{label} has {len(values)} entries; expected {dim_name}={dim}")
            low, high = getattr(self, f"{kind}_low"), getattr(self, f"{kind}_high")
            if (low is None) != (high is None):
                raise ValueError(f"give both {kind}_low and {kind}_high, or neither")
            if low is not None:
                pairs = enumerate(zip(low, high, strict=True))
                if bad := [i for i, (lo, hi) in pairs if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi)]:
                    raise ValueError(f"{kind}_low > {kind}_high or not finite for channels {bad}")
        if not self.cameras or len(set(self.cameras)) != len(self.cameras) or not all(self.cameras):
            raise ValueError(f"cameras {list(self.cameras)} must be distinct non-empty names, at least one")
        # Their bounds are checked where the smallest side is known, the VAE's (`PolicyPipeline.from_pretrained`).
        if self.camera_sizes is not None and set(self.camera_sizes) != set(self.cameras):
            raise ValueError(f"camera_sizes names {list(self.camera_sizes)}; expected one [height, width] for each "
                             f"of cameras {list(self.cameras)}")
        if self.viewpoint not in VIEWPOINTS:
            raise ValueError(
                f"viewpoint {self.viewpoint!r} is unknown; expected one of {', '.join(VIEWPOINTS)}"
            )
        if self.default_chunk_size > self.max_chunk_size:
            raise ValueError(
                f"default_chunk_size={self.default_chunk_size} exceeds max_chunk_size={self.max_chunk_size}"
            )
        spec = self.normalization
        if spec.method not in NORMALIZATION_METHODS:
            raise ValueError(
                f"normalization.method {spec.method!r} is unknown; "
                f"expected one of {', '.join(NORMALIZATION_METHODS)}"
            )
        if spec.method != "none" and spec.stats_path is None:
            raise ValueError(f"normalization.method {spec.method!r} needs normalization.stats_path")
        if bad := [c for c in spec.passthrough_action_channels if not 0 <= c < self.raw_action_dim]:
            raise ValueError(f"normalization.passthrough_action_channels {bad} are outside the actions' "
                             f"[0, {self.raw_action_dim})")
        return self

    # ---- request checks -----------------------------------------------------------------------

    def check_chunk_size(self, chunk_size: object) -> int:
        """The chunk size K if it is an integer in [1, max_chunk_size]; InvalidChunkSize otherwise."""
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer):
            raise InvalidChunkSize(chunk_size, 1, self.max_chunk_size)
        if not 1 <= chunk_size <= self.max_chunk_size:
            raise InvalidChunkSize(chunk_size, 1, self.max_chunk_size)
        return int(chunk_size)

    def state_range(self, normalizer: Normalizer | None) -> tuple[np.ndarray, np.ndarray] | None:
        """The accepted state range, float64 ``([S], [S])``: the declared one, else what ``normalizer``
        maps onto ``±MODEL_INPUT_BOUND``. None when the embodiment takes no state."""
        if self.state_dim == 0:
            return None
        if self.state_low is not None:
            return np.asarray(self.state_low, np.float64), np.asarray(self.state_high, np.float64)
        return _input_range(normalizer)

    def action_range(self, normalizer: Normalizer) -> tuple[np.ndarray, np.ndarray]:
        """The range given actions (forward dynamics, committed) are accepted in, float64 ``([D], [D])``: the
        declared limits, else what ``normalizer`` maps onto ``±MODEL_INPUT_BOUND``."""
        if self.action_low is not None:
            return np.asarray(self.action_low, np.float64), np.asarray(self.action_high, np.float64)
        return _input_range(normalizer)

    def check_state(self, state: object) -> np.ndarray | None:
        """The proprio state as float32 ``[S]``; None when the embodiment takes none.

        Raises InvalidState when a state is missing, unexpected, the wrong length, or not finite.
        The range is the transport's to check, against ``state_range``.
        """
        if self.state_dim == 0:
            if state is not None:
                raise InvalidState(f"embodiment {self.name!r} takes no state; expected none")
            return None
        expected = f"a finite float vector of length state_dim={self.state_dim}"
        if state is None:
            raise InvalidState(f"missing; embodiment {self.name!r} expects {expected}")
        array = _as_float32(state, InvalidState, expected)
        if array.shape != (self.state_dim,):
            raise InvalidState(f"got shape {array.shape}; expected {expected}")
        if bad := np.flatnonzero(~np.isfinite(array)).tolist():
            raise InvalidState(f"entries {bad} are NaN or infinite; expected {expected}")
        return array

    def check_actions(self, actions: object, field: str = "actions") -> np.ndarray:
        """Given physical actions (forward dynamics, history) as float32 ``[T, raw_action_dim]``."""
        expected = f"a finite float array [T >= 1, {self.raw_action_dim}]"
        array = _as_float32(actions, InvalidActions, expected, field)
        if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] != self.raw_action_dim:
            raise InvalidActions(f"got shape {array.shape}; expected {expected}", field)
        if not np.all(np.isfinite(array)):
            rows = sorted(set(np.argwhere(~np.isfinite(array))[:, 0].tolist()))
            raise InvalidActions(f"rows {rows} hold NaN or infinite values; expected {expected}", field)
        return array

    def out_of_limits(self, actions: np.ndarray) -> np.ndarray:
        """Bool mask ``[..., D]`` of values outside ``[action_low, action_high]`` as the actions' dtype holds them, so
        that it marks what `clip_to_limits` changes (none if unbounded)."""
        if self.action_low is None:
            return np.zeros(np.shape(actions), dtype=bool)
        low = np.asarray(self.action_low, dtype=actions.dtype)
        high = np.asarray(self.action_high, dtype=actions.dtype)
        return (actions < low) | (actions > high)

    def clip_to_limits(self, actions: np.ndarray) -> np.ndarray:
        """Actions ``[..., D]`` clipped to the declared limits (unchanged if unbounded)."""
        if self.action_low is None:
            return actions
        low = np.asarray(self.action_low, dtype=actions.dtype)
        high = np.asarray(self.action_high, dtype=actions.dtype)
        return np.clip(actions, low, high)

    def frame_sizes(self, canvas_hw: tuple[int, int]) -> dict[str, tuple[int, int]]:
        """Each camera's frame size ``(height, width)`` px, the one to send: the declared ``camera_sizes``, else
        its share of the model's largest canvas ``canvas_hw`` (the cameras side by side across its width)."""
        if self.camera_sizes is not None:
            return {name: tuple(self.camera_sizes[name]) for name in self.cameras}
        height, width = canvas_hw
        return dict.fromkeys(self.cameras, (height, width // len(self.cameras)))

    def channel_units(self, kind: str) -> tuple[str, ...]:
        """The units of the ``kind`` ("action" or "state") channels as served: the declared ones; undeclared,
        ``"normalized"`` where no stats de-normalise them (the model's own space), else none (the units of the
        data the stats came from, which nothing names)."""
        declared = self.action_units if kind == "action" else self.state_units
        dim = self.raw_action_dim if kind == "action" else self.state_dim
        if declared or self.normalization.method != "none":
            return declared
        return ("normalized",) * dim

    def to_spec(self, canvas_hw: tuple[int, int], min_side: int, normalizers: FeatureNormalizers) -> EmbodimentSpec:
        """The schema a server declares for this embodiment (``ServerInfo.embodiments``).

        canvas_hw: the model's largest canvas, which undeclared cameras share (``frame_sizes``). min_side: the
            smallest frame side the pipeline accepts (the VAE's spatial compression). normalizers: the action and
            state normalisers, for the accepted ranges where none are declared.
        """
        state_range = self.state_range(normalizers.state)
        low, high = ((), ()) if state_range is None else (tuple(map(float, state_range[0])),
                                                           tuple(map(float, state_range[1])))
        given_low, given_high = self.action_range(normalizers.action)
        return EmbodimentSpec(
            name=self.name,
            cameras=tuple(CameraSpec(name, height, width, min_side=min_side)
                          for name, (height, width) in self.frame_sizes(canvas_hw).items()),
            state_dim=self.state_dim,
            action=ActionSpec(dim=self.raw_action_dim, names=self.action_names, units=self.channel_units("action"),
                              low=self.action_low or (), high=self.action_high or (),
                              given_low=tuple(map(float, given_low)), given_high=tuple(map(float, given_high))),
            state_names=self.state_names,
            state_units=self.channel_units("state"),
            state_low=low,
            state_high=high,
            default_chunk_size=self.default_chunk_size,
            min_chunk_size=1,  # what check_chunk_size accepts
            max_chunk_size=self.max_chunk_size,
            control_hz=self.fps,
        )

    def load_normalizers(self) -> FeatureNormalizers:
        """Read the stats file and build the action (``[.., D]``) and state (``[.., S]``) normalisers."""
        return build_normalizers(self.normalization, self.raw_action_dim, self.state_dim)


def _input_range(normalizer: Normalizer) -> tuple[np.ndarray, np.ndarray]:
    """What ``normalizer`` maps onto ``±MODEL_INPUT_BOUND``, float64 ``([D], [D])``."""
    spread = MODEL_INPUT_BOUND * normalizer.scale
    return normalizer.offset - spread, normalizer.offset + spread


def _as_float32(value: object, error: type, expected: str, *args) -> np.ndarray:
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise error(f"cannot be read as an array ({exc}); expected {expected}", *args) from exc
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise error(f"has dtype {array.dtype}; expected {expected}", *args)
    return array.astype(np.float32)


# ---- the Cosmos3 seed ---------------------------------------------------------------------------


def _pose(prefix: str = "") -> list[str]:
    """A 9-D pose: translation xyz and a 6-D rotation (two columns of the rotation matrix)."""
    return [f"{prefix}{axis}" for axis in ("x", "y", "z")] + [f"{prefix}rot6d_{i}" for i in range(6)]


def _arm(prefix: str = "") -> list[str]:
    return _pose(prefix) + [f"{prefix}gripper"]


def _hand(side: str) -> list[str]:
    tips = [f"{side}_tip{finger}_{axis}" for finger in range(5) for axis in ("x", "y", "z")]
    return _pose(f"{side}_wrist_") + tips


# name: (domain id, raw width, channel names or None, extra fields). Domain ids and widths are
# Cosmos3's; names follow the paper's composition (9-D pose, 1-D gripper, 15-D fingertips).
_COSMOS3_EMBODIMENTS: dict[str, tuple[int, int, list[str] | None, dict[str, Any]]] = {
    "av": (1, 9, _pose(), {}),
    "camera_pose": (2, 9, _pose(), {}),
    "hand_pose": (3, 57, _pose("ego_") + _hand("left") + _hand("right"), {}),
    "pusht": (4, 2, ["x", "y"], {}),
    "libero": (5, 10, _arm(), {"viewpoint": "concat_view", "fps": 20.0}),
    "umi": (6, 10, _arm(), {}),
    "bridge_orig_lerobot": (7, 10, _arm(), {"fps": 5.0}),
    "droid_lerobot": (8, 10, _arm(), {"viewpoint": "concat_view", "fps": 15.0, "default_chunk_size": 32}),
    "robomind-franka": (8, 10, _arm(), {}),
    "galbot": (9, 30, None, {}),
    "robomind-franka-dual": (12, 20, _arm("left_") + _arm("right_"), {}),
    "robomind-ur": (13, 10, _arm(), {}),
    "agibotworld": (15, 29, _pose("ego_") + _arm("left_") + _arm("right_"), {}),
    "agibot_gear_gripper": (15, 29, _pose("ego_") + _arm("left_") + _arm("right_"), {}),
    "agibot_gear_gripper_ext": (15, 29, _pose("ego_") + _arm("left_") + _arm("right_"), {}),
    "fractal": (20, 10, _arm(), {}),
}


def cosmos3_embodiments() -> list[Embodiment]:
    """The Cosmos3 embodiment domains with their reference domain ids and raw action widths."""
    out = []
    for name, (domain_id, dim, names, extra) in _COSMOS3_EMBODIMENTS.items():
        out.append(
            Embodiment(name=name, domain_id=domain_id, raw_action_dim=dim, action_names=names or (), **extra)
        )
    return out


# ---- registry -----------------------------------------------------------------------------------


class _ConfigFile(BaseModel):
    """Top level of an embodiment config file; entries are validated after merging."""

    model_config = ConfigDict(extra="forbid")
    embodiments: list[dict[str, Any]]


def format_validation_error(exc: ValidationError, where: str) -> str:
    """A pydantic error on one line: ``where.field: message; ...``."""
    problems = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"])
        problems.append(f"{where}.{loc}: {err['msg']}" if loc else f"{where}: {err['msg']}")
    return "; ".join(problems)


class EmbodimentRegistry:
    """Embodiments by name. Not shared mutable state: build one at startup, then only read it."""

    def __init__(self, embodiments: Iterable[Embodiment] = ()) -> None:
        self._by_name: dict[str, Embodiment] = {}
        for embodiment in embodiments:
            self.register(embodiment)

    @classmethod
    def cosmos3(cls) -> EmbodimentRegistry:
        """A registry holding the Cosmos3 embodiment domains."""
        return cls(cosmos3_embodiments())

    def register(self, embodiment: Embodiment, *, replace: bool = False) -> None:
        if embodiment.name in self._by_name and not replace:
            raise EmbodimentConfigError(f"embodiment {embodiment.name!r} is already registered")
        self._by_name[embodiment.name] = embodiment

    def get(self, name: str) -> Embodiment:
        """The embodiment called ``name``; UnregisteredEmbodiment (naming the known ones) otherwise."""
        try:
            return self._by_name[name]
        except (KeyError, TypeError):
            raise UnregisteredEmbodiment(str(name), self._by_name) from None

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[Embodiment]:
        return iter(self._by_name[name] for name in self.names())

    def __len__(self) -> int:
        return len(self._by_name)

    def load_config(self, path: str | Path) -> list[str]:
        """Add or update embodiments from a JSON config file; returns the names it touched.

        An entry whose name exists updates only the fields it gives; a new name needs at least
        ``domain_id`` and ``raw_action_dim``. Errors name the file, the entry and the key.
        """
        path = Path(path)
        try:
            config = _ConfigFile.model_validate(read_json(path, EmbodimentConfigError))
        except ValidationError as exc:
            raise EmbodimentConfigError(format_validation_error(exc, str(path))) from None
        if not config.embodiments:
            raise EmbodimentConfigError(f"{path}: embodiments is empty; expected at least one to serve")

        updated: dict[str, Embodiment] = {}
        for index, entry in enumerate(config.embodiments):
            where = f"{path}: embodiments[{index}]"
            name = entry.get("name")
            if not isinstance(name, str) or not name:
                raise EmbodimentConfigError(f"{where}.name: required, a non-empty string")
            where = f"{where} ({name!r})"
            base = updated.get(name) or self._by_name.get(name)
            if base is None and not {"domain_id", "raw_action_dim"} <= entry.keys():
                # Most often a misspelt known name ("bridge"): "domain_id: Field required" would not say so.
                raise EmbodimentConfigError(f"{where}: not a known embodiment (known: {', '.join(self.names())}); "
                                            "a new one needs domain_id and raw_action_dim")
            fields = base.model_dump() if base is not None else {}
            if base is not None and entry.get("raw_action_dim", base.raw_action_dim) != base.raw_action_dim:
                # a new width invalidates the inherited per-channel labels and limits
                for label in ("action_names", "action_units", "action_low", "action_high"):
                    fields.pop(label, None)
            if base is not None and "camera_sizes" not in entry and entry.get("cameras") not in (None, [*base.cameras]):
                fields.pop("camera_sizes", None)  # sizes of other cameras
            fields.update(entry)
            fields["normalization"] = self._normalization_fields(entry, fields, path.parent, where)
            try:
                updated[name] = Embodiment.model_validate(fields)
            except ValidationError as exc:
                raise EmbodimentConfigError(format_validation_error(exc, where)) from None
        for embodiment in updated.values():
            self.register(embodiment, replace=True)
        return list(updated)

    @staticmethod
    def _normalization_fields(entry: dict, fields: dict, folder: Path, where: str) -> Any:
        """The entry's normalization block with a relative stats_path made absolute."""
        spec = fields.get("normalization", NormalizationSpec())
        if "normalization" not in entry:
            return spec
        if not isinstance(spec, dict):
            raise EmbodimentConfigError(f"{where}.normalization: expected an object")
        spec = dict(spec)
        if spec.get("stats_path") is not None:
            if not isinstance(spec["stats_path"], str):
                raise EmbodimentConfigError(f"{where}.normalization.stats_path: expected a file path, a string")
            stats_path = Path(spec["stats_path"])
            spec["stats_path"] = stats_path if stats_path.is_absolute() else folder / stats_path
        return spec


def load_registry(config_path: str | Path | None = None) -> EmbodimentRegistry:
    """The Cosmos3 registry, extended by ``config_path`` when given."""
    registry = EmbodimentRegistry.cosmos3()
    if config_path is not None:
        registry.load_config(config_path)
    return registry
