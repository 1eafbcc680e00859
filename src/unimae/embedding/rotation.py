"""Matryoshka prefixes by rotation: the principal axes of an adapter's embeddings, first coordinates first.

An adapter's ``dimensions=k`` embedding is the first k coordinates of its vector, re-normalised. Training with
Matryoshka losses (``contrastive --matryoshka-dims``, Kusupati et al. 2022, arXiv:2205.13147) asks the model to put
what matters into those first coordinates; the [EOS] state of a decoder also feeds its LM head, and 80-560
LoRA steps move it little (``docs/results.md``, the released retrievers' per-dimension tables). A rotation
does it exactly instead: with ``R`` (D, D) the principal axes of a sample of the
adapter's embeddings (PCA: the eigenvectors of their covariance, largest variance first; Jolliffe, *Principal
Component Analysis*), the prefix of ``R z`` keeps the most variance any k coordinates can keep, and

    dimensions=k:  z_k = normalize((R z)[:k]) = normalize(R[:k] z)          (R orthogonal)

The full-size vector stays ``z`` (``h_eos``) itself: a rotation changes no cosine, so only prefixes use ``R``, and
unimae's full-size vectors, binary codes and indexes, and the GGUF's vectors, stay those of the unrotated model
(the sentence-transformers export rotates every vector: same cosines, other coordinates). The mean is not
subtracted when projecting (only when fitting), so that the full size and every prefix stay rotations of ``z``.

``R`` is fitted by ``unimae rotation`` on texts of the adapter's own training data (both sides of the pairs,
embedded as documents, i.e. with the document prompt if it has one; the choice of texts is a flag), stored
beside the weights as :data:`ROTATION_FILE` (fp32; a release keeps it, exact, in its weights file's metadata,
:data:`ROTATION_METADATA`), and named in its ``EmbeddingSpec`` (``rotation``: a fingerprint of the matrix, so
an index of prefixes built with one rotation refuses another). PCA comes from numpy's SVD (no new dependency);
sign and order of the axes are fixed so that a fit is reproducible.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import numpy as np

ROTATION_FILE = "matryoshka_rotation.safetensors"
ROTATION_METADATA = "unimae.matryoshka_rotation"  # a release keeps R in its weights file's metadata instead


def fit_rotation(vectors: np.ndarray) -> np.ndarray:
    """(N, D) embeddings -> R (D, D): rows the principal axes of the centred vectors, largest variance first, each
    with its largest-magnitude coordinate positive. Needs N >= D."""
    n, d = vectors.shape
    if n < d:
        raise ValueError(f"a rotation of {d} coordinates needs at least {d} embeddings to fit, got {n}")
    centred = vectors.astype(np.float64) - vectors.mean(0, dtype=np.float64)  # (N, D)
    _, _, axes = np.linalg.svd(centred, full_matrices=False)  # (D, D) rows by singular value, descending
    signs = np.sign(axes[np.arange(d), np.abs(axes).argmax(1)])  # (D,)
    return (axes * signs[:, None]).astype(np.float32)


def fingerprint(rotation: np.ndarray) -> str:
    """A short content hash of a rotation (what ``EmbeddingSpec.rotation`` holds)."""
    return hashlib.sha256(np.ascontiguousarray(rotation, dtype=np.float32).tobytes()).hexdigest()[:12]


def save_rotation(folder: str | Path, rotation: np.ndarray, info: dict[str, str] | None = None) -> str:
    """Write ``rotation`` (D, D) as ``folder/ROTATION_FILE`` -> its fingerprint. ``info``: strings kept in the
    file's metadata (what it was fitted on)."""
    import torch
    from safetensors.torch import save_file

    path = Path(folder) / ROTATION_FILE
    partial = path.with_name(f".{path.name}.partial")
    tensor = torch.from_numpy(np.ascontiguousarray(rotation, dtype=np.float32))
    save_file({"rotation": tensor}, str(partial), metadata={"format": "pt", **(info or {})})
    partial.replace(path)
    return fingerprint(rotation)


def rotation_metadata(rotation: np.ndarray) -> dict[str, str]:
    """``rotation`` (D, D) as a safetensors metadata entry (base64 of little-endian fp32, exact): how a release
    carries it inside ``adapter_model.safetensors``, its one weights file."""
    data = np.ascontiguousarray(rotation, dtype="<f4")
    return {ROTATION_METADATA: f"{data.shape[0]}:{base64.b64encode(data.tobytes()).decode()}"}


def _from_metadata(weights: Path) -> np.ndarray | None:
    """The rotation kept in a weights file's metadata (None without one)."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="numpy") as f:
        text = (f.metadata() or {}).get(ROTATION_METADATA)
    if text is None:
        return None
    size, _, data = text.partition(":")
    return np.frombuffer(base64.b64decode(data), dtype="<f4").reshape(int(size), int(size)).astype(np.float32)


def load_rotation(folder: str | Path, expected: str) -> np.ndarray:
    """The rotation of the adapter ``folder`` whose ``EmbeddingSpec.rotation`` is ``expected``: its
    :data:`ROTATION_FILE`, or a release's weights-file metadata; a missing, unreadable or different one is an error
    that says how to make it again."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path, weights = Path(folder) / ROTATION_FILE, Path(folder) / "adapter_model.safetensors"
    again = (
        f"restore the adapter's files as written (a release keeps its rotation in {weights.name}'s metadata), "
        f"or fit it again: unimae rotation --adapter {folder} --data ... (for a release: on a copy of its folder)"
    )
    source = path if path.is_file() else weights
    try:
        rotation = load_file(str(path))["rotation"] if path.is_file() else None
        if rotation is None and weights.is_file():
            rotation = _from_metadata(weights)
    except (SafetensorError, KeyError, ValueError, OSError) as err:
        raise ValueError(f"{source} holds no readable rotation ({err}); {again}") from err
    if rotation is None:
        raise FileNotFoundError(
            f"{folder}'s unimae.json names a Matryoshka rotation but neither {path.name} nor {weights.name}'s "
            f"metadata holds one; {again}"
        )
    if rotation.ndim != 2 or rotation.shape[0] != rotation.shape[1] or fingerprint(rotation) != expected:
        raise ValueError(f"{source} does not hold the rotation {folder}'s unimae.json names ({expected}); {again}")
    return rotation
