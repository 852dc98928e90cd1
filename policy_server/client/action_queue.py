"""Robot-side action buffer indexed by control step.

The robot executes one action per control period and asks for a new chunk while the buffer still
holds some (``needs_refill``), so inference overlaps execution. When a chunk arrives, actions for
steps the robot has already executed are dropped (the stale prefix, which grows with inference
latency), and actions for steps still queued are merged with the ones already there:

- ``replace``: the newer prediction wins;
- ``average``: the mean of the queued action and the new one (each older prediction's weight halves with every
  newer one; ``temporal_ensemble`` with decay 0 is the plain mean of all);
- ``weighted``: ``(1 - new_weight) * old + new_weight * new`` (LeRobot's default blend is 0.7);
- ``temporal_ensemble``: every prediction made for a step is kept and averaged with weights
  ``exp(-decay * i)``, ``i = 0`` for the oldest (ACT's temporal ensembling).
"""

from __future__ import annotations

import math
from enum import StrEnum

import numpy as np


class Aggregation(StrEnum):
    REPLACE = "replace"
    AVERAGE = "average"
    WEIGHTED = "weighted"
    TEMPORAL_ENSEMBLE = "temporal_ensemble"


class ActionQueue:
    """Not thread-safe: merge and pop from one thread, or under a lock of the caller's. Send each observation with
    ``step_index=queue.next_step``, the step captured at, and merge its chunk at ``chunk.first_step_index``."""

    def __init__(
        self,
        action_dim: int,
        aggregation: Aggregation | str = Aggregation.REPLACE,
        *,
        new_weight: float = 0.7,
        ensemble_decay: float = 0.01,
        refill_threshold: float = 0.5,
        start_step: int = 0,
    ) -> None:
        """action_dim: the embodiment's (``ServerInfo``'s ``action.dim``); new_weight: ``weighted``'s share of the
        newer prediction, in [0, 1]; ensemble_decay: ``temporal_ensemble``'s decay per newer prediction (1/prediction,
        >= 0); refill_threshold: fraction of the last chunk's length; ``needs_refill`` turns True once the steps
        still buffered are at or below it; start_step: the ``next_step`` to begin at (a control step)."""
        if action_dim <= 0:
            raise ValueError(f"action_dim must be > 0, got {action_dim}")
        if not 0.0 <= new_weight <= 1.0:
            raise ValueError(f"new_weight must be in [0, 1], got {new_weight}")
        if not 0.0 <= refill_threshold <= 1.0:
            raise ValueError(f"refill_threshold must be in [0, 1], got {refill_threshold}")
        if not 0.0 <= ensemble_decay < math.inf:
            raise ValueError(f"ensemble_decay must be finite and >= 0, got {ensemble_decay}")
        self.action_dim = action_dim
        self.aggregation = Aggregation(aggregation)
        self.new_weight = new_weight
        self.ensemble_decay = ensemble_decay
        self.refill_threshold = refill_threshold
        self._next_step = start_step
        self._predictions: dict[int, list[np.ndarray]] = {}  # step -> predictions, oldest first
        self._last_chunk_len = 0

    @property
    def next_step(self) -> int:
        """The control step the robot executes next."""
        return self._next_step

    def __len__(self) -> int:
        """Buffered actions from ``next_step`` on, counting only the unbroken run."""
        count = 0
        while self._next_step + count in self._predictions:
            count += 1
        return count

    def needs_refill(self) -> bool:
        if self._last_chunk_len == 0:
            return True
        return len(self) <= self.refill_threshold * self._last_chunk_len

    def merge(self, actions: np.ndarray, first_step_index: int) -> int:
        """Add a chunk (float [K, action_dim] in the robot's action units, as `ActionChunk.actions`; ``actions[i]``
        for step ``first_step_index + i``, an integer). Returns how many leading actions were dropped as stale."""
        actions = np.array(actions, dtype=np.float32)  # a copy: the caller may reuse its array
        if actions.ndim != 2 or actions.shape[1] != self.action_dim:
            raise ValueError(f"actions must be [K, {self.action_dim}], got {list(actions.shape)}")
        if not np.isfinite(actions).all():  # a robot would execute it
            rows = sorted({int(row) for row in np.argwhere(~np.isfinite(actions))[:, 0]})
            raise ValueError(f"actions must be finite, got NaN/Inf in rows {rows}")
        if not isinstance(first_step_index, int | np.integer):  # 2.5 would never be popped, 2.0 only by chance
            raise ValueError(f"first_step_index must be an integer, got {first_step_index!r}")
        stale = max(0, min(len(actions), self._next_step - first_step_index))
        for offset in range(stale, len(actions)):
            step = first_step_index + offset
            new = actions[offset]
            existing = self._predictions.get(step)
            if existing is None or self.aggregation is Aggregation.TEMPORAL_ENSEMBLE:
                self._predictions.setdefault(step, []).append(new)
            elif self.aggregation is Aggregation.REPLACE:
                existing[:] = [new]
            elif self.aggregation is Aggregation.AVERAGE:
                existing[:] = [0.5 * (existing[0] + new)]
            else:  # WEIGHTED
                existing[:] = [(1.0 - self.new_weight) * existing[0] + self.new_weight * new]
        self._last_chunk_len = len(actions)
        return stale

    def _value(self, predictions: list[np.ndarray]) -> np.ndarray:
        if len(predictions) == 1:
            return predictions[0]
        weights = np.array([math.exp(-self.ensemble_decay * i) for i in range(len(predictions))], np.float32)
        return (np.tensordot(weights, np.stack(predictions), axes=1) / weights.sum()).astype(np.float32)

    def peek(self, step: int | None = None) -> np.ndarray | None:
        """The action `pop` would return for ``step`` (default: ``next_step``), float32 [action_dim], or None,
        without consuming anything."""
        predictions = self._predictions.get(self._next_step if step is None else step)
        return None if predictions is None else self._value(predictions)

    def upcoming(self, count: int) -> np.ndarray:
        """What ``pop`` returns for the next ``count`` steps, up to the end of the unbroken run: float32
        ``[min(count, len(self)), action_dim]``. Sent as an observation's ``committed_actions`` (captured at
        ``next_step``), ``count`` the steps its answer takes to come, below the session's chunk size (the server
        takes fewer rows than the chunk; here: below the last chunk's length), they are what the new chunk starts
        with."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if self._last_chunk_len and count >= self._last_chunk_len:
            raise ValueError(f"count must be below the chunk size, {self._last_chunk_len} (the last chunk's): the "
                             f"server takes fewer committed actions than a chunk holds; got {count}")
        values = [self.peek(self._next_step + i) for i in range(min(count, len(self)))]
        return np.array(values, np.float32).reshape(len(values), self.action_dim)

    def pop(self, step: int | None = None) -> np.ndarray | None:
        """The action for ``step`` (default: ``next_step``), float32 [action_dim] in the chunks' units, or None if
        the buffer has none (the robot should hold). Everything before ``step`` is discarded; ``next_step`` becomes
        step + 1."""
        step = self._next_step if step is None else step
        if step < self._next_step:
            raise ValueError(f"step {step} was already executed (next step is {self._next_step})")
        for old in [s for s in self._predictions if s < step]:
            del self._predictions[old]
        predictions = self._predictions.pop(step, None)
        self._next_step = step + 1
        return None if predictions is None else self._value(predictions)

    def clear(self, next_step: int = 0) -> None:
        """Forget everything (new episode)."""
        self._predictions.clear()
        self._next_step = next_step
        self._last_chunk_len = 0
