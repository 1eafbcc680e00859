"""DynamicBatcher without a model: token-budgeted chunks, least-attained-service order, cancellation, errors.

Items are strings and an item's size (its "tokens") is its length. A gated ``embed`` holds every call until the
test lets it go, so which chunk runs when is decided by the test, never by timing.
"""

from __future__ import annotations

import asyncio
import queue
import threading

import numpy as np
import pytest

from unimae.serving.batcher import DynamicBatcher


def _rows(items: list[str]) -> np.ndarray:
    """One row per item that says which item it is: (N, 1)."""
    return np.array([[float(item.split(":")[1].rstrip("."))] for item in items])


def _texts(name: str, count: int, size: int) -> list[str]:
    """``count`` items of exactly ``size`` characters named ``name:i``."""
    return [f"{name}:{i}".ljust(size, ".") for i in range(count)]


class Gate:
    """An ``embed`` whose calls each wait for :meth:`release`; :meth:`next_call` returns the items of the
    call that has started (waiting for it in a worker thread, so the event loop goes on)."""

    def __init__(self):
        self.started: queue.Queue[list[str]] = queue.Queue()
        self._go = threading.Semaphore(0)
        self.calls: list[list[str]] = []

    def __call__(self, items: list[str]) -> np.ndarray:
        self.calls.append(items)
        self.started.put(items)
        assert self._go.acquire(timeout=30), "the test never released this chunk"
        return _rows(items)

    async def next_call(self) -> list[str]:
        return await asyncio.get_running_loop().run_in_executor(None, self.started.get, True, 30)

    def release(self) -> None:
        self._go.release()


async def _until(condition) -> None:
    """Let other tasks run until ``condition()`` holds; the timeout only turns a hang into a failure."""

    async def poll():
        while not condition():
            await asyncio.sleep(0)

    await asyncio.wait_for(poll(), 30)


def test_a_large_request_is_embedded_in_chunks_within_the_token_budget_and_in_input_order():
    calls = []

    def embed(items):
        calls.append(items)
        return _rows(items)

    async def main():
        batcher = DynamicBatcher(embed, max_batch_texts=64, max_wait_ms=0, chunk_tokens=40)
        batcher.start()
        items = [f"big:{i}".ljust(5 + (i * 7) % 13, ".") for i in range(30)]  # 5 to 17 "tokens"
        out = await batcher.submit(items)
        await batcher.stop()
        return items, out, batcher.stats

    items, out, stats = asyncio.run(main())
    assert out[:, 0].tolist() == list(range(30))
    assert len(calls) > 1 and stats.chunks == len(calls) and stats.texts == 30
    for call in calls:
        assert len(call) * max(len(item) for item in call) <= 40  # padded tokens of the forward pass
    assert stats.tokens == sum(len(item) for item in items)


def test_a_small_request_waits_for_one_chunk_of_a_large_one_then_goes_first():
    gate = Gate()

    async def main():
        batcher = DynamicBatcher(gate, max_wait_ms=0, chunk_tokens=20)
        batcher.start()
        large = asyncio.create_task(batcher.submit(_texts("big", 6, 10)))  # 3 chunks of two
        assert len(await gate.next_call()) == 2  # chunk 1 of the large request is running
        small = asyncio.create_task(batcher.submit(["small:7"]))
        await _until(lambda: batcher.snapshot()["waiting_requests"] == 2)
        gate.release()
        assert await gate.next_call() == ["small:7"]  # the next chunk is the small request's
        gate.release()
        assert (await asyncio.wait_for(small, 30))[:, 0].tolist() == [7]
        assert not large.done()
        assert len(await gate.next_call()) == 2  # then the large request goes on
        gate.release()
        assert len(await gate.next_call()) == 2
        gate.release()
        out = await asyncio.wait_for(large, 30)
        await batcher.stop()
        return out, batcher.stats

    out, stats = asyncio.run(main())
    assert out[:, 0].tolist() == list(range(6)) and stats.chunks == 4 and stats.requests == 2


