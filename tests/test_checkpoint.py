"""Training checkpoints on disk (unimae.training.checkpoint): plain data only (a pickle that would run code is
refused), a checksum that catches damage in place, NaN weights never written nor loaded, a full disk that leaves no
half-written folder; loading falls back to the newest checkpoint that is whole. The checkpoints are copies of one
tiny run's (conftest's ``tiny_trained_run``); resuming a run from them: test_resume.py."""

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

from unimae.training.checkpoint import (
    CHECKSUM_FILE,
    STATE_FILE,
    CheckpointError,
    checkpoint_dir,
    checkpoint_folders,
    load_latest_checkpoint,
    save_checkpoint,
)


def test_checkpoints_hold_only_plain_data(tiny_trained_run):
    result, _ = tiny_trained_run
    state = torch.load(checkpoint_dir(result.output_dir) / "step-000002" / STATE_FILE, weights_only=True)
    assert state["step"] == 2 and state["rng"][0]["numpy"][0] == "MT19937"


def test_checkpoint_with_code_is_not_executed(tiny_trained_run, tmp_path):
    """state.pt is read with weights_only=True: a pickled object that would run code on load is refused."""
    result, _ = tiny_trained_run
    out = tmp_path / "run"
    step = checkpoint_dir(out) / "step-000001"
    step.mkdir(parents=True)
    good = torch.load(checkpoint_dir(result.output_dir) / "step-000002" / STATE_FILE, weights_only=True)
    torch.save({**good, "payload": _RunsCode()}, step / STATE_FILE)
    with pytest.raises(CheckpointError, match="every checkpoint .* is corrupt"):
        load_latest_checkpoint(out)
    assert not _RunsCode.ran


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


def test_checkpoint_damaged_in_place_falls_back_to_the_older_one(tiny_trained_run, tmp_path, caplog):
    """Before: a state.pt with other bytes but the same size loaded without a word (NaN weights, rc 0)."""
    result, _ = tiny_trained_run
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


def test_checkpoint_without_a_checksum_still_loads_with_a_warning(tiny_trained_run, tmp_path, caplog):
    result, _ = tiny_trained_run
    out = tmp_path / "run"
    (_copy_checkpoints(result, out) / "step-000002" / CHECKSUM_FILE).unlink()  # as an older unimae wrote it
    with caplog.at_level(logging.WARNING, logger="unimae.training.checkpoint"):
        assert load_latest_checkpoint(out)["step"] == 2
    assert "loading it unverified" in caplog.text


def test_nan_weights_are_never_saved_and_refused_when_loaded(tiny_trained_run, tmp_path, caplog):
    result, _ = tiny_trained_run
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


def test_full_disk_while_writing_a_checkpoint_leaves_no_temporary_folder(tiny_trained_run, tmp_path, monkeypatch):
    result, _ = tiny_trained_run
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


def test_checkpoints_are_ordered_by_step_number_past_six_digits(tiny_trained_run, tmp_path):
    """``step-1000000`` is newer than ``step-999999`` (a sort by name puts it first): the newest loads and the
    oldest is the one pruned."""
    result, _ = tiny_trained_run
    good = torch.load(checkpoint_dir(result.output_dir) / "step-000002" / STATE_FILE, weights_only=True)
    out = tmp_path / "run"
    save_checkpoint(out, 999_999, good)
    save_checkpoint(out, 1_000_000, good)
    (checkpoint_dir(out) / "step-notes").mkdir()  # not a checkpoint: ignored
    assert [p.name for p in checkpoint_folders(checkpoint_dir(out))] == ["step-999999", "step-1000000"]
    assert load_latest_checkpoint(out)["step"] == 1_000_000
    save_checkpoint(out, 1_000_001, good)
    assert [p.name for p in checkpoint_folders(checkpoint_dir(out))] == ["step-1000000", "step-1000001"]
    assert checkpoint_folders(tmp_path / "missing") == []
