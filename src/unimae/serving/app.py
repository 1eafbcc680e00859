"""The OpenAI-compatible HTTP server: embeddings, completions, chat and RAG from ONE loaded model.

Routes: ``POST /v1/embeddings``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming),
``POST /v1/rag`` (with ``--index``), ``GET /v1/models``, ``GET /health``. Every error is an OpenAI-style
body ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for bad requests.

Model work runs in worker threads: embedding requests go through a :class:`DynamicBatcher`; at most
``max_concurrent_generations`` generations run at once, ``max_queued_generations`` more may wait, and
further ones get 429. A client that disconnects from a stream stops its generation within a token.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from pydantic import ValidationError
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from unimae.generation import GenerationParams, GenerationResult, generate_stream, generate_text
from unimae.rag import RAG, RAGAnswer
from unimae.serving.batcher import DynamicBatcher
from unimae.serving.config import ServerConfig
from unimae.serving.schemas import APIError, ChatRequest, CompletionRequest, EmbeddingRequest, RAGRequest

logger = logging.getLogger(__name__)


class _Guard:
    """Pure ASGI middleware: API-key check (all routes but /health) and the request-body size limit.

    A body over ``limit`` bytes gets 413 before it is read into memory, whether it announces its length
    or streams in chunks. Pure ASGI (not ``BaseHTTPMiddleware``), so an error raised while reading the
    body reaches the route's error handler unwrapped.
    """

    def __init__(self, app, limit: int, api_key: str | None):
        self.app, self.limit, self.api_key = app, limit, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        if self.api_key and scope.get("path") != "/health":
            header = headers.get(b"authorization", b"").decode("latin-1")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not secrets.compare_digest(token.encode(), self.api_key.encode()):
                err = APIError(
                    401, "missing or wrong API key; send 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
                return await JSONResponse(err.body(), status_code=401)(scope, receive, send)
        length = headers.get(b"content-length")
        too_long = APIError(413, f"request body is larger than the server's limit of {self.limit} bytes")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await JSONResponse(too_long.body(), status_code=413)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise too_long
            return message

        return await self.app(scope, counted, send)


async def _parse(request: Request, model):
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise APIError(400, f"the request body is not valid JSON: {type(err).__name__}: {err}") from err
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        raise APIError(400, f"invalid '{where}': {message}" if where else message, param=where) from err


def _close_in_thread(generator) -> None:
    """Close a sync generator off the event loop (its cleanup joins the generation thread)."""
    if generator is None:
        return

    def close():
        with contextlib.suppress(ValueError):  # still running in the pool: it ends once cancelled
            generator.close()

    threading.Thread(target=close, name="unimae-close-stream", daemon=True).start()


def _sse(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def create_app(encoder, config: ServerConfig | None = None, index=None) -> FastAPI:
    """A FastAPI app serving ``encoder`` (an :class:`~unimae.encoder.Encoder`) and optionally ``index``."""
    config = config or ServerConfig()
    rag = RAG(encoder, index) if index is not None else None
    tokenizer = encoder.tokenizer
    context = getattr(encoder.model.config, "max_position_embeddings", None)

    def embed(texts: list[str]) -> np.ndarray:
        return encoder.encode(texts, normalize=True, show_progress=False)

    batcher = DynamicBatcher(embed, config.batch_max_texts, config.batch_wait_ms)
    generations = asyncio.Semaphore(config.max_concurrent_generations)
    waiting = 0

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher.start()
        logger.info("serving %s (%d-dim embeddings)", config.model_name, encoder.embedding_dim)
        yield
        await batcher.stop()

    app = FastAPI(title="unimae", lifespan=lifespan)
    app.state.batcher = batcher

    @app.exception_handler(APIError)
    async def _api_error(request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, err: StarletteHTTPException):
        return JSONResponse(APIError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request, err: Exception):
        logger.exception("internal error on %s", request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(err).__name__}").body(), status_code=500)

    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name:
            raise APIError(
                404, f"model {name!r} is not served here; use {config.model_name!r}", "model", "model_not_found"
            )

    def token_budget(requested: int | None, default: int) -> int:
        max_tokens = requested or min(default, config.max_new_tokens)
        if max_tokens > config.max_new_tokens:
            limit = config.max_new_tokens
            raise APIError(400, f"max_tokens {max_tokens} is over this server's limit of {limit}", "max_tokens")
        return max_tokens

    def sampling(body, default_tokens: int, prompt_tokens: int) -> GenerationParams:
        max_tokens = token_budget(body.max_tokens, default_tokens)
        if context is not None and prompt_tokens + max_tokens > context:
            raise APIError(
                400,
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context of {context}",
                "max_tokens",
            )
        return GenerationParams(
            max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, stop=body.stop, seed=body.seed
        )

    def reserve_slot() -> None:
        """Queue for a generation, or 429 now (before any streamed response has sent its 200)."""
        nonlocal waiting
        if generations.locked() and waiting >= config.max_queued_generations:
            raise APIError(429, "too many generation requests are waiting; retry later", code="server_busy")
        waiting += 1

    @contextlib.asynccontextmanager
    async def generation_slot():
        """Wait for a reserved slot, hold it while generating."""
        nonlocal waiting
        try:
            await generations.acquire()
        finally:
            waiting -= 1
        try:
            yield
        finally:
            generations.release()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": config.model_name, "index_passages": len(index) if index else None}

    @app.get("/v1/models")
    async def models():
        card = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "unimae"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await _parse(request, EmbeddingRequest)
        check_model(body.model)
        texts = body.input
        if len(texts) > config.max_inputs:
            raise APIError(
                400, f"{len(texts)} inputs; this server takes at most {config.max_inputs} per request", "input"
            )
        if body.dimensions is not None and body.dimensions != encoder.embedding_dim:
            raise APIError(400, f"this model gives {encoder.embedding_dim}-dimensional embeddings only", "dimensions")
        lengths = [len(ids) + 1 for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]]  # + EOS
        for i, (text, n) in enumerate(zip(texts, lengths, strict=True)):
            if not text.strip():
                raise APIError(400, f"input[{i}] is empty", "input")
            if n > encoder.max_length and config.on_too_long == "error":
                raise APIError(400, f"input[{i}] has {n} tokens; the limit is {encoder.max_length}", "input")
        vectors = await batcher.submit(texts)  # (N, D) unit rows
        if body.encoding_format == "base64":
            data = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
        else:
            data = [v.tolist() for v in vectors]
        used = sum(min(n, encoder.max_length) for n in lengths)
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
            "model": config.model_name,
            "usage": {"prompt_tokens": used, "total_tokens": used},
        }

    async def run_generation(ids: list[int], params: GenerationParams) -> GenerationResult:
        reserve_slot()
        async with generation_slot():
            return await run_in_threadpool(
                generate_text, encoder.model, tokenizer, ids, params, precision=encoder.precision
            )

    async def sse_events(make_items, render, cancel: threading.Event, first=()) -> AsyncIterator[bytes]:
        """SSE from a sync generator run in a worker thread while holding a generation slot: ``first``
        payloads, then ``render(item)`` for each item (None skips it), then [DONE]. An error after the 200
        is reported in the stream; a client that leaves sets ``cancel`` and so stops the generation."""
        items = None
        try:
            async with generation_slot():
                for payload in first:
                    yield _sse(payload)
                items = make_items()
                async for item in iterate_in_threadpool(items):
                    payload = render(item)
                    if payload is not None:
                        yield _sse(payload)
        except APIError as err:
            yield _sse(err.body())
        except Exception as err:  # the 200 is already sent: report in the stream, end it properly
            logger.exception("generation failed mid-stream")
            yield _sse(APIError(500, f"generation failed: {type(err).__name__}").body())
        finally:
            cancel.set()
            _close_in_thread(items)
        yield _sse("[DONE]")

    def stream_generation(ids, params, chunk, first=()) -> AsyncIterator[bytes]:
        """Completion/chat SSE: ``chunk(text, finish)`` payloads."""
        cancel = threading.Event()

        def render(item):
            if isinstance(item, GenerationResult):
                return chunk(None, item.finish_reason)
            return chunk(item, None) if item else None

        def pieces():
            return generate_stream(encoder.model, tokenizer, ids, params, precision=encoder.precision, cancel=cancel)

        return sse_events(pieces, render, cancel, first)

    def usage(result: GenerationResult) -> dict:
        return {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest)
        check_model(body.model)
        ids = encoder.prompt_ids(body.prompt)
        if not ids:
            raise APIError(400, "prompt is empty", "prompt")
        params = sampling(body, 16, len(ids))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, finish):
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": config.model_name,
                "choices": [{"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish}],
            }

        if body.stream:
            reserve_slot()
            return StreamingResponse(stream_generation(ids, params, chunk), media_type="text/event-stream")
        result = await run_generation(ids, params)
        return {**chunk(result.text, result.finish_reason), "usage": usage(result)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _parse(request, ChatRequest)
        check_model(body.model)
        try:
            ids = encoder.prompt_ids([m.as_template_message() for m in body.messages])
        except (ValueError, TemplateError) as err:
            raise APIError(400, str(err), "messages") from err
        params = sampling(body, config.default_chat_tokens, len(ids))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, finish, role=False):
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": config.model_name,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }

        if body.stream:
            reserve_slot()
            first = [chunk(None, None, role=True)]
            return StreamingResponse(stream_generation(ids, params, chunk, first), media_type="text/event-stream")
        result = await run_generation(ids, params)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": config.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result.text},
                    "logprobs": None,
                    "finish_reason": result.finish_reason,
                }
            ],
            "usage": usage(result),
        }

    @app.post("/v1/rag")
    async def rag_route(request: Request):
        body = await _parse(request, RAGRequest)
        if rag is None:
            raise APIError(404, "no index is loaded; start the server with --index DIR", code="no_index")
        params = GenerationParams(max_new_tokens=token_budget(body.max_tokens, config.default_chat_tokens))

        def passages(hits):
            return [{"id": h.id, "text": h.text, "score": h.score} for h in hits]

        def answer_body(answer: RAGAnswer) -> dict:
            return {
                "object": "rag.answer",
                "model": config.model_name,
                "answer": answer.text,
                "passages": passages(answer.hits),
                "finish_reason": answer.finish_reason,
                "usage": {
                    "prompt_tokens": answer.prompt_tokens,
                    "cached_prompt_tokens": answer.cached_tokens,
                    "completion_tokens": answer.completion_tokens,
                },
            }

        try:
            rag.check_budget(body.query, params.max_new_tokens)
        except ValueError as err:
            raise APIError(400, str(err), "query") from err
        reserve_slot()
        cancel = threading.Event()
        run = functools.partial(rag.stream, body.query, params=params, k=body.k, reuse_kv=body.reuse_kv, cancel=cancel)
        if not body.stream:
            async with generation_slot():
                try:
                    answer = await run_in_threadpool(lambda: [x for x in run() if isinstance(x, RAGAnswer)][0])
                except ValueError as err:
                    raise APIError(400, str(err), "query") from err
            return answer_body(answer)

        def render(item):
            if isinstance(item, list):
                return {"object": "rag.passages", "passages": passages(item)}
            if isinstance(item, RAGAnswer):
                return answer_body(item)
            return {"object": "rag.delta", "text": item}

        return StreamingResponse(sse_events(run, render, cancel), media_type="text/event-stream")

    app.add_middleware(_Guard, limit=config.max_body_bytes, api_key=config.api_key)
    return app
