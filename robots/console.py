"""The robot-side tools' console scripts (pyproject's ``[project.scripts]``): each keeps gRPC core's log to errors,
then runs its command. gRPC core logs each failed TLS handshake on stderr, a line of its own beside the command's
one-line error; it reads ``GRPC_VERBOSITY`` once, as grpc is imported, which the commands' modules do at their
import: hence here, before them, rather than in a module that a program may import (``robots.rollout``)."""

from __future__ import annotations

import os


def _quiet_grpc_core() -> None:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # a value the user set wins


def rollout() -> int:
    """``policy-rollout``: `robots.rollout.main`."""
    _quiet_grpc_core()
    from robots.rollout import main

    return main()


def soak() -> int:
    """``policy-soak``: `robots.soak.main`."""
    _quiet_grpc_core()
    from robots.soak import main

    return main()
