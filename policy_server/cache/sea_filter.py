"""The SEA (spectral-evolution-aware) filter and the relative-L1 distance SeaCache gates on.

The filter is a separable Wiener gain over the T, H, W axes of one noisy vision latent, for a flow-matching
corruption ``x_t = a*x0 + b*eps`` with ``a = 1 - sigma`` and ``b = sigma``, under a power-law prior
``S(f) = 1 / |f|**p`` on the clean signal. The gain is normalised to unit mean so that distances between
consecutive steps stay comparable across noise levels (spec: ../shared/reference/seacache.md §0, §1.3). It is
applied as one real matrix per axis rather than by FFT (`SeaFilter`).
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


def flow_ab(sigma: float) -> tuple[float, float]:
    """Signal and noise scales ``(a, b) = (1 - sigma, sigma)`` with sigma clamped to [1e-6, 1 - 1e-6]."""
    sigma = min(_SIGMA_MAX, max(_SIGMA_MIN, float(sigma)))
    return 1.0 - sigma, sigma


def axis_gain(length: int, sigma: float, power_exp: float) -> torch.Tensor:
    """1-D Wiener gain along one axis, before normalisation: fp32 ``[length]``, DC first (fftfreq order)."""
    if length < 1:
        raise ValueError(f"axis length must be >= 1, got {length}")
    a, b = flow_ab(sigma)
    freqs = torch.fft.fftfreq(length, dtype=torch.float32).abs()
    clean_power = 1.0 / (freqs.pow(power_exp) + _POWER_EPS)
    return a * clean_power / (a * a * clean_power + b * b + _GAIN_EPS)


class SeaFilter:
    """Applies the SEA filter to raw noisy vision latents, caching its per-axis matrices per (grid, sigma, device).

    The gain is real, separable and even in frequency, so filtering is a circular convolution along each axis by a
    real symmetric kernel: three small matrix products (`axis_filter`), the same linear map as the spec's
    ``Re(iFFTn(FFTn(x) * H))`` in fewer ops (it runs on every cached step). The matrices depend only on the grid,
    sigma and ``power_exp``, so for a fixed sampler schedule every step after the first request reuses cached ones.
    The cache is a small LRU bounded by ``max_filters``.
    """

    def __init__(self, power_exp: float = 3.0, max_filters: int = 256):
        if not math.isfinite(power_exp) or power_exp <= 0:
            raise ValueError(f"power_exp must be a finite number > 0, got {power_exp}")
        if max_filters < 1:
            raise ValueError(f"max_filters must be >= 1, got {max_filters}")
        self.power_exp = float(power_exp)
        self.max_filters = max_filters
        self._filters: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = OrderedDict()

    def filters(self, grid: tuple[int, int, int], sigma: float, device: torch.device | str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Cached fp32 filter matrices ``[T, T]``, ``[H, H]``, ``[W, W]`` of the normalised gain of this grid and
        sigma (`axis_filter`; the normalisation, a scalar, goes into the T one)."""
        key = (tuple(grid), float(sigma), str(device))
        cached = self._filters.get(key)
        if cached is not None:
            self._filters.move_to_end(key)
            return cached
        gains = [axis_gain(length, key[1], self.power_exp).double() for length in key[0]]
        mean = math.prod(gain.mean().item() for gain in gains)  # of the separable product: its factors' product
        matrices = [axis_filter(gain) for gain in gains]
        matrices[0] = matrices[0] / mean
        self._filters[key] = filters = tuple(m.to(device, torch.float32) for m in matrices)
        if len(self._filters) > self.max_filters:
            self._filters.popitem(last=False)
        return filters

    def indicator(self, latent_cthw: torch.Tensor, sigma: float) -> torch.Tensor:
        """SEA indicator of one raw noisy vision latent ``[C, T, H, W]``: filtered ``[T, H, W, C]``, computed in
        fp32 and cast back."""
        if latent_cthw.ndim != 4:
            raise ValueError(
                f"noisy vision latent must be [C, T, H, W], got shape {tuple(latent_cthw.shape)}"
            )
        channels, frames, height, width = latent_cthw.shape
        along_t, along_h, along_w = self.filters((frames, height, width), sigma, latent_cthw.device)
        x = latent_cthw.detach().float() @ along_w.T
        x = along_h @ x
        x = (along_t @ x.reshape(channels, frames, height * width)).view(channels, frames, height, width)
        return x.movedim(0, -1).to(latent_cthw.dtype)


def axis_filter(gain: torch.Tensor) -> torch.Tensor:
    """The real matrix ``[n, n]`` that applies a 1-D frequency-domain ``gain`` ``[n]`` (fftfreq order, even in
    frequency) along one axis: ``y = M @ x`` is ``Re(iFFT(FFT(x) * gain))``."""
    spectrum = torch.fft.fft(torch.eye(gain.shape[0], dtype=gain.dtype), dim=0)
    return torch.fft.ifft(spectrum * gain[:, None], dim=0).real


def rel_l1(current: torch.Tensor, previous: torch.Tensor) -> float:
    """``mean|current - previous| / (mean|previous| + 1e-16)``, reduced in fp32, as a Python float."""
    if current.shape != previous.shape:
        raise ValueError(
            f"rel_l1 needs equal shapes, got {tuple(current.shape)} and {tuple(previous.shape)}"
        )
    cur = current.float()
    prev = previous.float()
    return float((cur - prev).abs().mean() / (prev.abs().mean() + 1e-16))
