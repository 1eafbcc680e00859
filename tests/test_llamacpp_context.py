"""``unimae serve --engine llama.cpp --context N``: tokens per request (prompt + new tokens, or one embedding
input), at most the GGUF's trained context; the torch engine refuses the flag like --gguf/--threads/--slots.

The refusals come before llama.cpp starts (no xllamacpp needed); what llama.cpp is given is checked on a
recording stand-in for ``xllamacpp.Server`` (skipped without xllamacpp)."""

from __future__ import annotations

from pathlib import Path

import pytest

from unimae.serving.llamacpp_engine import LlamaCppModel

TRAINED = 512  # max_position_embeddings of the tiny models (unimae.tiny_models)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dirs, tmp_path_factory) -> Path:
    """The tiny Llama as an f32 GGUF (its llama.context_length is TRAINED)."""
    from unimae.export import export

    root = tmp_path_factory.mktemp("context")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UNIMAE_CACHE", str(root / "cache"))
        return export(str(tiny_model_dirs["llama"]), None, root / "tiny.gguf", fmt="gguf", gguf_type="f32")


@pytest.fixture
def llama_cpp_never_starts(monkeypatch):
    """A refusal must come before llama.cpp loads the model (with xllamacpp installed, starting it fails)."""
    try:
        import xllamacpp
    except ImportError:
        return

    def start(params):
        pytest.fail("llama.cpp started: the context was not refused first")

    monkeypatch.setattr(xllamacpp, "Server", start)


def test_resolve_context_defaults_within_the_trained_context_and_refuses_what_it_cannot_hold():
    from unimae.serving.llamacpp_engine import DEFAULT_CONTEXT, resolve_context

    path = Path("m.gguf")
    assert resolve_context(None, None, path) == DEFAULT_CONTEXT == 2048
    assert resolve_context(None, 8192, path) == 2048
    assert resolve_context(None, TRAINED, path) == TRAINED  # the default never exceeds the trained context
    assert resolve_context(4096, 8192, path) == 4096
    assert resolve_context(TRAINED, TRAINED, path) == TRAINED
    with pytest.raises(ValueError, match="--context 8193 is over the 8192 tokens m.gguf was trained for"):
        resolve_context(8193, 8192, path)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="--context must be at least 1 token"):
            resolve_context(bad, 8192, path)


def test_llamacpp_model_refuses_a_context_before_llama_cpp_starts(tiny_gguf, llama_cpp_never_starts):
    """Before: --context did not exist, and a context over the trained one was silently clamped."""
    with pytest.raises(ValueError, match=f"--context {TRAINED + 1} is over the {TRAINED} tokens"):
        LlamaCppModel(tiny_gguf, max_length=32, context=TRAINED + 1)
    with pytest.raises(ValueError, match="--context must be at least 1 token, got 0"):
        LlamaCppModel(tiny_gguf, max_length=32, context=0)
    with pytest.raises(ValueError, match=r"max_length \(--max-length\) must be in \[2, context=16\], got 32"):
        LlamaCppModel(tiny_gguf, max_length=32, context=16)


@pytest.mark.parametrize(("context", "expected"), [(None, TRAINED), (256, 256)])
def test_llama_cpp_gets_slots_times_context_tokens(tiny_gguf, monkeypatch, context, expected):
    """llama.cpp's KV cache holds every slot's full request at once; a micro-batch holds one embedding input."""
    xllamacpp = pytest.importorskip("xllamacpp", reason="llama.cpp bindings: pip install xllamacpp")
    started = []
    monkeypatch.setattr(xllamacpp, "Server", started.append)
    model = LlamaCppModel(tiny_gguf, max_length=32, threads=1, parallel=3, context=context)
    (params,) = started
    assert model.context == expected
    assert (params.n_ctx, params.n_batch, params.n_ubatch, params.n_parallel) == (3 * expected, expected, expected, 3)


def test_cli_context_is_for_the_llama_cpp_engine(tiny_gguf, llama_cpp_never_starts, capsys):
    pytest.importorskip("uvicorn", reason="the server needs pip install 'unimae[serve]'")
    from unimae.cli import main

    assert main(["serve", "--context", "1024"]) == 2  # before: an unknown flag; the torch engine has no such knob
    assert "--slots and --context are for --engine llama.cpp" in capsys.readouterr().err
    argv = ["serve", "--engine", "llama.cpp", "--gguf", str(tiny_gguf), "--max-length", "32"]
    assert main([*argv, "--context", str(TRAINED * 2)]) == 2
    assert f"--context {TRAINED * 2} is over the {TRAINED} tokens" in capsys.readouterr().err
    assert main([*argv, "--context", "0"]) == 2
    assert "--context must be at least 1 token" in capsys.readouterr().err
