"""The OpenAI-compatible HTTP server: embeddings, completions, chat and RAG from ONE loaded model.

Routes: ``POST /v1/embeddings``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming),
``POST /v1/rag`` (with ``--index``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``. Every error is
an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for bad requests. With
``--cors-origins``, Starlette's CORS middleware runs first: it answers a browser's preflight ``OPTIONS`` before the
API key is asked for (a preflight never carries it) and adds its headers to every response, errors included.

Model work runs on one thread, the model lock's (see ``model_lock.py``); parsing and tokenizing a request run in
worker threads (a body of a few MB would otherwise stall every other request). Embedding requests go through a
:class:`DynamicBatcher` that schedules by tokens: a large request is embedded in chunks of ``embed_chunk_tokens``
between the others, and a client that disconnects cancels its remaining chunks. Generations are batched in flight
by a :class:`~unimae.serving.scheduler.GenerationScheduler`: up to ``max_batch_generations`` decode together, one
token each per step, a new one joining at the next step (``--no-continuous-batching``:
``max_concurrent_generations`` at once, each on its own thread); ``max_queued_generations`` more may wait, and
further ones get 429. A client that disconnects from a stream stops its generation within a token. Embedding
chunks and decode steps take turns on the model (a FIFO lock, ``model_lock.py``).

The same routes serve either engine (:mod:`unimae.serving.engine`): the PyTorch one (``torch_engine.py``)
or an exported GGUF in llama.cpp (``llamacpp_engine.py``), with the same checks, limits, 429s and errors.

Where things are: the routes in ``routes/`` (one router per group), the state they share in ``state.py``,
generation slots in ``slots.py``, continuous batching of generations in ``scheduler.py``, the model lock in
``model_lock.py``, embedding batching in ``batcher.py``, SSE in ``sse.py``, the API-key, body-size and
body-timeout guard in ``guard.py``, the heap trim after a large body in ``heap_release.py``. This module builds
the app from them and turns every exception into the error body; a client that leaves mid-request is one INFO
line, a generation stopped by NaN scores a 422.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from unimae.encoder import Encoder
from unimae.generation.sampling import NonFiniteLogitsError
from unimae.retrieval.index import VectorIndex
from unimae.serving.config import ServerConfig
from unimae.serving.engine import Engine
from unimae.serving.guard import RequestGuard
from unimae.serving.heap_release import HeapRelease
from unimae.serving.routes import completions, embeddings, meta, rag
from unimae.serving.schemas import APIError, non_finite_logits
from unimae.serving.state import ServerState

logger = logging.getLogger(__name__)


def create_app(
    engine: Engine | Encoder, config: ServerConfig | None = None, index: VectorIndex | None = None
) -> FastAPI:
    """A FastAPI app serving ``engine`` (an :class:`~unimae.encoder.Encoder` is served by the PyTorch engine)
    and optionally ``index``."""
    config = config or ServerConfig()
    app = FastAPI(title="unimae", lifespan=_lifespan)
    app.state.server = ServerState.build(engine, config, index)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(ClientDisconnect, client_left)
    app.add_exception_handler(NonFiniteLogitsError, nan_logits)
    app.add_exception_handler(Exception, unexpected_error)
    for routes in (meta, embeddings, completions, rag):
        app.include_router(routes.router)
    app.add_middleware(
        RequestGuard, limit=config.max_body_bytes, api_key=config.api_key, body_timeout=config.body_timeout_s
    )
    app.add_middleware(HeapRelease)  # outside the guard: counts what the guard let in, as the route read it
    if origins := config.cors_origin_list():  # outermost: a preflight is answered before the guard asks for a key
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.server
    state.engine.start()
    logger.info(
        "serving %s (%s engine, %d-dim embeddings)",
        state.config.model_name,
        state.engine.kind,
        state.engine.embedding_dim,
    )
    yield
    await state.engine.stop()


async def api_error(request: Request, err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (unknown path, wrong method) in the OpenAI shape."""
    return JSONResponse(APIError(err.status_code, str(err.detail)).body(), status_code=err.status_code)


async def client_left(request: Request, err: ClientDisconnect) -> JSONResponse:
    """The client closed the connection while its request body was read: one line, no traceback."""
    logger.info("client left during %s %s", request.method, request.url.path)
    return JSONResponse(APIError(499, "the client closed the connection").body(), status_code=499)


async def nan_logits(request: Request, err: NonFiniteLogitsError) -> JSONResponse:
    """A generation stopped by NaN or infinite scores (damaged weights): a 422 naming the cause, no traceback."""
    error = non_finite_logits(err)
    return JSONResponse(error.body(), status_code=error.status)


async def unexpected_error(request: Request, err: Exception) -> JSONResponse:
    logger.exception("internal error on %s", request.url.path)
    return JSONResponse(APIError(500, f"internal error: {type(err).__name__}").body(), status_code=500)
