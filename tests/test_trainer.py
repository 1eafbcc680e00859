"""Training runs on tiny random models: what a run writes, bad batch settings and data, the merged export, bf16.
Stopping and resuming a run: test_resume.py; checkpoint files: test_checkpoint.py."""

import json

import pytest
import torch
from conftest import read_log, short_train_config

from unimae.encoder import Encoder
from unimae.training import trainer
from unimae.training.checkpoint import checkpoint_dir
from unimae.training.trainer import train


def test_train_writes_adapter_config_log_and_checkpoints(tiny_dir, corpus_file, tmp_path):
    result = train(short_train_config(tiny_dir, corpus_file, tmp_path / "run"))
    out = tmp_path / "run"
    assert result.steps == 4 and not result.interrupted
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "adapter" / "unimae.json").is_file()
    assert json.loads((out / "config.json").read_text())["steps"] == 4
    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert all({"loss", "mar", "mrc", "tokens_per_s", "grad_norm"} <= set(r) for r in log)
    assert sorted(p.name for p in checkpoint_dir(out).iterdir()) == ["step-000002", "step-000004"]
    emb = Encoder.from_pretrained(str(tiny_dir), adapter=str(result.adapter_dir), precision="fp32").encode(["x"])
    assert emb.shape[0] == 1 and (out / "adapter" / "adapter_model.safetensors").is_file()


def test_bad_batch_split_and_empty_corpus_are_clear_errors(tiny_dir, corpus_file, tmp_path):
    with pytest.raises(ValueError, match="not a multiple of micro_batch_size"):
        train(short_train_config(tiny_dir, corpus_file, tmp_path / "a", batch_size=5))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n   \n\n")
    with pytest.raises(ValueError, match="empty"):
        train(short_train_config(tiny_dir, empty, tmp_path / "b"))


def test_merge_exports_plain_model_with_same_embeddings(tiny_model_dirs, corpus_file, tmp_path):
    tiny = tiny_model_dirs["llama"]
    result = train(short_train_config(tiny, corpus_file, tmp_path / "run", steps=2, merge=True))
    merged = tmp_path / "run" / "merged"
    assert (merged / "config.json").is_file() and not (merged / "adapter_config.json").exists()
    separate = Encoder.from_pretrained(str(tiny), adapter=str(result.adapter_dir), merge=False, precision="fp32")
    in_memory = Encoder.from_pretrained(str(tiny), adapter=str(result.adapter_dir), precision="fp32")
    a = separate.encode(["a cat"])
    b = Encoder.from_pretrained(str(merged), precision="fp32").encode(["a cat"])
    c = in_memory.encode(["a cat"])
    torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(c), rtol=1e-4, atol=1e-4)
    assert not any("lora" in name for name, _ in in_memory.model.named_modules())
    with pytest.raises(RuntimeError, match="merge=False"):
        in_memory.adapter_disabled()


def test_bf16_training_without_peft_input_upcast_keeps_the_loss_curve(
    tiny_model_dirs, corpus_file, tmp_path, monkeypatch
):
    """skip_input_upcast (the bf16 speed-up) changes no number beyond bf16 noise: same 4-step loss curve."""
    tiny = tiny_model_dirs["llama"]
    train(short_train_config(tiny, corpus_file, tmp_path / "skip", precision="bf16", save_every=0))
    monkeypatch.setattr(trainer, "skip_input_upcast", lambda model: None)
    train(short_train_config(tiny, corpus_file, tmp_path / "cast", precision="bf16", save_every=0))
    skip, cast = read_log(tmp_path / "skip"), read_log(tmp_path / "cast")
    for a, b in zip(skip, cast, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2), a["step"]


def test_run_json_lists_the_cpu_of_every_sitting(tmp_path, monkeypatch):
    """run.json's cpu_models: a new run names this machine's CPU; a resumed one adds it to the earlier sittings'
    (the release card's wall-time line names them)."""
    import json

    import unimae.training.trainer as trainer
    from unimae.adapter import TrainingTime

    record = tmp_path / "run.json"
    monkeypatch.setattr(trainer, "cpu_model", lambda: "CPU B")
    assert trainer._sitting_cpus(record, 0) == ["CPU B"]
    record.write_text(json.dumps({"cpu_models": ["CPU A"]}))
    assert trainer._sitting_cpus(record, 40) == ["CPU A", "CPU B"]
    assert trainer._sitting_cpus(record, 0) == ["CPU B"], "a fresh run does not inherit an old run's machines"
    record.write_text(json.dumps({"cpu_models": ["CPU A", "CPU B"]}))
    assert TrainingTime.from_log(tmp_path / "log.jsonl").cpu_models == ("CPU A", "CPU B")
