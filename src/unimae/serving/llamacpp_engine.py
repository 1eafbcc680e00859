"""``unimae serve --engine llama.cpp``: unimae's routes served by ONE llama.cpp model (an exported GGUF).

:class:`LlamaCppModel` loads the file in llama.cpp in-process (the ``xllamacpp`` wheel's ``Server``) with
embeddings on and last-token pooling, so the same weights embed and generate. Embeddings follow unimae's
EOS rule exactly: texts are tokenized with the model's own tokenizer (read from the GGUF by transformers, as
``unimae.models`` does), truncated to ``max_length - 1`` tokens, and the EOS id is appended; llama.cpp gets
token ids and pools the last one. Generations send llama.cpp the prompt's token ids (chat through the GGUF's
chat template, as transformers reads it) and stream its text back; ``top_k`` and ``min_p`` are turned off so
temperature and top_p mean what they mean in unimae's engine.

:class:`LlamaCppEngine` is the model behind the SAME routes, state, limits (429s) and disconnect handling as
the PyTorch engine (:mod:`unimae.serving.engine`): embeddings go through the same token-budgeted batcher,
generations hold the same slots, and a client that leaves stops its generation at llama.cpp's next token.
RAG embeds the query (``query + EOS``) and starts the prompt with those ids; llama.cpp's prompt cache
reuses the query's KV when the same slot serves both, which ``usage.cached_prompt_tokens`` reports.

llama.cpp also opens its own HTTP port on 127.0.0.1 inside the process; it is given a random API key
so only this process can use it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from queue import SimpleQueue

import numpy as np
from fastapi import FastAPI

from unimae.embedding.pooling import PooledInput
from unimae.embedding.spec import with_prompt
from unimae.embedding.tokenization import encode_with_eos
from unimae.embedding.vectors import finish_embeddings
from unimae.export.gguf import KEY_PREFIX
from unimae.generation.prompt import check_fits, prompt_ids
from unimae.generation.sampling import GenerationParams
from unimae.generation.stream import GenerationResult
from unimae.retrieval.index import Hit, VectorIndex
from unimae.retrieval.rag import RAGAnswer, RAGPrompt, prompt_tail
from unimae.serving.app import create_app
from unimae.serving.batcher import DynamicBatcher
from unimae.serving.config import ServerConfig, model_id
from unimae.serving.schemas import APIError

logger = logging.getLogger(__name__)


def gguf_metadata(path: str | Path) -> dict:
    """The scalar (string/number/bool) metadata of a GGUF file, by key."""
    from gguf import GGUFReader, GGUFValueType

    fields = GGUFReader(path).fields.values()
    return {f.name: f.contents() for f in fields if f.types and f.types[0] != GGUFValueType.ARRAY}


def gguf_tokenizer(path: Path):
    """The Hugging Face tokenizer stored in a GGUF (transformers reads it, as for unimae's offline models)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


DEFAULT_CONTEXT = 2048  # tokens per request when --context is not given (the GGUF's trained context if smaller)


def resolve_context(requested: int | None, trained: int | None, path: Path) -> int:
    """Tokens per request of the llama.cpp engine: ``requested`` (``--context``), or :data:`DEFAULT_CONTEXT`
    capped at the GGUF's ``trained`` context (``{arch}.context_length``; None when the file has none).
    ValueError for a value below 1 or over the trained context: llama.cpp would otherwise run positions the
    model never saw (or fail deep inside)."""
    if requested is None:
        return min(DEFAULT_CONTEXT, trained) if trained else DEFAULT_CONTEXT
    if requested < 1:
        raise ValueError(f"--context must be at least 1 token, got {requested}")
    if trained and requested > trained:
        raise ValueError(
            f"--context {requested} is over the {trained} tokens {path} was trained for (its context_length); "
            f"pass --context {trained} or less"
        )
    return requested


class LlamaCppModel:
    """An exported GGUF in llama.cpp: unimae ``eos`` embeddings and generation from the same weights.

    ``threads``: CPU threads (default: all cores; on a machine shared with other jobs use fewer, since
    llama.cpp's threads spin at every barrier). ``parallel``: requests decoded together (llama.cpp slots).
    ``context``: tokens per request (see :func:`resolve_context`): a generation's prompt plus its new tokens,
    and the longest embedding input (``max_length``); llama.cpp gets one KV cache of ``parallel * context``
    tokens shared by the slots, and micro-batches of ``context`` tokens.
    """

    def __init__(
        self,
        gguf: str | Path,
        max_length: int = 512,
        threads: int | None = None,
        parallel: int = 4,
        context: int | None = None,
    ):
        self.path = Path(gguf)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"GGUF file {self.path} does not exist; write one with `unimae export --format gguf`"
            )
        self.metadata = gguf_metadata(self.path)
        arch = self.metadata.get("general.architecture")
        if self.metadata.get("general.type") == "adapter" or f"{arch}.embedding_length" not in self.metadata:
            raise ValueError(
                f"{self.path} is not a model GGUF (a LoRA adapter GGUF, or no {arch}.embedding_length): serve the "
                "merged model (`unimae export --format gguf`), or the adapter on its base in llama-server --lora"
            )
        trained = self.metadata.get(f"{arch}.context_length")
        self.context = resolve_context(context, None if trained is None else int(trained), self.path)
        if not 2 <= max_length <= self.context:
            raise ValueError(
                f"max_length (--max-length) must be in [2, context={self.context}], got {max_length}: an embedding "
                "input is one request; lower --max-length or raise --context"
            )
        try:
            import xllamacpp
        except ImportError as err:
            raise ImportError("the llama.cpp engine needs xllamacpp: pip install 'unimae[llamacpp]'") from err
        if f"{KEY_PREFIX}embedding.pooling" not in self.metadata:
            logger.warning("%s was not written by `unimae export --format gguf`; assuming the EOS rule", self.path)
        self.tokenizer = gguf_tokenizer(self.path)
        self.eos_id = int(self.metadata.get(f"{KEY_PREFIX}embedding.eos_token_id", self.tokenizer.eos_token_id))
        self.max_length = max_length
        self.embedding_dim = int(self.metadata[f"{arch}.embedding_length"])
        prefix = f"{KEY_PREFIX}embedding.prompt."
        self.prompts = {k.removeprefix(prefix): str(v) for k, v in self.metadata.items() if k.startswith(prefix)}
        dims = str(self.metadata.get(f"{KEY_PREFIX}embedding.matryoshka_dims", ""))
        self.matryoshka_dims = tuple(int(d) for d in dims.split(",") if d)
        params = xllamacpp.CommonParams()
        params.model.path = str(self.path)
        params.embedding = True
        params.pooling_type = xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_LAST
        params.n_parallel = parallel
        params.kv_unified = True
        params.n_ctx = parallel * self.context  # one KV pool: every slot can hold a full request at once
        params.n_batch = params.n_ubatch = self.context  # an embedding input must fit in one micro-batch
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads or os.cpu_count() or 1
        params.api_keys = [secrets.token_hex(16)]  # llama.cpp's own HTTP port: usable by this process only
        params.verbosity = 0
        self.server = xllamacpp.Server(params)

    @property
    def name(self) -> str:
        """The served model id: that of the model it was exported from (see :func:`model_id`), else its stem."""
        source = self.metadata.get(f"{KEY_PREFIX}base_model")
        return model_id(str(source)) if source else self.path.stem

    def prompt_ids(self, prompt: str | list[dict], limit: int | None = None) -> list[int]:
        """Token ids of a prompt: plain text, or a message list through the GGUF's chat template. ``limit``:
        tokenize no further than needed to know the prompt has more than ``limit`` tokens (see
        :func:`unimae.generation.prompt.prompt_ids`)."""
        return prompt_ids(self.tokenizer, prompt, limit)

    def embedding_ids(
        self, texts: list[str], max_length: int | None = None, input_type: str | None = None
    ) -> list[list[int]]:
        """unimae's ids: the tokenizer's (BOS as it adds it) of the prompt of ``input_type`` (if the export has
        one) + text, truncated to ``max_length - 1``, then EOS."""
        texts = with_prompt(texts, self.prompts.get(input_type, "") if input_type else "")
        ids = encode_with_eos(self.tokenizer, texts, max_length or self.max_length, warn=False)
        return [row[:-1] + [self.eos_id] for row in ids]

    def embed_ids(self, ids: list[list[int]]) -> np.ndarray:
        """(N, D) unit-length embeddings of token-id lists (last token pooled)."""
        data = _check(self.server.handle_embeddings({"input": ids}))["data"]
        return np.array([row["embedding"] for row in sorted(data, key=lambda r: r["index"])], dtype=np.float32)

    def encode(self, texts: list[str]) -> np.ndarray:
        """(N, D) unit-length ``eos`` embeddings of ``texts``, as ``Encoder.encode(texts, normalize=True)``."""
        return self.embed_ids(self.embedding_ids(texts))

    def complete(self, request: dict, on_chunk: Callable[[dict], bool]) -> None:
        """llama.cpp's /v1/completions, streamed: ``on_chunk`` gets each chunk (return True from it to stop)."""
        self.server.handle_completions(request, on_chunk)


