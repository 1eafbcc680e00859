"""The command line's parsers (help pages, choices from the registries), input and API-key handling, and
``unimae.retrieval.rag.load_index_and_encoder`` (the library side of ``ask`` / ``serve --index``)."""

import argparse
import logging
import re

import pytest
from conftest import SENTENCES

from unimae.cli import build_parser, main
from unimae.embedding.attention import ATTENTION_RULES
from unimae.embedding.pooling import POOLINGS
from unimae.export.base import FORMATS
from unimae.retrieval.index import INDEX_KINDS, VectorIndexError
from unimae.runtime.precision import INFERENCE_PRECISIONS, PRECISIONS
from unimae.training.config import method_names

PASSAGES = [(f"p{i}", text) for i, text in enumerate(SENTENCES)]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def _pages() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every (sub)command's parser by its argv, e.g. ("evaluate", "embeddings")."""
    pages = {}
    for name, parser in _subparsers(build_parser()).items():
        pages[(name,)] = parser
        pages.update({(name, kind): sub for kind, sub in _subparsers(parser).items()})
    return pages


def _choices(argv: tuple[str, ...], option: str) -> list:
    return list(_pages()[argv]._option_string_actions[option].choices)


def test_every_subcommand_is_listed():
    names = {argv[0] for argv in _pages()}
    expected = {"train", "embed", "generate", "check", "evaluate", "compare", "export", "index", "ask", "serve"}
    assert names == expected | {"models", "release", "rotation", "mine"}
    assert {argv[1] for argv in _pages() if len(argv) == 2} == {"embeddings", "summary", "figures", "generation"}


