"""Why a call on the model worker ends before its answer: the engine shuts down, the call's deadline passed,
or its caller went away."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from policy_server.engine import api

POLL_S = 0.02  # how often a caller waiting on the worker checks whether its call must end


@dataclass(frozen=True)
class CallEnd:
    """What ends one call early. ``deadline_s``: absolute ``time.monotonic()`` seconds, None for none;
    ``late``: what its DeadlineExpired says."""

    closing: threading.Event
    deadline_s: float | None
    should_abort: Callable[[], bool] | None
    late: str

    def reason(self) -> api.EngineError | None:
        """Why the call must end now; None while it may go on."""
        if self.closing.is_set():
            return api.ShuttingDown()
        if self.deadline_s is not None and time.monotonic() >= self.deadline_s:
            return api.DeadlineExpired(self.late)
        if self.should_abort is not None and self.should_abort():
            return api.Cancelled("the caller went away")
        return None