def _check(reply):
    """llama.cpp's reply, or an APIError with its message and status."""
    if isinstance(reply, dict) and "error" in reply:
        error = reply["error"]
        status = int(error.get("code", 500)) if str(error.get("code", "")).isdigit() else 500
        raise APIError(status if 400 <= status < 600 else 500, str(error.get("message", error)))
    return reply


def check_index(model: LlamaCppModel, index: VectorIndex) -> None:
    """ValueError unless ``index`` was embedded by the model and adapter this GGUF was exported from."""
    manifest, meta = index.manifest, model.metadata
    if not index.spec.is_last_token:
        raise ValueError(f"the index was built with {index.spec.describe()}; a GGUF model embeds with eos pooling")
    if index.dim > model.embedding_dim:
        raise ValueError(f"index dimension {index.dim} > model dimension {model.embedding_dim}")
    if index.spec.rotation and index.dim < model.embedding_dim:
        raise ValueError(
            f"the index holds {index.dim} rotated coordinates (the adapter's Matryoshka rotation), which a GGUF "
            "cannot compute: serve it with --engine torch, or index at the full size"
        )
    built, exported = manifest.get("adapter_revision", "base"), meta.get(f"{KEY_PREFIX}adapter_revision")
    base = meta.get(f"{KEY_PREFIX}base_model")
    if exported is None or base is None or base != manifest.get("model"):
        logger.warning(
            "cannot check that %s embeds as the index was built (GGUF base model %s, index model %s): queries "
            "embedded by another model do not match its passages (fine only if both name the same weights)",
            model.path,
            base or "not recorded",
            manifest.get("model"),
        )
    if exported is not None and built != exported:
        raise ValueError(
            f"the index was built with adapter revision {built} but {model.path} was exported from revision "
            f"{exported}; export the adapter the index was built with, or rebuild the index"
        )
    if manifest["max_length"] > model.context:
        raise ValueError(
            f"the index embeds up to {manifest['max_length']} tokens, over the {model.context} per request; "
            "raise --context (at most the GGUF's trained context)"
        )
    model.max_length = manifest["max_length"]


