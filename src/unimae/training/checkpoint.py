"""Resumable training checkpoints, written atomically.

``<output_dir>/checkpoints/step-NNNNNN/`` holds ``state.pt``: the trainable weights (LoRA and the
MRC tiny decoder), optimizer and scheduler state, RNG states and the data position (global step;
the data order and masks are functions of the seed and the example index). A checkpoint is
written to a temporary folder and renamed into place, so a crash never leaves a half-written one (nor does a
full disk: the temporary folder is deleted and the error names the checkpoint); the newest loadable checkpoint
wins, and a corrupt one is reported and skipped. ``state.pt.sha256`` beside it holds the file's SHA-256, so a
file damaged in place (same size, other bytes) is corrupt too; checkpoints written before it load unverified,
with a warning. Weights that are NaN or infinite are never saved (training diverged) and make a checkpoint
corrupt when loaded.

``state.pt`` holds only tensors, numbers, strings and containers of them (numpy's RNG key is stored as a
tensor), so it is read with ``torch.load(weights_only=True)``: a checkpoint folder from someone else
cannot run code. Why not ``Accelerator.save_state``: it writes several files non-atomically, pickles
RNG states (``weights_only=False`` to load) and has no "skip the corrupt newest one" fallback.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from unimae.adapter import check_finite
from unimae.files import file_sha256, writing

logger = logging.getLogger(__name__)

STATE_FILE = "state.pt"
CHECKSUM_FILE = "state.pt.sha256"
DIVERGED = (
    "training diverged (the checkpoints written before are kept): train again with a lower --lr or --max-grad-norm"
)


class CheckpointError(ValueError):
    """No usable checkpoint; the message says what was found and what to do."""


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states as weights-only-loadable values."""
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(output_dir: str | Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write ``state`` for ``step`` atomically, with its checksum; keep the newest ``keep`` checkpoints.

    Refuses trainable weights that are not finite (the older checkpoints stay as they were)."""
    check_finite(state.get("trainable", {}).items(), f"checkpoint of step {step} not written", DIVERGED)
    root = checkpoint_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    for stale in root.glob(".tmp-step-*"):  # left by a run killed while writing
        shutil.rmtree(stale, ignore_errors=True)
    with writing(final, partial=tmp):
        tmp.mkdir()
        torch.save({**state, "step": step}, tmp / STATE_FILE)
        (tmp / CHECKSUM_FILE).write_text(file_sha256(tmp / STATE_FILE) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in checkpoint_folders(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_folders(root: Path) -> list[Path]:
    """The ``step-N`` folders in ``root``, oldest step first (by number: ``step-1000000`` after ``step-999999``,
    which a sort by name would not give); [] for a missing folder."""
    if not root.is_dir():
        return []
    steps = [(int(p.name[5:]), p) for p in root.glob("step-*") if p.name[5:].isdigit()]
    return [p for _, p in sorted(steps)]


def load_latest_checkpoint(output_dir: str | Path) -> dict[str, Any]:
    """The newest checkpoint that loads; corrupt ones are named in a warning and skipped."""
    root = checkpoint_dir(output_dir)
    candidates = checkpoint_folders(root)[::-1]
    if not candidates:
        raise CheckpointError(f"no checkpoint in {root}; start a new run without --resume")
    for candidate in candidates:
        try:
            return _load_state(candidate)
        except Exception as err:  # noqa: BLE001 - any unreadable file means a corrupt checkpoint
            logger.warning(
                "checkpoint %s is corrupt (%s); trying an older one. Delete it to silence this.", candidate, err
            )
    raise CheckpointError(
        f"every checkpoint in {root} is corrupt; start the run over: `unimae train --overwrite` instead of --resume"
    )


def _load_state(directory: Path) -> dict[str, Any]:
    """The state of one checkpoint folder, after checking its checksum and that its weights are finite."""
    path = directory / STATE_FILE
    checksum = directory / CHECKSUM_FILE
    if not checksum.is_file():
        logger.warning(
            "checkpoint %s has no %s (an older unimae wrote it); loading it unverified", directory, CHECKSUM_FILE
        )
    elif checksum.read_text().strip() != file_sha256(path):
        raise ValueError(f"{path} does not match its checksum: it was changed or damaged after it was written")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if "step" not in state or "trainable" not in state:
        raise ValueError("missing fields")
    check_finite(state["trainable"].items(), str(path), "the checkpoint is damaged")
    return state
