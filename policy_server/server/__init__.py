"""Transport layer: gRPC service, health, reflection, auth, TLS, limits, error mapping, metrics and
the openpi-compatible WebSocket adapter. No torch here: the model is reached only through the
``Engine`` protocol in ``policy_server.engine.api``.

Kept import-light on purpose: importing one transport module (``validate``, ``convert``) does not
load the whole server (``app``). The wire protocol itself is ``policy_server.v1``, shared with the client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from policy_server.config import ServerConfig
    from policy_server.engine.api import Engine
    from policy_server.server.app import PolicyServer


def build_server(config: ServerConfig, engine: Engine) -> PolicyServer:
    """See ``policy_server.server.app.build_server``."""
    from policy_server.server.app import build_server as _build

    return _build(config, engine)
