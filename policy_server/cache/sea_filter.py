"""The SEA (spectral-evolution-aware) filter and the relative-L1 distance SeaCache gates on.

The filter is a separable Wiener gain over the T, H, W axes of one noisy vision latent, for a flow-matching
corruption ``x_t = a*x0 + b*eps`` with ``a = 1 - sigma`` and ``b = sigma``, under a power-law prior
``S(f) = 1 / |f|**p`` on the clean signal. The gain is normalised to unit mean so that distances between
consecutive steps stay comparable across noise levels (spec: ../shared/reference/seacache.md §0, §1.3).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

# Numerical floors of the published formula; they are part of the filter's definition (they set the DC gain).
_POWER_EPS = 1e-16
_GAIN_EPS = 1e-16
_SIGMA_MIN = 1e-6
_SIGMA_MAX = 1.0 - 1e-6
_FILTERED_AXES = (0, 1, 2)  # T, H, W of a [T, H, W, C] tensor; channels are never filtered


def flow_ab(sigma: float) -> tuple[float, float]:
    """Signal and noise scales ``(a, b) = (1 - sigma, sigma)`` with sigma clamped to [1e-6, 1 - 1e-6]."""
    sigma = min(_SIGMA_MAX, max(_SIGMA_MIN, float(sigma)))
    return 1.0 - sigma, sigma


def axis_gain(
    length: int, sigma: float, power_exp: float, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """1-D Wiener gain along one axis, before normalisation: fp32 ``[length]``, DC first (fftfreq order)."""
    if length < 1:
        raise ValueError(f"axis length must be >= 1, got {length}")
    a, b = flow_ab(sigma)
    freqs = torch.fft.fftfreq(length, device=device, dtype=torch.float32).abs()
    clean_power = 1.0 / (freqs.pow(power_exp) + _POWER_EPS)
    return a * clean_power / (a * a * clean_power + b * b + _GAIN_EPS)


def sea_gain(
    grid: tuple[int, int, int], sigma: float, power_exp: float, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Separable gain ``H_T x H_H x H_W`` over a ``(T, H, W)`` grid, mean 1: fp32 ``[T, H, W, 1]``.

    Normalisation is skipped when the mean is not finite and positive, as in the published filter.
    """
    gain = None
    for axis, length in enumerate(grid):
        shape = [1, 1, 1, 1]
        shape[axis] = length
        g = axis_gain(length, sigma, power_exp, device).reshape(shape)
        gain = g if gain is None else gain * g
    mean = gain.mean()
    if torch.isfinite(mean) and mean > 0:
        gain = gain / mean
    return gain


class SeaFilter:
    """Applies the SEA filter to raw noisy vision latents, caching gain tensors per (grid, sigma, device).

    The gain depends only on the grid shape, sigma and ``power_exp``, so for a fixed sampler schedule every
    step after the first request reuses a cached gain. The cache is a small LRU bounded by ``max_gains``.
    """

    def __init__(self, power_exp: float = 3.0, max_gains: int = 256):
        if not math.isfinite(power_exp) or power_exp <= 0:
            raise ValueError(f"power_exp must be a finite number > 0, got {power_exp}")
        if max_gains < 1:
            raise ValueError(f"max_gains must be >= 1, got {max_gains}")
        self.power_exp = float(power_exp)
        self.max_gains = max_gains
        self._gains: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def gain(self, grid: tuple[int, int, int], sigma: float, device: torch.device | str) -> torch.Tensor:
        """Cached normalised gain fp32 ``[T, H, W, 1]`` for this grid and sigma."""
        key = (tuple(int(n) for n in grid), float(sigma), str(device))
        cached = self._gains.get(key)
        if cached is not None:
            self._gains.move_to_end(key)
            return cached
        g = sea_gain(key[0], key[1], self.power_exp, device)
        self._gains[key] = g
        if len(self._gains) > self.max_gains:
            self._gains.popitem(last=False)
        return g

    def filter_thwc(self, x: torch.Tensor, sigma: float) -> torch.Tensor:
        """Filter a ``[T, H, W, C]`` tensor over T, H, W; computed in fp32 with a complex FFT, cast back."""
        if x.ndim != 4:
            raise ValueError(f"SEA filter expects a [T, H, W, C] tensor, got shape {tuple(x.shape)}")
        x32 = x.contiguous().float()
        spectrum = torch.fft.fftn(x32, dim=_FILTERED_AXES)
        g = self.gain(tuple(x32.shape[:3]), sigma, x32.device)
        return torch.fft.ifftn(spectrum * g, dim=_FILTERED_AXES).real.to(x.dtype)

    def indicator(self, latent_cthw: torch.Tensor, sigma: float) -> torch.Tensor:
        """SEA indicator of one raw noisy vision latent ``[C, T, H, W]``: filtered ``[T, H, W, C]``."""
        if latent_cthw.ndim != 4:
            raise ValueError(
                f"noisy vision latent must be [C, T, H, W], got shape {tuple(latent_cthw.shape)}"
            )
        return self.filter_thwc(latent_cthw.detach().movedim(0, -1), sigma)


def rel_l1(current: torch.Tensor, previous: torch.Tensor) -> float:
    """``mean|current - previous| / (mean|previous| + 1e-16)``, reduced in fp32, as a Python float."""
    if current.shape != previous.shape:
        raise ValueError(
            f"rel_l1 needs equal shapes, got {tuple(current.shape)} and {tuple(previous.shape)}"
        )
    cur = current.float()
    prev = previous.float()
    return float((cur - prev).abs().mean() / (prev.abs().mean() + 1e-16))