def test_small_requests_share_a_chunk_and_take_turns_with_a_large_one_but_never_share_with_it():
    gate = Gate()

    async def main():
        batcher = DynamicBatcher(gate, max_wait_ms=0, chunk_tokens=20)
        batcher.start()
        first = asyncio.create_task(batcher.submit(["first:0"]))
        assert await gate.next_call() == ["first:0"]
        large = asyncio.create_task(batcher.submit(_texts("big", 4, 10)))  # 2 chunks of two
        smalls = [asyncio.create_task(batcher.submit([f"s{i}:{i}"])) for i in range(2)]
        await _until(lambda: batcher.snapshot()["waiting_requests"] == 4)
        chunks = []
        for _ in range(3):
            gate.release()
            chunks.append(await gate.next_call())
        gate.release()
        await asyncio.wait_for(asyncio.gather(first, large, *smalls), 30)
        await batcher.stop()
        return chunks

    after_small, together, after_large = asyncio.run(main())
    assert after_small == ["big:0".ljust(10, "."), "big:1".ljust(10, ".")]  # a small chunk ran: the large one's turn
    assert sorted(together) == ["s0:0", "s1:1"]  # then both small requests, in one chunk of their own
    assert all(item.startswith("big") for item in after_large)


def test_a_large_request_gets_a_chunk_after_each_round_of_small_ones():
    gate = Gate()

    async def main():
        batcher = DynamicBatcher(gate, max_wait_ms=0, chunk_tokens=10)
        batcher.start()
        large = asyncio.create_task(batcher.submit(_texts("big", 3, 10)))
        kinds = [(await gate.next_call())[0][:3]]
        for i in range(5):  # a new small request arrives during every chunk
            small = asyncio.create_task(batcher.submit([f"s{i}:{i}"]))
            await _until(lambda: batcher.snapshot()["waiting_requests"] == 2)
            gate.release()
            kinds.append((await gate.next_call())[0][:3])
            if kinds[-1] != "big":
                gate.release()
                await asyncio.wait_for(small, 30)
                kinds.append((await gate.next_call())[0][:3])
            if kinds.count("big") == 3:
                break
        gate.release()
        await asyncio.wait_for(large, 30)
        await batcher.stop()
        return kinds

    kinds = asyncio.run(main())
    assert kinds[:5] == ["big", "s0:", "big", "s1:", "big"]


def test_the_rest_of_a_large_request_is_not_overtaken_forever_by_newer_small_requests():
    gate = Gate()

    async def main():
        batcher = DynamicBatcher(gate, max_wait_ms=0, chunk_tokens=10)
        batcher.start()
        large = asyncio.create_task(batcher.submit(_texts("big", 3, 4)))  # 12 tokens: 2 texts, then 1
        chunks, smalls = [await gate.next_call()], []
        for i in range(3):  # during every chunk a small request arrives that cannot share a chunk with big's rest
            smalls.append(asyncio.create_task(batcher.submit(_texts(f"s{i}", 2, 4))))
            await _until(lambda n=i + 2: batcher.snapshot()["requests"] == n)
            gate.release()
            chunks.append(await gate.next_call())
        for _ in range(3):  # the chunk running now and what is left (s1, s2): permits to spare
            gate.release()
        await asyncio.wait_for(asyncio.gather(large, *smalls), 30)
        await batcher.stop()
        return [[item.rstrip(".") for item in chunk] for chunk in chunks]

    chunks = asyncio.run(main())
    assert chunks[:3] == [["big:0", "big:1"], ["s0:0", "s0:1"], ["big:2"]]  # its rest: the next large turn


def test_small_requests_that_came_during_a_large_chunk_all_go_before_its_next_chunk():
    gate = Gate()

    async def main():
        batcher = DynamicBatcher(gate, max_wait_ms=0, chunk_tokens=10)
        batcher.start()
        large = asyncio.create_task(batcher.submit(_texts("big", 3, 10)))
        assert (await gate.next_call())[0].startswith("big")
        smalls = [asyncio.create_task(batcher.submit(_texts(f"s{i}", 1, 5))) for i in range(3)]  # 2 a chunk
        await _until(lambda: batcher.snapshot()["waiting_requests"] == 4)
        chunks = []
        for _ in range(4):
            gate.release()
            chunks.append(await gate.next_call())
        gate.release()
        await asyncio.wait_for(asyncio.gather(large, *smalls), 30)
        await batcher.stop()
        return chunks

    chunks = asyncio.run(main())
    assert [[item[:2] for item in chunk] for chunk in chunks[:2]] == [["s0", "s1"], ["s2"]]
    assert all(chunk[0].startswith("big") for chunk in chunks[2:])


def test_two_large_requests_take_turns():
    gate = Gate()

    async def main():
        batcher = DynamicBatcher(gate, max_wait_ms=0, chunk_tokens=10)
        batcher.start()
        a = asyncio.create_task(batcher.submit(_texts("a", 4, 10)))  # 4 chunks of one each
        assert (await gate.next_call())[0].startswith("a")
        b = asyncio.create_task(batcher.submit(_texts("b", 4, 10)))
        await _until(lambda: batcher.snapshot()["waiting_requests"] == 2)
        order = []
        for _ in range(8):
            gate.release()
            if len(order) < 7:
                order.append((await gate.next_call())[0][0])
        await asyncio.wait_for(asyncio.gather(a, b), 30)
        await batcher.stop()
        return order

    order = asyncio.run(main())
    assert order[:4] == ["b", "a", "b", "a"]  # the fewest tokens embedded so far goes next
    assert sorted(order) == ["a"] * 3 + ["b"] * 4


