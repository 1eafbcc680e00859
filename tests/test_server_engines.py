"""The server's routes over both engines: the PyTorch engine and the llama.cpp engine (a GGUF exported from the
same tiny random Llama; skipped without xllamacpp). Slots and 429s, ``stream_options.include_usage``, clients
that leave (streamed or not, /v1/rag too), request bodies that stall, and a real client library (langchain)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import httpx
import pytest
from conftest import REQUIRE_EXTRAS, SENTENCES, RecordingTokenizer, serving_in_a_thread

from unimae.embedding.tokenization import char_budget
from unimae.encoder import Encoder
from unimae.generation.stream import GenerationResult
from unimae.retrieval.index import VectorIndex
from unimae.serving.app import create_app
from unimae.serving.config import ServerConfig
from unimae.serving.engine import Engine

ENGINES = ["torch", "llama.cpp"]
WAIT = 60  # seconds: a guard against a hang, never an ordering device


@pytest.fixture(scope="module")
def tiny_sources(tiny_model_dirs, tmp_path_factory):
    """(model dir, its index, its f32 GGUF or None without xllamacpp) of the tiny Llama, made once."""
    model = str(tiny_model_dirs["llama"])
    root = tmp_path_factory.mktemp("engines")
    encoder = Encoder.from_pretrained(model, precision="fp32", max_length=32)
    source = {"model": model, "adapter": None, "adapter_revision": "base"}
    VectorIndex.build(encoder, [(f"p{i}", t) for i, t in enumerate(SENTENCES)], root / "index", source=source)
    gguf = None
    try:
        import xllamacpp  # noqa: F401
    except ImportError:
        if REQUIRE_EXTRAS:
            raise
    else:
        from unimae.export import export

        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("UNIMAE_CACHE", str(root / "cache"))
            gguf = export(model, None, root / "model.gguf", fmt="gguf", gguf_type="f32")
    return model, root / "index", gguf


def _engine(kind: str, sources, config: ServerConfig) -> tuple[Engine, VectorIndex]:
    from unimae.retrieval.disk_index import open_index

    model, index_dir, gguf = sources
    index = open_index(index_dir)
    if kind == "torch":
        from unimae.serving.torch_engine import TorchEngine

        return TorchEngine(Encoder.from_pretrained(model, precision="fp32", max_length=32), config, index), index
    if gguf is None:
        pytest.skip("the llama.cpp engine needs xllamacpp: pip install xllamacpp")
    from unimae.serving.llamacpp_engine import LlamaCppEngine, LlamaCppModel

    return LlamaCppEngine(LlamaCppModel(gguf, max_length=32, threads=1, parallel=2, context=512), config, index), index


def _app(kind: str, sources, **options):
    config = ServerConfig(model_name="tiny", **options)
    engine, index = _engine(kind, sources, config)
    return create_app(engine, config, index)


def test_one_model_id_rule_for_both_engines(tiny_sources, tmp_path):
    from unimae.serving.config import model_id

    model, _, gguf = tiny_sources
    assert model_id("smollm2-135m") == "smollm2-135m" and model_id("HuggingFaceTB/SmolLM2-135M").endswith("135M")
    assert model_id(model) == model.rstrip("/").rsplit("/", 1)[-1]
    if gguf is not None:  # the GGUF's id, read from its metadata as LlamaCppModel does (no llama.cpp server needed)
        from types import SimpleNamespace

        from unimae.serving.llamacpp_engine import LlamaCppModel, gguf_metadata

        loaded = SimpleNamespace(metadata=gguf_metadata(gguf), path=gguf)
        assert LlamaCppModel.name.fget(loaded) == model_id(model)
        assert LlamaCppModel.name.fget(SimpleNamespace(metadata={}, path=tmp_path / "other.gguf")) == "other"


@pytest.mark.parametrize(
    ("kind", "one_at_a_time"),
    [
        ("torch", {"max_batch_generations": 1}),
        ("torch", {"continuous_batching": False, "max_concurrent_generations": 1}),
        ("llama.cpp", {"max_batch_generations": 1}),
    ],
    ids=["torch-batched", "torch-threads", "llama.cpp"],
)
def test_generation_queue_overflow_is_429_even_for_streams(tiny_sources, monkeypatch, kind, one_at_a_time):
    """One generation runs and one waits in the queue's one place: a third, streamed, is refused with 429 at once
    and takes no place; the two accepted then answer what the model answers alone (for the torch engines, what
    ``Encoder.generate`` decodes outside the server)."""
    app = _app(kind, tiny_sources, max_queued_generations=1, **one_at_a_time)
    state = app.state.server
    slots, engine = state.slots, state.engine
    release = threading.Event()  # the running generation holds its slot until the test releases it
    generate = engine.generate

    def gated(ids, params, cancel):
        assert release.wait(WAIT), "the test never released the generation"
        yield from generate(ids, params, cancel)

    monkeypatch.setattr(engine, "generate", gated)

    async def until(condition):
        async def poll():
            while not condition():
                await asyncio.sleep(0.01)

        await asyncio.wait_for(poll(), WAIT)

    async def main():
        engine.start()  # as the lifespan does (the continuous-batching scheduler); ASGITransport runs no lifespan
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=WAIT) as http:
                body = {"prompt": "the cat", "max_tokens": 4, "temperature": 0}
                try:
                    running = asyncio.create_task(http.post("/v1/completions", json=body))
                    await until(lambda: slots.running == 1)
                    queued = asyncio.create_task(http.post("/v1/completions", json=body))
                    await until(lambda: slots.waiting == 1)
                    rejected = await http.post("/v1/completions", json={**body, "stream": True})
                    health = (await http.get("/health")).json()
                finally:
                    release.set()
                answers = [await running, await queued]
                alone = await http.post("/v1/completions", json=body)  # the queue empty
        finally:
            await engine.stop()
        return answers, rejected, health, alone

    answers, rejected, health, alone = asyncio.run(main())
    assert [a.status_code for a in answers] == [200, 200]
    assert rejected.status_code == 429 and rejected.json()["error"]["type"] == "rate_limit_error"
    assert health["engine"] == kind and health["slots"] == {"running": 1, "waiting": 1, "max_running": 1}
    assert (slots.running, slots.waiting) == (0, 0)
    expected = alone.json()["choices"][0]["text"]
    if kind == "torch":
        assert expected == engine.encoder.generate("the cat", max_new_tokens=4)
    assert [a.json()["choices"][0]["text"] for a in answers] == [expected, expected]


def _sse(response: httpx.Response) -> list:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("kind", ENGINES)
def test_include_usage_adds_a_final_usage_chunk_and_health_counts(tiny_sources, kind):
    from fastapi.testclient import TestClient

    with TestClient(_app(kind, tiny_sources)) as client:
        body = {"prompt": "the cat sat on", "max_tokens": 6, "temperature": 0, "stream": True}
        plain = _sse(client.post("/v1/completions", json=body))
        counted = _sse(client.post("/v1/completions", json={**body, "stream_options": {"include_usage": True}}))
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        chat_frames = _sse(
            client.post("/v1/chat/completions", json={**chat, "stream_options": {"include_usage": True}})
        )
        whole = client.post("/v1/completions", json={**body, "stream": False}).json()
        embedded = client.post("/v1/embeddings", json={"input": SENTENCES[:3]})
        health = client.get("/health").json()
    assert all("usage" not in frame for frame in plain)
    last = counted[-1]
    assert last["choices"] == [] and last["usage"] == whole["usage"], (last, whole)
    assert "".join(f["choices"][0]["text"] for f in counted[:-1]) == whole["choices"][0]["text"]
    assert chat_frames[-1]["choices"] == [] and chat_frames[-1]["object"] == "chat.completion.chunk"
    assert chat_frames[-1]["usage"]["completion_tokens"] >= 1
    assert embedded.status_code == 200 and len(embedded.json()["data"]) == 3
    assert health["engine"] == kind and health["embeddings"]["texts"] == 3 and health["generations"]["tokens"] >= 1


async def _leaving_client(app, path: str, body: dict, leave: threading.Event) -> list[dict]:
    """Send ``body`` to ``path`` over raw ASGI; the client disconnects once ``leave`` is set. -> messages sent."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
        "state": {},
    }
    sent, told = [], False
    loop = asyncio.get_running_loop()

    async def receive() -> dict:
        nonlocal told
        if not told:
            told = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await loop.run_in_executor(None, leave.wait, WAIT)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), WAIT)
    return sent


