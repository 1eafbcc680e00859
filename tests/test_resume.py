"""Stopping and resuming a training run (`unimae train --resume`) on tiny random models: the loss curve of the run
never stopped, SIGINT / SIGTERM, damaged checkpoints and log lines, and the run folder's rules: a new run never
writes into an old run's folder unless --overwrite, and --resume with other settings is refused. Each is one clear
error that writes and deletes nothing. A method's own state across a resume is tested with the method
(test_contrastive.py: the data mixture; test_gem.py: the two-phase learning rate and the logit scale)."""

import json
import signal

import pytest
import torch
from conftest import read_log, short_train_config, tiny_train_config

from unimae.cli import main
from unimae.data.order import DataOrder
from unimae.files import file_sha256
from unimae.training import trainer
from unimae.training.checkpoint import CheckpointError, checkpoint_dir
from unimae.training.trainer import train


def _checkpoints(out) -> list[str]:
    return sorted(p.name for p in checkpoint_dir(out).iterdir())


def test_resume_continues_the_same_loss_curve(tiny_dir, corpus_file, tmp_path):
    train(short_train_config(tiny_dir, corpus_file, tmp_path / "straight", lora_dropout=0.1))
    train(short_train_config(tiny_dir, corpus_file, tmp_path / "resumed", steps=2, lora_dropout=0.1))
    train(short_train_config(tiny_dir, corpus_file, tmp_path / "resumed", steps=4, lora_dropout=0.1), resume=True)
    straight, resumed = read_log(tmp_path / "straight"), read_log(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), a["step"]


def test_resuming_a_finished_run_returns_at_once_and_more_steps_continue_it(
    tiny_dir, corpus_file, tmp_path, monkeypatch
):
    """Recipes resume every run that has checkpoints: a finished one must not load its model or rewrite its
    adapter; asked for more steps, it goes on as the longer run would have."""
    out = tmp_path / "run"
    train(short_train_config(tiny_dir, corpus_file, out, steps=2))
    adapter = out / "adapter" / "adapter_model.safetensors"
    written = adapter.stat().st_mtime_ns
    with monkeypatch.context() as patch:
        patch.setattr(trainer, "_setup", lambda *a, **k: pytest.fail("a finished run loaded its model"))
        result = train(short_train_config(tiny_dir, corpus_file, out, steps=2), resume=True)
    assert result.already_finished and result.steps == 2 and adapter.stat().st_mtime_ns == written
    with pytest.raises(ValueError, match=r"settings differ .*lr 0.0001 -> 0.0005"):  # before: "already finished"
        train(short_train_config(tiny_dir, corpus_file, out, steps=2, lr=5e-4), resume=True)
    merged = train(short_train_config(tiny_dir, corpus_file, out, steps=2, merge=True), resume=True)
    assert merged.already_finished and (out / "merged" / "config.json").is_file()  # --merge asked only now
    longer = train(short_train_config(tiny_dir, corpus_file, out, steps=3), resume=True)
    assert longer.steps == 3 and not longer.already_finished and [r["step"] for r in read_log(out)] == [1, 2, 3]
    assert json.loads((out / "adapter" / "unimae.json").read_text())["trained_steps"] == 3


def test_a_full_disk_while_saving_the_adapter_keeps_the_earlier_one_whole(tiny_dir, corpus_file, tmp_path, monkeypatch):
    """The adapter is filled beside the old one and swapped in: a failed save leaves the earlier step's weights
    with their own unimae.json (not step 3's weights labelled step 2), and no partial folder."""
    import errno

    out = tmp_path / "run"
    train(short_train_config(tiny_dir, corpus_file, out, steps=2))
    weights = (out / "adapter" / "adapter_model.safetensors").read_bytes()

    def disk_full(folder, meta):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer, "write_adapter_meta", disk_full)
    with pytest.raises(OSError, match="the disk is full"):
        train(short_train_config(tiny_dir, corpus_file, out, steps=3), resume=True)
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == weights
    assert json.loads((out / "adapter" / "unimae.json").read_text())["trained_steps"] == 2
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_resume_drops_a_log_line_cut_off_by_a_crash(tiny_dir, corpus_file, tmp_path):
    out = tmp_path / "run"
    train(short_train_config(tiny_dir, corpus_file, out, steps=2))
    with open(out / "log.jsonl", "a") as log:
        log.write('{"step": 3, "loss": 1.2')  # the append a crash cut short
    train(short_train_config(tiny_dir, corpus_file, out, steps=3), resume=True)
    assert [r["step"] for r in read_log(out)] == [1, 2, 3]


# --- damaged or missing checkpoints ------------------------------------------------------------------------------


