"""The model behind the server's routes: one :class:`Engine` protocol, two engines.

The routes (``routes/*.py``), :class:`~unimae.serving.state.ServerState`, the request checks, the generation
slots (429), the error bodies and the disconnect handling are the same for every engine; an engine only
turns token ids into vectors and text:

- :class:`unimae.serving.torch_engine.TorchEngine`: the model in PyTorch (the embedding batcher, the
  continuous-batching generation scheduler and the model lock).
- :class:`unimae.serving.llamacpp_engine.LlamaCppEngine`: an exported GGUF in llama.cpp (the same
  embedding batcher in front of llama.cpp's embeddings; llama.cpp's own slots decode generations together).

Threads: ``embedding_inputs``, ``prompt_ids``, ``rag_prepare`` and the iterators of ``generate`` and
``rag_stream`` run in worker threads (they block); ``embed`` is awaited on the event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Protocol

import numpy as np

from unimae.embedding.pooling import PooledInput
from unimae.generation.sampling import GenerationParams
from unimae.generation.stream import GenerationResult
from unimae.retrieval.index import Hit
from unimae.retrieval.rag import RAGAnswer, RAGPrompt


class Engine(Protocol):
    """What a route needs of the served model. Contracts:

    - ``embedding_inputs(texts, input_type, over)``: unimae's EOS rule (the prompt of ``input_type``, if the
      model has one, + text, cut to ``max_length - 1`` tokens, + EOS). ``over``: build them a little longer,
      so that an input over ``max_length`` comes out longer than it (``--on-too-long error``).
    - ``embed(inputs)``: (N, D) unit rows, in token-budgeted chunks shared with other requests; cancelling the
      awaited call drops the request's chunks not yet run.
    - ``prompt_ids(prompt)``: a text, or a message list through the model's chat template (ValueError if it has
      none), tokenized no further than ``context + 1`` tokens need: a prompt that fits gets exactly its ids, a
      longer one more than ``context`` ids (:func:`unimae.generation.prompt.prompt_ids`).
    - ``generate(ids, params, cancel)``: text pieces, then one :class:`GenerationResult`; stop strings cut.
      Setting ``cancel`` (or closing the iterator) ends the generation within a token.
    - ``rag_prepare`` / ``rag_stream``: /v1/rag (with an index): retrieve and build the prompt (ValueError when
      it does not fit; a question over the context is refused before it is tokenized whole), then the hits, text
      pieces and the :class:`RAGAnswer`.
    """

    kind: str  # "torch" or "llama.cpp": /health reports it
    embedding_dim: int
    matryoshka_dims: tuple[int, ...]
    rotation: np.ndarray | None  # the adapter's Matryoshka rotation (D, D): `dimensions` keeps R[:k] z; None: z[:k]
    max_length: int  # tokens per embedding input, EOS included
    context: int | None  # tokens of a prompt and its answer, when the model has a limit
    has_index: bool

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    def snapshot(self) -> dict: ...

    def embedding_inputs(self, texts: list[str], input_type: str | None, over: bool) -> list[PooledInput]: ...

    async def embed(self, inputs: list[PooledInput]) -> np.ndarray: ...

    def prompt_ids(self, prompt: str | list[dict]) -> list[int]: ...

    def generate(
        self, ids: list[int], params: GenerationParams, cancel: threading.Event
    ) -> Iterator[str | GenerationResult]: ...

    def rag_prepare(self, query: str, params: GenerationParams, k: int | None, reuse_kv: bool) -> RAGPrompt: ...

    def rag_stream(
        self, query: str, prompt: RAGPrompt, params: GenerationParams, cancel: threading.Event
    ) -> Iterator[list[Hit] | str | RAGAnswer]: ...


def run_to_end(items: Iterator) -> object:
    """The last item of ``items`` (a generation's result or a RAG answer), the iterator run to its end."""
    last = None
    for item in items:
        last = item
    if last is None:
        raise RuntimeError("the generation ended without a result")
    return last
