"""What real OpenAI clients send, answered as OpenAI (or vLLM) answers it: the `openai` SDK and langchain-openai
against an in-process uvicorn server over the tiny random Llama (the PyTorch engine; the llama.cpp engine too
where the two differ: seeds, several prompts in one completion).

Requests for what the server does not do (tool calling, structured output, logprobs) are 400s naming the field,
never a plain-text answer as if they had not been asked; JSON nulls mean the defaults; a completion takes a list
of prompts; the embeddings limits take LangChain's default batch; whitespace-only texts embed as the Encoder
embeds them; seeds take OpenAI's int64 range; ``GET /v1/models/{id}``; CORS for browser front-ends.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from conftest import REQUIRE_EXTRAS, SENTENCES, serving_in_a_thread

from unimae.encoder import Encoder
from unimae.serving.app import create_app
from unimae.serving.config import ServerConfig
from unimae.serving.schemas import ChatMessage

openai = pytest.importorskip("openai", reason="the OpenAI client tests need pip install openai (unimae[dev])")
KEY = "test-key"
MODEL = "org/tiny"  # a Hugging Face-style id: GET /v1/models/{id} must take its "/"
WAIT = 60  # seconds: a guard against a hang, never an ordering device
CHAT = [{"role": "user", "content": "the cat"}]


@pytest.fixture(scope="module")
def encoder(tiny_model_dirs):
    return Encoder.from_pretrained(str(tiny_model_dirs["llama"]), precision="fp32", max_length=32)


@pytest.fixture(scope="module")
def gguf(tiny_model_dirs, tmp_path_factory):
    """The tiny Llama as an f32 GGUF, or None without xllamacpp."""
    try:
        import xllamacpp  # noqa: F401
    except ImportError:
        if REQUIRE_EXTRAS:
            raise
        return None
    from unimae.export import export

    root = tmp_path_factory.mktemp("compat-gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UNIMAE_CACHE", str(root / "cache"))
        return export(str(tiny_model_dirs["llama"]), None, root / "model.gguf", fmt="gguf", gguf_type="f32")


def _engine_app(kind: str, encoder: Encoder, gguf, **options):
    config = ServerConfig(model_name=MODEL, **options)
    if kind == "torch":
        return create_app(encoder, config)
    if gguf is None:
        pytest.skip("the llama.cpp engine needs xllamacpp: pip install xllamacpp")
    from unimae.serving.llamacpp_engine import LlamaCppModel, create_llamacpp_app

    return create_llamacpp_app(LlamaCppModel(gguf, max_length=32, threads=1, parallel=2, context=512), config)


@pytest.fixture(scope="module")
def base(encoder):
    """The URL of a server with the default limits and an API key, on 127.0.0.1 (uvicorn in a thread)."""
    with serving_in_a_thread(create_app(encoder, ServerConfig(model_name=MODEL, api_key=KEY)), WAIT) as url:
        yield url


@pytest.fixture
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=WAIT)


def _post(base: str, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(base + path, json=body, headers=headers, timeout=WAIT)


def _refused(response: httpx.Response, param: str, needle: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    assert error["type"] == "invalid_request_error"


def _events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


# 1. tool calling

TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}


def test_tool_calling_is_refused_naming_the_field(base, client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=CHAT, tools=[TOOL], max_tokens=2)
    assert refused.value.body["param"] == "tools" and "does not do tool calling" in refused.value.body["message"]
    for extra in ({"tools": [TOOL], "tool_choice": "auto"}, {"tools": [TOOL], "tool_choice": "required"}):
        _refused(_post(base, "/v1/chat/completions", {"messages": CHAT, **extra}), "tools", "tool calling")
    functions = {"messages": CHAT, "functions": [TOOL["function"]]}
    _refused(_post(base, "/v1/chat/completions", functions), "functions", "tool calling")
    # told not to call them (or given none), the request is answered
    declined = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=[TOOL], tool_choice="none", max_tokens=2
    )
    assert declined.choices[0].message.content is not None
    for ok in ({"tools": []}, {"functions": [TOOL["function"]], "function_call": "none"}, {"tools": None}):
        assert _post(base, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **ok}).status_code == 200


@pytest.mark.parametrize(
    "message",
    [
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "function", "name": "weather", "content": "sunny"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {}}]},
    ],
)
def test_tool_messages_are_refused_saying_why(base, message):
    response = _post(base, "/v1/chat/completions", {"messages": [*CHAT, message]})
    _refused(response, "messages.1." + ("tool_calls" if "tool_calls" in message else "role"), "tool calling")


# 2. structured output, 3. logprobs


@pytest.mark.parametrize(
    "response_format",
    [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}, {}],
)
def test_structured_output_is_refused(base, client, response_format):
    for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "the cat"})):
        response = _post(base, path, {**body, "response_format": response_format})
        _refused(response, "response_format", "structured output")
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, response_format={"type": "text"}, max_tokens=2)
    assert plain.choices[0].message.content is not None


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/chat/completions", "logprobs", True),
        ("/v1/chat/completions", "top_logprobs", 2),
        ("/v1/completions", "logprobs", 1),
        ("/v1/completions", "echo", True),
    ],
)
def test_logprobs_are_refused_naming_the_field(base, path, field, value):
    body = {"messages": CHAT} if "chat" in path else {"prompt": "the cat"}
    _refused(_post(base, path, {**body, field: value}), field, "does not return logprobs")


@pytest.mark.parametrize(
    ("path", "body", "param", "needle"),
    [
        ("/v1/completions", {"prompt": "the cat", "stop": 5}, "stop", "a valid string or a valid list"),
        ("/v1/completions", {"prompt": "the cat", "stop": ["ok", 5]}, "stop.1", "a valid string"),
        ("/v1/chat/completions", {"messages": CHAT, "stop": 5}, "stop", "a valid string or a valid list"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 5}]},
            "messages.0.content",
            "a valid string or a valid list",
        ),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": 5}, "tool_choice", "a valid string or a valid dict"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "stream_options": {"include_usage": "maybe"}},
            "stream_options.include_usage",
            "a valid boolean",
        ),
        ("/v1/embeddings", {"input": 5}, "input", "non-empty string"),
        ("/v1/embeddings", {"input": "a", "dimensions": "64"}, "dimensions", "a valid integer"),
    ],
)
def test_a_wrong_type_is_a_400_naming_the_field_not_pydantic_s_union_member(base, path, body, param, needle):
    """Before: `"stop": 5` had `param: "stop.str"`, a message content `"messages.0.content.str"`: pydantic's tag
    of the union member it tried last, which is no field of the request."""
    response = _post(base, path, body)
    _refused(response, param, needle)
    assert response.json()["error"]["message"].startswith(f"invalid '{param}': "), response.text


def test_logprobs_not_asked_for_are_answered(client):
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=False, top_logprobs=0, max_tokens=2)
    assert chat.choices[0].logprobs is None
    text = client.completions.create(model=MODEL, prompt="the cat", logprobs=0, echo=False, max_tokens=2)
    assert text.choices[0].logprobs is None
    nulls = client.completions.create(model=MODEL, prompt="the cat", logprobs=None, max_tokens=2)
    assert nulls.choices[0].text is not None


# 4. null means the default

NULLS = ["temperature", "top_p", "n", "stream", "max_tokens", "stop", "seed", "stream_options", "user"]
NULLS += ["presence_penalty", "frequency_penalty", "logit_bias", "response_format", "model"]


def test_null_on_an_optional_field_means_its_default(base, client):
    nulls = dict.fromkeys(NULLS)
    seeded = {"max_tokens": 6, "seed": 7}  # temperature 1 (the default): the same seed gives the same draw
    for path, body in (("/v1/completions", {"prompt": "the cat"}), ("/v1/chat/completions", {"messages": CHAT})):
        extra = {"logprobs": None, "echo": None} if "chat" not in path else {"max_completion_tokens": None}
        response = _post(base, path, {**body, **nulls, **extra, **seeded})
        assert response.status_code == 200, response.text
        expected = _post(base, path, {**body, **seeded}).json()["choices"][0]
        assert response.json()["choices"][0] == expected
    streamed = _post(
        base, "/v1/completions", {"prompt": "the cat", "stream": True, "stream_options": {"include_usage": None}}
    )
    assert streamed.status_code == 200 and all("usage" not in event for event in _events(streamed))
    embedded = _post(base, "/v1/embeddings", {"input": "the cat", "encoding_format": None, "dimensions": None})
    assert embedded.status_code == 200 and isinstance(embedded.json()["data"][0]["embedding"], list)
    # as the openai SDK sends a None a wrapper passes on
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=None, top_p=None, n=None, seed=7)
    assert chat.choices[0].message.content is not None
    # a required field stays required
    _refused(_post(base, "/v1/completions", {"prompt": None}), "prompt", "prompt")


# 5. a list of prompts


def test_a_list_of_prompts_gets_one_choice_each(client):
    prompts = ["the cat sat", "a dog", "the river ran"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0) for p in prompts]
    together = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    assert [c.finish_reason for c in together.choices] == [a.choices[0].finish_reason for a in alone]
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(together.usage, field) == sum(getattr(a.usage, field) for a in alone)


@pytest.mark.parametrize("kind", ["torch", "llama.cpp"])
def test_a_list_of_prompts_streams_each_choice_with_its_index(encoder, gguf, kind):
    from fastapi.testclient import TestClient

    prompts = ["the cat sat", "a dog", "the river ran"]
    body = {"prompt": prompts, "max_tokens": 5, "temperature": 0}
    with TestClient(_engine_app(kind, encoder, gguf)) as http:
        whole = http.post("/v1/completions", json=body).json()
        streamed = http.post(
            "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
        )
    events = _events(streamed)
    assert streamed.text.count("data: [DONE]") == 1 and streamed.text.rstrip().endswith("data: [DONE]")
    usage = [event for event in events if "usage" in event]
    assert len(usage) == 1 and usage[0] is events[-1] and usage[0]["choices"] == []
    assert usage[0]["usage"] == whole["usage"]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2] and whole["usage"]["prompt_tokens"] > 6
    for choice in whole["choices"]:
        mine = [event["choices"][0] for event in events[:-1] if event["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [c["finish_reason"] for c in mine][-1] == choice["finish_reason"] and choice["text"]


def test_a_list_of_prompts_is_bounded_and_takes_text_only(base):
    _refused(_post(base, "/v1/completions", {"prompt": [[1, 2, 3]]}), "prompt", "token arrays")
    _refused(_post(base, "/v1/completions", {"prompt": ["the cat", [1, 2]]}), "prompt", "token arrays")
    _refused(_post(base, "/v1/completions", {"prompt": ["x"] * 33}), "prompt", "at most 32 per request (--max-prompts)")
    over = _post(base, "/v1/completions", {"prompt": ["the cat", " ".join(SENTENCES * 3)], "max_tokens": 4})
    _refused(over, "prompt", "prompt[1]: ")


# 6. embedding limits


def test_the_default_embedding_limits_are_openais():
    config = ServerConfig()
    assert config.max_inputs == 2048 and config.max_request_tokens == 300_000  # 2048 texts of 146 tokens


def test_langchains_default_embedding_batch_is_taken(base, client):
    langchain_openai = pytest.importorskip(
        "langchain_openai", reason="langchain-openai is not installed (pip install 'unimae[dev]')"
    )
    texts = [f"{SENTENCES[i % len(SENTENCES)]} {i}" for i in range(1001)]
    embeddings = langchain_openai.OpenAIEmbeddings(  # chunk_size left at its default: 1000 texts a request
        model=MODEL, base_url=base + "/v1", api_key=KEY, check_embedding_ctx_length=False, max_retries=0
    )
    vectors = embeddings.embed_documents(texts)
    assert len(vectors) == 1001 and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-4)
    most = client.embeddings.create(model=MODEL, input=["the cat"] * 2048)
    assert len(most.data) == 2048
    _refused(_post(base, "/v1/embeddings", {"input": ["the cat"] * 2049}), "input", "at most 2048")


def test_a_large_float_response_is_the_same_json_written_row_by_row():
    from unimae.serving.schemas import embeddings_json

    vectors = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    for encoding in ("float", "base64"):
        body = json.loads(embeddings_json("m", vectors, encoding, 9))
        assert (
            body["object"] == "list"
            and body["model"] == "m"
            and body["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
        )
        assert [d["index"] for d in body["data"]] == list(range(5))
    floats = np.array([d["embedding"] for d in json.loads(embeddings_json("m", vectors, "float", 9))["data"]])
    assert np.array_equal(floats.astype(np.float32), vectors)


# 7. whitespace-only inputs


@pytest.mark.parametrize("kind", ["torch", "llama.cpp"])
def test_whitespace_only_inputs_embed_as_the_encoder_embeds_them(encoder, gguf, kind):
    from fastapi.testclient import TestClient

    texts = ["the cat sat", "   ", "\n\t"]
    with TestClient(_engine_app(kind, encoder, gguf)) as http:
        response = http.post("/v1/embeddings", json={"input": texts, "encoding_format": "float"})
        empty = http.post("/v1/embeddings", json={"input": ["the cat", ""]})
    assert response.status_code == 200, response.text
    got = np.array([d["embedding"] for d in response.json()["data"]])
    assert np.allclose(got, encoder.encode(texts, normalize=True), atol=1e-3 if kind == "llama.cpp" else 1e-5)
    _refused(empty, "input", "input[1] is empty")


# 8. seeds


@pytest.mark.parametrize("kind", ["torch", "llama.cpp"])
def test_a_negative_seed_is_taken_and_deterministic(encoder, gguf, kind):
    from fastapi.testclient import TestClient

    body = {"prompt": "the cat", "max_tokens": 8, "temperature": 1.0}
    with TestClient(_engine_app(kind, encoder, gguf)) as http:
        for seed in (-1, -(2**63), 2**63 - 1, -12345):
            first, again = (http.post("/v1/completions", json={**body, "seed": seed}) for _ in range(2))
            assert first.status_code == 200, first.text
            assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"], seed
        for seed in (2**63, -(2**63) - 1):
            assert http.post("/v1/completions", json={**body, "seed": seed}).status_code == 400


# 9. content parts


def test_text_parts_are_joined_by_newlines(client):
    parts = [{"type": "text", "text": "the cat"}, {"type": "text", "text": "sat"}]
    assert ChatMessage(role="user", content=parts).content == "the cat\nsat"
    joined = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "the cat\nsat"}], max_tokens=4, temperature=0
    )
    as_parts = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=4, temperature=0
    )
    assert as_parts.usage == joined.usage and as_parts.choices[0].message == joined.choices[0].message


# 10. GET /v1/models/{id}


def test_the_served_model_is_retrieved_by_id(base, client):
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "unimae") and model.created == 0
    assert client.models.list().data[0] == model
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.body["code"] == "model_not_found"
    assert httpx.get(f"{base}/v1/models/{MODEL}", timeout=WAIT).status_code == 401  # the key, as /v1/models


# 11. CORS


def test_cors_answers_the_preflight_before_the_api_key(encoder):
    from fastapi.testclient import TestClient

    origin = "https://app.example.com"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    preflight["Access-Control-Request-Headers"] = "authorization,content-type"
    with TestClient(
        create_app(
            encoder, ServerConfig(model_name=MODEL, api_key=KEY, cors_origins=f"{origin}, http://localhost:3000")
        )
    ) as http:
        allowed = http.options("/v1/embeddings", headers=preflight)
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == origin
        assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
        other = http.options("/v1/embeddings", headers={**preflight, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        answered = http.post(
            "/v1/embeddings", json={"input": "a"}, headers={"Origin": origin, "Authorization": f"Bearer {KEY}"}
        )
        assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == origin
        no_key = http.post("/v1/embeddings", json={"input": "a"}, headers={"Origin": origin})
        assert no_key.status_code == 401 and no_key.headers["access-control-allow-origin"] == origin  # readable
    with TestClient(create_app(encoder, ServerConfig(model_name=MODEL, cors_origins="*"))) as http:
        anyone = http.options("/v1/chat/completions", headers=preflight)
        assert anyone.status_code == 200 and anyone.headers["access-control-allow-origin"] == "*"
    with TestClient(create_app(encoder, ServerConfig(model_name=MODEL, api_key=KEY))) as http:  # off by default
        assert http.options("/v1/embeddings", headers=preflight).status_code == 401
    with pytest.raises(ValueError, match="comma-separated"):
        ServerConfig(cors_origins="https://a.example,,https://b.example")


def test_serve_takes_cors_origins(fake_server, monkeypatch):
    from unimae.cli import main

    monkeypatch.setattr("unimae.runtime.memory.limit_arenas", lambda count=2: None)
    assert main(["serve", "--model", "m", "--cors-origins", "*"]) == 0
    assert main(["serve", "--model", "m"]) == 0
    assert [c.cors_origins for c in fake_server] == ["*", None]


def test_a_request_cancel_reaches_the_running_generation_and_stops_the_rest():
    """Each prompt's generation has a cancel event of its own (an engine sets it when the generation ends, which
    must not end the next one); the request's, set when its client leaves, reaches the one running."""
    from unimae.serving.routes.completions import _Cancel

    cancel = _Cancel()
    first = cancel.next()
    first.set()  # the first generation ended
    second = cancel.next()
    assert not second.is_set() and not cancel.is_set()
    cancel.set()  # the client left
    assert second.is_set() and cancel.next().is_set()
