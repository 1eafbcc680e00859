"""Hostile but fair input, round two (issue 44): a text of any size costs what ``max_length`` costs; bytes that
are not UTF-8, damaged files, folders that cannot be written, a full disk and API keys no client can send are
each one sentence (exit code 2), never a traceback; a NaN embedding is never a 500 or NaN bytes on the wire."""

import contextlib
import errno
import io
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import SENTENCES, RecordingTokenizer, build_tokenizer, post_embeddings

import unimae.embedding.pooling
import unimae.embedding.tokenization
from unimae.cli import main
from unimae.cli.embed import read_texts
from unimae.embedding.pooling import build_inputs
from unimae.embedding.tokenization import TextTooLongWarning, char_budget, prose_cut
from unimae.encoder import Encoder
from unimae.generation.prompt import prompt_ids
from unimae.models import resolve_model_path
from unimae.retrieval.index import LOCK_FILE
from unimae.serving.config import ServerConfig

MAX_LENGTH = 16
POOLINGS = ["eos", "mean", "echo", "summary"]
HOSTILE = [  # long texts of every shape a tokenizer splits differently: prose, one run of spaces, one word ...
    " ".join(SENTENCES) * 300,
    " " * 100_000 + "x",
    "a" * 100_000,
    "é漢🙂 \n\t.," * 20_000,
    "\n".join("    " + word for word in " ".join(SENTENCES).split()) * 50,
]


def _tokenizer(arch: str):
    return build_tokenizer(add_bos=arch != "qwen2", with_mask=arch != "qwen2")


def _options(tokenizer, pooling: str) -> dict:
    return {"summary_ids": [tokenizer.convert_tokens_to_ids("<extra_2>")]} if pooling == "summary" else {}


def _build(pooling: str, tokenizer, texts: list[str], options: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TextTooLongWarning)
        return build_inputs(pooling, tokenizer, texts, MAX_LENGTH, **options)


@pytest.mark.parametrize("pooling", POOLINGS)
def test_the_tokenizer_never_sees_more_of_a_text_than_max_length_needs(arch, pooling):
    """Before: every text was tokenized whole and cut afterwards (a 50 MB line peaked at 7.7 GB)."""
    tokenizer = _tokenizer(arch)
    recording = RecordingTokenizer(tokenizer)
    inputs = _build(pooling, recording, [*HOSTILE, "short"], _options(tokenizer, pooling))
    assert recording.longest <= char_budget(tokenizer, MAX_LENGTH + 2) < 1000
    assert len(inputs) == len(HOSTILE) + 1 and all(len(item.ids) <= MAX_LENGTH + 1 for item in inputs)


def _whole(encode, tokenizer, texts, tokens):
    return encode(list(texts))


@pytest.mark.parametrize("pooling", POOLINGS)
def test_ids_are_those_of_the_whole_text_near_the_limit(arch, pooling, monkeypatch):
    """Texts around the cut and around max_length tokens get exactly the ids (and pool masks) of the code that
    tokenized them whole."""
    tokenizer = _tokenizer(arch)
    options = _options(tokenizer, pooling)
    cut = char_budget(tokenizer, MAX_LENGTH + 2)
    words = " ".join(SENTENCES).split()
    texts = [source[:n] for source in HOSTILE for n in range(cut - 60, cut + 61, 3)]
    texts += [" ".join(words[:k]) for k in range(1, 40)] + HOSTILE  # fits, fits exactly, one token over ...
    bounded = _build(pooling, tokenizer, texts, options)
    monkeypatch.setattr(unimae.embedding.pooling, "tokenize_bounded", _whole)
    monkeypatch.setattr(unimae.embedding.tokenization, "tokenize_bounded", _whole)
    whole = _build(pooling, tokenizer, texts, options)
    assert [(b.ids, b.pool) for b in bounded] == [(w.ids, w.pool) for w in whole]


