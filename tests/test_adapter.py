"""Loading a trained adapter (unimae.adapter) onto its base model: damaged or malformed adapter files, NaN weights
and an adapter trained on another base model (with or without its unimae.json) are each one message naming the
file or the base, exit code 2 on the command line. The adapters are copies of one tiny run's (conftest's
``tiny_trained_run``); ``unimae.json`` itself: test_adapter_meta.py."""

import shutil

import pytest

from unimae.cli import main
from unimae.encoder import Encoder


def _copy_adapter(src, dst):
    dst.mkdir()
    for path in src.iterdir():
        if path.is_file():
            (dst / path.name).write_bytes(path.read_bytes())
    return dst


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_damaged_adapter_weights_name_the_file(tiny_trained_run, tmp_path, damage, capsys):
    result, tiny = tiny_trained_run
    adapter = _copy_adapter(result.adapter_dir, tmp_path / "adapter")
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(b"" if damage == "empty" else weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="adapter_model.safetensors cannot be read"):
        Encoder.from_pretrained(str(tiny), adapter=str(adapter), precision="fp32")
    assert main(["embed", "--model", str(tiny), "--adapter", str(adapter), "hello"]) == 2
    err = capsys.readouterr().err
    assert "adapter_model.safetensors" in err and "Traceback" not in err


def test_malformed_adapter_config_names_the_file(tiny_trained_run, tmp_path):
    result, tiny = tiny_trained_run
    adapter = _copy_adapter(result.adapter_dir, tmp_path / "adapter")
    (adapter / "adapter_config.json").write_text('{"r": 4,')
    with pytest.raises(ValueError, match=r"adapter config .*adapter_config.json is not valid JSON"):
        Encoder.from_pretrained(str(tiny), adapter=str(adapter), precision="fp32")


def _nan_adapter(result, directory):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    adapter = _copy_adapter(result.adapter_dir, directory)
    weights = adapter / "adapter_model.safetensors"
    with safe_open(weights, framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name][0, 0] = float("nan")
    save_file(tensors, weights, metadata=metadata)
    return adapter


def test_adapter_with_a_nan_weight_is_refused_naming_the_file(tiny_trained_run, tmp_path, capsys):
    """Before: the adapter loaded and `unimae embed` printed NaN."""
    result, tiny = tiny_trained_run
    adapter = _nan_adapter(result, tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"adapter weights .*adapter_model.safetensors: weight .* holds NaN"):
        Encoder.from_pretrained(str(tiny), adapter=str(adapter), precision="fp32")
    assert main(["embed", "--model", str(tiny), "--adapter", str(adapter), "hello"]) == 2
    captured = capsys.readouterr()
    assert "adapter_model.safetensors" in captured.err and "Traceback" not in captured.err
    assert "NaN" not in captured.out


def test_adapter_on_another_base_model_is_refused(tiny_trained_run, tiny_model_dirs):
    result, _ = tiny_trained_run
    with pytest.raises(ValueError, match="trained on base model"):
        Encoder.from_pretrained(str(tiny_model_dirs["gemma3"]), adapter=str(result.adapter_dir))


def test_adapter_of_another_base_is_one_line(tiny_trained_run, tmp_path, capsys):
    """A plain PEFT adapter (no unimae.json to name its base) on a base of other shapes: before, the error listed
    every weight ('size mismatch for ...', one line each) before the sentence."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    result, tiny = tiny_trained_run
    adapter = _copy_adapter(result.adapter_dir, tmp_path / "adapter")
    (adapter / "unimae.json").unlink()
    config = LlamaConfig.from_pretrained(tiny)
    config.hidden_size, config.intermediate_size = 32, 64
    other = tmp_path / "other-base"
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    shutil.copy(tiny / "tokenizer.json", other)
    shutil.copy(tiny / "tokenizer_config.json", other)
    assert main(["embed", "--model", str(other), "--adapter", str(adapter), "hello", "--precision", "fp32"]) == 2
    message = capsys.readouterr().err.splitlines()[-1]  # the lines before it: progress bars
    assert "size mismatch" not in message and message.startswith("unimae embed: error: adapter")
    assert "20 weights have other shapes here" in message and "trained on another base model" in message


def test_an_adapter_without_its_unimae_json_loads_with_a_warning_naming_what_it_loses(tiny_trained_run, tmp_path):
    result, tiny = tiny_trained_run
    adapter = _copy_adapter(result.adapter_dir, tmp_path / "adapter")
    (adapter / "unimae.json").unlink()
    with pytest.warns(UserWarning, match="has no unimae.json: it loads unchecked.*no query prompt"):
        Encoder.from_pretrained(str(tiny), adapter=str(adapter), precision="fp32")


def test_model_defaults_to_the_adapters_base_and_a_wrong_adapter_fails_before_a_model_loads(
    tiny_trained_run, tmp_path, monkeypatch, capsys
):
    """Before: ``--model`` defaulted to smollm2-135m whatever the adapter, which loaded that model first and then
    failed (another base) or was reported only after it loaded (a mistyped adapter path)."""
    import json

    result, tiny = tiny_trained_run
    assert main(["embed", "--adapter", str(result.adapter_dir), "--precision", "fp32", "the cat"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 64  # the tiny base's width: the adapter's own base loaded

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(Encoder, "from_pretrained", no_loading)
    for command in (["embed", "x"], ["export", "--output", str(tmp_path / "out")]):
        assert main([*command, "--adapter", str(tmp_path / "typo" / "adapter")]) == 2
        assert "not an adapter directory" in capsys.readouterr().err
