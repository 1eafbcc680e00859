"""Model resolution and the GGUF cache's integrity checks."""

import json

import pytest

from unimae.models import MANIFEST, OFFLINE_MODELS, _manifest_ok, load_model, resolve_model_path


def test_local_directory_and_hub_id_pass_through(tiny_model_dirs):
    assert resolve_model_path(str(tiny_model_dirs["llama"])) == tiny_model_dirs["llama"]
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"


def test_bad_paths_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="GGUF file .* does not exist"):
        resolve_model_path(str(tmp_path / "model.gguf"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_offline_short_names_are_registered():
    assert {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"} <= set(OFFLINE_MODELS)


def test_manifest_detects_missing_and_truncated_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    assert not _manifest_ok(tmp_path), "no manifest: incomplete entry"
    (tmp_path / MANIFEST).write_text(json.dumps({"files": {"model.safetensors": 100}}))
    assert _manifest_ok(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"x" * 60)
    assert not _manifest_ok(tmp_path), "truncated file"
    (tmp_path / MANIFEST).write_text("{broken")
    assert not _manifest_ok(tmp_path)


def test_tokenizer_without_pad_gets_eos_as_pad(tiny_model_dirs):
    _, tokenizer, _ = load_model(str(tiny_model_dirs["gemma3"]))
    assert tokenizer.pad_token_id is not None and tokenizer.eos_token_id is not None
