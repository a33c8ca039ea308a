"""Keep freed chunk buffers from lingering in the process's resident set.

glibc raises its mmap threshold each time a large mmapped block is freed, after which buffers
of that size come from the heap and are seldom returned to the OS: a streaming loop that frees
tens of MB per chunk then holds them forever. A fixed threshold keeps large buffers mmapped,
so freeing one gives its pages back at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_THRESHOLD = 1024 * 1024


def return_large_buffers_to_os() -> None:
    """Pin glibc's mmap threshold at 1 MiB (a no-op where libc is not glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, 4 * _THRESHOLD)
    except (OSError, AttributeError):
        pass
