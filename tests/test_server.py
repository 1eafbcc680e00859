"""The OpenAI-compatible server, as a real process on 127.0.0.1, driven by the official `openai` client.

The server process runs with a *gate* on the embedding forward pass: a pass whose input holds the token
``GATE`` prints "gated" and waits for a line on its stdin. Tests that need a request to be part-way through
(a large request, a client that disconnects) hold it there, so what runs when is decided by the test, not by
timing; every wait has a generous timeout that only turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from conftest import SENTENCES

from unimae.encoder import Encoder
from unimae.retrieval.index import VectorIndex

openai = pytest.importorskip("openai", reason="the OpenAI client tests need pip install openai (unimae[dev])")
KEY = "test-key"
GATE = "<extra_2>"  # a special token of the tiny tokenizer: one token wherever it is in a text
LONG = " ".join(SENTENCES)  # 237 tokens: truncated to the index's max_length of 64
CHUNK_TOKENS = 64  # --embed-chunk-tokens: one LONG input per chunk
GATED_SERVE = """
import sys

from unimae.cli import main
from unimae.embedding.spec import EmbeddingSpec

forward, gate_open = EmbeddingSpec.forward, False


def gated(self, model, input_ids, *args):
    global gate_open
    if (input_ids == GATE_ID).any() and not gate_open:
        print("gated", flush=True)
        gate_open = sys.stdin.readline().strip() in ("", "open for good")
    return forward(self, model, input_ids, *args)


EmbeddingSpec.forward = gated
raise SystemExit(main())
"""


class Gate:
    """The test's side of the server's gate: :meth:`held` waits until a forward pass is held there,
    :meth:`release` lets it go, :meth:`open_for_good` lets every later one through (after a failure)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self._held = proc, queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            if line.strip() == "gated":
                self._held.put(True)

    def held(self) -> None:
        self._held.get(timeout=60)

    def release(self, line: str = "go") -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def open_for_good(self) -> None:
        self.release("open for good")


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
    gate_id = encoder.tokenizer.convert_tokens_to_ids(GATE)
    cmd = [
        sys.executable,
        "-c",
        GATED_SERVE.replace("GATE_ID", str(gate_id)),
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
        "--embed-chunk-tokens",
        str(CHUNK_TOKENS),
        "--max-request-tokens",
        str(7 * CHUNK_TOKENS),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(index_dir / "server.log", "w+")  # noqa: SIM115 - read back on failure
    pipe = subprocess.PIPE
    proc = subprocess.Popen(cmd, stdin=pipe, stdout=pipe, stderr=log, text=True, env=env)
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
    yield {"base": base, "encoder": encoder, "proc": proc, "log": index_dir / "server.log", "gate": Gate(proc)}
    proc.stdin.close()  # a pass still held at the gate goes on
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
        ("/v1/embeddings", {"input": "a", "dimensions": "64"}, 400, "dimensions"),  # a strict integer
        ("/v1/embeddings", {"input": "a", "dimensions": True}, 400, "dimensions"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400, "limit of 32"),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "temperature": "NaN"}, 400, "must be a finite number"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": "nan"}, 400, "finite"),
        ("/v1/embeddings", {"input": [LONG] * 8}, 413, "max-request-tokens"),
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