@pytest.mark.parametrize(
    ("kind", "options"),
    [("torch", {}), ("torch", {"continuous_batching": False}), ("llama.cpp", {})],
    ids=["torch-batched", "torch-threads", "llama.cpp"],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/rag"])
def test_a_client_that_leaves_a_non_streamed_answer_stops_its_generation(
    tiny_sources, monkeypatch, kind, options, path
):
    """The generation is held after its first token until the route has cancelled it, so the client provably
    leaves while it runs (however fast the model): the answer is a 499 and the generation ends there. The torch
    engines decode no token after the step that was held (the scheduler counts the request cancelled); llama.cpp
    decodes in threads of its own, which no callback holds, so what is checked there is that the engine tells it
    to stop at the chunk that was held and reads nothing after it."""
    app = _app(kind, tiny_sources, max_new_tokens=256, **options)
    state = app.state.server
    engine, leave = state.engine, threading.Event()
    cancels, results, released = [], [], []  # the route's cancel event; the answer's counts; held until cancelled?
    ended = threading.Event()  # the engine is done with the request (the scheduler: at its turn after the answer)

    def hold() -> None:
        """In the generation, its first token given: the client leaves; go on once the route has cancelled."""
        leave.set()
        released.append(cancels[0].wait(WAIT))

    def watched(ids, params, cancel):  # the engine's own generation (llama.cpp's RAG decodes through it too)
        cancels.append(cancel)
        for item in generate(ids, params, cancel):
            if isinstance(item, GenerationResult):
                results.append(item)
            yield item

    generate = engine.generate
    monkeypatch.setattr(engine, "generate", watched)
    if kind == "torch":  # its RAG decodes through the encoder's stream, not engine.generate
        from unimae.generation.decoding import Decoder

        stream, step, steps = engine.rag_stream, Decoder.step, []

        def rag_watched(query, prompt, params, cancel):
            cancels.append(cancel)
            for item in stream(query, prompt, params, cancel):
                if hasattr(item, "completion_tokens"):
                    results.append(item)
                yield item

        def held_step(self, states):  # every token after the prefill's, on both token sources
            if not leave.is_set():
                hold()
            steps.append(len(states))
            return step(self, states)

        monkeypatch.setattr(engine, "rag_stream", rag_watched)
        monkeypatch.setattr(Decoder, "step", held_step)
        if engine.scheduler is not None:
            end = engine.scheduler._end

            def ending(request, *args, **kwargs):
                end(request, *args, **kwargs)
                ended.set()

            monkeypatch.setattr(engine.scheduler, "_end", ending)
        else:
            ended.set()  # decode_tokens ran in the route's worker thread, which ended before the answer
    else:
        ended.set()  # the engine's stream ends before the answer
        complete, told = engine.model.complete, []

        def held_complete(request, on_chunk):
            chunks = []

            def held(chunk) -> bool:  # the engine's callback, given llama.cpp's chunks in order
                chunks.append(chunk)
                data = json.loads(chunk) if isinstance(chunk, (str, bytes)) and chunk != "[DONE]" else chunk
                running = isinstance(data, dict) and [c["finish_reason"] for c in data.get("choices", [])] == [None]
                if len(chunks) != 2 or not running:  # held at the second: a token of a generation not yet ended
                    return on_chunk(chunk)
                hold()
                told.append(on_chunk(chunk))  # True: the engine tells llama.cpp to stop
                return told[-1]

            return complete(request, held)

        monkeypatch.setattr(engine.model, "complete", held_complete)
    body = {"prompt": "the cat", "max_tokens": 256, "temperature": 0}
    if path == "/v1/rag":
        body = {"query": "where did the dog run", "max_tokens": 200}

    async def main():
        engine.start()
        try:
            return await _leaving_client(app, path, body, leave)
        finally:
            leave.set()  # a generation that ended before it was held: the client's receive returns at once
            await asyncio.to_thread(ended.wait, WAIT)  # stopping first would end the request as failed
            await engine.stop()

    sent = asyncio.run(main())
    assert released == [True], "the generation was never held, or never cancelled while it was"
    assert sent[0]["status"] == 499, sent
    assert len(results) == 1 and results[0].completion_tokens <= 2 < body["max_tokens"], results
    if kind == "torch":
        assert steps == [1], steps  # the step under way when the client left; none after it
        if engine.scheduler is not None:
            stats = engine.scheduler.snapshot()
            assert (stats["cancelled"], stats["finished"], stats["tokens"]) == (1, 0, 2), stats
    else:
        assert told == [True] and (engine.stats.cancelled, engine.stats.finished) == (1, 0), (told, engine.stats)
    assert (state.slots.running, state.slots.waiting) == (0, 0)


@pytest.mark.parametrize("kind", ENGINES)
def test_a_prompt_of_megabytes_is_refused_naming_the_context_having_been_read_only_that_far(tiny_sources, kind):
    """Completions and chat tokenize a prompt no further than the context + 1 tokens need: a 3.6 MB one is a 400
    naming the limit, its tokenizer never called with more than the char budget. Before: tokenized whole (a 4 MB
    prompt: +0.63 GB and 4.7 s before the 400). A /v1/rag question over the context is refused the same way."""
    from fastapi.testclient import TestClient

    app = _app(kind, tiny_sources, max_body_bytes=8 * 2**20)
    engine = app.state.server.engine
    holder = engine.encoder if kind == "torch" else engine.model  # whose tokenizer turns prompts into ids
    recording = holder.tokenizer = RecordingTokenizer(holder.tokenizer)
    huge = "the cat sat on the mat. " * 150_000
    requests = [
        ("/v1/completions", {"prompt": huge}, "prompt"),
        ("/v1/completions", {"prompt": huge, "max_tokens": 4, "stream": True}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages"),
        ("/v1/rag", {"query": huge[:4000]}, "query"),  # its schema takes 4000 characters: over 512 tokens here
    ]
    with TestClient(app) as client:
        replies = [(client.post(path, json=body), param) for path, body, param in requests]
        fits = client.post("/v1/completions", json={"prompt": "the cat sat on", "max_tokens": 2})
    for reply, param in replies:
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert "longer than the model's context of 512 tokens" in error["message"] and error["param"] == param, error
    assert fits.status_code == 200, fits.text
    assert 0 < recording.longest <= char_budget(recording.tokenizer, 512 + 1) < len(huge) // 100


def test_a_stalled_body_gets_408_and_a_client_leaving_mid_body_is_one_info_line(tiny_sources, caplog):
    app = _app("torch", tiny_sources, body_timeout_s=0.2)
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/embeddings",
        "raw_path": b"/v1/embeddings",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }

    def run(second: dict | None) -> list[dict]:
        sent, parts = [], [{"type": "http.request", "body": b'{"input": "the', "more_body": True}]

        async def receive():
            if parts:
                return parts.pop()
            if second is None:
                await asyncio.sleep(WAIT)  # half a body, then nothing
            return second

        async def send(message):
            sent.append(message)

        asyncio.run(asyncio.wait_for(app(scope, receive, send), WAIT))
        return sent

    assert run(None)[0]["status"] == 408
    with caplog.at_level(logging.INFO, logger="unimae.serving.app"):
        assert run({"type": "http.disconnect"})[0]["status"] == 499
    records = [r for r in caplog.records if r.name == "unimae.serving.app"]
    assert [(r.levelno, r.exc_info) for r in records] == [(logging.INFO, None)], records


@pytest.mark.parametrize("kind", ENGINES)
def test_langchain_openai_drives_the_server(tiny_sources, kind):
    langchain_openai = pytest.importorskip(
        "langchain_openai", reason="langchain-openai is not installed (pip install 'unimae[dev]')"
    )
    with serving_in_a_thread(_app(kind, tiny_sources), WAIT) as url:
        base = f"{url}/v1"
        embeddings = langchain_openai.OpenAIEmbeddings(
            model="tiny", base_url=base, api_key="none", check_embedding_ctx_length=False, chunk_size=4
        )
        vectors = embeddings.embed_documents(SENTENCES[:6])
        assert len(vectors) == 6 and len(embeddings.embed_query("a dog")) == len(vectors[0])
        chat = langchain_openai.ChatOpenAI(
            model="tiny", base_url=base, api_key="none", max_tokens=4, temperature=0, stream_usage=True
        )
        chunks = list(chat.stream("hi"))
        total = chunks[0]
        for chunk in chunks[1:]:
            total = total + chunk
        assert total.usage_metadata is not None and total.usage_metadata["output_tokens"] >= 1
