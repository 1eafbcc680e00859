"""Damaged or hostile files on disk: one clear message naming the file, exit code 2, nothing run or written."""

import json

import pytest
import torch

from unimae.checkpoint import STATE_FILE, CheckpointError, checkpoint_dir, load_latest_checkpoint
from unimae.cli import main
from unimae.config import TrainConfig
from unimae.encoder import Encoder
from unimae.trainer import train


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
