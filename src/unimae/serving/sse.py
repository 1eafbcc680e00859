"""Server-sent events: every streamed response (completions, chat, RAG) is framed here.

A stream is ``data: <json>\\n\\n`` events ending with ``data: [DONE]\\n\\n``, as OpenAI sends them. The
items come from a sync generator (the model's token loop) run in worker threads while the stream holds a
generation slot; a client that leaves sets the generation's ``cancel`` event, which ends it within a token.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.concurrency import iterate_in_threadpool

from unimae.generation.sampling import NonFiniteLogitsError
from unimae.serving.schemas import APIError, non_finite_logits
from unimae.serving.slots import GenerationSlots

logger = logging.getLogger(__name__)


def sse_frame(payload: dict | str) -> bytes:
    """One SSE event: a dict as JSON, a string (``[DONE]``) as is."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


class SSEResponse(StreamingResponse):
    """The streamed response of ``events`` (from :func:`sse_events`, whose place in ``slots`` the route
    reserved). A client that leaves before the body starts (e.g. while the headers are sent) would leave
    that place reserved for ever, since the body's ``hold()`` never runs: then it is given back here."""

    def __init__(self, events: AsyncIterator[bytes], slots: GenerationSlots):
        self._slots, self._started = slots, False
        super().__init__(self._body(events), media_type="text/event-stream")

    async def _body(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        self._started = True  # from here on, the body's hold() gives the place back however it ends
        async for chunk in events:
            yield chunk

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._started:
                self._slots.unreserve()


def sse_response(events: AsyncIterator[bytes], slots: GenerationSlots) -> StreamingResponse:
    return SSEResponse(events, slots)


async def sse_events(
    slots: GenerationSlots,
    make_items: Callable[[], Iterator[Any]],
    render: Callable[[Any], dict | list[dict] | None],
    cancel: threading.Event,
    first: Iterable[dict] = (),
) -> AsyncIterator[bytes]:
    """Events of a generation that holds one of ``slots`` (reserved by the route before it returned).

    ``first`` payloads, then ``render(item)`` for each item of ``make_items()`` (None skips it, a list is several
    payloads), then
    [DONE]. An error after the 200 is reported in the stream; a client that leaves sets ``cancel``.
    """
    items = None
    try:
        async with slots.hold():
            for payload in first:
                yield sse_frame(payload)
            items = make_items()
            async for item in iterate_in_threadpool(items):
                payload = render(item)
                for one in payload if isinstance(payload, list) else [] if payload is None else [payload]:
                    yield sse_frame(one)
    except APIError as err:
        yield sse_frame(err.body())
    except NonFiniteLogitsError as err:  # damaged weights: the cause, not a traceback
        yield sse_frame(non_finite_logits(err).body())
    except Exception as err:  # the 200 is already sent: report in the stream, end it properly
        logger.exception("generation failed mid-stream")
        yield sse_frame(APIError(500, f"generation failed: {type(err).__name__}").body())
    finally:
        cancel.set()
        _close_in_thread(items)
    yield sse_frame("[DONE]")


def _close_in_thread(generator: Iterator[Any] | None) -> None:
    """Close a sync generator off the event loop (its cleanup joins the generation thread)."""
    if generator is None:
        return

    def close():
        with contextlib.suppress(ValueError):  # still running in the pool: it ends once cancelled
            generator.close()

    threading.Thread(target=close, name="unimae-close-stream", daemon=True).start()
