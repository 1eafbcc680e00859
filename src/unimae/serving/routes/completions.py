"""``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI format, streamed over SSE or not.

Both parse the body and tokenize the prompt in a worker thread (a 4 MB prompt would stall the event loop for
seconds), check the token budget, then either take a generation slot and answer in one body, or reserve a
slot (429 now if the queue is full) and return an SSE stream that holds it. The text comes from the engine's
``generate`` (:mod:`unimae.serving.engine`), the same routes for both engines. ``stream_options.include_usage``
adds a last chunk with the usage and no choices, as OpenAI sends it.

A completion's ``prompt`` may be a list of texts (at most ``--max-prompts``): one choice each, ``index`` its
position, generated one after another in the request's one slot (streamed: each chunk names its choice's
``index``), the usage summed over them, as OpenAI and vLLM answer it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool

from unimae.generation.sampling import GenerationParams
from unimae.generation.stream import GenerationResult
from unimae.serving.disconnect import client_gone, unless_gone
from unimae.serving.engine import Engine, run_to_end
from unimae.serving.schemas import APIError, ChatRequest, CompletionRequest, parse_request
from unimae.serving.sse import sse_events, sse_response
from unimae.serving.state import ServerState, StateDep

router = APIRouter()
DEFAULT_COMPLETION_TOKENS = 16  # max_tokens of /v1/completions when not given, as OpenAI's

Chunk = Callable[[int, str | None, str | None], dict]  # (choice, text piece, finish_reason) -> one payload
Prompt = tuple[list[int], GenerationParams]  # a prompt's token ids and its decoding options


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
    prompts = await _completion_prompts(state, body)
    reply = _Reply.new("cmpl", state.config.model_name)
    chunk = functools.partial(_completion_chunk, reply)
    if body.stream:
        state.slots.reserve()
        usage = reply.head("text_completion") if body.include_usage else None
        return sse_response(_stream(state, prompts, chunk, usage=usage), state.slots)
    results = await _generate(state, prompts, request)
    choices = [chunk(i, result.text, result.finish_reason)["choices"][0] for i, result in enumerate(results)]
    return {**reply.head("text_completion"), "choices": choices, "usage": _usage(results)}


async def _completion_prompts(state: ServerState, body: CompletionRequest) -> list[Prompt]:
    """Each prompt's ids (tokenized in a worker thread) and decoding options; 400 for more prompts than
    ``max_prompts``, an empty one, or one the context cannot take (named by its position when there are several)."""
    texts, limit = body.prompt, state.config.max_prompts
    if len(texts) > limit:
        raise APIError(
            400, f"{len(texts)} prompts; this server takes at most {limit} per request (--max-prompts)", "prompt"
        )
    all_ids = await run_in_threadpool(lambda: [state.engine.prompt_ids(text) for text in texts])
    prompts = []
    for i, ids in enumerate(all_ids):
        where = f"prompt[{i}]" if len(texts) > 1 else "prompt"
        if not ids:
            raise APIError(400, f"{where} is empty", "prompt")
        try:
            prompts.append((ids, state.sampling(body, DEFAULT_COMPLETION_TOKENS, len(ids))))
        except APIError as err:
            if len(texts) == 1:
                raise
            raise APIError(err.status, f"{where}: {err.message}", err.param) from err
    return prompts


@router.post("/v1/chat/completions", response_model=None)
async def chat(request: Request, state: StateDep) -> dict | StreamingResponse:
    body = await parse_request(request, ChatRequest)
    state.check_model(body.model)
    try:
        ids = await run_in_threadpool(state.engine.prompt_ids, [m.as_template_message() for m in body.messages])
    except (ValueError, TemplateError) as err:
        raise APIError(400, str(err), "messages") from err
    prompts = [(ids, state.sampling(body, state.config.default_chat_tokens, len(ids)))]
    reply = _Reply.new("chatcmpl", state.config.model_name)
    if body.stream:
        state.slots.reserve()
        role = _chat_chunk(reply, 0, None, None, role=True)  # the first chunk only says who speaks
        usage = reply.head("chat.completion.chunk") if body.include_usage else None
        stream = _stream(state, prompts, functools.partial(_chat_chunk, reply), first=[role], usage=usage)
        return sse_response(stream, state.slots)
    results = await _generate(state, prompts, request)
    message = {"role": "assistant", "content": results[0].text}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": results[0].finish_reason}
    return {**reply.head("chat.completion"), "choices": [choice], "usage": _usage(results)}


async def _generate(state: ServerState, prompts: list[Prompt], request: Request) -> list[GenerationResult]:
    """The whole generations, in a worker thread, once a slot is free (or 429 now). A client that disconnects
    first ends them within a token (a 499 nobody reads), so it does not hold its slot and batch row to the end."""
    state.slots.reserve()
    cancel = _Cancel()
    gone = asyncio.ensure_future(client_gone(request))
    try:
        async with state.slots.hold():
            work = run_in_threadpool(_generate_all, state.engine, prompts, cancel)
            return await unless_gone(work, gone, "its completion", stop=cancel)
    finally:
        gone.cancel()


def _generate_all(engine: Engine, prompts: list[Prompt], cancel: _Cancel) -> list[GenerationResult]:
    """The result of each prompt, generated one after another; once ``cancel`` is set, no other one starts."""
    results = []
    for ids, params in prompts:
        own = cancel.next()
        if cancel.is_set():
            break
        results.append(run_to_end(engine.generate(ids, params, own)))
    return results


class _Cancel(threading.Event):
    """The cancel event of a request's generations, one after another. Each gets an event of its own from
    :meth:`next` (an engine sets its generation's event when it ends); setting this one sets the current one."""

    def __init__(self):
        super().__init__()
        self._lock, self._current = threading.Lock(), threading.Event()

    def next(self) -> threading.Event:
        """The event of the next generation: already set if this one is."""
        with self._lock:
            self._current = threading.Event()
            if self.is_set():
                self._current.set()
            return self._current

    def set(self) -> None:
        with self._lock:
            super().set()
            self._current.set()


def _stream(
    state: ServerState,
    prompts: list[Prompt],
    chunk: Chunk,
    first: Iterable[dict] = (),
    usage: dict | None = None,
) -> AsyncIterator[bytes]:
    """SSE of ``first`` payloads, then per prompt (one after another) a ``chunk`` per text piece and a last
    ``chunk`` with the finish reason, each naming the prompt's index; with ``usage`` (the head of the payloads,
    for ``include_usage``) one more after the last prompt, with the usage of all and no choices."""
    cancel = _Cancel()
    results: list[GenerationResult] = []

    def items() -> Iterator[tuple[int, str | GenerationResult]]:
        for index, (ids, params) in enumerate(prompts):
            own = cancel.next()
            if cancel.is_set():
                return
            with contextlib.closing(state.engine.generate(ids, params, own)) as pieces:  # closed with the stream
                for item in pieces:
                    yield index, item

    def render(indexed: tuple[int, str | GenerationResult]) -> dict | list[dict] | None:
        index, item = indexed
        if isinstance(item, GenerationResult):
            results.append(item)
            last = chunk(index, None, item.finish_reason)
            if usage is None or len(results) < len(prompts):
                return last
            return [last, {**usage, "choices": [], "usage": _usage(results)}]
        return chunk(index, item, None) if item else None

    return sse_events(state.slots, items, render, cancel, first)


def _completion_chunk(reply: _Reply, index: int, text: str | None, finish: str | None) -> dict:
    choice = {"text": text or "", "index": index, "logprobs": None, "finish_reason": finish}
    return {**reply.head("text_completion"), "choices": [choice]}


def _chat_chunk(reply: _Reply, index: int, text: str | None, finish: str | None, role: bool = False) -> dict:
    delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {**reply.head("chat.completion.chunk"), "choices": [choice]}


def _usage(results: list[GenerationResult]) -> dict:
    """The usage of ``results`` together (one per prompt)."""
    prompt = sum(result.prompt_tokens for result in results)
    completion = sum(result.completion_tokens for result in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
