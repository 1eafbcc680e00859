"""`unimae train` as a new user meets it: an --output-dir that holds a run, --resume with other flags, damaged
config files, impossible numbers. Each is one clear error that writes and deletes nothing."""

import pytest
from conftest import read_log, tiny_train_config

from unimae.cli import main
from unimae.training.checkpoint import CheckpointError, checkpoint_dir
from unimae.training.config import TrainConfig, resolve_config
from unimae.training.trainer import train


def _checkpoints(out) -> list[str]:
    return sorted(p.name for p in checkpoint_dir(out).iterdir())


def test_new_run_refuses_an_output_dir_that_holds_a_run_unless_overwrite(tiny_model_dirs, corpus_file, tmp_path):
    """Before: the new run's checkpoints were pruned at once (the old run's higher steps outranked them), its log
    replaced the old one, and a later --resume continued the OLD run."""
    tiny, out = tiny_model_dirs["llama"], tmp_path / "run"
    train(tiny_train_config(tiny, corpus_file, out, steps=4, save_every=2))
    adapter = (out / "adapter" / "adapter_model.safetensors").read_bytes()
    again = tiny_train_config(tiny, corpus_file, out, steps=3, save_every=2, seed=5)
    with pytest.raises(FileExistsError, match=r"already holds a training run .*step-000004.*--resume.*--overwrite"):
        train(again)
    assert _checkpoints(out) == ["step-000002", "step-000004"] and len(read_log(out)) == 4
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == adapter
    result = train(again, overwrite=True)
    assert result.steps == 3 and _checkpoints(out) == ["step-000002", "step-000003"]
    assert [r["step"] for r in read_log(out)] == [1, 2, 3]
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() != adapter


def test_cli_new_run_in_a_finished_runs_folder_exits_2(tiny_model_dirs, corpus_file, tmp_path, capsys):
    tiny, out = tiny_model_dirs["llama"], tmp_path / "run"
    train(tiny_train_config(tiny, corpus_file, out, steps=1))
    argv = ["train", "--model", str(tiny), "--data", str(corpus_file), "--output-dir", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "already holds a training run" in err and "Traceback" not in err
    with pytest.raises(SystemExit):  # --resume and --overwrite contradict each other
        main([*argv, "--resume", "--overwrite"])


def test_resume_with_other_settings_names_them_and_writes_nothing(tiny_model_dirs, corpus_file, tmp_path):
    """Before: --resume with, e.g., another --seed or --lr went on silently, no longer the interrupted run."""
    tiny, out = tiny_model_dirs["llama"], tmp_path / "run"
    train(tiny_train_config(tiny, corpus_file, out, steps=2, save_every=1))
    log = (out / "log.jsonl").read_text()
    with pytest.raises(ValueError, match=r"differ from the run .*lr 0\.005 -> 0\.001, seed 0 -> 1"):
        train(tiny_train_config(tiny, corpus_file, out, steps=3, seed=1, lr=1e-3), resume=True)
    assert (out / "log.jsonl").read_text() == log and _checkpoints(out) == ["step-000001", "step-000002"]
    # its length, checkpointing, threads and the final export may change
    result = train(tiny_train_config(tiny, corpus_file, out, steps=3, save_every=0, threads=1, merge=True), resume=True)
    assert result.steps == 3 and [r["step"] for r in read_log(out)] == [1, 2, 3]


def test_run_whose_every_checkpoint_is_corrupt_is_started_over_with_overwrite(tiny_model_dirs, corpus_file, tmp_path):
    tiny, out = tiny_model_dirs["llama"], tmp_path / "run"
    config = tiny_train_config(tiny, corpus_file, out, steps=2)
    train(config)
    (checkpoint_dir(out) / "step-000002" / "state.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="every checkpoint .* is corrupt; .*--overwrite"):
        train(config, resume=True)
    assert train(config, overwrite=True).steps == 2


def test_resume_into_a_missing_folder_creates_nothing(tiny_model_dirs, corpus_file, tmp_path):
    out = tmp_path / "typo"
    with pytest.raises(CheckpointError, match="no checkpoint"):
        train(tiny_train_config(tiny_model_dirs["llama"], corpus_file, out), resume=True)
    assert not out.exists()


@pytest.mark.parametrize(
    ("name", "content"),
    [("c.json", b'{"steps": 3,'), ("c.yaml", b"steps: [3\n"), ("c.json", b"\xff\xfe{}"), ("c.yaml", b"\xff: 1\n")],
)
def test_damaged_config_file_names_the_file(tmp_path, capsys, name, content):
    """Before: a malformed YAML file was a traceback, a malformed JSON one a message without the file name."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"config file {path}"):
        resolve_config({"config": str(path)})
    assert main(["train", "--config", str(path), "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "Traceback" not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("field", "value"), [("threads", -2), ("save_every", -1), ("ce_chunk_size", 0), ("alpha", -0.1)]
)
def test_impossible_numbers_are_named(field, value):
    """Before: --threads -2 was a RuntimeError traceback after loading the model, --ce-chunk-size 0 a
    'range() arg 3 must not be zero' in the first step, and negative --save-every / --alpha were accepted."""
    with pytest.raises(ValueError, match=f"{field} must be >= "):
        TrainConfig.from_dict({field: value}).validate()
