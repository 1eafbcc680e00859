"""The OpenAI-compatible server, as a real process on 127.0.0.1, driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from conftest import SENTENCES

from unimae.encoder import Encoder
from unimae.index import VectorIndex
from unimae.serving.batcher import DynamicBatcher

openai = pytest.importorskip("openai")
KEY = "test-key"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    model = str(tiny_model_dirs["llama"])
    encoder = Encoder.from_pretrained(model, precision="fp32", max_length=64)
    index_dir = tmp_path_factory.mktemp("index")
    source = {"model": model, "adapter": None, "adapter_revision": "base"}
    VectorIndex.build(encoder, [(f"p{i}", t) for i, t in enumerate(SENTENCES)], index_dir, source=source)
    port = _free_port()
    cmd = [
        sys.executable,
        "-c",
        "from unimae.cli import main; raise SystemExit(main())",
        "serve",
        "--index",
        str(index_dir),
        "--precision",
        "fp32",
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--model-name",
        "tiny",
        "--max-inputs",
        "8",
        "--max-body-bytes",
        "20000",
        "--max-new-tokens",
        "32",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(index_dir / "server.log", "w+")  # noqa: SIM115 - read back on failure
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited: {(index_dir / 'server.log').read_text()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.3)  # polls until the server answers; the deadline only guards against a hang
    else:
        proc.kill()
        pytest.fail("server did not start within 120 s")
    yield {"base": base, "encoder": encoder, "proc": proc, "log": index_dir / "server.log"}
    proc.terminate()
    code = proc.wait(timeout=30)
    output = (index_dir / "server.log").read_text()
    # uvicorn finishes in-flight requests, then re-raises the signal it caught: exit status -SIGTERM
    assert code in (0, -signal.SIGTERM) and "Traceback" not in output, output[-5000:]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _post(server, path, body=None, content=None, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server["base"] + path, json=body, content=content, headers=headers, timeout=60)


def test_embeddings_match_the_encoder_in_base64_and_float(server, client):
    texts = SENTENCES[:5]
    expected = server["encoder"].encode(texts, normalize=True)
    b64 = client.embeddings.create(model="tiny", input=texts)  # the client asks for base64 by default
    floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    for response in (b64, floats):
        got = np.array([d.embedding for d in response.data])
        assert got.shape == expected.shape
        assert (got * expected).sum(1).min() >= 0.9999
        assert [d.index for d in response.data] == list(range(5)) and response.usage.prompt_tokens > 5
    single = client.embeddings.create(model="tiny", input=texts[0], encoding_format="float")
    assert len(single.data) == 1 and np.allclose(single.data[0].embedding, expected[0], atol=1e-4)


def test_completions_and_chat_stream_equal_non_stream(client):
    plain = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=8, temperature=0)
    chunks = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=8, temperature=0, stream=True)
    streamed = list(chunks)
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    assert streamed[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert plain.usage.completion_tokens >= 1 and plain.choices[0].finish_reason in ("stop", "length")

    messages = [{"role": "user", "content": "the dog ran"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    pieces = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in pieces)
    assert chat.choices[0].message.role == "assistant" and text == chat.choices[0].message.content
    parts = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "the dog ran"}]},
    ]
    same = client.chat.completions.create(model="tiny", messages=parts, max_completion_tokens=8, temperature=0)
    assert same.usage.completion_tokens <= 8 and same.choices[0].message.content is not None


def test_stop_string_cuts_the_completion(client):
    full = client.completions.create(model="tiny", prompt="the river", max_tokens=16, temperature=0).choices[0]
    assert len(full.text) > 4, "the tiny model should produce some text"
    stop = full.text[2:4]
    cut = client.completions.create(model="tiny", prompt="the river", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == full.text[: full.text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/embeddings", {"input": ""}, 400, "empty"),
        ("/v1/embeddings", {"input": []}, 400, "non-empty"),
        ("/v1/embeddings", {"input": 5}, 400, "input"),
        ("/v1/embeddings", {"input": [[1, 2, 3]]}, 400, "token arrays"),
        ("/v1/embeddings", {"input": ["a"] * 9}, 400, "at most 8"),
        ("/v1/embeddings", {"input": "a", "model": "gpt-4"}, 404, "not served"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
        ("/v1/embeddings", {"input": "a", "dimensions": 3}, 400, "dimensional"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400, "limit of 32"),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        ("/v1/rag", {"query": ""}, 400, "query"),
    ],
)
def test_bad_requests_get_openai_style_4xx(server, path, body, status, needle):
    response = _post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] or needle == error.get("param"), error
    assert error["type"] in ("invalid_request_error", "not_found_error")


def test_malformed_json_oversized_body_and_auth(server):
    bad = _post(server, "/v1/embeddings", content=b'{"input": ')
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    assert _post(server, "/v1/embeddings", content=b"[1, 2]").status_code == 400
    big = _post(server, "/v1/embeddings", {"input": "word " * 10000})
    assert big.status_code == 413 and "limit" in big.json()["error"]["message"]
    assert _post(server, "/v1/embeddings", {"input": "a"}, key=None).status_code == 401
    wrong = _post(server, "/v1/embeddings", {"input": "a"}, key="nope")
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server["base"] + "/health").json()["status"] == "ok"  # no key needed
    assert _post(server, "/v1/embeddings", {"input": "still works"}).status_code == 200


def test_models_route_and_concurrent_embeddings(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    results, errors = [], []

    def call(i):
        try:
            results.append(client.embeddings.create(model="tiny", input=SENTENCES[i % 12]).data[0].embedding)
        except Exception as err:  # noqa: BLE001 - collected and asserted below
            errors.append(err)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors and len(results) == 12


def test_rag_route_retrieves_and_answers_the_same_with_and_without_cache(server):
    body = {"query": "where did the cat sit", "k": 2, "max_tokens": 8}
    cached = _post(server, "/v1/rag", body).json()
    plain = _post(server, "/v1/rag", {**body, "reuse_kv": False}).json()
    assert [p["id"] for p in cached["passages"]] == [p["id"] for p in plain["passages"]] and len(plain["passages"]) == 2
    assert cached["answer"] == plain["answer"]
    assert cached["usage"]["cached_prompt_tokens"] > 0 and plain["usage"]["cached_prompt_tokens"] == 0
    stream = _post(server, "/v1/rag", {**body, "stream": True}).text
    events = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    assert events[0]["object"] == "rag.passages" and events[-1]["answer"] == cached["answer"]
    assert stream.rstrip().endswith("data: [DONE]")


def test_dynamic_batcher_merges_concurrent_requests_and_returns_each_its_rows():
    calls = []

    def embed(texts):
        calls.append(len(texts))
        return np.array([[float(t)] for t in texts])

    async def main():
        batcher = DynamicBatcher(embed, max_batch_texts=16, max_wait_ms=50)
        batcher.start()
        outs = await asyncio.gather(*(batcher.submit([str(i), str(i + 100)]) for i in range(20)))
        await batcher.stop()
        return outs, batcher.stats

    outs, stats = asyncio.run(main())
    for i, out in enumerate(outs):
        assert out[:, 0].tolist() == [i, i + 100]
    assert stats.requests == 20 and stats.texts == 40 and max(calls) <= 16 and len(calls) < 20


def test_dynamic_batcher_passes_errors_to_every_caller():
    def embed(texts):
        raise RuntimeError("boom")

    async def main():
        batcher = DynamicBatcher(embed, max_wait_ms=20)
        batcher.start()
        outs = await asyncio.gather(*(batcher.submit(["x"]) for _ in range(3)), return_exceptions=True)
        await batcher.stop()
        return outs

    assert all(isinstance(o, RuntimeError) for o in asyncio.run(main()))


def test_more_edge_cases_get_clean_4xx(server):
    def chunks():
        for _ in range(30):
            yield b"x" * 1000  # 30 kB in chunks, no Content-Length: still 413

    chunked = httpx.post(
        server["base"] + "/v1/embeddings", content=chunks(), headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert chunked.status_code == 413 and "limit" in chunked.json()["error"]["message"]
    assert _post(server, "/v1/rag", {"query": "   "}).status_code == 400
    assert _post(server, "/v1/completions", {"prompt": "x", "seed": 2**70}).status_code == 400
    assert _post(server, "/v1/embeddings", content=b"[" * 5000).status_code == 400
    missing = _post(server, "/v1/nothing", {})
    assert missing.status_code == 404 and "error" in missing.json()


def test_generation_queue_overflow_is_429_even_for_streams(tiny_model_dirs, monkeypatch):
    import unimae.serving.routes.completions as completions_module
    from unimae.generation import GenerationResult
    from unimae.serving.app import create_app
    from unimae.serving.config import ServerConfig

    release = threading.Event()  # the running generation holds its slot until the test releases it

    def blocked(*args, **kwargs):
        assert release.wait(60), "the test never released the generation"
        yield "hi"
        yield GenerationResult("hi", 1, 1, "stop")

    monkeypatch.setattr(completions_module, "generate_stream", blocked)
    monkeypatch.setattr(completions_module, "generate_text", lambda *a, **k: list(blocked())[-1])
    encoder = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), precision="fp32", max_length=32)
    app = create_app(encoder, ServerConfig(model_name="tiny", max_concurrent_generations=1, max_queued_generations=1))
    slots = app.state.server.slots

    async def until(condition):
        async def poll():
            while not condition():
                await asyncio.sleep(0.01)

        await asyncio.wait_for(poll(), 30)  # a guard against a hang, not an ordering device

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            body = {"prompt": "the cat", "max_tokens": 4}
            try:
                running = asyncio.create_task(http.post("/v1/completions", json=body))
                await until(lambda: slots.running == 1)
                queued = asyncio.create_task(http.post("/v1/completions", json=body))
                await until(lambda: slots.waiting == 1)
                rejected = await http.post("/v1/completions", json={**body, "stream": True})
                assert (slots.running, slots.waiting) == (1, 1)  # the refused stream took no place
            finally:
                release.set()
            return (await running).status_code, (await queued).status_code, rejected

    first, second, rejected = asyncio.run(main())
    assert (first, second) == (200, 200)
    assert rejected.status_code == 429 and rejected.json()["error"]["type"] == "rate_limit_error"
    assert (slots.running, slots.waiting) == (0, 0)
