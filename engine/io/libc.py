"""C library functions Python's os module lacks (glibc's mallopt, Linux's sync_file_range)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any


def function(name: str, *argtypes: Any) -> Callable[..., int] | None:
    """The C library's `name` taking `argtypes` and returning an int; None where the C library
    has no such function (not glibc, not Linux): callers then do without it."""
    try:
        call = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    call.argtypes = list(argtypes)
    call.restype = ctypes.c_int
    return call  # type: ignore[no-any-return]
