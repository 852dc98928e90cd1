"""The PolicyService calls a server is serving, so that its shutdown lets them end rather than waiting out its grace.

A unary call or a ``Reason`` stream ends on its own. A ``Control`` stream lasts as long as its client keeps it open,
so `drain` tells each to answer the frame it is serving and end (``SHUTTING_DOWN``); what is left once every policy
call has ended (health ``Watch`` and reflection streams) has nothing to finish, and the server cancels it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from policy_server.server.control_stream import ControlCall


class RunningCalls:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count = 0
        self._streams: set[ControlCall] = set()
        self._draining = False

    def counted(self, behavior: Callable, streaming: bool) -> Callable:
        """A handler's ``behavior(request, context)``, counted while it runs (a streaming one until its responses
        end or gRPC closes them)."""
        if streaming:
            def serve_stream(request, context):
                with self._serving():
                    yield from behavior(request, context)
            return serve_stream

        def serve(request, context):
            with self._serving():
                return behavior(request, context)
        return serve

    @contextmanager
    def stream(self, stream: ControlCall) -> Iterator[None]:
        """Hold ``stream`` while it runs, so that `drain` reaches it (one that starts during a drain drains at once)."""
        with self._cond:
            self._streams.add(stream)
            draining = self._draining
        if draining:
            stream.drain()
        try:
            yield
        finally:
            with self._cond:
                self._streams.discard(stream)

    def drain(self) -> None:
        """End every stream once the frame it serves is answered (`ControlCall.drain`)."""
        with self._cond:
            self._draining = True
            streams = list(self._streams)
        for stream in streams:
            stream.drain()

    def wait_ended(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` for every call to end."""
        with self._cond:
            self._cond.wait_for(lambda: self._count == 0, timeout=timeout_s)

    @contextmanager
    def _serving(self) -> Iterator[None]:
        with self._cond:
            self._count += 1
        try:
            yield
        finally:
            with self._cond:
                self._count -= 1
                self._cond.notify_all()
