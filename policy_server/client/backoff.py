"""Exponential backoff for reconnecting (seconds)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Delays initial_s, initial_s*multiplier, ... capped at max_s, each scaled by a random factor in
    [1 - jitter, 1 + jitter] so that many robots do not reconnect in lockstep. ``max_attempts``
    None retries forever."""

    initial_s: float = 0.05
    max_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2
    max_attempts: int | None = 20

    def delays(self) -> Iterator[float]:
        delay, attempt = self.initial_s, 0
        while self.max_attempts is None or attempt < self.max_attempts:
            yield min(self.max_s, delay) * random.uniform(1 - self.jitter, 1 + self.jitter)
            delay *= self.multiplier
            attempt += 1