def create_llamacpp_app(model: LlamaCppModel, config: ServerConfig, index: VectorIndex | None = None) -> FastAPI:
    """The OpenAI-compatible app of ``unimae serve --engine llama.cpp`` over ``model``: unimae's routes over a
    :class:`LlamaCppEngine`."""
    app = create_app(LlamaCppEngine(model, config, index), config, index)
    app.state.llamacpp = model
    return app


@dataclass
class LlamaCppStats:
    """Generation counters since start (``/health`` reports them)."""

    requests: int = 0  # started
    finished: int = 0  # ended at EOS, a stop string or max_tokens
    cancelled: int = 0  # the client left
    failed: int = 0  # ended by an error
    tokens: int = 0  # new tokens produced


class LlamaCppEngine:
    """A :class:`LlamaCppModel` behind the server's routes (:class:`~unimae.serving.engine.Engine`)."""

    kind = "llama.cpp"

    def __init__(self, model: LlamaCppModel, config: ServerConfig, index: VectorIndex | None = None):
        if index is not None:
            check_index(model, index)
        self.model, self.config, self.index = model, config, index
        self.has_index = index is not None
        self.embedding_dim, self.matryoshka_dims = model.embedding_dim, model.matryoshka_dims
        self.rotation = None  # a GGUF carries none (its export names no Matryoshka sizes for a rotated adapter)
        self.context = model.context
        self.batcher = DynamicBatcher(  # started and stopped by the app's lifespan
            self._embed_chunk,
            config.batch_max_texts,
            config.batch_wait_ms,
            chunk_tokens=config.embed_chunk_tokens,
            size=lambda item: len(item.ids),
        )
        self.stats = LlamaCppStats()

    @property
    def max_length(self) -> int:
        return self.model.max_length  # the index's, once check_index has run

    def start(self) -> None:
        self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()

    def snapshot(self) -> dict:
        return {"embeddings": self.batcher.snapshot(), "generations": asdict(self.stats)}

    def embedding_inputs(self, texts: list[str], input_type: str | None, over: bool) -> list[PooledInput]:
        """unimae's EOS rule (see :meth:`LlamaCppModel.embedding_ids`); ``over``: one token more, so that an input
        over ``max_length`` comes out longer than it."""
        rows = self.model.embedding_ids(texts, self.max_length + 1 if over else self.max_length, input_type)
        return [PooledInput(row, [0] * (len(row) - 1) + [1]) for row in rows]

    def _embed_chunk(self, inputs: list[PooledInput]) -> np.ndarray:
        return self.model.embed_ids([item.ids for item in inputs])  # (N, D) unit rows

    async def embed(self, inputs: list[PooledInput]) -> np.ndarray:
        return await self.batcher.submit(inputs)

    def prompt_ids(self, prompt: str | list[dict]) -> list[int]:
        return self.model.prompt_ids(prompt, limit=self.context)

    def generate(
        self, ids: list[int], params: GenerationParams, cancel: threading.Event
    ) -> Iterator[str | GenerationResult]:
        """llama.cpp's completion of the token ids ``ids``, streamed: text pieces, then the result. ``cancel``
        (or closing the iterator) stops llama.cpp at its next token."""
        request = {
            "prompt": ids,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": 0,
            "min_p": 0.0,
            "stop": list(params.stop),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if params.seed is not None:  # llama.cpp's seed is 32 bits and 0xFFFFFFFF means "random": kept below it
            request["seed"] = params.seed % 0xFFFFFFFF
        return self._stream(request, len(ids), cancel)

    def _stream(self, request: dict, prompt_tokens: int, cancel: threading.Event) -> Iterator[str | GenerationResult]:
        chunks: SimpleQueue = SimpleQueue()
        done = object()

        def on_chunk(chunk) -> bool:
            chunks.put(json.loads(chunk) if isinstance(chunk, (str, bytes)) and chunk != "[DONE]" else chunk)
            return cancel.is_set()

        def run() -> None:
            try:
                self.model.complete(request, on_chunk)
            except Exception as err:  # noqa: BLE001 - handed to the consumer, which raises it
                chunks.put(err)
            finally:
                chunks.put(done)

        self.stats.requests += 1
        worker = threading.Thread(target=run, name="unimae-llamacpp-generation", daemon=True)
        worker.start()
        text, usage, finish = [], {}, None
        try:
            while (chunk := chunks.get()) is not done:
                if isinstance(chunk, Exception):
                    self.stats.failed += 1
                    raise chunk
                if not isinstance(chunk, dict):  # "[DONE]"
                    continue
                _check(chunk)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    finish = choice.get("finish_reason") or finish
                    if choice.get("text"):
                        text.append(choice["text"])
                        yield choice["text"]
        finally:
            stopped_early = cancel.is_set()
            cancel.set()  # llama.cpp stops at its next chunk
        self.stats.cancelled += stopped_early
        self.stats.finished += not stopped_early
        completion = usage.get("completion_tokens", len(text))
        self.stats.tokens += completion
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        prompt = usage.get("prompt_tokens", prompt_tokens)
        yield GenerationResult("".join(text), prompt, completion, finish or "stop", cached)

    def rag_prepare(self, query: str, params: GenerationParams, k: int | None, reuse_kv: bool) -> RAGPrompt:
        """Embed the query (``query + EOS``), retrieve ``k`` passages and build the prompt that starts with the
        query's ids (llama.cpp's prompt cache reuses their KV); ValueError when it leaves no room for the answer."""
        if not query.strip():
            raise ValueError("the question is empty")
        model = self.model
        check_fits(len(model.prompt_ids(query, limit=model.context)), model.context, "the question")
        query_ids = model.embedding_ids([query], input_type="query")[0]
        dims = self.index.dim if self.index.dim < model.embedding_dim else None
        hits = self.index.search(finish_embeddings(model.embed_ids([query_ids]), dims, normalize=True), k or 3)[0]
        prompt = query_ids + prompt_tail(model.tokenizer, query, hits)
        if len(prompt) + params.max_new_tokens > model.context:
            raise ValueError(
                f"the prompt ({len(prompt)} tokens) and {params.max_new_tokens} new tokens exceed the context "
                f"of {model.context} tokens; shorten the question or lower k / max_tokens"
            )
        return RAGPrompt(hits, prompt)

    def rag_stream(
        self, query: str, prompt: RAGPrompt, params: GenerationParams, cancel: threading.Event
    ) -> Iterator[list[Hit] | str | RAGAnswer]:
        """The hits, the answer's text pieces (greedy), then the :class:`RAGAnswer`."""
        yield prompt.hits
        result = None
        for item in self.generate(prompt.ids, GenerationParams(max_new_tokens=params.max_new_tokens), cancel):
            if isinstance(item, GenerationResult):
                result = item
            else:
                yield item
        yield RAGAnswer(
            text=result.text,
            hits=prompt.hits,
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            completion_tokens=result.completion_tokens,
            finish_reason=result.finish_reason,
        )
