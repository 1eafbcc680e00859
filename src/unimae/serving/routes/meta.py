"""``GET /health`` (liveness, the embedding batcher's and the generation scheduler's counters; the only route that
needs no API key) and ``GET /v1/models``."""

from __future__ import annotations

from fastapi import APIRouter

from unimae.serving.schemas import models_body
from unimae.serving.state import StateDep

router = APIRouter()


@router.get("/health", response_model=None)
async def health(state: StateDep) -> dict:
    index = state.index
    return {
        "status": "ok",
        "model": state.config.model_name,
        "index_passages": len(index) if index else None,
        "embeddings": state.batcher.snapshot(),  # chunks, tokens, waiting and cancelled requests
        "generations": state.scheduler.snapshot() if state.scheduler is not None else None,  # steps, batch sizes
    }


@router.get("/v1/models", response_model=None)
async def models(state: StateDep) -> dict:
    return models_body(state.config.model_name)
