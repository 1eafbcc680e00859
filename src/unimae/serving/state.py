"""What every route shares: the loaded model, the settings, the embedding batcher, RAG, generation slots.

One :class:`ServerState` per app, on ``app.state.server``; a route asks for it with a ``StateDep``
parameter. Its methods are the request checks that depend on the served model and the server's limits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from unimae.encoder import Encoder
from unimae.generation import GenerationParams
from unimae.index import VectorIndex
from unimae.rag import RAG
from unimae.serving.batcher import DynamicBatcher
from unimae.serving.config import ServerConfig
from unimae.serving.schemas import APIError, ChatRequest, CompletionRequest
from unimae.serving.slots import GenerationSlots


@dataclass
class ServerState:
    encoder: Encoder
    config: ServerConfig
    batcher: DynamicBatcher  # started and stopped by the app's lifespan
    slots: GenerationSlots
    index: VectorIndex | None = None
    rag: RAG | None = None  # with an index only
    context: int | None = None  # the model's context length in tokens, when it has one

    @classmethod
    def build(cls, encoder: Encoder, config: ServerConfig, index: VectorIndex | None = None) -> ServerState:
        embed = functools.partial(encoder.encode, normalize=True, show_progress=False)  # texts -> (N, D) unit rows
        return cls(
            encoder=encoder,
            config=config,
            batcher=DynamicBatcher(embed, config.batch_max_texts, config.batch_wait_ms),
            slots=GenerationSlots(config.max_concurrent_generations, config.max_queued_generations),
            index=index,
            rag=RAG(encoder, index) if index is not None else None,
            context=getattr(encoder.model.config, "max_position_embeddings", None),
        )

    def check_model(self, name: str | None) -> None:
        """404 unless ``name`` is the served model's id (or not given)."""
        if name is not None and name != self.config.model_name:
            served = self.config.model_name
            raise APIError(404, f"model {name!r} is not served here; use {served!r}", "model", "model_not_found")

    def token_budget(self, requested: int | None, default: int) -> int:
        """``max_tokens`` of a request: ``requested``, else ``default`` capped by the server's limit."""
        max_tokens = requested or min(default, self.config.max_new_tokens)
        if max_tokens > self.config.max_new_tokens:
            limit = self.config.max_new_tokens
            raise APIError(400, f"max_tokens {max_tokens} is over this server's limit of {limit}", "max_tokens")
        return max_tokens

    def sampling(
        self, body: CompletionRequest | ChatRequest, default_tokens: int, prompt_tokens: int
    ) -> GenerationParams:
        """Decoding options of a completion or chat ``body``; 400 when the prompt and answer overflow the context."""
        max_tokens = self.token_budget(body.max_tokens, default_tokens)
        if self.context is not None and prompt_tokens + max_tokens > self.context:
            raise APIError(
                400,
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context of {self.context}",
                "max_tokens",
            )
        return GenerationParams(
            max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, stop=body.stop, seed=body.seed
        )


async def get_state(request: Request) -> ServerState:
    """FastAPI dependency: the app's :class:`ServerState` (async, so it runs on the loop, not in a thread)."""
    return request.app.state.server


StateDep = Annotated[ServerState, Depends(get_state)]
