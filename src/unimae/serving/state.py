"""What every route shares: the loaded model, the settings, the embedding batcher and its tokenizer, RAG,
generation slots and the generation scheduler.

The embedding batcher and the scheduler take turns on the model through one FIFO :class:`ModelLock`: the
batcher holds it for one chunk (one forward pass), the scheduler for one prefill or one decode step, so
embedding chunks run between decode steps and neither starves the other. With ``--no-continuous-batching``
each generation decodes on its own thread, without the lock, as before the scheduler.

One :class:`ServerState` per app, on ``app.state.server``; a route asks for it with a ``StateDep``
parameter. Its methods are the request checks that depend on the served model and the server's limits.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
from fastapi import Depends, Request

from unimae.embedding.pooling import PooledInput
from unimae.encoder import Encoder
from unimae.generation.decoding import decode_tokens, warm_up
from unimae.generation.sampling import GenerationParams
from unimae.retrieval.index import VectorIndex
from unimae.retrieval.rag import RAG
from unimae.runtime.memory import release_free_memory
from unimae.serving.batcher import DynamicBatcher
from unimae.serving.config import ServerConfig
from unimae.serving.model_lock import ModelLock
from unimae.serving.scheduler import GenerationScheduler
from unimae.serving.schemas import APIError, ChatRequest, CompletionRequest
from unimae.serving.slots import GenerationSlots


@dataclass
class ServerState:
    encoder: Encoder
    config: ServerConfig
    batcher: DynamicBatcher  # started and stopped by the app's lifespan
    slots: GenerationSlots
    embedding_tokenizer: Any  # the encoder's tokenizer, copied: see embedding_inputs
    index: VectorIndex | None = None
    rag: RAG | None = None  # with an index only
    context: int | None = None  # the model's context length in tokens, when it has one
    scheduler: GenerationScheduler | None = None  # continuous batching; started and stopped by the lifespan
    lock: ModelLock = field(default_factory=ModelLock)  # one forward pass at a time: embedding chunk or decode step

    @classmethod
    def build(cls, encoder: Encoder, config: ServerConfig, index: VectorIndex | None = None) -> ServerState:
        lock = ModelLock()
        batcher = DynamicBatcher(
            functools.partial(_embed_chunk, encoder, lock),
            config.batch_max_texts,
            config.batch_wait_ms,
            chunk_tokens=config.embed_chunk_tokens,
            size=lambda item: len(item.ids),
            on_idle=release_free_memory,
        )
        lock.run(warm_up, encoder.model, encoder.precision)  # bf16: pack the decode weights now, on the model's thread
        scheduler = None
        running = config.max_concurrent_generations
        if config.continuous_batching:
            scheduler = GenerationScheduler(
                encoder.model, encoder.precision, config.max_batch_generations, lock, config.embed_chunk_tokens
            )
            running = config.max_batch_generations
        state = cls(
            encoder=encoder,
            config=config,
            batcher=batcher,
            slots=GenerationSlots(running, config.max_queued_generations),
            embedding_tokenizer=copy.deepcopy(encoder.tokenizer),
            index=index,
            rag=RAG(encoder, index) if index is not None else None,
            context=getattr(encoder.model.config, "max_position_embeddings", None),
            scheduler=scheduler,
            lock=lock,
        )
        state.embedding_inputs(["warm up"])  # sets the copy's truncation before threads share it
        return state

    def embedding_inputs(self, texts: list[str], input_type: str | None = None) -> list[PooledInput]:
        """Model inputs of ``texts`` for the batcher (call it in a worker thread: a few MB of text takes seconds).

        With ``on_too_long='error'`` they are built for ``max_length + 2`` tokens: an input longer than
        ``max_length`` comes out longer than that (the route refuses it), and every other input is exactly what
        ``max_length`` gives (truncation is the only effect of the length on every pooling). Two, not one: echo
        halves its budget between the two copies, so one more token may not lengthen a truncated echo input.

        The tokenizer is the encoder's, copied once, and always called with the same truncation setting:
        a Hugging Face fast tokenizer rewrites its Rust state when the setting changes, which fails ("Already
        borrowed") while another thread is tokenizing with it, and prompts are tokenized in other threads.
        """
        error = self.config.on_too_long == "error"
        length = self.encoder.max_length + 2 if error else self.encoder.max_length
        spec = self.encoder.spec
        prompt = spec.prompt_map.get(input_type, "") if input_type else ""  # no such prompt: the texts as they are
        return spec.build_inputs(self.embedding_tokenizer, texts, length, prompt=prompt)

    @property
    def decode(self) -> Callable[..., Iterator[int]]:
        """The token source of every generation (``generate_stream``'s ``decode``): the scheduler's with
        continuous batching, else :func:`~unimae.generation.decoding.decode_tokens` in the generation's own thread."""
        return self.scheduler.decode if self.scheduler is not None else decode_tokens

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
        Without ``max_tokens`` the default answer length shrinks to the context left (as OpenAI and vLLM do)."""
        max_tokens = self.token_budget(body.max_tokens, default_tokens)
        if body.max_tokens is None and self.context is not None:
            if prompt_tokens >= self.context:
                raise APIError(400, f"the prompt ({prompt_tokens} tokens) fills the context of {self.context}")
            max_tokens = min(max_tokens, self.context - prompt_tokens)
        if self.context is not None and prompt_tokens + max_tokens > self.context:
            raise APIError(
                400,
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context of {self.context}",
                "max_tokens",
            )
        return GenerationParams(
            max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, stop=body.stop, seed=body.seed
        )


def _embed_chunk(encoder: Encoder, lock: ModelLock, inputs: list[PooledInput]) -> np.ndarray:
    """One chunk of the batcher -> (N, D) unit rows, in ONE forward pass (its token budget is per pass), with
    the model to itself: between two decode steps of the generation scheduler."""
    return lock.run(encoder.encode_inputs, inputs, batch_size=len(inputs), normalize=True, show_progress=False)


async def get_state(request: Request) -> ServerState:
    """FastAPI dependency: the app's :class:`ServerState` (async, so it runs on the loop, not in a thread)."""
    return request.app.state.server


StateDep = Annotated[ServerState, Depends(get_state)]
