"""Per-session memory of how many full calls each cache setting needed on the previous ticks.

Consecutive ticks of one robot episode see similar observations, so the gate refreshes about as often on
the next tick as on the last ones. The planner reads a high quantile of the recent counts per (setting,
step structure): a ladder rung's, or a quality-profile point's. The count stored is what the gate wanted
(`CacheRecord.wanted_full_calls`): the calls that ran full and the refreshes the deadline guard denied.
"""

from __future__ import annotations

import math
from collections import Counter, deque

# (num_steps, cfg_steps): the full-call count depends on both.
Structure = tuple[int, int]


class SessionHistory:
    """Recent natural full-call counts per (setting name, structure) of one session; ``window`` ticks each."""

    def __init__(self, window: int = 16) -> None:
        self.window = window
        self._counts: dict[tuple[str, Structure], deque[int]] = {}

    def observe(self, setting: str, structure: Structure, full_calls: int) -> None:
        self._counts.setdefault((setting, structure), deque(maxlen=self.window)).append(int(full_calls))

    def quantile(self, setting: str, structure: Structure, q: float) -> int | None:
        """The ``q`` quantile (nearest rank, rounded up) of the recent counts, or None if never observed."""
        values = sorted(self._counts.get((setting, structure), ()))
        if not values:
            return None
        rank = max(1, math.ceil(q * len(values)))
        return values[rank - 1]

    def tally(self, setting: str, structure: Structure) -> Counter[int]:
        """How many of the recent ticks wanted each count (empty if never observed)."""
        return Counter(self._counts.get((setting, structure), ()))