def test_eos_ids_match_the_uncut_tokenization_rule(arch):
    """The UniMAE rule, written out: the tokenizer's ids of the whole text (its own EOS dropped), the first
    max_length - 1 of them, then EOS."""
    tokenizer = _tokenizer(arch)
    eos = tokenizer.eos_token_id
    texts = [source[: char_budget(tokenizer, MAX_LENGTH + 2) + shift] for source in HOSTILE for shift in (-5, 0, 5)]
    for text, item in zip(texts, _build("eos", tokenizer, texts, {}), strict=True):
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        ids = ids[:-1] if ids and ids[-1] == eos else ids
        assert item.ids == ids[: MAX_LENGTH - 1] + [eos]


@pytest.mark.parametrize("limit", [8, 40])
@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_prompt_ids_are_the_whole_prompts_within_the_limit_and_read_no_further_beyond(arch, limit, chat):
    """A generation prompt (plain, or through the chat template) of at most ``limit`` tokens gets exactly the ids
    of the whole text; a longer one more than ``limit`` ids, its text read only to the char budget of limit + 1
    tokens. Before: every prompt was tokenized whole (a 4 MB prompt: +0.63 GB and 4.7 s before its 400)."""
    tokenizer = _tokenizer(arch)
    recording = RecordingTokenizer(tokenizer)
    cut, first = char_budget(tokenizer, limit + 1), prose_cut(tokenizer, limit + 1)
    words = " ".join(SENTENCES * 3).split()
    texts = [source[:n] for source in HOSTILE for c in (first, cut) for n in range(max(c - 60, 1), c + 61, 3)]
    texts += [" ".join(words[:k]) for k in range(1, 3 * limit)] + HOSTILE  # fits, fits exactly, one token over ...
    for text in texts:
        whole = prompt_ids(tokenizer, text, chat=chat)
        bounded = prompt_ids(recording, text, limit, chat=chat)
        if len(whole) <= limit:
            assert bounded == whole, text[:80]
        else:
            assert len(bounded) > limit and bounded[: limit + 1] == whole[: limit + 1], text[:80]
    assert recording.longest <= cut


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_a_long_prose_prompt_is_refused_from_its_first_prose_chars(arch, chat):
    """Prose over the limit is known to be too long from its first ``prose_cut`` characters (the offsets show
    its first limit + 1 ids end well before the cut), not the worst-case ``char_budget``. Before: a 4 MB prompt
    against SmolLM2's 8k context was tokenized to 660k characters (150k tokens, +0.13 GB kept by the server's
    worker thread) to be refused."""
    tokenizer, limit = _tokenizer(arch), 40
    recording = RecordingTokenizer(tokenizer)
    prompt = " ".join(SENTENCES) * 400
    ids = prompt_ids(recording, prompt, limit, chat=chat)
    assert len(ids) > limit and ids[: limit + 1] == prompt_ids(tokenizer, prompt, chat=chat)[: limit + 1]
    assert recording.longest <= prose_cut(tokenizer, limit + 1) < char_budget(tokenizer, limit + 1)


def test_unimae_generate_refuses_a_prompt_over_the_context(tiny_model_dirs, monkeypatch, capsys):
    """The CLI shares the bounded prompt: a prompt over the model's context (512) is one sentence naming it."""
    load, recordings = Encoder.from_pretrained, []

    def recorded(*args, **kwargs):
        encoder = load(*args, **kwargs)
        encoder.tokenizer = RecordingTokenizer(encoder.tokenizer)
        recordings.append(encoder.tokenizer)
        return encoder

    monkeypatch.setattr(Encoder, "from_pretrained", recorded)
    prompt = " ".join(SENTENCES) * 400  # about 200k characters, thousands of tokens
    assert main(["generate", "--model", str(tiny_model_dirs["llama"]), "--precision", "fp32", prompt]) == 2
    err = capsys.readouterr().err
    assert "unimae generate: error: the prompt is longer than the model's context of 512 tokens" in err, err
    assert "Traceback" not in err
    assert recordings[0].longest <= char_budget(recordings[0].tokenizer, 512 + 1) < len(prompt) // 10


