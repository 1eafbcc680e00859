"""Training runs, checkpoints, resume, Ctrl-C and bad input on tiny random models."""

import json
import signal

import pytest
import torch

from unimae.data.order import DataOrder
from unimae.encoder import Encoder
from unimae.training import trainer
from unimae.training.checkpoint import CheckpointError, checkpoint_dir
from unimae.training.config import TrainConfig
from unimae.training.trainer import train


def _config(tiny_dir, corpus_file, out, **overrides):
    values = dict(
        model=str(tiny_dir),
        data=str(corpus_file),
        output_dir=str(out),
        steps=4,
        batch_size=4,
        micro_batch_size=2,
        max_length=24,
        save_every=2,
        precision="fp32",
        lora_r=4,
        lora_alpha=8,
        p_mar=0.5,  # the paper's rate, so resume and logs are tested with masking on
    )
    values.update(overrides)
    return TrainConfig.from_dict(values)


def _log(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_train_writes_adapter_config_log_and_checkpoints(tiny_dir, corpus_file, tmp_path):
    result = train(_config(tiny_dir, corpus_file, tmp_path / "run"))
    out = tmp_path / "run"
    assert result.steps == 4 and not result.interrupted
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "adapter" / "unimae.json").is_file()
    assert json.loads((out / "config.json").read_text())["steps"] == 4
    log = _log(out)
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert all({"loss", "mar", "mrc", "tokens_per_s", "grad_norm"} <= set(r) for r in log)
    assert sorted(p.name for p in checkpoint_dir(out).iterdir()) == ["step-000002", "step-000004"]
    emb = Encoder.from_pretrained(str(tiny_dir), adapter=str(result.adapter_dir), precision="fp32").encode(["x"])
    assert emb.shape[0] == 1 and (out / "adapter" / "adapter_model.safetensors").is_file()


def test_resume_continues_the_same_loss_curve(tiny_dir, corpus_file, tmp_path):
    train(_config(tiny_dir, corpus_file, tmp_path / "straight", lora_dropout=0.1))
    train(_config(tiny_dir, corpus_file, tmp_path / "resumed", steps=2, lora_dropout=0.1))
    train(_config(tiny_dir, corpus_file, tmp_path / "resumed", steps=4, lora_dropout=0.1), resume=True)
    straight, resumed = _log(tmp_path / "straight"), _log(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), a["step"]


def test_corrupt_checkpoint_falls_back_to_older(tiny_dir, corpus_file, tmp_path):
    out = tmp_path / "run"
    train(_config(tiny_dir, corpus_file, out, steps=4))
    (checkpoint_dir(out) / "step-000004" / "state.pt").write_bytes(b"garbage")
    result = train(_config(tiny_dir, corpus_file, out, steps=5), resume=True)
    assert result.steps == 5
    assert [r["step"] for r in _log(out)] == [1, 2, 3, 4, 5]


def test_resuming_a_finished_run_returns_at_once_and_more_steps_continue_it(
    tiny_dir, corpus_file, tmp_path, monkeypatch
):
    """Recipes resume every run that has checkpoints: a finished one must not load its model or rewrite its
    adapter; asked for more steps, it goes on as the longer run would have."""
    out = tmp_path / "run"
    train(_config(tiny_dir, corpus_file, out, steps=2))
    adapter = out / "adapter" / "adapter_model.safetensors"
    written = adapter.stat().st_mtime_ns
    with monkeypatch.context() as patch:
        patch.setattr(trainer, "_setup", lambda *a, **k: pytest.fail("a finished run loaded its model"))
        result = train(_config(tiny_dir, corpus_file, out, steps=2), resume=True)
    assert result.already_finished and result.steps == 2 and adapter.stat().st_mtime_ns == written
    longer = train(_config(tiny_dir, corpus_file, out, steps=3), resume=True)
    assert longer.steps == 3 and not longer.already_finished and [r["step"] for r in _log(out)] == [1, 2, 3]
    assert json.loads((out / "adapter" / "unimae.json").read_text())["trained_steps"] == 3


