"""A fingerprint of a run's training examples: a resumed run must see the data its checkpoint was trained on
(an appended or edited pairs file changes every later batch, silently)."""

from __future__ import annotations

import hashlib
import json


def examples_fingerprint(examples: list) -> dict:
    """``{"count": N, "sha256": first 16 hex digits}`` over the examples in order (texts, or pair records as
    key-sorted JSON)."""
    digest = hashlib.sha256()
    for example in examples:
        text = example if isinstance(example, str) else json.dumps(example, sort_keys=True, default=str)
        digest.update(text.encode("utf-8", "surrogatepass"))
        digest.update(b"\x00")
    return {"count": len(examples), "sha256": digest.hexdigest()[:16]}


def check_same_examples(saved: dict | None, current: dict, where: str) -> None:
    """A ValueError when ``current`` is not the fingerprint a checkpoint ``saved`` (older checkpoints have none)."""
    if saved and saved != current:
        raise ValueError(
            f"--resume: the training data changed since the checkpoint in {where} ({saved['count']} examples, "
            f"{saved['sha256']}, then; {current['count']}, {current['sha256']}, now): resume with the data the run "
            "started with, or train on the new data into another --output-dir"
        )
