"""`return_large_frees`: after a large block is freed, glibc still gives blocks of the threshold's size a mapping of
their own (unmapped when freed), where it would otherwise take them from a heap that keeps what they free."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

PROBE = """
import ctypes, sys
from policy_server.allocator import MMAP_THRESHOLD_BYTES, return_large_frees

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "set":
    assert return_large_frees()
# Unset, glibc now takes blocks up to this size (within its 32 MiB cap) from a heap.
libc.free(libc.malloc(MMAP_THRESHOLD_BYTES * 3 // 2))
mapped = libc.mallinfo2().hblkhd  # bytes in blocks of their own mapping
libc.malloc(MMAP_THRESHOLD_BYTES)
print(libc.mallinfo2().hblkhd - mapped >= MMAP_THRESHOLD_BYTES)
"""


def _maps_its_own(how: str) -> bool:
    env = {name: value for name, value in os.environ.items()  # without glibc's own settings
           if not name.startswith("MALLOC_") and name != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PROBE, how], capture_output=True, text=True, check=True, env=env)
    return out.stdout.strip() == "True"


def test_a_block_at_the_threshold_is_mapped_after_a_larger_one_was_freed():
    assert _maps_its_own("set")


def test_glibc_left_alone_takes_it_from_a_heap():
    assert not _maps_its_own("unset")  # what `return_large_frees` turns off (else the test above proves nothing)
