"""Damaged or hostile files on disk: one clear message naming the file, exit code 2, nothing run or written."""

import errno
import json
import logging
import re
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from unimae.cli import main
from unimae.encoder import Encoder
from unimae.training.checkpoint import (
    CHECKSUM_FILE,
    STATE_FILE,
    CheckpointError,
    checkpoint_dir,
    load_latest_checkpoint,
    save_checkpoint,
)
from unimae.training.config import TrainConfig
from unimae.training.trainer import train


@pytest.fixture(scope="module")
def trained(tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-files")
    corpus = root / "corpus.txt"
    corpus.write_text("the cat sat on the mat\na dog ran across the field\nrain fell on the city\nthe river flows\n")
    config = TrainConfig(
        model=str(tiny_model_dirs["llama"]), data=str(corpus), output_dir=str(root / "run"), steps=2, batch_size=2,
        micro_batch_size=2, max_length=16, save_every=1, precision="fp32", lora_r=4, lora_alpha=8,
    )  # fmt: skip
    return train(config), tiny_model_dirs["llama"]


def _copy_adapter(src, dst):
    dst.mkdir()
    for path in src.iterdir():
        if path.is_file():
            (dst / path.name).write_bytes(path.read_bytes())
    return dst


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_damaged_adapter_weights_name_the_file(trained, tmp_path, damage, capsys):
    result, tiny = trained
    adapter = _copy_adapter(result.adapter_dir, tmp_path / "adapter")
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(b"" if damage == "empty" else weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="adapter_model.safetensors cannot be read"):
        Encoder.from_pretrained(str(tiny), adapter=str(adapter), precision="fp32")
    assert main(["embed", "--model", str(tiny), "--adapter", str(adapter), "hello"]) == 2
    err = capsys.readouterr().err
    assert "adapter_model.safetensors" in err and "Traceback" not in err


def test_malformed_adapter_config_names_the_file(trained, tmp_path):
    result, tiny = trained
    adapter = _copy_adapter(result.adapter_dir, tmp_path / "adapter")
    (adapter / "adapter_config.json").write_text('{"r": 4,')
    with pytest.raises(ValueError, match=r"adapter config .*adapter_config.json is not valid JSON"):
        Encoder.from_pretrained(str(tiny), adapter=str(adapter), precision="fp32")


def test_checkpoint_with_code_is_not_executed(trained, tmp_path):
    """state.pt is read with weights_only=True: a pickled object that would run code on load is refused."""
    result, _ = trained
    out = tmp_path / "run"
    step = checkpoint_dir(out) / "step-000001"
    step.mkdir(parents=True)
    good = torch.load(checkpoint_dir(result.output_dir) / "step-000002" / STATE_FILE, weights_only=True)
    torch.save({**good, "payload": _RunsCode()}, step / STATE_FILE)
    with pytest.raises(CheckpointError, match="every checkpoint .* is corrupt"):
        load_latest_checkpoint(out)
    assert not _RunsCode.ran


def test_checkpoints_hold_only_plain_data(trained):
    result, _ = trained
    state = torch.load(checkpoint_dir(result.output_dir) / "step-000002" / STATE_FILE, weights_only=True)
    assert state["step"] == 2 and state["rng"][0]["numpy"][0] == "MT19937"


def test_resume_without_usable_checkpoint_exits_2_without_traceback(trained, tmp_path, capsys):
    _, tiny = trained
    code = main(["train", "--model", str(tiny), "--output-dir", str(tmp_path / "empty"), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and "no checkpoint" in err and "Traceback" not in err


class _RunsCode:
    ran = False

    def __reduce__(self):
        return (_mark_ran, ())


def _mark_ran():
    _RunsCode.ran = True
    return json.dumps({"ran": True})


def _copy_checkpoints(result, out):
    shutil.copytree(checkpoint_dir(result.output_dir), checkpoint_dir(out))
    return checkpoint_dir(out)


def _overwrite_tensor_data(path, fill: bytes = b"\0"):
    """Overwrite (up to 4 KB of) the largest tensor record of a torch zip file in place: same size, the zip and
    the pickle still read, only the numbers change (what a bad disk block does)."""
    with zipfile.ZipFile(path) as archive:
        record = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as handle:
        handle.seek(record.header_offset)
        header = handle.read(30)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        handle.seek(record.header_offset + 30 + name_len + extra_len)
        length = min(4096, record.file_size)
        handle.write((fill * length)[:length])


def test_checkpoint_damaged_in_place_falls_back_to_the_older_one(trained, tmp_path, caplog):
    """Before: a state.pt with other bytes but the same size loaded without a word (NaN weights, rc 0)."""
    result, _ = trained
    out = tmp_path / "run"
    newest = _copy_checkpoints(result, out) / "step-000002" / STATE_FILE
    size = newest.stat().st_size
    _overwrite_tensor_data(newest)  # zeros: finite numbers, so only the checksum can tell
    assert newest.stat().st_size == size
    assert torch.load(newest, weights_only=True)["step"] == 2, "the damage must leave a loadable file"
    with caplog.at_level(logging.WARNING, logger="unimae.training.checkpoint"):
        state = load_latest_checkpoint(out)
    assert state["step"] == 1
    assert "step-000002 is corrupt" in caplog.text and "does not match its checksum" in caplog.text


def test_checkpoint_without_a_checksum_still_loads_with_a_warning(trained, tmp_path, caplog):
    result, _ = trained
    out = tmp_path / "run"
    (_copy_checkpoints(result, out) / "step-000002" / CHECKSUM_FILE).unlink()  # as an older unimae wrote it
    with caplog.at_level(logging.WARNING, logger="unimae.training.checkpoint"):
        assert load_latest_checkpoint(out)["step"] == 2
    assert "loading it unverified" in caplog.text


def test_nan_weights_are_never_saved_and_refused_when_loaded(trained, tmp_path, caplog):
    result, _ = trained
    good = torch.load(checkpoint_dir(result.output_dir) / "step-000002" / STATE_FILE, weights_only=True)
    name = sorted(good["trainable"])[0]
    bad = {**good["trainable"], name: torch.full_like(good["trainable"][name], float("nan"))}
    out = tmp_path / "run"
    _copy_checkpoints(result, out)
    refused = rf"checkpoint of step 3 not written: weight {re.escape(name)} holds NaN.*--lr"
    with pytest.raises(ValueError, match=refused):
        save_checkpoint(out, 3, {**good, "trainable": bad})
    assert sorted(p.name for p in checkpoint_dir(out).iterdir()) == ["step-000001", "step-000002"]
    older = checkpoint_dir(out) / "step-000003"  # NaN weights in a checkpoint written without the check
    older.mkdir()
    torch.save({**good, "trainable": bad, "step": 3}, older / STATE_FILE)
    with caplog.at_level(logging.WARNING, logger="unimae.training.checkpoint"):
        assert load_latest_checkpoint(out)["step"] == 2
    assert "step-000003 is corrupt" in caplog.text and "NaN or infinite" in caplog.text


def test_full_disk_while_writing_a_checkpoint_leaves_no_temporary_folder(trained, tmp_path, monkeypatch):
    result, _ = trained
    good = torch.load(checkpoint_dir(result.output_dir) / "step-000002" / STATE_FILE, weights_only=True)
    out = tmp_path / "run"
    _copy_checkpoints(result, out)

    def disk_full(obj, path):
        Path(path).write_bytes(b"PK\3\4 half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match=r"could not write .*step-000003: the disk is full"):
        save_checkpoint(out, 3, good)
    assert sorted(p.name for p in checkpoint_dir(out).iterdir()) == ["step-000001", "step-000002"]


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


def test_adapter_with_a_nan_weight_is_refused_naming_the_file(trained, tmp_path, capsys):
    """Before: the adapter loaded and `unimae embed` printed NaN."""
    result, tiny = trained
    adapter = _nan_adapter(result, tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"adapter weights .*adapter_model.safetensors: weight .* holds NaN"):
        Encoder.from_pretrained(str(tiny), adapter=str(adapter), precision="fp32")
    assert main(["embed", "--model", str(tiny), "--adapter", str(adapter), "hello"]) == 2
    captured = capsys.readouterr()
    assert "adapter_model.safetensors" in captured.err and "Traceback" not in captured.err
    assert "NaN" not in captured.out


def test_adapter_of_another_base_is_one_line(trained, tmp_path, capsys):
    """A plain PEFT adapter (no unimae.json to name its base) on a base of other shapes: before, the error listed
    every weight ('size mismatch for ...', one line each) before the sentence."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    result, tiny = trained
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
