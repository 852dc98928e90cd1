"""Per-channel normalisation of actions and proprio state between physical units and model space.

Stats files are JSON objects keyed by feature (``"action"``, ``"state"``, ...), each holding
per-channel arrays among ``min``, ``max``, ``mean``, ``std``, ``q01``, ``q99``::

    {"action": {"min": [...], "max": [...], "q01": [...], "q99": [...]}, "state": {...}}

A LeRobot dataset's ``meta/stats.json`` is one too (its state is ``"observation.state"``): only the features
normalised are read, and its other statistics (``count``, ``q10``, ``q50``, ``q90``) are skipped.

Methods (the Cosmos3 framework's ``minmax`` / ``meanstd`` / ``quantile``):

- ``minmax``:   ``[min, max]`` → ``[−1, 1]``
- ``meanstd``:  ``(x − mean) / std``
- ``quantile``: ``[q01, q99]`` → ``[−1, 1]``, clipped to ``[−1, 1]`` both ways
- ``none``:     identity (model space is physical space)

Each is an affine map per channel, ``x_n = (x − offset) / scale``, inverted exactly by
``x = x_n · scale + offset``. A small epsilon in the scale keeps constant channels finite.
Inputs are NumPy arrays or torch tensors ``[..., D]``; outputs have the same type, dtype and device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from pydantic import StrictInt

from policy_server.json_file import read_json

NORMALIZATION_METHODS = ("none", "minmax", "meanstd", "quantile")
STAT_FIELDS = ("min", "max", "mean", "std", "q01", "q99")
LEROBOT_ONLY_FIELDS = ("count", "q10", "q50", "q90")  # in LeRobot's meta/stats.json; no method uses them
REQUIRED_FIELDS = {
    "none": (),
    "minmax": ("min", "max"),
    "meanstd": ("mean", "std"),
    "quantile": ("q01", "q99"),
}

# Added to the scale so a channel that never moved (max == min, std == 0) maps to a finite value.
SCALE_EPS = 1e-8

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)


class NormalizationStatsError(ValueError):
    """A stats file that is missing, malformed, or does not fit the embodiment."""


@dataclass(frozen=True, eq=False)
class FeatureStats:
    """Per-channel statistics of one feature, each array float64 ``[D]``."""

    key: str
    arrays: dict[str, np.ndarray]
    source: str = "<memory>"

    @property
    def dim(self) -> int:
        return len(next(iter(self.arrays.values())))

    def require(self, name: str, method: str) -> np.ndarray:
        if name not in self.arrays:
            raise NormalizationStatsError(
                f"{self.source}: feature {self.key!r} has no {name!r} array; method {method!r} needs "
                f"{', '.join(REQUIRED_FIELDS[method])} (present: {', '.join(sorted(self.arrays)) or 'none'})"
            )
        return self.arrays[name]


def parse_stats(data: object, source: str = "<memory>", features: list[str] | None = None) -> dict[str, FeatureStats]:
    """Validate a decoded stats JSON object; arrays of one feature must share one length. ``features``: read only
    these (a LeRobot stats file also holds its images' and index columns'), each required."""
    if not isinstance(data, dict) or not data:
        raise NormalizationStatsError(
            f"{source}: expected a non-empty JSON object of features, got {data!r:.80}"
        )
    if features is not None:
        if missing := [key for key in features if key not in data]:
            raise NormalizationStatsError(f"{source}: no feature {missing[0]!r}; present: {', '.join(sorted(data))}")
        data = {key: data[key] for key in features}
    stats = {}
    for key, fields in data.items():
        if not isinstance(fields, dict) or not fields:
            raise NormalizationStatsError(
                f"{source}: feature {key!r} must be an object with arrays among {', '.join(STAT_FIELDS)}"
            )
        arrays = {}
        for name, values in fields.items():
            if name in LEROBOT_ONLY_FIELDS:
                continue
            if name not in STAT_FIELDS:
                raise NormalizationStatsError(
                    f"{source}: feature {key!r} has unknown field {name!r}; expected {', '.join(STAT_FIELDS)}"
                )
            if not isinstance(values, list) or not values or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values
            ):
                raise NormalizationStatsError(
                    f"{source}: {key}.{name} must be a non-empty list of finite numbers, got {values!r:.80}"
                )
            arrays[name] = np.asarray(values, dtype=np.float64)
        lengths = {name: len(a) for name, a in arrays.items()}
        if len(set(lengths.values())) != 1:
            raise NormalizationStatsError(
                f"{source}: arrays of feature {key!r} differ in length: {lengths}; expected one length"
            )
        stats[key] = FeatureStats(key=key, arrays=arrays, source=source)
    return stats


def load_stats(path: str | Path, features: list[str] | None = None) -> dict[str, FeatureStats]:
    """Read and validate a stats JSON file (only ``features``, when given)."""
    path = Path(path)
    return parse_stats(read_json(path, NormalizationStatsError), source=str(path), features=features)


@dataclass(frozen=True, eq=False)
class Normalizer:
    """Affine per-channel map ``x_n = (x − offset) / scale`` for one feature of width ``dim``.

    ``clip`` clips model-space values to ``[−1, 1]`` on the way in and before mapping back out.
    Channels in ``passthrough`` are left as they are (e.g. a binary gripper or rot6d channels).
    """

    key: str
    method: str
    offset: np.ndarray  # float64 [D]
    scale: np.ndarray  # float64 [D]
    clip: bool = False
    passthrough: tuple[int, ...] = ()
    _clip_mask: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        mask = np.full(len(self.offset), self.clip)
        mask[list(self.passthrough)] = False
        object.__setattr__(self, "_clip_mask", mask)

    @property
    def dim(self) -> int:
        return len(self.offset)

    def normalize(self, x: ArrayT) -> ArrayT:
        """Physical units → model space, ``[..., D]``."""
        x = self._checked(x)
        offset, scale, mask = self._params_like(x)
        y = (x - offset) / scale
        return self._clipped(y, mask)

    def denormalize(self, y: ArrayT) -> ArrayT:
        """Model space → physical units, ``[..., D]``."""
        y = self._checked(y)
        offset, scale, mask = self._params_like(y)
        return self._clipped(y, mask) * scale + offset

    def _checked(self, x: ArrayT) -> ArrayT:
        if isinstance(x, torch.Tensor):
            if not x.is_floating_point():
                x = x.float()
        else:
            x = np.asarray(x)
            if not np.issubdtype(x.dtype, np.floating):
                x = x.astype(np.float32)
        if x.ndim == 0 or x.shape[-1] != self.dim:
            raise ValueError(
                f"{self.key}: got shape {tuple(x.shape)}; the {self.method!r} normaliser for {self.key!r} "
                f"expects a last dimension of {self.dim}"
            )
        return x

    def _params_like(self, x: ArrayT):
        if isinstance(x, torch.Tensor):
            as_t = lambda a: torch.as_tensor(a, dtype=x.dtype, device=x.device)  # noqa: E731
            return as_t(self.offset), as_t(self.scale), torch.as_tensor(self._clip_mask, device=x.device)
        return self.offset.astype(x.dtype), self.scale.astype(x.dtype), self._clip_mask

    def _clipped(self, y: ArrayT, mask) -> ArrayT:
        if not self._clip_mask.any():
            return y
        if isinstance(y, torch.Tensor):
            return torch.where(mask, y.clamp(-1.0, 1.0), y)
        return np.where(mask, np.clip(y, -1.0, 1.0), y).astype(y.dtype)


def identity_normalizer(key: str, dim: int) -> Normalizer:
    return Normalizer(key=key, method="none", offset=np.zeros(dim), scale=np.ones(dim))


def make_normalizer(
    method: str, stats: FeatureStats | None, dim: int, passthrough: tuple[int, ...] = ()
) -> Normalizer:
    """Build the normaliser for one feature; ``stats`` may be None only for ``method="none"``.

    Raises NormalizationStatsError naming the feature, the field and the expected length when the
    stats do not fit ``dim``.
    """
    if method not in NORMALIZATION_METHODS:
        raise NormalizationStatsError(
            f"unknown normalisation method {method!r}; expected one of {', '.join(NORMALIZATION_METHODS)}"
        )
    if bad := [c for c in passthrough if not 0 <= c < dim]:
        raise NormalizationStatsError(f"passthrough channels {bad} are outside [0, {dim})")
    if method == "none":
        return identity_normalizer(stats.key if stats else "feature", dim)
    if stats is None:
        raise NormalizationStatsError(f"method {method!r} needs stats; none were given")
    arrays = {name: stats.require(name, method) for name in REQUIRED_FIELDS[method]}
    for name, values in arrays.items():
        if len(values) != dim:
            raise NormalizationStatsError(
                f"{stats.source}: {stats.key}.{name} has {len(values)} values; expected {dim} "
                f"(the width of {stats.key!r})"
            )
    if method == "meanstd":
        if np.any(arrays["std"] < 0):  # would flip those channels' sign
            raise NormalizationStatsError(
                f"{stats.source}: feature {stats.key!r} has channels with a negative std (meanstd): "
                f"{np.flatnonzero(arrays['std'] < 0).tolist()}; expected standard deviations, 0 or more"
            )
        offset, scale = arrays["mean"], arrays["std"] + SCALE_EPS
    else:
        low, high = (arrays["min"], arrays["max"]) if method == "minmax" else (arrays["q01"], arrays["q99"])
        if np.any(high < low):
            raise NormalizationStatsError(
                f"{stats.source}: feature {stats.key!r} has channels with upper < lower bound "
                f"({method}): {np.flatnonzero(high < low).tolist()}"
            )
        scale = (high - low + SCALE_EPS) / 2
        offset = low + scale
    offset, scale = offset.copy(), scale.copy()
    offset[list(passthrough)] = 0.0
    scale[list(passthrough)] = 1.0
    return Normalizer(
        key=stats.key, method=method, offset=offset, scale=scale, clip=method == "quantile",
        passthrough=tuple(passthrough),
    )


@dataclass(frozen=True)
class NormalizationSpec:
    """How an embodiment's actions and state map to model space.

    Attributes:
        method: one of NORMALIZATION_METHODS.
        stats_path: the stats JSON file (None only for ``"none"``).
        action_key, state_key: feature keys in the stats file.
        passthrough_action_channels: action channels left unnormalised.
    """

    method: str = "none"
    stats_path: Path | None = None
    action_key: str = "action"
    state_key: str = "state"
    passthrough_action_channels: tuple[StrictInt, ...] = ()  # read from JSON: "1" is no channel


@dataclass(frozen=True)
class FeatureNormalizers:
    """The action normaliser ``[..., raw_action_dim]`` and, when the embodiment has state, the state one."""

    action: Normalizer
    state: Normalizer | None


def build_normalizers(spec: NormalizationSpec, action_dim: int, state_dim: int) -> FeatureNormalizers:
    """Load ``spec.stats_path`` (if any) and build the action and state normalisers."""
    if spec.method == "none":
        state = identity_normalizer(spec.state_key, state_dim) if state_dim else None
        return FeatureNormalizers(action=identity_normalizer(spec.action_key, action_dim), state=state)
    if spec.stats_path is None:
        raise NormalizationStatsError(f"method {spec.method!r} needs a stats_path; none was given")
    stats = load_stats(spec.stats_path, [spec.action_key, *([spec.state_key] if state_dim else [])])
    action = make_normalizer(
        spec.method, stats[spec.action_key], action_dim, spec.passthrough_action_channels
    )
    state = make_normalizer(spec.method, stats[spec.state_key], state_dim) if state_dim else None
    return FeatureNormalizers(action=action, state=state)
