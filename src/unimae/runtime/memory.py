"""Process-level CPU tuning for long PyTorch jobs.

glibc returns every large (> 32 MB) allocation to the OS with ``munmap`` and maps it again on the
next step; a training step allocates hundreds of such tensors (logit chunks, activations), so much
of its time went to page faults. Raising the mmap and trim thresholds keeps those blocks in the heap
for reuse, which cut a UniMAE step's system time sharply (``benchmarks/train_step.py`` measures a step;
benchmarks/README.md).

The price is that freed memory stays in the process: with many differently sized blocks (Gemma-3's
262k-token output head) the heap fragments and the resident size grows step after step (a Gemma-3-270M
UniMAE run was killed by the OOM killer). :func:`release_if_above`
hands the free pages back (``malloc_trim``); the trainer calls it after a step only when the process
holds more than a quarter of the machine's memory, so small runs pay nothing. On Gemma-3-270M, trimming
after every step kept the resident size between steps near its start, the loss curve unchanged and the
step time about the same (``benchmarks/train_step.py --models gemma3-270m`` reports the step time and
peak RSS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_tuned = False


def tune_allocator(threshold_bytes: int = 1 << 30) -> bool:
    """Keep large freed blocks in the glibc heap (Linux only; a no-op elsewhere). Returns success."""
    global _tuned
    if _tuned or not sys.platform.startswith("linux"):
        return _tuned
    libc = _libc()
    ok = (
        libc is not None
        and libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1
        and libc.mallopt(_M_TRIM_THRESHOLD, threshold_bytes) == 1
    )
    _tuned = ok
    logger.debug("allocator tuning %s", "applied" if ok else "not available")
    return ok


def limit_arenas(count: int = 2) -> bool:
    """Let glibc malloc make at most ``count`` arenas (``M_ARENA_MAX``; Linux only): True if set, False where it
    is not glibc or ``$MALLOC_ARENA_MAX`` already says (the user's choice is kept).

    By default glibc gives each new thread an arena of its own at its first allocation, up to 8 per core, and
    a thread frees into its arena: what a server's worker thread allocated for one large request (parsing,
    tokenizing) stays there, free but resident, until that thread allocates again or the heap is trimmed. With
    tens of worker threads taking requests in turn, every arena ends up holding its own largest request (16
    threads each refusing one 4 MB prompt in turn kept 0.79 GB; two arenas, 0.16 GB: docs/serving.md,
    "Memory"). Call it before the threads start (arenas already made stay). ``count`` includes the main arena.
    """
    if not sys.platform.startswith("linux") or "MALLOC_ARENA_MAX" in os.environ:
        return False
    libc = _libc()
    return libc is not None and libc.mallopt(_M_ARENA_MAX, count) == 1


def resident_bytes() -> int | None:
    """This process's resident memory (Linux ``/proc/self/statm``; None elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def total_memory_bytes() -> int | None:
    """The machine's physical memory (None where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, or None where there is none (musl, macOS): then the allocator is left alone."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only (not musl): fail here, once
    except (OSError, AttributeError):
        return None
    return libc


def release_free_memory() -> bool:
    """Return the free pages of every glibc malloc arena to the OS (``malloc_trim(0)``, about a millisecond
    plus page faults when the memory is used again): True if any were (False off glibc).

    The server calls it when its embedding batcher's queue drains after a large batch and after a request with
    a large body (:class:`unimae.serving.heap_release.HeapRelease`): a server that has just embedded one large
    request would otherwise keep that memory for good (``benchmarks/load_test.py --mix hostile`` reports the
    server's RSS idle, at its peak and after the run).
    """
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


def release_if_above(share: float = 0.25) -> bool:
    """:func:`release_free_memory` if this process holds more than ``share`` of the machine's memory (the
    trainer, after each step: see the module docstring); returns whether it trimmed."""
    rss, total = resident_bytes(), total_memory_bytes()
    if rss is None or total is None or rss <= share * total:
        return False
    logger.debug("releasing free heap memory: %.1f GB resident", rss / 1e9)
    return release_free_memory()


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (None where there is none): every speed figure states it."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return None
