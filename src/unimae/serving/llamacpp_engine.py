"""``unimae serve --engine llama.cpp``: unimae's OpenAI routes served by ONE llama.cpp model (an exported GGUF).

:class:`LlamaCppModel` loads the file in llama.cpp in-process (the ``xllamacpp`` wheel's ``Server``) with
embeddings on and last-token pooling, so the same weights embed and generate. Embeddings follow unimae's
EOS rule exactly: texts are tokenized with the model's own tokenizer (read from the GGUF by transformers, as
``unimae.models`` does), truncated to ``max_length - 1`` tokens, and the EOS id is appended; llama.cpp gets
token ids and pools the last one. Completions and chat go to llama.cpp's own OpenAI handlers (its sampler,
the GGUF's chat template); ``top_k`` and ``min_p`` are turned off so temperature and top_p mean what they
mean in unimae's engine.

:func:`create_llamacpp_app` builds the routes: ``POST /v1/embeddings``, ``/v1/completions``,
``/v1/chat/completions`` (SSE streaming), ``/v1/rag`` (with an index built from the same adapter),
``GET /v1/models``, ``GET /health``, behind the same API-key and body-size guard as ``unimae serve``.
RAG embeds the query (``query + EOS``) and starts the prompt with those ids; llama.cpp's prompt cache
reuses the query's KV when the same slot serves both, which ``usage.cached_prompt_tokens`` reports.

llama.cpp also opens its own HTTP port on 127.0.0.1 inside the process; it is given a random API key
so only this process can use it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from unimae.embedding.spec import with_prompt
from unimae.embedding.tokenization import encode_with_eos
from unimae.embedding.vectors import finish_embeddings
from unimae.export.gguf import KEY_PREFIX
from unimae.retrieval.index import Hit, VectorIndex
from unimae.retrieval.rag import RAGAnswer, passages_json, prompt_tail
from unimae.serving.config import ServerConfig
from unimae.serving.guard import RequestGuard
from unimae.serving.schemas import (
    APIError,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    RAGRequest,
    check_dimensions,
    embeddings_body,
    models_body,
    parse_body,
)
from unimae.serving.sse import sse_frame

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


class LlamaCppModel:
    """An exported GGUF in llama.cpp: unimae ``eos`` embeddings and generation from the same weights.

    ``threads``: CPU threads (default: all cores; on a machine shared with other jobs use fewer, since
    llama.cpp's threads spin at every barrier). ``parallel``: requests decoded together (llama.cpp slots),
    each with ``context`` tokens.
    """

    def __init__(
        self,
        gguf: str | Path,
        max_length: int = 512,
        threads: int | None = None,
        parallel: int = 4,
        context: int = 2048,
    ):
        try:
            import xllamacpp
        except ImportError as err:
            raise ImportError("the llama.cpp engine needs xllamacpp: pip install 'unimae[llamacpp]'") from err
        self.path = Path(gguf)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"GGUF file {self.path} does not exist; write one with `unimae export --format gguf`"
            )
        if max_length < 2 or max_length > context:
            raise ValueError(f"max_length must be in [2, context={context}], got {max_length}")
        self.metadata = gguf_metadata(self.path)
        arch = self.metadata["general.architecture"]
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
        self.context = min(context, int(self.metadata.get(f"{arch}.context_length", context)))  # tokens per request
        params = xllamacpp.CommonParams()
        params.model.path = str(self.path)
        params.embedding = True
        params.pooling_type = xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_LAST
        params.n_parallel = parallel
        params.kv_unified = True
        params.n_ctx = parallel * context
        params.n_batch = params.n_ubatch = context  # an embedding input must fit in one micro-batch
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads or os.cpu_count() or 1
        params.api_keys = [secrets.token_hex(16)]  # llama.cpp's own HTTP port: usable by this process only
        params.verbosity = 0
        self.server = xllamacpp.Server(params)

    @property
    def name(self) -> str:
        return self.path.stem

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

    def complete(self, request: dict, on_chunk: Callable[[dict], bool] | None = None) -> dict | None:
        """llama.cpp's /v1/completions; with ``on_chunk`` it streams (return True from it to stop)."""
        return _call(self.server.handle_completions, request, on_chunk)

    def chat(self, request: dict, on_chunk: Callable[[dict], bool] | None = None) -> dict | None:
        """llama.cpp's /v1/chat/completions (the GGUF's chat template); streams like :meth:`complete`."""
        return _call(self.server.handle_chat_completions, request, on_chunk)


def _call(handler, request: dict, on_chunk) -> dict | None:
    return _check(handler(request)) if on_chunk is None else handler(request, on_chunk)


def _check(reply):
    """llama.cpp's reply, or an APIError with its message and status."""
    if isinstance(reply, dict) and "error" in reply:
        error = reply["error"]
        status = int(error.get("code", 500)) if str(error.get("code", "")).isdigit() else 500
        raise APIError(status if 400 <= status < 600 else 500, str(error.get("message", error)))
    return reply


class LlamaCppState:
    """What the routes share: the model, the settings and the index (optional)."""

    def __init__(self, model: LlamaCppModel, config: ServerConfig, index: VectorIndex | None):
        self.model, self.config, self.index = model, config, index
        if index is not None:
            check_index(model, index)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            served = self.config.model_name
            raise APIError(404, f"model {name!r} is not served here; use {served!r}", "model", "model_not_found")

    def sampling(self, body, default_tokens: int) -> dict:
        """The sampling fields of an OpenAI request for llama.cpp (only temperature and top_p act)."""
        tokens = body.max_tokens or default_tokens
        if tokens > self.config.max_new_tokens:
            raise APIError(400, f"max_tokens {tokens} is over this server's limit of {self.config.max_new_tokens}")
        request = {"max_tokens": tokens, "temperature": body.temperature, "top_p": body.top_p, "top_k": 0}
        request.update({"min_p": 0.0, "stop": body.stop, "stream": body.stream})
        return request | ({"seed": body.seed} if body.seed is not None else {})


def check_index(model: LlamaCppModel, index: VectorIndex) -> None:
    """ValueError unless ``index`` was embedded by the model and adapter this GGUF was exported from."""
    manifest, meta = index.manifest, model.metadata
    if not index.spec.is_last_token:
        raise ValueError(f"the index was built with {index.spec.describe()}; a GGUF model embeds with eos pooling")
    if index.dim > model.embedding_dim:
        raise ValueError(f"index dimension {index.dim} > model dimension {model.embedding_dim}")
    built, exported = manifest.get("adapter_revision", "base"), meta.get(f"{KEY_PREFIX}adapter_revision")
    if exported is not None and built != exported:
        raise ValueError(
            f"the index was built with adapter revision {built} but {model.path} was exported from revision "
            f"{exported}; export the adapter the index was built with, or rebuild the index"
        )
    if manifest["max_length"] > model.context:
        raise ValueError(
            f"the index embeds up to {manifest['max_length']} tokens, over the {model.context} per request"
        )
    model.max_length = manifest["max_length"]


def create_llamacpp_app(model: LlamaCppModel, config: ServerConfig, index: VectorIndex | None = None) -> FastAPI:
    """The OpenAI-compatible app of ``unimae serve --engine llama.cpp`` over ``model``."""
    app = FastAPI(title="unimae (llama.cpp)")
    state = LlamaCppState(model, config, index)
    app.state.llamacpp = model

    @app.get("/health")
    async def health() -> dict:
        passages = len(index) if index is not None else None
        return {"status": "ok", "model": config.model_name, "engine": "llama.cpp", "index_passages": passages}

    @app.get("/v1/models")
    async def models() -> dict:
        return models_body(config.model_name)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict:
        body, ids = await run_in_threadpool(_embedding_inputs, state, await request.body())
        vectors = finish_embeddings(await run_in_threadpool(model.embed_ids, ids), body.dimensions, normalize=True)
        return embeddings_body(config.model_name, vectors, body.encoding_format, sum(map(len, ids)))

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> dict | StreamingResponse:
        body = parse_body(await request.body(), CompletionRequest)
        state.check_model(body.model)
        return await _generate(model.complete, {"prompt": body.prompt, **state.sampling(body, 16)}, config.model_name)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> dict | StreamingResponse:
        body = parse_body(await request.body(), ChatRequest)
        state.check_model(body.model)
        messages = [m.as_template_message() for m in body.messages]
        sampling = state.sampling(body, config.default_chat_tokens)
        return await _generate(model.chat, {"messages": messages, **sampling}, config.model_name)

    @app.post("/v1/rag", response_model=None)
    async def rag(request: Request) -> dict | StreamingResponse:
        body = parse_body(await request.body(), RAGRequest)
        if index is None:
            raise APIError(404, "no index is loaded; start the server with --index DIR", code="no_index")
        tokens = body.max_tokens or config.default_chat_tokens
        if tokens > config.max_new_tokens:
            raise APIError(400, f"max_tokens {tokens} is over this server's limit of {config.max_new_tokens}")
        query_ids, hits, prompt = await run_in_threadpool(_rag_prompt, state, body.query, body.k)
        if len(prompt) + tokens > model.context:
            raise APIError(400, f"the prompt ({len(prompt)} tokens) and {tokens} new tokens exceed the context")
        request_body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": body.stream}
        if body.stream:
            return StreamingResponse(
                _rag_events(model, request_body, hits, config.model_name), media_type="text/event-stream"
            )
        reply = await run_in_threadpool(model.complete, request_body)
        return _rag_answer(reply, hits).to_json(config.model_name)

    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    app.add_middleware(RequestGuard, limit=config.max_body_bytes, api_key=config.api_key)
    return app


def _embedding_inputs(state: LlamaCppState, raw: bytes) -> tuple[EmbeddingRequest, list[list[int]]]:
    body = parse_body(raw, EmbeddingRequest)
    state.check_model(body.model)
    model, config = state.model, state.config
    if len(body.input) > config.max_inputs:
        raise APIError(400, f"{len(body.input)} inputs; this server takes at most {config.max_inputs}", "input")
    check_dimensions(body.dimensions, model.embedding_dim, model.matryoshka_dims)
    for i, text in enumerate(body.input):
        if not text.strip():
            raise APIError(400, f"input[{i}] is empty", "input")
    error = config.on_too_long == "error"
    ids = model.embedding_ids(body.input, model.max_length + 1 if error else model.max_length, body.input_type)
    for i, row in enumerate(ids):
        if len(row) > model.max_length:
            raise APIError(400, f"input[{i}] is over this server's limit of {model.max_length} tokens", "input")
    return body, ids


def _rag_prompt(state: LlamaCppState, query: str, k: int):
    """(query ids = query + EOS, hits, prompt ids): the prompt starts with the embedding pass's ids."""
    model = state.model
    query_ids = model.embedding_ids([query], input_type="query")[0]
    dims = state.index.dim if state.index.dim < model.embedding_dim else None
    hits = state.index.search(finish_embeddings(model.embed_ids([query_ids]), dims, normalize=True), k)[0]
    return query_ids, hits, query_ids + prompt_tail(model.tokenizer, query, hits)


def _rag_answer(reply: dict, hits: list[Hit]) -> RAGAnswer:
    """A llama.cpp completion reply as unimae's RAG answer (usage from its OpenAI-style ``usage``)."""
    choice, usage = reply["choices"][0], reply.get("usage", {})
    return RAGAnswer(
        text=choice["text"],
        hits=hits,
        prompt_tokens=usage.get("prompt_tokens"),
        cached_tokens=usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        completion_tokens=usage.get("completion_tokens"),
        finish_reason=choice.get("finish_reason"),
    )


async def _generate(handler: Callable, request: dict, name: str) -> dict | StreamingResponse:
    if not request["stream"]:
        reply = await run_in_threadpool(handler, request)
        return {**reply, "model": name}

    def rename(chunk: dict) -> dict:
        return {**chunk, "model": name} if isinstance(chunk, dict) and "choices" in chunk else chunk

    return StreamingResponse(_stream(handler, request, rename), media_type="text/event-stream")


async def _stream(handler: Callable, request: dict, render: Callable[[dict], dict]) -> AsyncIterator[bytes]:
    """SSE frames of a streamed llama.cpp call run in a worker thread; a client that leaves stops it."""
    loop, queue, stop = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
    done = object()

    def on_chunk(chunk) -> bool:
        chunk = json.loads(chunk) if isinstance(chunk, (str, bytes)) else chunk
        loop.call_soon_threadsafe(queue.put_nowait, chunk)
        return stop.is_set()

    def run() -> None:
        try:
            handler(request, on_chunk)
        except Exception as err:  # the 200 is already sent: report in the stream
            logger.exception("llama.cpp generation failed mid-stream")
            loop.call_soon_threadsafe(queue.put_nowait, APIError(500, f"generation failed: {err}").body())
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, done)

    worker = loop.run_in_executor(None, run)
    try:
        while (chunk := await queue.get()) is not done:
            if chunk != "[DONE]":
                yield sse_frame(render(chunk))
        yield sse_frame("[DONE]")
    finally:
        stop.set()
        await asyncio.shield(worker)


async def _rag_events(model: LlamaCppModel, request: dict, hits: list[Hit], name: str) -> AsyncIterator[bytes]:
    """``rag.passages``, ``rag.delta`` text pieces, then ``rag.answer`` (as unimae's engine streams RAG)."""
    yield sse_frame({"object": "rag.passages", "passages": passages_json(hits)})
    text, last = [], {}

    def delta(chunk: dict) -> dict:
        if "choices" not in chunk:
            return chunk
        piece = chunk["choices"][0].get("text") or ""
        text.append(piece)
        last.update(chunk)
        return {"object": "rag.delta", "text": piece}

    async for frame in _stream(model.complete, request, delta):
        if frame == sse_frame("[DONE]"):
            reply = {**last, "choices": [{**last.get("choices", [{}])[0], "text": "".join(text)}]}
            yield sse_frame(_rag_answer(reply, hits).to_json(name))
        yield frame


async def _api_error(request: Request, err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(APIError(err.status_code, str(err.detail)).body(), status_code=err.status_code)


async def _unexpected_error(request: Request, err: Exception) -> JSONResponse:
    logger.exception("internal error on %s", request.url.path)
    return JSONResponse(APIError(500, f"internal error: {type(err).__name__}").body(), status_code=500)