def test_nan_weights_in_unimae_generate_are_one_sentence_not_a_traceback(tiny_model_dirs, monkeypatch, capsys):
    """Before: ``unimae generate`` with damaged (NaN) weights printed the NonFiniteLogitsError's traceback."""
    import torch

    load = Encoder.from_pretrained

    def damaged(*args, **kwargs):
        encoder = load(*args, **kwargs)
        with torch.no_grad():
            for weight in encoder.model.parameters():
                weight.fill_(float("nan"))
        return encoder

    monkeypatch.setattr(Encoder, "from_pretrained", damaged)
    assert main(["generate", "--model", str(tiny_model_dirs["llama"]), "--precision", "fp32", "the cat"]) == 2
    err = capsys.readouterr().err
    assert "unimae generate: error: the model gave non-finite next-token scores" in err and "Traceback" not in err


def test_invalid_utf8_on_stdin_is_one_sentence(tiny_model_dirs, monkeypatch, capsys):
    """Before (``printf 'ok\\n\\xff\\n' | unimae embed``): TypeError: TextEncodeInput must be ... (a traceback)."""
    stdin = io.TextIOWrapper(io.BytesIO(b"ok\n\xff\n"), encoding="utf-8", errors="surrogateescape")  # C locale
    monkeypatch.setattr(sys, "stdin", stdin)
    assert main(["embed", "--model", str(tiny_model_dirs["llama"])]) == 2
    err = capsys.readouterr().err
    assert "line 2 of standard input is not UTF-8 text (byte 0xff at byte 0)" in err and "Traceback" not in err


def test_stdin_lines_split_as_text_mode_did(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("first\r\nsecond\n\nthird é".encode())))
    assert read_texts([], None) == ["first", "second", "", "third é"]


@pytest.mark.parametrize(
    "argv, where",
    [
        (["generate", "ok \udcff"], "the prompt"),
        (["embed", "ok", "bad \udcff"], "text argument 2"),
        (["embed", "--prompt", "query\udcff: ", "ok"], "--prompt"),
        (["ask", "why \udcff", "--index", "nowhere"], "the question"),
    ],
)
def test_invalid_utf8_in_arguments_is_one_sentence(tiny_model_dirs, argv, where, capsys):
    """Before (``unimae generate $'ok \\xff'``): the tokenizer's TypeError. Python hands the undecodable byte over
    as the lone surrogate U+DCFF."""
    model = [] if argv[0] == "ask" else ["--model", str(tiny_model_dirs["llama"])]
    assert main([*argv, *model]) == 2
    assert f"{where} is not UTF-8 text (byte 0xff at character" in capsys.readouterr().err


