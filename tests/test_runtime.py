"""Process-level memory helpers (glibc)."""

import sys

import pytest

from unimae.runtime import memory

glibc = pytest.mark.skipif(memory._libc() is None, reason="not glibc")


def test_resident_and_total_memory_are_read():
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    rss, total = memory.resident_bytes(), memory.total_memory_bytes()
    assert 0 < rss < total


@glibc
def test_release_if_above_trims_only_past_its_share():
    assert memory.release_if_above(1.0) is False  # no process holds more than the whole machine
    memory.tune_allocator()  # as the trainer does: blocks under 1 GB now come from the heap
    blocks = [bytearray(8 << 20) for _ in range(16)]  # 128 MB
    del blocks  # freed into the heap, still resident
    assert memory.release_if_above(0.0) is True  # freed pages are there to hand back


ARENAS = """
import ctypes, os, sys, threading
from unimae.runtime import memory
print(memory.limit_arenas(2) if sys.argv[1] == "capped" else None)
libc, started, done = ctypes.CDLL("libc.so.6"), threading.Barrier(9), threading.Event()
libc.malloc.restype = ctypes.c_void_p

def worker():
    libc.malloc(1 << 16)  # a thread's first malloc takes it an arena (a new one while the limit allows)
    started.wait()
    done.wait()

threads = [threading.Thread(target=worker) for _ in range(8)]
[t.start() for t in threads]
started.wait()
os.dup2(1, 2)  # malloc_stats writes to stderr: one "Arena N:" block per arena
sys.stdout.flush()
libc.malloc_stats()
done.set()
"""


@glibc
@pytest.mark.parametrize("mode", ["capped", "default"])
def test_limit_arenas_keeps_threads_to_two_malloc_arenas(mode, monkeypatch):
    """Eight threads allocating at once get an arena each by default (each then keeps what it frees); after
    limit_arenas(2) they share two. An explicit $MALLOC_ARENA_MAX is the user's and is left alone."""
    import subprocess

    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    out = subprocess.run([sys.executable, "-c", ARENAS, mode], capture_output=True, text=True, check=True).stdout
    arenas = out.count("Arena ")
    if mode == "capped":
        assert out.startswith("True") and arenas == 2, out
    else:
        assert arenas >= 8, out
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert memory.limit_arenas(2) is False
