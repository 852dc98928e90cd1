"""Residual extrapolation for skipped steps: Newton divided differences at the real step indices.

Skipped steps leave gaps in the history, so the full-step residuals sit at non-uniform step indices; the
interpolating polynomial is built on those indices, not on sigma (spec §1.7). Order 0 reuses the last
residual (original SeaCache/TeaCache), order 1 is linear (the Cosmos3 default), order 2 is quadratic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def newton_extrapolate(history: Sequence[tuple[int, torch.Tensor]], step: int, order: int) -> torch.Tensor:
    """Evaluate at ``step`` the Newton polynomial through the last ``order + 1`` residuals of ``history``.

    history: chronological ``(step_index, residual [N, D])`` pairs from full steps (at least one), step indices
    increasing; order: 0..``limits.MAX_RESIDUAL_ORDER``.
    With fewer entries than ``order + 1`` the order drops to what the history supports (one entry = reuse).
    Arithmetic runs in the residuals' dtype. Returns a new tensor, never a view of a stored residual.
    """
    points = list(history[-(order + 1):])
    steps = [s for s, _ in points]
    if len(set(steps)) != len(steps):
        # Equal indices give a zero denominator; the only defensible estimate is the latest residual.
        return points[-1][1].clone()
    k = len(points) - 1
    coeffs = [r for _, r in points]
    for level in range(1, k + 1):
        for j in range(k, level - 1, -1):
            coeffs[j] = (coeffs[j] - coeffs[j - 1]) / float(steps[j] - steps[j - level])
    estimate = coeffs[k].clone()
    for j in range(k - 1, -1, -1):
        estimate = estimate * float(step - steps[j]) + coeffs[j]
    return estimate
