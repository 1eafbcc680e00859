"""Dynamic batching of embedding requests across concurrent callers, with a bounded wait.

The first request to arrive opens a batch; requests that come within ``max_wait_ms`` join it until it
holds ``max_batch_texts`` texts; then one ``embed`` call (in a worker thread) serves them all and each
caller gets its own rows back. A request larger than ``max_batch_texts`` is served alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass
class BatcherStats:
    requests: int = 0
    texts: int = 0
    batches: int = 0


class DynamicBatcher:
    """``await batcher.submit(texts)`` -> (len(texts), D) array from a shared batched ``embed`` call."""

    def __init__(self, embed: Callable[[list[str]], np.ndarray], max_batch_texts: int = 64, max_wait_ms: float = 10):
        if max_batch_texts < 1 or max_wait_ms < 0:
            raise ValueError("max_batch_texts must be >= 1 and max_wait_ms >= 0")
        self.embed, self.max_batch_texts, self.max_wait = embed, max_batch_texts, max_wait_ms / 1000
        self.stats = BatcherStats()
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the batching loop on the running event loop."""
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="unimae-embedding-batcher")

    async def stop(self) -> None:
        """Stop the loop; callers still queued get an error instead of waiting forever."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        while self._queue is not None and not self._queue.empty():
            _, future = self._queue.get_nowait()
            if not future.done():
                future.set_exception(RuntimeError("the server is shutting down"))

    async def submit(self, texts: list[str]) -> np.ndarray:
        if self._task is None or self._task.done():
            raise RuntimeError("the embedding batcher is not running")
        future = asyncio.get_running_loop().create_future()
        await self._queue.put((texts, future))
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            size = len(batch[0][0])
            deadline = time.monotonic() + self.max_wait
            while size < self.max_batch_texts:
                try:
                    item = self._queue.get_nowait()  # already waiting: joins even with max_wait 0
                except asyncio.QueueEmpty:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        item = await asyncio.wait_for(self._queue.get(), remaining)
                    except asyncio.TimeoutError:
                        break
                if size + len(item[0]) > self.max_batch_texts:
                    await self._serve(loop, batch)  # the newcomer opens the next batch
                    batch, size, deadline = [item], len(item[0]), time.monotonic() + self.max_wait
                    continue
                batch.append(item)
                size += len(item[0])
            await self._serve(loop, batch)

    async def _serve(self, loop, batch: list[tuple[list[str], asyncio.Future]]) -> None:
        live = [(texts, future) for texts, future in batch if not future.done()]  # callers may have gone
        if not live:
            return
        texts = [text for item, _ in live for text in item]
        self.stats.requests += len(live)
        self.stats.texts += len(texts)
        self.stats.batches += 1
        try:
            vectors = await loop.run_in_executor(None, self.embed, texts)  # (N, D)
        except Exception as err:  # every caller of this batch gets the error
            for _, future in live:
                if not future.done():
                    future.set_exception(err)
            return
        start = 0
        for item, future in live:
            if not future.done():
                future.set_result(vectors[start : start + len(item)])
            start += len(item)