def test_corrupt_checkpoint_falls_back_to_older(tiny_dir, corpus_file, tmp_path):
    out = tmp_path / "run"
    train(short_train_config(tiny_dir, corpus_file, out, steps=4))
    (checkpoint_dir(out) / "step-000004" / "state.pt").write_bytes(b"garbage")
    result = train(short_train_config(tiny_dir, corpus_file, out, steps=5), resume=True)
    assert result.steps == 5
    assert [r["step"] for r in read_log(out)] == [1, 2, 3, 4, 5]


def test_run_whose_every_checkpoint_is_corrupt_is_started_over_with_overwrite(tiny_model_dirs, corpus_file, tmp_path):
    tiny, out = tiny_model_dirs["llama"], tmp_path / "run"
    config = tiny_train_config(tiny, corpus_file, out, steps=2)
    train(config)
    (checkpoint_dir(out) / "step-000002" / "state.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="every checkpoint .* is corrupt; .*--overwrite"):
        train(config, resume=True)
    assert train(config, overwrite=True).steps == 2


def test_resume_without_checkpoint_is_a_clear_error(tiny_dir, corpus_file, tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        train(short_train_config(tiny_dir, corpus_file, tmp_path / "empty"), resume=True)


def test_resume_into_a_missing_folder_creates_nothing(tiny_model_dirs, corpus_file, tmp_path):
    out = tmp_path / "typo"
    with pytest.raises(CheckpointError, match="no checkpoint"):
        train(tiny_train_config(tiny_model_dirs["llama"], corpus_file, out), resume=True)
    assert not out.exists()


def test_resume_without_usable_checkpoint_exits_2_without_traceback(tiny_model_dirs, tmp_path, capsys):
    tiny = tiny_model_dirs["llama"]
    code = main(["train", "--model", str(tiny), "--output-dir", str(tmp_path / "empty"), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and "no checkpoint" in err and "Traceback" not in err


# --- the run folder: resume, a new run or --overwrite ------------------------------------------------------------


def test_resume_with_another_configuration_names_the_mismatch(tiny_dir, corpus_file, tmp_path):
    out = tmp_path / "run"
    train(short_train_config(tiny_dir, corpus_file, out, steps=2))
    with pytest.raises(ValueError, match="missing weights"):  # this run trains a weight the checkpoint lacks
        train(short_train_config(tiny_dir, corpus_file, out, steps=3, train_mask_token=True), resume=True)
    with pytest.raises(ValueError, match="other shapes"):
        train(short_train_config(tiny_dir, corpus_file, out, steps=3, lora_r=8), resume=True)


def test_resume_with_other_settings_names_them_and_writes_nothing(tiny_model_dirs, corpus_file, tmp_path):
    """Before: --resume with, e.g., another --seed or --lr went on silently, no longer the interrupted run."""
    tiny, out = tiny_model_dirs["llama"], tmp_path / "run"
    train(tiny_train_config(tiny, corpus_file, out, steps=2, save_every=1))
    log = (out / "log.jsonl").read_text()
    with pytest.raises(ValueError, match=r"differ from the run .*lr 0\.005 -> 0\.001, seed 0 -> 1"):
        train(tiny_train_config(tiny, corpus_file, out, steps=3, seed=1, lr=1e-3), resume=True)
    assert (out / "log.jsonl").read_text() == log and _checkpoints(out) == ["step-000001", "step-000002"]
    # a setting the run predates counts as its default: set otherwise, it would change the run
    path = out / "checkpoints" / "step-000002" / "state.pt"
    written, checksum = path.read_bytes(), path.with_name("state.pt.sha256").read_text()
    state = torch.load(path, weights_only=True)
    del state["config"]["lr"]  # as if --lr had come after this run was written
    torch.save(state, path)
    path.with_name("state.pt.sha256").write_text(file_sha256(path) + "\n")
    with pytest.raises(ValueError, match=r"differ from the run .*lr 0\.0001 -> 0\.001"):
        train(tiny_train_config(tiny, corpus_file, out, steps=3, lr=1e-3), resume=True)
    path.write_bytes(written)
    path.with_name("state.pt.sha256").write_text(checksum)
    # its length, checkpointing, threads and the final export may change
    result = train(tiny_train_config(tiny, corpus_file, out, steps=3, save_every=0, threads=1, merge=True), resume=True)
    assert result.steps == 3 and [r["step"] for r in read_log(out)] == [1, 2, 3]


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


# --- stop signals ------------------------------------------------------------------------------------------------


def _signal_during_step(monkeypatch, step: int, batch_size: int, signals: list[int]) -> None:
    """Send ``signals`` to this process while the trainer picks the first example of ``step`` (1-based).

    Examples are picked only inside the training loop, after train() installed its stop handler; that
    handler (not pytest's) is checked before any signal is sent, so none can reach the test process.
    """
    real_text_index = DataOrder.text_index
    pytest_handlers = {sig: signal.getsignal(sig) for sig in signals}
    pending = [(step - 1) * batch_size]  # global index of the step's first example

    def text_index(self, example: int) -> int:
        if pending and example == pending[0]:
            pending.clear()
            for sig in signals:
                if signal.getsignal(sig) is pytest_handlers[sig]:
                    raise AssertionError(f"train() installed no handler for {signal.Signals(sig).name}")
                signal.raise_signal(sig)
        return real_text_index(self, example)

    monkeypatch.setattr(DataOrder, "text_index", text_index)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_stop_signal_finishes_the_step_saves_and_resume_continues_the_same_run(
    sig, tiny_dir, corpus_file, tmp_path, monkeypatch
):
    straight = tmp_path / "straight"
    train(short_train_config(tiny_dir, corpus_file, straight, save_every=0))
    out = tmp_path / "run"
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with monkeypatch.context() as patch:
        _signal_during_step(patch, step=2, batch_size=4, signals=[sig])
        result = train(short_train_config(tiny_dir, corpus_file, out, save_every=0))
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # the test process's handlers are back
    assert result.interrupted and result.steps == 2
    assert [r["step"] for r in read_log(out)] == [1, 2]  # step 2 (signalled mid-step) finished, step 3 never began
    assert sorted(p.name for p in checkpoint_dir(out).iterdir()) == ["step-000002"]
    assert json.loads((out / "adapter" / "unimae.json").read_text())["trained_steps"] == 2
    resumed = train(short_train_config(tiny_dir, corpus_file, out, save_every=0), resume=True)
    assert resumed.steps == 4 and not resumed.interrupted
    for a, b in zip(read_log(straight), read_log(out), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), a["step"]


def test_second_stop_signal_aborts_at_once(tiny_model_dirs, corpus_file, tmp_path, monkeypatch):
    out = tmp_path / "run"
    handler = signal.getsignal(signal.SIGINT)
    _signal_during_step(monkeypatch, step=2, batch_size=4, signals=[signal.SIGINT, signal.SIGINT])
    with pytest.raises(KeyboardInterrupt):
        train(short_train_config(tiny_model_dirs["llama"], corpus_file, out, save_every=0))
    assert signal.getsignal(signal.SIGINT) is handler
    assert [r["step"] for r in read_log(out)] == [1] and not checkpoint_dir(out).exists()


def test_continuing_a_unimae_adapter_warns_that_its_mrc_decoder_starts_afresh(
    tiny_model_dirs, corpus_file, tmp_path, caplog
):
    """--continue-adapter holds the LoRA only: UniMAE's throw-away decoder is not in the adapter."""
    tiny = tiny_model_dirs["llama"]
    train(short_train_config(tiny, corpus_file, tmp_path / "a", steps=2))
    with caplog.at_level("WARNING", logger="unimae.training.trainer"):
        source = str(tmp_path / "a" / "adapter")
        train(short_train_config(tiny, corpus_file, tmp_path / "b", steps=3, continue_adapter=source))
    assert "restores the LoRA weights only" in caplog.text and "start afresh" in caplog.text


def test_a_resumed_continued_run_records_what_its_source_held_when_it_started(tiny_model_dirs, corpus_file, tmp_path):
    """Before: each sitting read --continue-adapter's folder again when it saved; the retrieval recipe replaces that
    folder (a release) with a later step between sittings, so the adapter named the wrong start and its card counted
    the steps in between twice."""
    import shutil

    from unimae.adapter import adapter_meta

    tiny = tiny_model_dirs["llama"]
    train(short_train_config(tiny, corpus_file, tmp_path / "a", steps=2))
    train(short_train_config(tiny, corpus_file, tmp_path / "later", steps=3))
    source = tmp_path / "a" / "adapter"
    train(short_train_config(tiny, corpus_file, tmp_path / "b", steps=3, save_every=1, continue_adapter=str(source)))
    shutil.rmtree(source)
    shutil.copytree(tmp_path / "later" / "adapter", source)  # the folder now holds a 3-step adapter
    train(short_train_config(tiny, corpus_file, tmp_path / "b", steps=4, save_every=1, continue_adapter=str(source)),
          resume=True)  # fmt: skip
    meta = adapter_meta(tmp_path / "b" / "adapter")
    assert meta.trained_steps == 4 and meta.continued_from_step == 2


def test_resume_refuses_training_data_that_changed_since_the_checkpoint(tiny_model_dirs, corpus_file, tmp_path):
    """Before: an appended corpus line silently changed every later batch of the resumed run."""
    tiny = tiny_model_dirs["llama"]
    out = tmp_path / "run"
    train(short_train_config(tiny, corpus_file, out, steps=2))
    corpus_file.write_text(corpus_file.read_text() + "one more line of text\n")
    with pytest.raises(ValueError, match=r"the training data changed since the checkpoint .* examples"):
        train(short_train_config(tiny, corpus_file, out, steps=3), resume=True)
    corpus_file.write_text(corpus_file.read_text().replace("one more line of text\n", ""))
    assert train(short_train_config(tiny, corpus_file, out, steps=3), resume=True).steps == 3
