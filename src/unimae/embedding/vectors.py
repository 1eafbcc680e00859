"""What is done to finished embeddings: Matryoshka truncation, L2 normalisation, quantization.

One function for every path that hands vectors out (``Encoder.encode``, the server's embeddings route, RAG's
query, the binary index's codes), so they all truncate, normalise and quantize alike.
"""

from __future__ import annotations

import numpy as np
import torch

EMBEDDING_PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")
# sentence-transformers' encode() keywords -> unimae's (None: no counterpart; the result is a numpy array)
SENTENCE_TRANSFORMERS_NAMES = {
    "normalize_embeddings": "normalize",
    "truncate_dim": "dimensions",
    "show_progress_bar": "show_progress",
    "convert_to_numpy": None,
    "convert_to_tensor": None,
    "output_value": None,
    "device": "Encoder.from_pretrained(device=...)",
}


def refuse_unknown_options(options: dict) -> None:
    """A TypeError for keywords ``Encoder.encode`` does not take, naming unimae's spelling of sentence-transformers'
    (silently ignoring ``normalize_embeddings=True`` would hand out unnormalised vectors)."""
    if not options:
        return
    hints = [f"{name} (use {ours})" if (ours := SENTENCE_TRANSFORMERS_NAMES.get(name)) else name for name in options]
    raise TypeError(f"encode() got unexpected keyword arguments: {', '.join(hints)}")


def finish_embeddings(
    vectors: np.ndarray,
    dimensions: int | None,
    normalize: bool,
    precision: str = "float32",
    rotation: np.ndarray | None = None,
    ranges: np.ndarray | None = None,
    calibration_embeddings: np.ndarray | None = None,
) -> np.ndarray:
    """(N, D) float32 -> the first ``dimensions`` coordinates, L2-normalised if asked (after truncation, as
    Matryoshka models are used), then quantized to ``precision`` by sentence-transformers. With ``rotation``
    R (D, D) (:mod:`unimae.embedding.rotation`), a prefix is the first ``dimensions`` of ``R z`` instead; the full
    size stays ``z``.

    int8 / uint8 scale each coordinate by its range: ``ranges`` (2, k) (min and max rows), else the ranges of
    ``calibration_embeddings`` (M, D) full-size float vectors, truncated and normalised as ``vectors`` are (or
    (M, k) ones already finished so), else of ``vectors`` themselves (then codes of two calls do not compare)."""
    if precision not in EMBEDDING_PRECISIONS:
        raise ValueError(f"precision must be one of {list(EMBEDDING_PRECISIONS)}, got {precision!r}")
    out = _finish_floats(vectors, dimensions, normalize, rotation)  # (N, k)
    if precision == "float32":
        return out
    options = _scale_options(out, vectors.shape[1], dimensions, normalize, rotation, ranges, calibration_embeddings)
    if precision in ("int8", "uint8") and not options and len(out) < 2:
        raise ValueError(
            f"precision={precision!r} of one vector needs per-dimension ranges: pass ranges= or "
            "calibration_embeddings= (unimae embed --calibration FILE.npy)"
        )
    try:
        try:
            from sentence_transformers.util.quantization import quantize_embeddings
        except ImportError:  # sentence-transformers < 5.1
            from sentence_transformers.quantization import quantize_embeddings
    except ImportError as err:
        raise ImportError(
            f"precision={precision!r} quantizes with sentence-transformers: pip install 'unimae[eval]'"
        ) from err
    return quantize_embeddings(out, precision=precision, **options)


def _finish_floats(vectors: np.ndarray, dimensions: int | None, normalize: bool, rotation) -> np.ndarray:
    """(N, D) -> (N, k) float32: the Matryoshka prefix, normalised row by row when ``normalize``."""
    out = matryoshka_prefix(vectors, dimensions, rotation)  # (N, k)
    if normalize and len(out):  # the same op as encode_inputs(normalize=True), row by row
        out = torch.nn.functional.normalize(torch.from_numpy(np.ascontiguousarray(out)), dim=-1).numpy()
    return np.ascontiguousarray(out, dtype=np.float32)


def _scale_options(out, full: int, dimensions, normalize, rotation, ranges, calibration) -> dict:
    """sentence-transformers' quantize options for the (N, k) ``out``: ``ranges`` (2, k) checked, or the
    ``calibration`` vectors finished as ``out`` was; {} for neither."""
    width = out.shape[1]
    if ranges is not None:
        ranges = np.asarray(ranges, dtype=np.float32)
        if ranges.shape != (2, width):
            raise ValueError(f"ranges must be (2, {width}) (min and max rows), got {ranges.shape}")
        return {"ranges": ranges}
    if calibration is None:
        return {}
    calibration = np.asarray(calibration, dtype=np.float32)
    if calibration.ndim != 2 or calibration.shape[1] not in (full, width) or len(calibration) < 2:
        raise ValueError(
            f"calibration_embeddings must be at least 2 float vectors of {full} (full size) or {width} coordinates, "
            f"got shape {calibration.shape}"
        )
    if calibration.shape[1] == full:
        calibration = _finish_floats(calibration, dimensions, normalize, rotation)
    return {"calibration_embeddings": calibration}


def matryoshka_prefix(vectors: np.ndarray, dimensions: int | None, rotation: np.ndarray | None = None) -> np.ndarray:
    """(N, D) -> (N, k): the first ``dimensions`` coordinates (of ``rotation @ z`` when given; all D when
    ``dimensions`` is None or D), not re-normalised."""
    if not dimensions or dimensions >= vectors.shape[1]:
        return vectors
    if rotation is None:
        return vectors[:, :dimensions]
    return vectors @ rotation[:dimensions].T  # (N, D) x (D, k): only the k leading axes