def _tiny_gguf(path: Path) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight", np.zeros((64, 256), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("damage", ["truncated", "fake"])
def test_a_truncated_or_fake_gguf_is_one_sentence(tmp_path, damage, capsys):
    """Before: struct.error (a traceback), or numpy's 'cannot reshape array' naming no file."""
    path = tmp_path / "model.gguf"
    if damage == "fake":
        path.write_bytes(b"GGUF\x03\x00\x00\x00 and then nothing a GGUF holds")
    else:
        _tiny_gguf(path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model.gguf is not a readable GGUF model .*truncated, damaged or not a GGUF"):
        resolve_model_path(str(path))
    assert main(["embed", "--model", str(path), "hello"]) == 2
    assert "model.gguf is not a readable GGUF model" in capsys.readouterr().err


def test_export_to_a_folder_that_cannot_be_written_fails_before_merging(tiny_model_dirs, tmp_path, monkeypatch, capsys):
    """Before: the merge ran first (60 s for a real model), then the write failed."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setattr("unimae.export.gguf.merged_model", lambda *args: pytest.fail("merged before checking --output"))
    argv = ["export", "--model", str(tiny_model_dirs["llama"]), "--format", "gguf", "--output"]
    assert main([*argv, str(blocker / "sub" / "model.gguf")]) == 2
    assert f"cannot write to {blocker / 'sub'} (" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


class SafetensorError(Exception):
    """Stands in for safetensors' own error class (not an OSError), which a full disk raises."""


@pytest.mark.parametrize(
    "failure",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        SafetensorError('Error while serializing: IoError(Os { code: 28, message: "No space left on device" })'),
    ],
    ids=["oserror", "safetensors"],
)
def test_full_disk_during_export_leaves_no_partial_folder(tiny_model_dirs, tmp_path, monkeypatch, capsys, failure):
    """Before: the library's error (a SafetensorError traceback) and a `.exp.partial/` folder left behind."""

    def disk_full(model, adapter, directory):
        (Path(directory) / "model.safetensors").write_bytes(b"half a model")
        raise failure

    monkeypatch.setattr("unimae.export.hf.save_merged", disk_full)
    out = tmp_path / "exp"
    assert main(["export", "--model", str(tiny_model_dirs["llama"]), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"could not write {out}: the disk is full" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_full_disk_while_writing_the_index_is_one_sentence(tiny_model_dirs, tmp_path, monkeypatch, capsys):
    """Before: FAISS's RuntimeError (a traceback)."""
    import faiss

    def disk_full(index, path):
        Path(path).write_bytes(b"half an index")
        raise RuntimeError(
            "Error in faiss::write_index: 'ret == (n)' failed: write error in x (No space left on device)"
        )

    monkeypatch.setattr(faiss, "write_index", disk_full)
    corpus, out = tmp_path / "docs.txt", tmp_path / "idx"
    corpus.write_text("\n".join(SENTENCES) + "\n")
    argv = ["index", "--model", str(tiny_model_dirs["llama"]), "--corpus", str(corpus), "--output-dir", str(out)]
    assert main([*argv, "--precision", "fp32"]) == 2
    err = capsys.readouterr().err
    assert f"could not write {out / 'index.faiss'}: the disk is full" in err and "Traceback" not in err
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == [LOCK_FILE]  # no temporary file left


@pytest.mark.parametrize("key", ["clé-secrète", "tab\tkey", " padded "])
def test_an_api_key_no_client_can_send_is_refused_at_start(key, monkeypatch, capsys):
    """Before: accepted, and every request got 401 (the header read as latin-1, the key encoded as UTF-8)."""
    with pytest.raises(ValueError, match="printable ASCII"):
        ServerConfig(api_key=key)
    monkeypatch.setenv("UNIMAE_API_KEY", key)
    assert main(["serve", "--model", "/nowhere/model"]) == 2
    assert "the API key must be printable ASCII" in capsys.readouterr().err  # said before any model is loaded


def test_a_large_body_is_followed_by_a_heap_trim_and_a_small_one_is_not():
    """After a request whose body had at least ``min_bytes``, freed heap memory goes back to the OS (what its
    worker thread parsed and tokenized; the batcher's trim waits for an empty queue, which the hostile load test
    never gave it); the small requests of the normal path pay nothing. Every app has it in front of its routes."""
    import asyncio

    import httpx
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from unimae.serving.app import create_app
    from unimae.serving.heap_release import HeapRelease

    async def read(request):
        return PlainTextResponse(str(len(await request.body())))

    released: list[int] = []
    routes = Starlette(routes=[Route("/", read, methods=["POST"])])
    app = HeapRelease(routes, min_bytes=1000, release=lambda: released.append(1))

    async def post(size: int) -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            response = await http.post("/", content=b"x" * size)
        assert response.text == str(size)
        return len(released)

    assert asyncio.run(post(999)) == 0
    assert asyncio.run(post(1000)) == 1
    served = create_app(object(), ServerConfig())
    assert [m.cls for m in served.user_middleware][0] is HeapRelease, "outermost: it counts the body the guard let in"


def test_a_nan_embedding_is_a_clear_error_not_a_500_nor_nan_bytes(tiny_model_dirs, monkeypatch):
    """Before: float answers were 500 ('Out of range float values are not JSON compliant'), base64 answers 200
    with NaN bytes."""
    encoder = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), precision="fp32", max_length=32)
    embed = encoder.encode_inputs

    def second_is_nan(inputs, **kwargs):
        vectors = embed(inputs, **kwargs)  # (N, D)
        vectors[1:2] = np.nan
        return vectors

    monkeypatch.setattr(encoder, "encode_inputs", second_is_nan)
    texts = ["the cat sat", "a dog ran"]
    for response in post_embeddings(encoder, [{"input": texts}, {"input": texts, "encoding_format": "base64"}]):
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "non_finite_embedding" and error["param"] == "input"
        assert "NaN or infinite embedding for input[1] (1 of 2 inputs)" in error["message"]


