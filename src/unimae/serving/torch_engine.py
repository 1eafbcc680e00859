"""The PyTorch engine of the server: an :class:`~unimae.encoder.Encoder` behind the :class:`Engine` routes.

The embedding batcher and the generation scheduler take turns on the model through one FIFO
:class:`ModelLock`: the batcher holds it for one chunk (one forward pass), the scheduler for one prefill or
one decode step, so embedding chunks run between decode steps and neither starves the other. With
``--no-continuous-batching`` each generation decodes on its own thread, without the lock.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import threading
from collections.abc import Iterator

import numpy as np

from unimae.embedding.pooling import PooledInput
from unimae.encoder import Encoder
from unimae.generation.decoding import decode_tokens, warm_up
from unimae.generation.sampling import GenerationParams
from unimae.generation.stream import GenerationResult, generate_stream
from unimae.retrieval.index import Hit, VectorIndex
from unimae.retrieval.rag import RAG, RAGAnswer, RAGPrompt
from unimae.runtime.memory import release_free_memory
from unimae.serving.batcher import DynamicBatcher
from unimae.serving.config import ServerConfig
from unimae.serving.model_lock import ModelLock
from unimae.serving.scheduler import GenerationScheduler, TokenSource


class TorchEngine:
    """The encoder, its embedding batcher, the generation scheduler (continuous batching) and the model lock."""

    kind = "torch"

    def __init__(self, encoder: Encoder, config: ServerConfig, index: VectorIndex | None = None):
        self.encoder, self.config = encoder, config
        self.lock = ModelLock()  # one forward pass at a time: embedding chunk or decode step
        self.batcher = DynamicBatcher(  # started and stopped by the app's lifespan
            functools.partial(_embed_chunk, encoder, self.lock),
            config.batch_max_texts,
            config.batch_wait_ms,
            chunk_tokens=config.embed_chunk_tokens,
            size=lambda item: len(item.ids),
            on_idle=release_free_memory,
        )
        self.lock.run(warm_up, encoder.model, encoder.precision)  # bf16: pack the decode weights now, on its thread
        self.scheduler = None  # continuous batching; started and stopped by the lifespan
        if config.continuous_batching:
            self.scheduler = GenerationScheduler(
                encoder.model, encoder.precision, config.max_batch_generations, self.lock, config.embed_chunk_tokens
            )
        self.embedding_tokenizer = copy.deepcopy(encoder.tokenizer)  # see embedding_inputs
        self.rag = RAG(encoder, index) if index is not None else None
        self.has_index = index is not None
        self.context = encoder.context
        self.embedding_dim, self.max_length = encoder.embedding_dim, encoder.max_length
        self.matryoshka_dims, self.rotation = encoder.spec.matryoshka_dims, encoder.rotation
        self.embedding_inputs(["warm up"], None, config.on_too_long == "error")  # truncation set before threads

    def start(self) -> None:
        self.batcher.start()
        if self.scheduler is not None:
            self.scheduler.start()

    async def stop(self) -> None:
        await self.batcher.stop()
        if self.scheduler is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.scheduler.stop)  # waits for its step

    def snapshot(self) -> dict:
        generations = self.scheduler.snapshot() if self.scheduler is not None else None  # steps, batch sizes
        return {"embeddings": self.batcher.snapshot(), "generations": generations}

    @property
    def decode(self) -> TokenSource:
        """The token source of every generation (``generate_stream``'s ``decode``): the scheduler's with
        continuous batching, else :func:`~unimae.generation.decoding.decode_tokens` in the generation's thread."""
        return self.scheduler.decode if self.scheduler is not None else decode_tokens

    def embedding_inputs(self, texts: list[str], input_type: str | None, over: bool) -> list[PooledInput]:
        """Model inputs of ``texts`` for the batcher (call it in a worker thread: a few MB of text takes seconds).

        ``over`` (``on_too_long='error'``): built for ``max_length + 2`` tokens: an input longer than
        ``max_length`` comes out longer than that (the route refuses it), and every other input is exactly what
        ``max_length`` gives (truncation is the only effect of the length on every pooling), and no truncation
        warning is emitted (the route refuses those inputs itself). Two, not one: echo
        halves its budget between the two copies, so one more token may not lengthen a truncated echo input.

        The tokenizer is the encoder's, copied once, and always called with the same truncation setting (the
        server passes the same ``over``): a Hugging Face fast tokenizer rewrites its Rust state when the setting
        changes, which fails ("Already borrowed") while another thread is tokenizing with it.
        """
        length = self.max_length + 2 if over else self.max_length
        spec = self.encoder.spec
        prompt = spec.prompt_map.get(input_type, "") if input_type else ""  # no such prompt: the texts as they are
        return spec.build_inputs(self.embedding_tokenizer, texts, length, prompt=prompt, warn=not over)

    async def embed(self, inputs: list[PooledInput]) -> np.ndarray:
        return await self.batcher.submit(inputs)  # (N, D) unit rows

    def prompt_ids(self, prompt: str | list[dict]) -> list[int]:
        return self.encoder.prompt_ids(prompt, limit=self.context)

    def generate(
        self, ids: list[int], params: GenerationParams, cancel: threading.Event
    ) -> Iterator[str | GenerationResult]:
        encoder = self.encoder
        return generate_stream(
            encoder.model,
            encoder.tokenizer,
            ids,
            params,
            precision=encoder.precision,
            cancel=cancel,
            decode=self.decode,
        )

    def rag_prepare(self, query: str, params: GenerationParams, k: int | None, reuse_kv: bool) -> RAGPrompt:
        return self.rag.prepare(query, params, k=k, reuse_kv=reuse_kv, on_model=self.lock.run)

    def rag_stream(
        self, query: str, prompt: RAGPrompt, params: GenerationParams, cancel: threading.Event
    ) -> Iterator[list[Hit] | str | RAGAnswer]:
        return self.rag.stream(query, params=params, cancel=cancel, decode=self.decode, prompt=prompt)


def _embed_chunk(encoder: Encoder, lock: ModelLock, inputs: list[PooledInput]) -> np.ndarray:
    """One chunk of the batcher -> (N, D) unit rows, in ONE forward pass (its token budget is per pass), with
    the model to itself: between two decode steps of the generation scheduler."""
    return lock.run(encoder.encode_inputs, inputs, batch_size=len(inputs), normalize=True, show_progress=False)
