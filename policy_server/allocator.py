"""`return_large_frees`: the server's large buffers go back to the system when freed, not into glibc's heaps."""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc.h)
# Allocations of this many bytes or more get a mapping of their own, unmapped when freed: a large frame's buffers do
# (a 2048 x 2048 one is 12 MiB decoded, 48 MiB as floats on its way to the canvas; a 480 x 640 one's stay below), a
# tick's model work on the embedded model's canvas does not.
MMAP_THRESHOLD_BYTES = 4 << 20


def return_large_frees() -> bool:
    """Fix glibc's mmap threshold, once at the start of a server process. True where glibc took it.

    glibc raises the threshold to the largest block freed so far (up to 32 MiB), and the heap-top trim threshold to
    twice that: after one large frame, the next large frames' buffers come from the heap of whichever thread handled
    them, and a thread's heap keeps what they free. A fixed threshold turns that off. On a 2-core CPU, 40 requests with
    a 2048 x 2048 frame among small ones left the server 95 MB larger (glibc holding 99 MB more, 1.7 MB more of it in
    use), 220 of them 153 MB; with this threshold (set by glibc's variable below), 5 and 13 MB. Small ticks map nothing;
    a 2048 px frame's tick took about 10% longer (its buffers' pages are new each time). glibc's own settings in the
    environment win (`MALLOC_MMAP_THRESHOLD_`, or `glibc.malloc.mmap_threshold` in `GLIBC_TUNABLES`); elsewhere than
    glibc (musl, macOS) nothing is set."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
