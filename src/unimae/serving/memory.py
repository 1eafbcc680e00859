"""Handing freed heap memory back to the OS once a large embedding batch is done.

:func:`unimae.runtime.tune_allocator` keeps freed blocks of up to 1 GB in the glibc heap, which a training loop
reuses every step; a server that has just embedded one large request would keep that memory for good (the
issue measured RSS 1.1 -> 2.4 GB, and it stayed). ``malloc_trim(0)`` returns the heap's free pages to the OS
without undoing the tuning; the embedding batcher calls :func:`release_free_memory` when its queue drains after
a large batch. It takes about a millisecond.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only (not musl): fail here, once
    except (OSError, AttributeError):
        return None
    return libc


def release_free_memory() -> bool:
    """Return the free pages of every glibc malloc arena to the OS: True if any were (False off glibc)."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))
