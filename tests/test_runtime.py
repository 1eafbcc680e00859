"""Process-level memory helpers (glibc)."""

import sys

import pytest

from unimae import runtime

glibc = pytest.mark.skipif(runtime._libc() is None, reason="not glibc")


def test_resident_and_total_memory_are_read():
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    rss, total = runtime.resident_bytes(), runtime.total_memory_bytes()
    assert 0 < rss < total


@glibc
def test_release_if_above_trims_only_past_its_share():
    assert runtime.release_if_above(1.0) is False  # no process holds more than the whole machine
    runtime.tune_allocator()  # as the trainer does: blocks under 1 GB now come from the heap
    blocks = [bytearray(8 << 20) for _ in range(16)]  # 128 MB
    del blocks  # freed into the heap, still resident
    assert runtime.release_if_above(0.0) is True  # freed pages are there to hand back