def test_a_cancelled_request_is_dropped_at_the_next_chunk():
    gate = Gate()

    async def main():
        batcher = DynamicBatcher(gate, max_wait_ms=0, chunk_tokens=10)
        batcher.start()
        large = asyncio.create_task(batcher.submit(_texts("big", 5, 10)))  # 5 chunks of one
        await gate.next_call()
        large.cancel()  # what the route does when its client disconnects
        await _until(lambda: batcher.stats.cancelled_requests == 1)
        gate.release()
        small = asyncio.create_task(batcher.submit(["small:3"]))
        assert await gate.next_call() == ["small:3"]  # no second chunk of the cancelled request
        gate.release()
        assert (await asyncio.wait_for(small, 30))[:, 0].tolist() == [3]
        await batcher.stop()
        return batcher.snapshot()

    stats = asyncio.run(main())
    assert len(gate.calls) == 2 and stats["dropped_texts"] == 4 and stats["waiting_requests"] == 0


def test_a_failed_chunk_fails_its_requests_only():
    def embed(items):
        if any(item.startswith("bad") for item in items):
            raise RuntimeError("boom")
        return _rows(items)

    async def main():
        batcher = DynamicBatcher(embed, max_wait_ms=0, chunk_tokens=10)
        batcher.start()
        outs = await asyncio.gather(
            batcher.submit(_texts("bad", 3, 10)), batcher.submit(["ok:1"]), return_exceptions=True
        )
        await batcher.stop()
        return outs, batcher.stats

    (bad, good), stats = asyncio.run(main())
    assert isinstance(bad, RuntimeError) and good[:, 0].tolist() == [1]
    assert stats.dropped_texts == 2  # the failed request's texts after its first chunk


def test_dynamic_batcher_merges_concurrent_requests_and_returns_each_its_rows():
    calls = []

    def embed(texts):
        calls.append(len(texts))
        return np.array([[float(t)] for t in texts])

    async def main():
        batcher = DynamicBatcher(embed, max_batch_texts=16, max_wait_ms=50)
        batcher.start()
        outs = await asyncio.gather(*(batcher.submit([str(i), str(i + 100)]) for i in range(20)))
        await batcher.stop()
        return outs, batcher.stats

    outs, stats = asyncio.run(main())
    for i, out in enumerate(outs):
        assert out[:, 0].tolist() == [i, i + 100]
    assert stats.requests == 20 and stats.texts == 40 and max(calls) <= 16 and len(calls) < 20


def test_dynamic_batcher_passes_errors_to_every_caller():
    def embed(texts):
        raise RuntimeError("boom")

    async def main():
        batcher = DynamicBatcher(embed, max_wait_ms=20)
        batcher.start()
        outs = await asyncio.gather(*(batcher.submit(["x"]) for _ in range(3)), return_exceptions=True)
        await batcher.stop()
        return outs

    assert all(isinstance(o, RuntimeError) for o in asyncio.run(main()))


@pytest.mark.parametrize(("total", "idle_calls"), [(30, 1), (5, 0)])
def test_on_idle_runs_when_the_queue_drains_after_a_large_batch_only(total, idle_calls):
    idle = []

    async def main():
        batcher = DynamicBatcher(_rows, max_wait_ms=0, chunk_tokens=10, on_idle=lambda: idle.append(True))
        batcher.start()
        await batcher.submit(_texts("x", total // 5, 5))
        await _until(lambda: len(idle) >= idle_calls)
        for _ in range(10):
            await asyncio.sleep(0)  # a second (wrong) call has every chance to happen
        await batcher.stop()

    asyncio.run(main())
    assert len(idle) == idle_calls


def test_stop_fails_waiting_callers():
    gate = Gate()

    async def main():
        batcher = DynamicBatcher(gate, max_wait_ms=0, chunk_tokens=10)
        batcher.start()
        waiting = asyncio.create_task(batcher.submit(_texts("x", 2, 10)))
        await gate.next_call()
        await batcher.stop()
        gate.release()
        with pytest.raises(RuntimeError, match="shutting down"):
            await waiting
        with pytest.raises(RuntimeError, match="not running"):
            await batcher.submit(["y:0"])

    asyncio.run(main())