def test_resume_drops_a_log_line_cut_off_by_a_crash(tiny_dir, corpus_file, tmp_path):
    out = tmp_path / "run"
    train(_config(tiny_dir, corpus_file, out, steps=2))
    with open(out / "log.jsonl", "a") as log:
        log.write('{"step": 3, "loss": 1.2')  # the append a crash cut short
    train(_config(tiny_dir, corpus_file, out, steps=3), resume=True)
    assert [r["step"] for r in _log(out)] == [1, 2, 3]


def test_resume_without_checkpoint_is_a_clear_error(tiny_dir, corpus_file, tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        train(_config(tiny_dir, corpus_file, tmp_path / "empty"), resume=True)


def test_resume_with_another_configuration_names_the_mismatch(tiny_dir, corpus_file, tmp_path):
    out = tmp_path / "run"
    train(_config(tiny_dir, corpus_file, out, steps=2))
    with pytest.raises(ValueError, match="missing weights"):  # this run trains a weight the checkpoint lacks
        train(_config(tiny_dir, corpus_file, out, steps=3, train_mask_token=True), resume=True)
    with pytest.raises(ValueError, match="other shapes"):
        train(_config(tiny_dir, corpus_file, out, steps=3, lora_r=8), resume=True)


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
    train(_config(tiny_dir, corpus_file, straight, save_every=0))
    out = tmp_path / "run"
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with monkeypatch.context() as patch:
        _signal_during_step(patch, step=2, batch_size=4, signals=[sig])
        result = train(_config(tiny_dir, corpus_file, out, save_every=0))
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # the test process's handlers are back
    assert result.interrupted and result.steps == 2
    assert [r["step"] for r in _log(out)] == [1, 2]  # step 2 (signalled mid-step) finished, step 3 never began
    assert sorted(p.name for p in checkpoint_dir(out).iterdir()) == ["step-000002"]
    assert json.loads((out / "adapter" / "unimae.json").read_text())["trained_steps"] == 2
    resumed = train(_config(tiny_dir, corpus_file, out, save_every=0), resume=True)
    assert resumed.steps == 4 and not resumed.interrupted
    for a, b in zip(_log(straight), _log(out), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), a["step"]


def test_second_stop_signal_aborts_at_once(tiny_model_dirs, corpus_file, tmp_path, monkeypatch):
    out = tmp_path / "run"
    handler = signal.getsignal(signal.SIGINT)
    _signal_during_step(monkeypatch, step=2, batch_size=4, signals=[signal.SIGINT, signal.SIGINT])
    with pytest.raises(KeyboardInterrupt):
        train(_config(tiny_model_dirs["llama"], corpus_file, out, save_every=0))
    assert signal.getsignal(signal.SIGINT) is handler
    assert [r["step"] for r in _log(out)] == [1] and not checkpoint_dir(out).exists()


def test_bad_batch_split_and_empty_corpus_are_clear_errors(tiny_dir, corpus_file, tmp_path):
    with pytest.raises(ValueError, match="not a multiple of micro_batch_size"):
        train(_config(tiny_dir, corpus_file, tmp_path / "a", batch_size=5))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n   \n\n")
    with pytest.raises(ValueError, match="empty"):
        train(_config(tiny_dir, empty, tmp_path / "b"))


def test_adapter_on_another_base_model_is_refused(tiny_model_dirs, corpus_file, tmp_path):
    result = train(_config(tiny_model_dirs["llama"], corpus_file, tmp_path / "run", steps=1))
    with pytest.raises(ValueError, match="trained on base model"):
        Encoder.from_pretrained(str(tiny_model_dirs["gemma3"]), adapter=str(result.adapter_dir))


def test_merge_exports_plain_model_with_same_embeddings(tiny_model_dirs, corpus_file, tmp_path):
    tiny = tiny_model_dirs["llama"]
    result = train(_config(tiny, corpus_file, tmp_path / "run", steps=2, merge=True))
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
    train(_config(tiny, corpus_file, tmp_path / "skip", precision="bf16", save_every=0))
    monkeypatch.setattr(trainer, "skip_input_upcast", lambda model: None)
    train(_config(tiny, corpus_file, tmp_path / "cast", precision="bf16", save_every=0))
    skip, cast = _log(tmp_path / "skip"), _log(tmp_path / "cast")
    for a, b in zip(skip, cast, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2), a["step"]
