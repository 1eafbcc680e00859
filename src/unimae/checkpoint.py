"""Resumable training checkpoints, written atomically.

``<output_dir>/checkpoints/step-NNNNNN/`` holds ``state.pt``: the trainable weights (LoRA and the
MRC tiny decoder), optimizer and scheduler state, RNG states and the data position (global step;
the data order and masks are functions of the seed and the example index). A checkpoint is
written to a temporary folder and renamed into place, so a crash never leaves a half-written one;
the newest loadable checkpoint wins, and a corrupt one is reported and skipped.

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

logger = logging.getLogger(__name__)

STATE_FILE = "state.pt"


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
    """Write ``state`` for ``step`` atomically; keep the newest ``keep`` checkpoints."""
    root = checkpoint_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save({**state, "step": step}, tmp / STATE_FILE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_latest_checkpoint(output_dir: str | Path) -> dict[str, Any]:
    """The newest checkpoint that loads; corrupt ones are named in a warning and skipped."""
    root = checkpoint_dir(output_dir)
    candidates = sorted(root.glob("step-*"), reverse=True) if root.is_dir() else []
    if not candidates:
        raise CheckpointError(f"no checkpoint in {root}; start a new run without --resume")
    for candidate in candidates:
        try:
            state = torch.load(candidate / STATE_FILE, map_location="cpu", weights_only=True)
            if "step" not in state or "trainable" not in state:
                raise ValueError("missing fields")
            return state
        except Exception as err:  # noqa: BLE001 - any unreadable file means a corrupt checkpoint
            logger.warning(
                "checkpoint %s is corrupt (%s); trying an older one. Delete it to silence this.", candidate, err
            )
    raise CheckpointError(
        f"every checkpoint in {root} is corrupt; start the run over: `unimae train --overwrite` instead of --resume"
    )