@pytest.mark.parametrize("argv", sorted(_pages()), ids="-".join)
def test_help_renders_and_shows_each_default_once(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: unimae " + " ".join(argv))
    options = re.split(r"\n  (?=-)", text.split("\noptions:\n", 1)[-1])  # one block per option
    twice = [block.split()[0] for block in options if block.count("(default:") > 1]
    assert not twice, f"defaults shown twice for {twice}"


def test_serve_help_states_server_defaults_once(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert text.count("(default: 4194304)") == 1 and text.count("(default: unimae)") == 1
    assert "--api-key-file" in text and "(default: 8000)" in text


def test_pooling_attention_precision_kind_format_and_method_choices_come_from_the_registries():
    pooling = ["auto", *POOLINGS]
    assert _choices(("embed",), "--pooling") == pooling
    assert _choices(("evaluate", "embeddings"), "--pooling") == pooling
    assert _choices(("evaluate", "embeddings"), "--attention") == list(ATTENTION_RULES)
    assert _choices(("index",), "--kind") == list(INDEX_KINDS)
    assert _choices(("export",), "--format") == list(FORMATS)
    assert _choices(("train",), "--method") == method_names()
    with_precision = [argv for argv, parser in _pages().items() if "--precision" in parser._option_string_actions]
    assert {argv[-1] for argv in with_precision} >= {"train", "embed", "generate", "index", "ask", "serve"}
    inference = {("embed",), ("generate",), ("serve",), ("evaluate", "embeddings")}  # + the CPU decode/int8 ones
    for argv in with_precision:
        expected = INFERENCE_PRECISIONS if argv in inference else PRECISIONS
        assert _choices(argv, "--precision") == list(expected), argv


@pytest.mark.parametrize(
    ("name", "content", "problem"),
    [
        ("in.txt", b"fine\n\xff\xfe broken\n", "invalid UTF-8"),
        ("in.jsonl", b'{"text": "fine"}\n{"text": oops}\n', "not valid JSON"),
        ("in.jsonl", b'{"text": "fine"}\n{"body": "no text field"}\n', "'text' field"),
    ],
    ids=["txt-utf8", "jsonl-json", "jsonl-field"],
)
def test_embed_input_errors_name_the_file_and_line(tmp_path, capsys, name, content, problem):
    path = tmp_path / name
    path.write_bytes(content)
    assert main(["embed", "--input", str(path)]) == 2  # fails before any model is loaded
    err = capsys.readouterr().err
    assert err.startswith("unimae embed: error:") and f"{path}, line 2" in err and problem in err


def test_embed_missing_input_file_is_a_clear_error(tmp_path, capsys):
    assert main(["embed", "--input", str(tmp_path / "nope.txt")]) == 2
    assert f"input file {tmp_path / 'nope.txt'} does not exist" in capsys.readouterr().err


def test_serve_limits_malloc_arenas_before_loading_the_model(fake_server, monkeypatch):
    """The worker threads' arenas are capped before any thread can make one (runtime.memory.limit_arenas)."""
    events = []
    monkeypatch.setattr("unimae.runtime.memory.limit_arenas", lambda count=2: events.append(("arenas", count)))
    monkeypatch.setattr("unimae.encoder.Encoder.from_pretrained", lambda *a, **k: events.append("load") or "encoder")
    assert main(["serve", "--model", "m"]) == 0
    assert events == [("arenas", 2), "load"]


def _key_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "--api-key" in r.getMessage()]


def test_api_key_file_is_read_and_stripped_without_a_warning(fake_server, tmp_path, caplog):
    key_file = tmp_path / "key"
    key_file.write_text("  s3cret\n")
    assert main(["serve", "--model", "m", "--api-key-file", str(key_file)]) == 0
    assert fake_server[0].api_key == "s3cret" and fake_server[0].model_name == "m"
    assert not _key_warnings(caplog)


def test_api_key_on_the_command_line_warns(fake_server, caplog):
    assert main(["serve", "--model", "m", "--api-key", "visible"]) == 0
    assert fake_server[0].api_key == "visible"
    assert any("visible to other users" in message for message in _key_warnings(caplog))


def test_api_key_from_the_environment_and_bad_key_files(fake_server, monkeypatch, tmp_path, capsys, caplog):
    monkeypatch.setenv("UNIMAE_API_KEY", "from-env")
    assert main(["serve", "--model", "m"]) == 0
    assert fake_server[0].api_key == "from-env" and not _key_warnings(caplog)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert main(["serve", "--api-key-file", str(empty)]) == 2
    assert f"API key file {empty} is empty" in capsys.readouterr().err
    assert main(["serve", "--api-key-file", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["serve", "--api-key", "k", "--api-key-file", str(empty)]) == 2
    assert "not both" in capsys.readouterr().err


@pytest.fixture
def loads(monkeypatch):
    """The keyword arguments of every Encoder.from_pretrained call (no model is loaded), with uvicorn and
    create_app faked as in ``fake_server`` but the port really checked and bound."""
    calls = []
    monkeypatch.setattr("unimae.encoder.Encoder.from_pretrained", lambda *args, **kwargs: calls.append(kwargs))
    monkeypatch.setattr("unimae.serving.app.create_app", lambda encoder, config, index: None)
    monkeypatch.setattr("unimae.cli.serve.run_uvicorn", lambda app, sock, config: sock.close())
    monkeypatch.delenv("UNIMAE_API_KEY", raising=False)
    return calls


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def index_at_32(tiny_model_dirs, tmp_path):
    """An index of the tiny Llama whose passages were embedded at max_length 32."""
    from unimae.encoder import Encoder
    from unimae.retrieval.index import VectorIndex

    tiny = str(tiny_model_dirs["llama"])
    encoder = Encoder.from_pretrained(tiny, precision="fp32", max_length=32)
    VectorIndex.build(
        encoder, PASSAGES, tmp_path / "idx", source={"model": tiny, "adapter": None, "adapter_revision": "base"}
    )
    return str(tmp_path / "idx")


def test_serve_max_length_with_an_index_is_the_index_s_and_another_is_refused(index_at_32, loads, capsys):
    """Before: `serve --index DIR --max-length 16` served at the index's length, silently ignoring the flag."""
    port = ["--port", str(_free_port())]
    for engine in (["--engine", "torch"], ["--engine", "llama.cpp", "--gguf", "model.gguf"]):
        assert main(["serve", "--index", index_at_32, "--max-length", "16", *engine, *port]) == 2
        err = capsys.readouterr().err
        assert "--max-length 16 differs from the index's max_length 32" in err, err
        assert "Leave --max-length out" in err and "unimae index --max-length 16" in err and "Traceback" not in err
    assert loads == []  # refused before any model loaded
    for given in ([], ["--max-length", "32"]):  # not given, or the index's own: the index's
        assert main(["serve", "--index", index_at_32, "--precision", "fp32", *given, *port]) == 0
        assert loads.pop()["max_length"] == 32
    assert main(["serve", "--model", "m", *port]) == 0  # without an index: as before
    assert loads.pop()["max_length"] == 512
    assert main(["serve", "--model", "m", "--max-length", "16", *port]) == 0
    assert loads.pop()["max_length"] == 16


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_serve_refuses_a_port_out_of_range_before_loading(port, loads, capsys):
    """Before: `--port 99999` printed "unimae serving ... :99999", then a traceback (OverflowError from bind)."""
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--model", "m", "--port", port])
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert "argument --port" in err and "from 0 to 65535" in err and "serving" not in out
    assert loads == []


def test_serve_on_a_port_in_use_fails_in_one_line_without_claiming_to_serve(loads, monkeypatch, capsys):
    """Before: "unimae serving ... on http://127.0.0.1:PORT" was printed, then uvicorn's bind error. Now a port in
    use is one line and exit 2, before the model loads; one taken while the model loads, after it, before the
    line that says the server serves."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["serve", "--model", "m", "--port", port]) == 2
        out, err = capsys.readouterr()
        assert err.strip() == (
            f"unimae serve: error: cannot listen on 127.0.0.1:{port}: Address already in use; another process "
            "listens there: stop it or pass another --port"
        )
        assert "serving" not in out and loads == []

    port = str(_free_port())
    with socket.socket() as late:

        def load_while_another_takes_the_port(*args, **kwargs):
            late.bind(("127.0.0.1", int(port)))
            late.listen()
            return "encoder"

        monkeypatch.setattr("unimae.encoder.Encoder.from_pretrained", load_while_another_takes_the_port)
        assert main(["serve", "--model", "m", "--port", port]) == 2
        out, err = capsys.readouterr()
        assert f"cannot listen on 127.0.0.1:{port}" in err and "serving" not in out
    monkeypatch.setattr("unimae.encoder.Encoder.from_pretrained", lambda *args, **kwargs: "encoder")
    assert main(["serve", "--model", "m", "--port", port]) == 0  # free again
    assert f"unimae serving m on http://127.0.0.1:{port}" in capsys.readouterr().out


def test_serve_port_0_prints_the_port_it_bound_and_holds_it(loads, monkeypatch, capsys):
    """Before: `serve --port 0` printed "on http://127.0.0.1:0" and uvicorn bound a port of its own later. Now the
    socket is bound before the line is printed, the line names its port, and uvicorn serves on that socket."""
    import socket

    served = []

    def run(app, sock, config):
        served.append(sock.getsockname()[1])
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", served[-1]))  # the port is held while the server runs
        sock.close()

    monkeypatch.setattr("unimae.cli.serve.run_uvicorn", run)
    assert main(["serve", "--model", "m", "--port", "0"]) == 0
    (port,) = served
    assert port != 0 and f"unimae serving m on http://127.0.0.1:{port} " in capsys.readouterr().out


def _adapter(tiny_dir, directory, spec, seed: int) -> str:
    """A fresh random LoRA adapter of ``tiny_dir`` whose unimae.json records ``spec``."""
    import torch
    from peft import LoraConfig, get_peft_model

    from unimae.adapter import AdapterMeta, base_fingerprint, quiet_peft, write_adapter_meta
    from unimae.models import load_model

    model, _, _ = load_model(str(tiny_dir))
    fingerprint = base_fingerprint(model)
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    with quiet_peft():
        lora = get_peft_model(model, config)
    lora.save_pretrained(directory)
    write_adapter_meta(directory, AdapterMeta(str(tiny_dir), fingerprint, spec))
    return str(directory)


@pytest.fixture
def mean_index(tiny_model_dirs, tmp_path):
    """(index dir, its adapter, another adapter): an index built with a bidirectional-mean adapter."""
    from unimae.adapter import adapter_revision
    from unimae.embedding.spec import EmbeddingSpec
    from unimae.encoder import Encoder
    from unimae.retrieval.index import VectorIndex

    tiny = tiny_model_dirs["llama"]
    spec = EmbeddingSpec(attention="bidirectional", pooling="mean")
    adapter = _adapter(tiny, tmp_path / "adapter", spec, seed=1)
    other = _adapter(tiny, tmp_path / "other", spec, seed=2)
    encoder = Encoder.from_pretrained(str(tiny), adapter=adapter, precision="fp32", max_length=32)
    source = {"model": str(tiny), "adapter": adapter, "adapter_revision": adapter_revision(adapter)}
    source["merged"] = encoder.adapter_merged
    VectorIndex.build(encoder, PASSAGES, tmp_path / "idx", source=source)
    return tmp_path / "idx", adapter, other


def test_load_index_and_encoder_embeds_queries_as_the_index_was_built(mean_index):
    from unimae.retrieval.rag import RAG, load_index_and_encoder

    index_dir, _, _ = mean_index
    encoder, index = load_index_and_encoder(index_dir, precision="fp32")
    assert encoder.spec == index.spec and (encoder.attention, encoder.pooling) == ("bidirectional", "mean")
    assert encoder.max_length == 32 and encoder.adapter_merged == index.manifest["merged"]
    hits = index.search(encoder.encode([SENTENCES[4]], normalize=True), k=1)[0]
    assert hits[0].id == "p4" and abs(hits[0].score - 1) < 1e-4
    assert RAG(encoder, index).retrieve(SENTENCES[4], k=1)[0].id == "p4"


def test_load_index_and_encoder_refuses_another_adapter_revision(mean_index, tmp_path, capsys):
    from unimae.retrieval.rag import load_index_and_encoder

    index_dir, _, other = mean_index
    with pytest.raises(VectorIndexError, match="adapter revision"):
        load_index_and_encoder(index_dir, adapter=other)
    with pytest.raises(VectorIndexError, match="does not exist"):
        load_index_and_encoder(index_dir, adapter=str(tmp_path / "gone"))
    assert main(["ask", "q", "--index", str(index_dir), "--adapter", other]) == 2
    assert "rebuild the index" in capsys.readouterr().err
