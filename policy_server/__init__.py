"""policy-server: a gRPC robot-policy server with a per-tick latency budget."""

import importlib.metadata

try:
    __version__ = importlib.metadata.version("policy-server")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never pip-installed
    __version__ = "source-tree"
