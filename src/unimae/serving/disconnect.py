"""A client that disconnects before its answer is ready: noticing it, and stopping the work done for it.

Uvicorn does not cancel a handler whose client has gone, so a route races its work against
:func:`client_gone` with :func:`unless_gone` and answers 499 (a status nobody reads) once the client left.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from unimae.serving.schemas import APIError

T = TypeVar("T")


async def client_gone(request: Request) -> None:
    """Returns once the client has disconnected: after the body, the only message left to receive."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(work: Awaitable[T], gone: asyncio.Future, what: str, stop: threading.Event | None = None) -> T:
    """``await work``, or a 499 naming ``what`` if the client disconnects first (``gone``: :func:`client_gone`).

    Without ``stop`` the work is cancelled (the embedding batcher then drops the request's chunks not yet run).
    With ``stop`` (work in a worker thread, which cancelling would not end) ``stop`` is set and the work awaited
    to its end: a generation ends within a token and only then gives back its slot and batch row.
    """
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done() and stop is not None:  # the client has gone, or this handler was cancelled
            stop.set()
        elif not task.done():
            task.cancel()
    if not task.done():
        if stop is not None:
            await asyncio.wait({task})
        raise APIError(499, f"the client closed the connection before {what} was ready")
    return task.result()
