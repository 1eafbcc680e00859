"""``POST /v1/embeddings``: OpenAI format, unit-length embeddings batched across concurrent callers.

Parsing, checking and tokenizing run in a worker thread (a 4 MB body takes seconds to tokenize), then the
token ids go to the :class:`~unimae.serving.batcher.DynamicBatcher`, which embeds them in token-budgeted
chunks between other requests. A client that disconnects while it waits cancels its request: the batcher
drops its chunks not yet run. The response body is rendered in a worker thread too (2048 x D floats as JSON).
"""

from __future__ import annotations

import asyncio

import numpy as np
from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from unimae.embedding.pooling import PooledInput
from unimae.embedding.vectors import finish_embeddings
from unimae.serving.disconnect import client_gone, unless_gone
from unimae.serving.schemas import APIError, EmbeddingRequest, check_dimensions, embeddings_json, parse_body
from unimae.serving.state import ServerState, StateDep

router = APIRouter()


@router.post("/v1/embeddings", response_model=None)
async def embeddings(request: Request, state: StateDep) -> Response:
    raw = await request.body()
    gone = asyncio.ensure_future(client_gone(request))
    try:
        body, inputs = await run_in_threadpool(_prepare, state, raw)
        vectors = await unless_gone(state.engine.embed(inputs), gone, "its embeddings")  # (N, D) unit rows
    finally:
        gone.cancel()
    content = await run_in_threadpool(_render, state, body, inputs, vectors)
    return Response(content, media_type="application/json")


def _prepare(state: ServerState, raw: bytes) -> tuple[EmbeddingRequest, list[PooledInput]]:
    """The parsed body and its model inputs; 400 for a bad body, too many inputs, empty ones ("", not
    whitespace: the Encoder embeds that as BOS/EOS only) or (if so set) too long ones, 413 for more tokens
    than ``max_request_tokens``."""
    body = parse_body(raw, EmbeddingRequest)
    state.check_model(body.model)
    texts, config, engine = body.input, state.config, state.engine
    if len(texts) > config.max_inputs:
        raise APIError(400, f"{len(texts)} inputs; this server takes at most {config.max_inputs} per request", "input")
    check_dimensions(body.dimensions, engine.embedding_dim, engine.matryoshka_dims, engine.rotation is not None)
    for i, text in enumerate(texts):
        if not text:
            raise APIError(400, f"input[{i}] is empty", "input")
    inputs = state.embedding_inputs(texts, body.input_type)
    for i, item in enumerate(inputs):
        if len(item.ids) > engine.max_length:  # built longer only when on_too_long is "error"
            raise APIError(
                400,
                f"input[{i}] is over this server's limit of {engine.max_length} tokens; shorten it "
                "(or start the server with --on-too-long truncate)",
                "input",
            )
    tokens = sum(len(item.ids) for item in inputs)
    if tokens > config.max_request_tokens:
        raise APIError(
            413,
            f"the {len(texts)} inputs have {tokens} tokens; this server embeds at most {config.max_request_tokens} "
            "tokens per request (--max-request-tokens): split the request",
            "input",
            "request_too_large",
        )
    return body, inputs


def _render(state: ServerState, body: EmbeddingRequest, inputs: list[PooledInput], vectors: np.ndarray) -> bytes:
    """The response body as JSON bytes; ``usage`` counts the tokens embedded (after truncation, with specials)."""
    tokens = sum(len(item.ids) for item in inputs)
    vectors = finish_embeddings(vectors, body.dimensions, True, rotation=state.engine.rotation)  # (N, k) unit rows
    return embeddings_json(state.config.model_name, vectors, body.encoding_format, tokens)
