"""Test helper (not a test module): hold a real engine's model worker with a background job until released."""

from __future__ import annotations

import threading


class _Gate:
    """A background job that holds the model worker until `opened` is set."""

    end = None  # nothing but `opened` ends it

    def __init__(self):
        self.running, self.opened = threading.Event(), threading.Event()

    def step(self):
        self.running.set()
        self.opened.wait()
        return True

    def fail(self, error):
        pass


def hold_worker(engine) -> threading.Event:
    """Block `engine`'s worker; setting the returned event lets it go."""
    gate = _Gate()
    engine._worker.submit(gate)
    gate.running.wait()
    return gate.opened
