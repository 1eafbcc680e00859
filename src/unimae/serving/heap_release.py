"""Hand the heap memory a large request freed back to the OS once it is answered (``malloc_trim``).

A request body of megabytes (a 4 MB text near ``--max-body-bytes``, 256 inputs of 512 tokens) is parsed and
tokenized in a worker thread: tens of MB that are freed when the request ends but stay resident in the heap
(glibc keeps freed memory for reuse; :func:`unimae.runtime.memory.tune_allocator`, which the encoder applies
for large embedding batches, keeps up to 1 GB of it). The embedding batcher trims when its queue drains, which
a server under steady load never sees. So a request whose body had at least ``min_bytes`` is followed by
:func:`~unimae.runtime.memory.release_free_memory` in a worker thread, after its response: a millisecond or
so for a request that took far longer, and nothing for the small requests of the normal path.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from unimae.runtime.memory import release_free_memory

LARGE_BODY_BYTES = 256 * 1024  # a normal request is a few KB; a 256 x 512-token embeddings request is 0.8 MB


class HeapRelease:
    """ASGI middleware: after an HTTP request whose body had at least ``min_bytes``, ``release()`` (in a worker
    thread; what it returns is ignored)."""

    def __init__(
        self, app: ASGIApp, min_bytes: int = LARGE_BODY_BYTES, release: Callable[[], object] = release_free_memory
    ):
        self.app, self.min_bytes, self.release = app, min_bytes, release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            if seen >= self.min_bytes:
                await run_in_threadpool(self.release)
