"""``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI format, streamed over SSE or not.

Both parse the body and tokenize the prompt in a worker thread (a 4 MB prompt would stall the event loop for
seconds), check the token budget, then either take a generation slot and answer in one body, or reserve a
slot (429 now if the queue is full) and return an SSE stream that holds it. The text comes from the engine's
``generate`` (:mod:`unimae.serving.engine`), the same routes for both engines. ``stream_options.include_usage``
adds a last chunk with the usage and no choices, as OpenAI sends it.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool

from unimae.generation.sampling import GenerationParams
from unimae.generation.stream import GenerationResult
from unimae.serving.disconnect import client_gone, unless_gone
from unimae.serving.engine import run_to_end
from unimae.serving.schemas import APIError, ChatRequest, CompletionRequest, parse_request
from unimae.serving.sse import sse_events, sse_response
from unimae.serving.state import ServerState, StateDep

router = APIRouter()
DEFAULT_COMPLETION_TOKENS = 16  # max_tokens of /v1/completions when not given, as OpenAI's

Chunk = Callable[[str | None, str | None], dict]  # (text piece, finish_reason) -> one streamed payload


@dataclass(frozen=True)
class _Reply:
    """What every payload of one response repeats: its id, creation time and model."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> _Reply:
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)

    def head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


@router.post("/v1/completions", response_model=None)
async def completions(request: Request, state: StateDep) -> dict | StreamingResponse:
    body = await parse_request(request, CompletionRequest)
    state.check_model(body.model)
    ids = await run_in_threadpool(state.engine.prompt_ids, body.prompt)
    if not ids:
        raise APIError(400, "prompt is empty", "prompt")
    params = state.sampling(body, DEFAULT_COMPLETION_TOKENS, len(ids))
    reply = _Reply.new("cmpl", state.config.model_name)
    chunk = functools.partial(_completion_chunk, reply)
    if body.stream:
        state.slots.reserve()
        usage = reply.head("text_completion") if body.include_usage else None
        return sse_response(_stream(state, ids, params, chunk, usage=usage), state.slots)
    result = await _generate(state, ids, params, request)
    return {**chunk(result.text, result.finish_reason), "usage": _usage(result)}


@router.post("/v1/chat/completions", response_model=None)
async def chat(request: Request, state: StateDep) -> dict | StreamingResponse:
    body = await parse_request(request, ChatRequest)
    state.check_model(body.model)
    try:
        ids = await run_in_threadpool(state.engine.prompt_ids, [m.as_template_message() for m in body.messages])
    except (ValueError, TemplateError) as err:
        raise APIError(400, str(err), "messages") from err
    params = state.sampling(body, state.config.default_chat_tokens, len(ids))
    reply = _Reply.new("chatcmpl", state.config.model_name)
    if body.stream:
        state.slots.reserve()
        role = _chat_chunk(reply, None, None, role=True)  # the first chunk only says who speaks
        usage = reply.head("chat.completion.chunk") if body.include_usage else None
        stream = _stream(state, ids, params, functools.partial(_chat_chunk, reply), first=[role], usage=usage)
        return sse_response(stream, state.slots)
    result = await _generate(state, ids, params, request)
    message = {"role": "assistant", "content": result.text}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": result.finish_reason}
    return {**reply.head("chat.completion"), "choices": [choice], "usage": _usage(result)}


async def _generate(state: ServerState, ids: list[int], params: GenerationParams, request: Request) -> GenerationResult:
    """The whole generation, in a worker thread, once a slot is free (or 429 now). A client that disconnects
    first ends it within a token (a 499 nobody reads), so it does not hold its slot and batch row to the end."""
    state.slots.reserve()
    cancel = threading.Event()
    gone = asyncio.ensure_future(client_gone(request))
    try:
        async with state.slots.hold():
            work = run_in_threadpool(lambda: run_to_end(state.engine.generate(ids, params, cancel)))
            return await unless_gone(work, gone, "its completion", stop=cancel)
    finally:
        gone.cancel()


def _stream(
    state: ServerState,
    ids: list[int],
    params: GenerationParams,
    chunk: Chunk,
    first: Iterable[dict] = (),
    usage: dict | None = None,
) -> AsyncIterator[bytes]:
    """SSE of ``first`` payloads, a ``chunk`` per text piece, a last ``chunk`` with the finish reason, and with
    ``usage`` (the head of the payloads, for ``include_usage``) one more with the usage and no choices."""
    cancel = threading.Event()

    def render(item: str | GenerationResult) -> dict | list[dict] | None:
        if isinstance(item, GenerationResult):
            last = chunk(None, item.finish_reason)
            return last if usage is None else [last, {**usage, "choices": [], "usage": _usage(item)}]
        return chunk(item, None) if item else None

    return sse_events(state.slots, lambda: state.engine.generate(ids, params, cancel), render, cancel, first)


def _completion_chunk(reply: _Reply, text: str | None, finish: str | None) -> dict:
    choice = {"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish}
    return {**reply.head("text_completion"), "choices": [choice]}


def _chat_chunk(reply: _Reply, text: str | None, finish: str | None, role: bool = False) -> dict:
    delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {**reply.head("chat.completion.chunk"), "choices": [choice]}


def _usage(result: GenerationResult) -> dict:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }
