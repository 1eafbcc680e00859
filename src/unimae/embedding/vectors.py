"""What is done to finished embeddings: Matryoshka truncation, L2 normalisation, quantization.

One function for every path that hands vectors out (``Encoder.encode``, the server's embeddings route, RAG's
query, the binary index's codes), so they all truncate, normalise and quantize alike.
"""

from __future__ import annotations

import numpy as np
import torch

EMBEDDING_PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")


def finish_embeddings(
    vectors: np.ndarray,
    dimensions: int | None,
    normalize: bool,
    precision: str = "float32",
    rotation: np.ndarray | None = None,
    **quantize_options,
) -> np.ndarray:
    """(N, D) float32 -> the first ``dimensions`` coordinates, L2-normalised if asked (after truncation, as
    Matryoshka models are used), then quantized to ``precision`` by sentence-transformers. With ``rotation``
    R (D, D) (:mod:`unimae.embedding.rotation`), a prefix is the first ``dimensions`` of ``R z`` instead; the full
    size stays ``z``."""
    if precision not in EMBEDDING_PRECISIONS:
        raise ValueError(f"precision must be one of {list(EMBEDDING_PRECISIONS)}, got {precision!r}")
    out = matryoshka_prefix(vectors, dimensions, rotation)  # (N, k)
    if normalize and len(out):  # the same op as encode_inputs(normalize=True), row by row
        out = torch.nn.functional.normalize(torch.from_numpy(np.ascontiguousarray(out)), dim=-1).numpy()
    if precision == "float32":
        return np.ascontiguousarray(out, dtype=np.float32)
    try:
        try:
            from sentence_transformers.util.quantization import quantize_embeddings
        except ImportError:  # sentence-transformers < 5.1
            from sentence_transformers.quantization import quantize_embeddings
    except ImportError as err:
        raise ImportError(
            f"precision={precision!r} quantizes with sentence-transformers: pip install 'unimae[eval]'"
        ) from err
    return quantize_embeddings(out, precision=precision, **quantize_options)


def matryoshka_prefix(vectors: np.ndarray, dimensions: int | None, rotation: np.ndarray | None = None) -> np.ndarray:
    """(N, D) -> (N, k): the first ``dimensions`` coordinates (of ``rotation @ z`` when given; all D when
    ``dimensions`` is None or D), not re-normalised."""
    if not dimensions or dimensions >= vectors.shape[1]:
        return vectors
    if rotation is None:
        return vectors[:, :dimensions]
    return vectors @ rotation[:dimensions].T  # (N, D) x (D, k): only the k leading axes