def test_pick_token_refuses_nan_scores_and_keeps_a_minus_inf_mask():
    import torch

    from unimae.generation.sampling import GenerationParams, NonFiniteLogitsError, pick_token

    greedy, sampled = GenerationParams(), GenerationParams(temperature=1.0, seed=0)
    masked = torch.tensor([[0.5, -float("inf"), 2.0, -float("inf")]])  # (1, V)
    assert pick_token(masked, greedy, None) == 2
    assert pick_token(masked, sampled, torch.Generator().manual_seed(0)) in (0, 2)
    for bad in ([[0.5, float("nan"), 2.0]], [[0.5, float("inf"), 2.0]], [[-float("inf")] * 3]):
        for params in (greedy, sampled):
            with pytest.raises(NonFiniteLogitsError, match="non-finite next-token scores"):
                pick_token(torch.tensor(bad), params, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("batching", ["continuous", "threads"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_weights_make_completions_a_clear_422_not_a_500_nor_garbage(tiny_model_dirs, batching, temperature, caplog):
    """Before: greedy answered 200 with the tokens at the NaNs' positions; sampling answered 500 (``probability
    tensor contains either inf, nan``) with a traceback in the log. Now: 422 ``non_finite_logits`` in the body or in
    the stream, one ERROR line, no traceback."""
    import asyncio
    import json
    import logging

    import httpx
    import torch

    from unimae.serving.app import create_app

    encoder = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), precision="fp32", max_length=32)
    with torch.no_grad():
        for weight in encoder.model.parameters():
            weight.fill_(float("nan"))
    config = ServerConfig(model_name="tiny", continuous_batching=batching == "continuous")
    app = create_app(encoder, config)
    engine = app.state.server.engine
    sampling = {"max_tokens": 4, "temperature": temperature}
    chat = {"messages": [{"role": "user", "content": "the dog ran"}], **sampling}

    async def main():
        engine.start()
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
                plain = await http.post("/v1/completions", json={"prompt": "the cat sat", **sampling})
                chatted = await http.post("/v1/chat/completions", json=chat)
                streamed = await http.post("/v1/completions", json={"prompt": "the cat", "stream": True, **sampling})
        finally:
            await engine.stop()
        return plain, chatted, streamed

    with caplog.at_level(logging.INFO):
        plain, chatted, streamed = asyncio.run(main())
    for response in (plain, chatted):
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "non_finite_logits" and "non-finite next-token scores" in error["message"]
    assert streamed.status_code == 200  # the headers went before the first token
    events = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "non_finite_logits", events
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert sum("a generation stopped" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR) == 3


WAIT = 60  # seconds: a guard against a hang, never an ordering device


def _read_response(sock) -> tuple[int, bytes]:
    """The status and body of the next HTTP/1.1 response on ``sock`` (the body read whole, by its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        assert part, f"the server closed the connection mid-response: {data!r}"
        data += part
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split(b" ")[1]), body


@contextlib.contextmanager
def _serving(tiny_model_dirs, monkeypatch, *flags: str) -> Iterator[int]:
    """``unimae serve --port 0`` with ``flags`` in a thread, its uvicorn server kept so the test can stop it; yields
    the port the server bound (what `serve` prints); stopped on exit."""
    import threading

    import uvicorn

    servers: list[tuple[uvicorn.Server, int]] = []
    real_run = uvicorn.Server.run

    def run(self, sockets=None):  # the Server `unimae serve` made, with its options, noted before it runs
        servers.append((self, sockets[0].getsockname()[1]))
        return real_run(self, sockets=sockets)

    monkeypatch.setattr(uvicorn.Server, "run", run)
    argv = ["serve", "--model", str(tiny_model_dirs["llama"]), "--precision", "fp32", "--port", "0", *flags]
    thread = threading.Thread(target=main, args=(argv,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT
        while not (servers and servers[0][0].started):
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        yield servers[0][1]
    finally:
        if servers:
            servers[0][0].should_exit = True
        thread.join(WAIT)
    assert not thread.is_alive()


def _closed_after(conn, since: float) -> float:
    """Seconds from ``since`` until the server closes ``conn``, on which it must send nothing more (blocks until
    then). ``since`` is read before the client acts that starts the server's timer, so the lower bounds on it hold
    however late this thread runs."""
    assert conn.recv(1) == b"", "the server sent something on an idle connection"
    return time.monotonic() - since


def test_keep_alive_reuses_a_connection_within_the_timeout_and_closes_it_after(tiny_model_dirs, monkeypatch):
    """``unimae serve --keep-alive-s`` reaches uvicorn: a second request within the timeout is answered on the same
    connection; the connection, idle, is then closed by the server, not before the timeout and not never."""
    import socket

    keep_alive = 6.0  # over uvicorn's own default (5 s): a timeout that did not reach uvicorn fails the lower bound
    with _serving(tiny_model_dirs, monkeypatch, "--keep-alive-s", str(keep_alive)) as port:
        request = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as conn:
            conn.sendall(request)
            assert _read_response(conn)[0] == 200
            since = time.monotonic()  # before the request whose response starts the keep-alive timer
            conn.sendall(request)  # at once: well within the timeout
            assert _read_response(conn)[0] == 200  # answered on the same connection
            idle = _closed_after(conn, since)  # blocks until it closes
        assert keep_alive - 0.1 <= idle < WAIT, idle


def test_headers_that_never_come_or_trickle_in_are_cut_off_at_the_header_timeout(tiny_model_dirs, monkeypatch, caplog):
    """Before: a connection that sent nothing, or its headers a byte at a time, was held for ever (uvicorn starts its
    keep-alive timer only after a response, and every byte resets it). Now ``--header-timeout-s`` after it opens
    the connection is closed: silently if nothing came, with a 408 if part of a request did, and bytes that keep
    trickling in (every 0.2 s here, against a 1.5 s timeout) do not extend it."""
    import logging
    import select
    import socket

    timeout = 1.5
    with (
        caplog.at_level(logging.INFO),
        _serving(tiny_model_dirs, monkeypatch, "--header-timeout-s", str(timeout)) as port,
    ):
        since = time.monotonic()  # before the connection whose opening starts the header timer
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as silent:
            idle = _closed_after(silent, since)
        opened = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as slow:
            slow.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode())
            while not select.select([slow], [], [], 0.2)[0]:  # one more header line until the server answers
                assert time.monotonic() - opened < WAIT, "the server held a connection that kept sending headers"
                slow.sendall(b"X-Padding: 1\r\n")
            status, body = _read_response(slow)
            trickled = time.monotonic() - opened
            assert slow.recv(1) == b""  # and closed
    assert timeout - 0.1 <= idle < WAIT, idle
    assert status == 408 and b"request headers did not arrive within 1.5 s" in body, body
    assert timeout - 0.1 <= trickled < WAIT, trickled
    closed = [r.getMessage() for r in caplog.records if "no complete request headers" in r.getMessage()]
    assert len(closed) == 2 and "(0 bytes of them came)" in closed[0], closed


def test_the_header_timeout_spares_requests_whose_headers_came_and_idle_keep_alive(tiny_model_dirs, monkeypatch):
    """Once a request's headers are in, the header timeout is done with it: a body that stalls gets the body
    timeout's 408 (2 s, after the 1 s header timeout), and an idle connection after a response is closed by the
    keep-alive timeout (3 s), not by the header timeout (which waits for the next request's first byte)."""
    import socket

    flags = ["--header-timeout-s", "1", "--body-timeout-s", "2", "--keep-alive-s", "3"]
    with _serving(tiny_model_dirs, monkeypatch, *flags) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as conn:
            head = f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 20\r\n\r\n"
            conn.sendall(head.encode() + b'{"input": ')  # and the rest never
            status, body = _read_response(conn)
        assert status == 408 and b"request body did not arrive within 2 s" in body, body
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as conn:
            since = time.monotonic()
            conn.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            assert _read_response(conn)[0] == 200
            idle = _closed_after(conn, since)
    assert 3 - 0.1 <= idle < WAIT, idle
