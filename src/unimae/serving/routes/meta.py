"""``GET /health`` (liveness, the engine, the generation slots, the embedding batcher's and the engine's
generation counters; the only route that needs no API key), ``GET /v1/models`` and ``GET /v1/models/{id}``."""

from __future__ import annotations

from fastapi import APIRouter

from unimae.serving.schemas import model_body, models_body
from unimae.serving.state import StateDep

router = APIRouter()


@router.get("/health", response_model=None)
async def health(state: StateDep) -> dict:
    index, slots = state.index, state.slots
    return {
        "status": "ok",
        "model": state.config.model_name,
        "engine": state.engine.kind,
        "index_passages": len(index) if index else None,
        "slots": {"running": slots.running, "waiting": slots.waiting, "max_running": slots.max_running},
        **state.engine.snapshot(),  # embeddings: chunks, tokens, waiting and cancelled; generations: the engine's
    }


@router.get("/v1/models", response_model=None)
async def models(state: StateDep) -> dict:
    return models_body(state.config.model_name)


@router.get("/v1/models/{model_id:path}", response_model=None)  # path: a Hugging Face id has a "/"
async def model(model_id: str, state: StateDep) -> dict:
    """The served model; 404 (``model_not_found``) for any other id."""
    state.check_model(model_id)
    return model_body(state.config.model_name)
