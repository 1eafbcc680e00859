"""What every route shares: the engine (the served model), the settings, the index and the generation slots.

One :class:`ServerState` per app, on ``app.state.server``; a route asks for it with a ``StateDep``
parameter. Its methods are the request checks that depend on the served model and the server's limits,
the same for both engines (:mod:`unimae.serving.engine`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from unimae.embedding.pooling import PooledInput
from unimae.encoder import Encoder
from unimae.generation.prompt import check_fits
from unimae.generation.sampling import GenerationParams
from unimae.retrieval.index import VectorIndex
from unimae.serving.config import ServerConfig
from unimae.serving.engine import Engine
from unimae.serving.schemas import APIError, ChatRequest, CompletionRequest
from unimae.serving.slots import GenerationSlots
from unimae.serving.torch_engine import TorchEngine


@dataclass
class ServerState:
    engine: Engine
    config: ServerConfig
    slots: GenerationSlots
    index: VectorIndex | None = None

    @classmethod
    def build(cls, engine: Engine | Encoder, config: ServerConfig, index: VectorIndex | None = None) -> ServerState:
        """The state of a server over ``engine`` (an :class:`Encoder` is served by a :class:`TorchEngine`).

        Generation slots: ``max_batch_generations`` running (``max_concurrent_generations`` with
        ``--no-continuous-batching``), ``max_queued_generations`` waiting, then 429: for both engines."""
        if isinstance(engine, Encoder):
            engine = TorchEngine(engine, config, index)
        running = config.max_batch_generations if config.continuous_batching else config.max_concurrent_generations
        return cls(engine, config, GenerationSlots(running, config.max_queued_generations), index)

    def __getattr__(self, name: str) -> Any:
        """The engine's parts by name (``state.batcher``, ``state.scheduler``, ``state.lock``, ``state.encoder``)."""
        if name in ("batcher", "scheduler", "lock", "encoder"):
            return getattr(self.engine, name)
        raise AttributeError(name)

    def embedding_inputs(self, texts: list[str], input_type: str | None = None) -> list[PooledInput]:
        """Model inputs of ``texts`` (a worker thread's job); built over ``max_length`` with ``on_too_long='error'``
        so that the route can refuse a too-long input (see the engine's ``embedding_inputs``)."""
        return self.engine.embedding_inputs(texts, input_type, self.config.on_too_long == "error")

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
        """Decoding options of a completion or chat ``body``; 400 when the prompt and answer overflow the context.
        Without ``max_tokens`` the default answer length shrinks to the context left (as OpenAI and vLLM do).
        ``prompt_tokens``: the length of the engine's ``prompt_ids`` (over the context: tokenized only that far)."""
        max_tokens = self.token_budget(body.max_tokens, default_tokens)
        context = self.engine.context
        try:
            check_fits(prompt_tokens, context)
        except ValueError as err:
            raise APIError(400, str(err), "messages" if isinstance(body, ChatRequest) else "prompt") from err
        if body.max_tokens is None and context is not None:
            if prompt_tokens >= context:
                raise APIError(400, f"the prompt ({prompt_tokens} tokens) fills the context of {context}")
            max_tokens = min(max_tokens, context - prompt_tokens)
        if context is not None and prompt_tokens + max_tokens > context:
            raise APIError(
                400,
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context of {context}",
                "max_tokens",
            )
        return GenerationParams(
            max_new_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            stop=body.stop,
            seed=body.sampling_seed,
        )


async def get_state(request: Request) -> ServerState:
    """FastAPI dependency: the app's :class:`ServerState` (async, so it runs on the loop, not in a thread)."""
    return request.app.state.server


StateDep = Annotated[ServerState, Depends(get_state)]
