"""``POST /v1/embeddings``: OpenAI format, unit-length embeddings batched across concurrent callers."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Request

from unimae.serving.schemas import APIError, EmbeddingRequest, parse_body
from unimae.serving.state import ServerState, StateDep

router = APIRouter()


@router.post("/v1/embeddings", response_model=None)
async def embeddings(request: Request, state: StateDep) -> dict:
    body = parse_body(await request.body(), EmbeddingRequest)
    state.check_model(body.model)
    lengths = _checked_lengths(state, body)
    vectors = await state.batcher.submit(body.input)  # (N, D) unit rows
    used = sum(min(n, state.encoder.max_length) for n in lengths)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(_encoded(vectors, body))],
        "model": state.config.model_name,
        "usage": {"prompt_tokens": used, "total_tokens": used},
    }


def _checked_lengths(state: ServerState, body: EmbeddingRequest) -> list[int]:
    """Token count of each input (with EOS); 400 for too many inputs, empty ones or (if so set) too long ones."""
    texts, config, encoder = body.input, state.config, state.encoder
    if len(texts) > config.max_inputs:
        raise APIError(400, f"{len(texts)} inputs; this server takes at most {config.max_inputs} per request", "input")
    if body.dimensions is not None and body.dimensions != encoder.embedding_dim:
        raise APIError(400, f"this model gives {encoder.embedding_dim}-dimensional embeddings only", "dimensions")
    lengths = [len(ids) + 1 for ids in encoder.tokenizer(texts, add_special_tokens=True)["input_ids"]]  # + EOS
    for i, (text, n) in enumerate(zip(texts, lengths, strict=True)):
        if not text.strip():
            raise APIError(400, f"input[{i}] is empty", "input")
        if n > encoder.max_length and config.on_too_long == "error":
            raise APIError(400, f"input[{i}] has {n} tokens; the limit is {encoder.max_length}", "input")
    return lengths


def _encoded(vectors: np.ndarray, body: EmbeddingRequest) -> list[list[float]] | list[str]:
    """(N, D) rows as float lists, or as base64 of little-endian float32 (``encoding_format``)."""
    if body.encoding_format == "base64":
        return [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
    return [v.tolist() for v in vectors]
