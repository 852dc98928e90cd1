"""The suite runs the GEN stack eagerly, though servers compile it by default: on CI's two cores compiling an
engine's call patterns takes over a minute (about 10 s each), far longer than most tests. Server processes the
tests start inherit TORCH_COMPILE_DISABLE. The tests of the compiled stack take the `compiles` fixture, which
switches torch.compile back on."""

import os
import signal

os.environ["TORCH_COMPILE_DISABLE"] = "1"

# A shell starts its background jobs (CI's) with SIGINT ignored, and an ignored signal stays ignored through exec: a
# handled one is reset to its default action there, so every process a test starts takes SIGINT as under a terminal.
# The tests need no `preexec_fn` for it, which makes subprocess fork rather than vfork: a child of a process whose
# gRPC and Ray threads hold locks could hang or abort before its exec (a Ray driver's child aborted there).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402
import torch  # noqa: E402

torch._dynamo.config.disable = True  # the variable above is read when torch is imported: it may have been already


@pytest.fixture
def compiles(monkeypatch):
    """torch.compile on, in this process and in the server processes the test starts."""
    monkeypatch.delenv("TORCH_COMPILE_DISABLE")
    with torch._dynamo.config.patch(disable=False):
        yield
