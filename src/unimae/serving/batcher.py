"""Dynamic batching of embedding requests, scheduled by tokens: large requests are cut into chunks that
interleave with small ones, and the work of a caller that has gone is dropped.

One scheduling round builds one *chunk*: one ``embed`` call (one forward pass, off the event loop) of at most
``chunk_tokens`` padded tokens (texts x longest text) and ``max_batch_texts`` texts. A waiting request is
*small* if it fits in one chunk, *large* otherwise (until it is done, even once its rest would fit).

- A small round takes whole small requests, oldest first, while they fit.
- A large round gives one chunk to the large request with the fewest tokens embedded so far (then the
  oldest): its longest texts that fit, at least one. Large requests thus take turns, and a large request
  never pads a small one to its length.
- After a large round, every small request that came before it ended is served (in as many small rounds
  as it takes) before the next large round; otherwise a waiting large request goes next.

What that guarantees: a small request waits for at most ONE chunk of a large request (the one running when
it arrives, or the next one), plus the small requests that came before it; a large request gets a chunk
after each such round of small ones, so it progresses even under a steady stream of them (its total size is
bounded by the server's ``--max-request-tokens``).

Batching: while the oldest waiting request arrived less than ``max_wait_ms`` ago and the next chunk is not
full, the round waits (at most until then) for more requests to join. A busy server never waits.

Cancellation: a caller that cancels its awaited :meth:`DynamicBatcher.submit` (the route does when its client
disconnects) cancels its request: rows of a chunk already running are discarded, and its texts not yet
embedded are dropped before the next chunk.

Memory: when the queue drains after at least ``chunk_tokens`` tokens of work, ``on_idle`` runs in a worker
thread (the server hands freed heap memory back to the OS there).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


@dataclass
class BatcherStats:
    """Counters since start (``/health`` reports them)."""

    requests: int = 0  # submitted
    texts: int = 0  # embedded
    tokens: int = 0  # real (unpadded) tokens embedded
    chunks: int = 0  # embed calls
    cancelled_requests: int = 0  # their caller went away before the result
    dropped_texts: int = 0  # never embedded: their request was cancelled or failed


@dataclass(eq=False)
class _Request:
    items: Sequence[Any]
    sizes: list[int]  # tokens of each item
    future: asyncio.Future
    seq: int  # arrival number: 0, 1, 2 ...
    arrived: float  # time.monotonic()
    pending: list[int] = field(default_factory=list)  # items not handed to a chunk yet, longest first
    left: int = 0  # tokens of the pending items
    attained: int = 0  # tokens embedded so far
    rows: np.ndarray | None = None  # (N, D), filled chunk by chunk

    def take(self, count: int) -> list[int]:
        """Hand the ``count`` longest pending items to a chunk."""
        taken, self.pending = self.pending[:count], self.pending[count:]
        self.left -= sum(self.sizes[i] for i in taken)
        return taken


Chunk = list[tuple[_Request, list[int]]]  # (request, indices of its items) in one embed call


class DynamicBatcher:
    """``await batcher.submit(items)`` -> (len(items), D) array, embedded in token-budgeted chunks.

    ``embed(items) -> (N, D)`` runs one chunk; ``size(item)`` is an item's token count (``len`` by default).
    """

    def __init__(
        self,
        embed: Callable[[list], np.ndarray],
        max_batch_texts: int = 64,
        max_wait_ms: float = 10,
        chunk_tokens: int = 512,
        size: Callable[[Any], int] = len,
        on_idle: Callable[[], object] | None = None,
    ):
        if max_batch_texts < 1 or max_wait_ms < 0 or chunk_tokens < 1:
            raise ValueError("max_batch_texts and chunk_tokens must be >= 1 and max_wait_ms >= 0")
        self.embed, self.size, self.on_idle = embed, size, on_idle
        self.max_batch_texts, self.max_wait, self.chunk_tokens = max_batch_texts, max_wait_ms / 1000, chunk_tokens
        self.stats = BatcherStats()
        self._requests: list[_Request] = []  # submitted, not finished (a running chunk's included)
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._since_idle = 0  # tokens embedded since on_idle last ran
        self._after_large = False  # the last chunk was a large round
        self._due = 0  # small requests numbered below this go before the next large round

    def start(self) -> None:
        """Start the scheduling loop on the running event loop."""
        self._arrived = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="unimae-embedding-batcher")

    async def stop(self) -> None:
        """Stop the loop; callers still waiting get an error instead of waiting forever."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for request in self._requests:
            if not request.future.done():
                request.future.set_exception(RuntimeError("the server is shutting down"))
        self._requests.clear()

    def snapshot(self) -> dict:
        """The counters, plus the requests and tokens waiting now."""
        live = [r for r in self._requests if not r.future.done()]
        return {**asdict(self.stats), "waiting_requests": len(live), "waiting_tokens": sum(r.left for r in live)}

    async def submit(self, items: Sequence[Any]) -> np.ndarray:
        """Embed ``items`` -> (len(items), D), in input order. Cancelling the call cancels the request."""
        if self._task is None or self._task.done():
            raise RuntimeError("the embedding batcher is not running")
        if not items:
            raise ValueError("nothing to embed")
        sizes = [max(1, self.size(item)) for item in items]
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(self._count_cancelled)
        request = _Request(items, sizes, future, self.stats.requests, time.monotonic())
        request.pending, request.left = sorted(range(len(items)), key=lambda i: -sizes[i]), sum(sizes)
        self._requests.append(request)
        self.stats.requests += 1
        self._arrived.set()
        return await future  # a cancelled caller cancels the future too

    def _count_cancelled(self, future: asyncio.Future) -> None:
        if future.cancelled():
            self.stats.cancelled_requests += 1

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._drop_finished()
            if not self._requests:
                if self.on_idle is not None and self._since_idle >= self.chunk_tokens:
                    self._since_idle = 0
                    await self._idle(loop)
                    continue  # requests may have come meanwhile
                self._arrived.clear()
                await self._arrived.wait()
                continue
            await self._wait_for_company()
            self._drop_finished()
            chunk = self._next_chunk()
            if chunk:
                await self._serve(loop, chunk)

    def _drop_finished(self) -> None:
        """Forget requests whose future is done (cancelled, failed): their pending texts are never embedded."""
        for request in [r for r in self._requests if r.future.done()]:
            self._requests.remove(request)
            self.stats.dropped_texts += len(request.pending)

    async def _wait_for_company(self) -> None:
        deadline = min(r.arrived for r in self._requests) + self.max_wait
        while not self._full() and (remaining := deadline - time.monotonic()) > 0:
            self._arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining)

    def _full(self) -> bool:
        texts = sum(len(r.pending) for r in self._requests)
        return texts >= self.max_batch_texts or sum(r.left for r in self._requests) >= self.chunk_tokens

    def _next_chunk(self) -> Chunk:
        """The next embed call: a large round, unless small requests that came during the last one wait."""
        if self._after_large:  # what was submitted while that large chunk ran goes before the next one
            self._due, self._after_large = self.stats.requests, False
        waiting = [r for r in self._requests if r.pending]
        small = sorted((r for r in waiting if self._small(r)), key=lambda r: (r.attained, r.seq))
        large = sorted((r for r in waiting if not self._small(r)), key=lambda r: (r.attained, r.seq))
        if large and not any(r.seq < self._due for r in small):
            self._after_large = True
            request = large[0]
            fits = self.chunk_tokens // request.sizes[request.pending[0]]  # its longest texts first
            return [(request, request.take(max(1, min(fits, self.max_batch_texts))))]
        chunk: Chunk = []
        texts = width = 0
        for request in small:
            count, grown = len(request.pending), max(width, request.sizes[request.pending[0]])
            if texts + count > self.max_batch_texts or (texts + count) * grown > self.chunk_tokens:
                break
            chunk.append((request, request.take(count)))
            texts, width = texts + count, grown
        return chunk

    def _small(self, request: _Request) -> bool:
        """Whether ``request`` is served in small rounds: it fits in one chunk and none of it was embedded yet.
        The rest of a large request stays in the large lane, so it gets the next large turn and is not
        overtaken forever by newer small requests that it cannot share a chunk with."""
        return request.attained == 0 and self._fits(request)

    def _fits(self, request: _Request) -> bool:
        """Whether what ``request`` has left fits in one chunk (pending texts are longest first)."""
        count = len(request.pending)
        return count <= self.max_batch_texts and count * request.sizes[request.pending[0]] <= self.chunk_tokens

    async def _serve(self, loop: asyncio.AbstractEventLoop, chunk: Chunk) -> None:
        items = [request.items[i] for request, indices in chunk for i in indices]
        self.stats.chunks += 1
        try:
            vectors = await loop.run_in_executor(None, self.embed, items)  # (n, D)
        except Exception as err:  # every request in this chunk fails; the others go on
            for request, _ in chunk:
                if not request.future.done():
                    request.future.set_exception(err)
            return
        start = 0
        for request, indices in chunk:
            rows, start = vectors[start : start + len(indices)], start + len(indices)
            tokens = sum(request.sizes[i] for i in indices)
            self.stats.texts += len(indices)
            self.stats.tokens += tokens
            self._since_idle += tokens
            request.attained += tokens
            if request.future.done():  # cancelled while its chunk ran: the rows are discarded
                continue
            if request.rows is None:
                request.rows = np.empty((len(request.items), rows.shape[1]), dtype=rows.dtype)
            request.rows[indices] = rows
            if not request.pending:
                request.future.set_result(request.rows)
                self._requests.remove(request)

    async def _idle(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            await loop.run_in_executor(None, self.on_idle)
        except Exception:  # housekeeping only: never stop serving because of it
            logger.exception("the embedding batcher's idle hook failed")