def test_the_default_answer_length_shrinks_to_the_context_left(server, tiny_model_dirs):
    """Without max_tokens, a prompt near the context (512) gets a shorter answer, not a 400 about max_tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dirs["llama"]))
    words = (LONG + " " + LONG + " " + LONG).split()
    prompt = " ".join(
        next(words[:n] for n in range(len(words)) if len(tokenizer(" ".join(words[:n]))["input_ids"]) > 500)
    )
    n_prompt = len(tokenizer(prompt)["input_ids"])
    assert 500 < n_prompt < 512 - 1
    reply = _post(server, "/v1/completions", {"prompt": prompt, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert 1 <= reply.json()["usage"]["completion_tokens"] <= 512 - n_prompt
    explicit = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 16})
    assert explicit.status_code == 400 and "exceeds the context" in explicit.json()["error"]["message"]
    full = _post(server, "/v1/completions", {"prompt": " ".join(words)})
    assert full.status_code == 400 and "longer than the model's context of 512" in full.json()["error"]["message"]


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
    # the question alone fits the context, with its passages it does not: 400 before the stream, not 200 + error
    overflow = _post(server, "/v1/rag", {"query": LONG, "k": 50, "max_tokens": 8, "stream": True})
    assert overflow.status_code == 400 and "context" in overflow.json()["error"]["message"]


def test_a_rag_answer_without_max_tokens_shrinks_to_the_context_left(server):
    """As for chat: a prompt (question + passages) that leaves less room than the default answer length gets a
    shorter answer, not a 400 about max_tokens."""
    query = LONG.rsplit(" ", 12)[0]
    lengths = {}
    for k in range(1, 9):
        reply = _post(server, "/v1/rag", {"query": query, "k": k, "max_tokens": 1})
        if reply.status_code == 200:
            lengths[k] = reply.json()["usage"]["prompt_tokens"]
    near = [k for k, n in lengths.items() if 512 - 32 < n < 512]  # less room than the default 32 tokens
    assert near, lengths
    k, n_prompt = near[0], lengths[near[0]]
    reply = _post(server, "/v1/rag", {"query": query, "k": k})
    assert reply.status_code == 200, reply.text
    assert 1 <= reply.json()["usage"]["completion_tokens"] <= 512 - n_prompt
    explicit = _post(server, "/v1/rag", {"query": query, "k": k, "max_tokens": 32})
    assert explicit.status_code == 400 and "context" in explicit.json()["error"]["message"]


def test_more_edge_cases_get_clean_4xx(server):
    def chunks():
        for _ in range(30):
            yield b"x" * 1000  # 30 kB in chunks, no Content-Length: still 413

    chunked = httpx.post(
        server["base"] + "/v1/embeddings", content=chunks(), headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert chunked.status_code == 413 and "limit" in chunked.json()["error"]["message"]
    assert _post(server, "/v1/rag", {"query": "   "}).status_code == 400
    assert _post(server, "/v1/rag", {"query": "x", "model": "other"}).status_code == 404
    assert _post(server, "/v1/completions", {"prompt": "x", "seed": 2**70}).status_code == 400
    assert _post(server, "/v1/embeddings", content=b"[" * 5000).status_code == 400
    missing = _post(server, "/v1/nothing", {})
    assert missing.status_code == 404 and "error" in missing.json()


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/embeddings", rb'{"input": "hi \ud800"}', "input"),
        ("/v1/embeddings", rb'{"input": ["fine", "x \udfff y"]}', "input.1"),
        ("/v1/embeddings", rb'{"input": "hi", "model": "\ud800"}', "model"),
        ("/v1/embeddings", rb'{"input": "hi", "user": "\udbff"}', "user"),
        ("/v1/completions", rb'{"prompt": "hi \ud800"}', "prompt"),
        ("/v1/completions", rb'{"prompt": "hi", "stop": ["\ud800"]}', "stop.0"),
        ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "hi \ud800"}]}', "messages.0.content"),
        (
            "/v1/chat/completions",
            rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}',
            "messages.0.content.0.text",
        ),
        ("/v1/rag", rb'{"query": "where \ud800"}', "query"),
    ],
)
def test_text_that_utf8_cannot_encode_is_a_400_naming_the_field(server, path, raw, param):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=server["base"], headers=headers, timeout=60) as http:
        response = http.post(path, content=raw)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and "not valid Unicode" in error["message"], error
        assert http.post("/v1/embeddings", json={"input": "the same connection"}).status_code == 200


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/v1/embeddings", rb'{"input": "a\u0000b"}'),
        ("/v1/embeddings", rb'{"input": "\ud83d\ude00 a valid surrogate pair"}'),
        ("/v1/embeddings", rb'{"input": ["a", null]}'),
        ("/v1/embeddings", rb'{"input": {"text": "a"}}'),
        ("/v1/embeddings", rb'{"input": "a", "dimensions": 1e400}'),
        ("/v1/embeddings", rb'{"input": "a", "encoding_format": null}'),
        ("/v1/embeddings", rb'{"input": "a", "\ud800": 1}'),
        ("/v1/embeddings", b"\xff\xfe{}"),
        ("/v1/embeddings", b""),
        ("/v1/embeddings", b"null"),
        ("/v1/completions", rb'{"prompt": "x", "temperature": NaN}'),
        ("/v1/completions", rb'{"prompt": "x", "temperature": Infinity}'),
        ("/v1/completions", rb'{"prompt": "x", "top_p": -Infinity}'),
        ("/v1/completions", rb'{"prompt": "x", "max_tokens": 1e999}'),
        ("/v1/completions", rb'{"prompt": "x", "max_tokens": 99999999999999999999999}'),
        ("/v1/completions", rb'{"prompt": "x", "seed": -1}'),
        ("/v1/completions", rb'{"prompt": "x", "stop": [""]}'),
        ("/v1/completions", rb'{"prompt": "x", "stop": 5}'),
        ("/v1/completions", rb'{"prompt": [], "max_tokens": 1}'),
        ("/v1/completions", rb'{"prompt": "", "max_tokens": 1}'),
        ("/v1/chat/completions", rb'{"messages": "hi"}'),
        ("/v1/chat/completions", rb'{"messages": [null]}'),
        ("/v1/chat/completions", rb'{"messages": [{"role": "user"}], "max_tokens": 1}'),
        ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'),
        ("/v1/rag", rb'{"query": "x", "k": 0}'),
        ("/v1/rag", rb'{"query": "x", "k": 1e9}'),
        ("/v1/rag", rb'{"query": "x", "max_tokens": 100000}'),
    ],
)
def test_no_bad_input_gets_a_500(server, path, raw):
    response = _post(server, path, content=raw)
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        assert response.json()["error"]["type"] == "invalid_request_error", response.text


def _embedding_stats(server) -> dict:
    return httpx.get(server["base"] + "/health", timeout=60).json()["embeddings"]


def _until_stats(server, condition) -> dict:
    """Poll /health until ``condition(stats)``; the deadline only turns a hang into a failure."""
    deadline = time.monotonic() + 60
    while not condition(stats := _embedding_stats(server)):
        assert time.monotonic() < deadline, f"the server's embedding counters never got there: {stats}"
        time.sleep(0.05)
    return stats


def test_a_small_request_waits_at_most_one_chunk_behind_a_large_one(server):
    gate, before = server["gate"], _embedding_stats(server)
    large_body = {"input": [f"{GATE} {LONG}"] * 6, "encoding_format": "float"}  # 6 chunks of one input
    try:
        with ThreadPoolExecutor(2) as pool:
            large = pool.submit(_post, server, "/v1/embeddings", large_body)
            gate.held()  # chunk 1 of the large request runs, held at the gate
            small = pool.submit(_post, server, "/v1/embeddings", {"input": "the cat sat"})
            _until_stats(server, lambda s: s["waiting_requests"] == 2)  # the small one waits behind it
            gate.release()
            assert small.result(timeout=60).status_code == 200  # served while the large one is held again:
            gate.held()  # its chunk 2 came after the small request's chunk
            assert not large.done()
            for _ in range(4):
                gate.release()
                gate.held()
            gate.release()
            response = large.result(timeout=60)
    except BaseException:
        gate.open_for_good()
        raise
    assert response.status_code == 200 and len(response.json()["data"]) == 6
    after = _embedding_stats(server)
    assert after["chunks"] - before["chunks"] == 7 and after["waiting_requests"] == 0
    assert response.json()["usage"]["prompt_tokens"] == 6 * CHUNK_TOKENS
    expected = server["encoder"].encode(large_body["input"][:1], normalize=True)[0]
    assert np.allclose(response.json()["data"][5]["embedding"], expected, atol=1e-4)


def test_a_client_that_disconnects_has_its_remaining_chunks_dropped(server):
    gate, before = server["gate"], _embedding_stats(server)
    body = json.dumps({"input": [f"{GATE} {LONG}"] * 6}).encode()
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    try:
        host, port = server["base"].removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(head.encode() + body)
            gate.held()  # chunk 1 of 6 runs, held at the gate
        _until_stats(server, lambda s: s["cancelled_requests"] == before["cancelled_requests"] + 1)
        gate.release()  # chunk 1 ends; the other five must never run (they would be held at the gate)
        assert _post(server, "/v1/embeddings", {"input": "the dog ran"}).status_code == 200
    except BaseException:
        gate.open_for_good()
        raise
    after = _embedding_stats(server)
    assert after["dropped_texts"] - before["dropped_texts"] == 5
    assert after["chunks"] - before["chunks"] == 2 and after["waiting_requests"] == 0  # chunk 1 + the small one


def test_embedding_requests_are_tokenized_off_the_event_loop(tiny_model_dirs, monkeypatch):
    from unimae.serving.app import create_app
    from unimae.serving.config import ServerConfig

    encoder = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), precision="fp32", max_length=32)
    app = create_app(encoder, ServerConfig(model_name="tiny"))
    state = app.state.server
    tokenizing, release, finished = threading.Event(), threading.Event(), threading.Event()
    tokenize = state.embedding_inputs

    def slow_tokenize(texts, input_type=None):  # as a huge request would: holds its thread until the test releases it
        tokenizing.set()
        try:
            assert release.wait(30), "the test never released the tokenizer"
            return tokenize(texts, input_type)
        finally:
            finished.set()

    monkeypatch.setattr(state, "embedding_inputs", slow_tokenize)

    async def main():
        state.batcher.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            try:
                request = asyncio.create_task(http.post("/v1/embeddings", json={"input": "the cat"}))
                assert await asyncio.get_running_loop().run_in_executor(None, tokenizing.wait, 30)
                health = await http.get("/health")  # answered while the tokenizer still holds its thread
                answered_while_tokenizing = not finished.is_set()
            finally:
                release.set()
            response = await request
        await state.batcher.stop()
        return health, answered_while_tokenizing, response

    health, answered_while_tokenizing, response = asyncio.run(main())
    assert health.status_code == 200 and answered_while_tokenizing
    assert response.status_code == 200 and len(response.json()["data"]) == 1


@pytest.mark.parametrize("pooling,limit", [("eos", 16), ("echo", 17)])  # echo at 17: an even budget to halve
def test_on_too_long_error_refuses_only_inputs_over_max_length(tiny_model_dirs, pooling, limit):
    from unimae.serving.app import create_app
    from unimae.serving.config import ServerConfig

    tiny = str(tiny_model_dirs["llama"])
    encoder = Encoder.from_pretrained(tiny, precision="fp32", max_length=limit, pooling=pooling)
    app = create_app(encoder, ServerConfig(model_name="tiny", on_too_long="error"))
    words = LONG.split()
    by_length = {}  # model input length (BOS, text, EOS) -> a text of that length
    for n in range(1, len(words)):
        text = " ".join(words[:n])
        by_length.setdefault(len(encoder.spec.build_inputs(encoder.tokenizer, [text], 10_000)[0].ids), text)
    fits, over = by_length[max(k for k in by_length if k <= limit)], by_length[min(k for k in by_length if k > limit)]

    async def main():
        app.state.server.batcher.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            ok = await http.post("/v1/embeddings", json={"input": fits, "encoding_format": "float"})
            refused = await http.post("/v1/embeddings", json={"input": ["short", over]})
        await app.state.server.batcher.stop()
        return ok, refused

    ok, refused = asyncio.run(main())
    assert ok.status_code == 200, ok.text
    assert np.allclose(ok.json()["data"][0]["embedding"], encoder.encode([fits], normalize=True)[0], atol=1e-5)
    assert refused.status_code == 400, refused.text
    assert f"input[1] is over this server's limit of {limit}" in refused.json()["error"]["message"]


@pytest.mark.parametrize("on_too_long", ["error", "truncate"])
def test_a_refused_input_logs_no_truncation_warning(tiny_model_dirs, on_too_long, recwarn):
    """Before: with --on-too-long error a refused input logged "TextTooLongWarning: texts longer than max_length=18
    tokens were truncated": nothing was, and 18 is max_length + 2, the length the refusal tokenizes to. The 400
    says it all; truncating (the default) still warns once, at the server's max_length."""
    from fastapi.testclient import TestClient

    from unimae.embedding.tokenization import TextTooLongWarning
    from unimae.serving.app import create_app
    from unimae.serving.config import ServerConfig

    encoder = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), precision="fp32", max_length=16)
    with TestClient(create_app(encoder, ServerConfig(model_name="tiny", on_too_long=on_too_long))) as http:
        response = http.post("/v1/embeddings", json={"input": ["short", LONG]})
    warned = [str(w.message) for w in recwarn if issubclass(w.category, TextTooLongWarning)]
    if on_too_long == "error":
        assert response.status_code == 400 and "input[1] is over this server's limit of 16" in response.text
        assert warned == []
    else:
        assert response.status_code == 200, response.text
        assert warned and all("max_length=16 tokens" in message for message in warned), warned
