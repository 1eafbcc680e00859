"""Generation slots: at most ``max_running`` generations at once, ``max_queued`` more waiting, then 429.

Taking a slot is two steps, so that a stream can still be refused with a 429 before its 200 is sent:

1. ``slots.reserve()`` in the route handler: a place in the queue, or :class:`APIError` 429 now;
2. ``async with slots.hold():`` where the generation runs (in the handler, or in the stream's body):
   waits for a free slot, holds it until the block ends, however it ends (error, client gone).

Every ``reserve()`` is followed by exactly one ``hold()``, or by ``unreserve()`` when a stream's body
never starts (:class:`unimae.serving.sse.SSEResponse`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from unimae.serving.schemas import APIError


class GenerationSlots:
    """The server's generation capacity; ``running`` and ``waiting`` count the generations in each state."""

    def __init__(self, max_running: int, max_queued: int):
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.max_running, self.max_queued = max_running, max_queued
        self.running = 0  # holding a slot
        self.waiting = 0  # reserved, not holding one yet
        self._free = asyncio.Semaphore(max_running)

    def reserve(self) -> None:
        """Queue for a slot, or raise 429 when every slot is taken and the queue is full."""
        if self._free.locked() and self.waiting >= self.max_queued:
            raise APIError(429, "too many generation requests are waiting; retry later", code="server_busy")
        self.waiting += 1

    def unreserve(self) -> None:
        """Give back a place that will never be held: its stream's body never started (the client left)."""
        self.waiting -= 1

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Wait for a slot (reserved before), hold it for the ``async with`` block."""
        try:
            await self._free.acquire()
        finally:  # cancelled while waiting: the place in the queue is given up too
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._free.release()
