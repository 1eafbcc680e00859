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
