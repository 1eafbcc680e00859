"""What is done to finished embeddings: Matryoshka truncation, L2 normalisation, quantization.

One function for every path that hands vectors out (``Encoder.encode``, the server's embeddings route, RAG's
query, the binary index's codes), so they all truncate, normalise and quantize alike. Also: which of
sentence-transformers' ``encode()`` keywords ``Encoder.encode`` takes, and as what.
"""

from __future__ import annotations

import functools
import logging
import numbers

import numpy as np
import torch

logger = logging.getLogger(__name__)

EMBEDDING_PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")
# sentence-transformers' encode() keywords that Encoder.encode takes under its own name (sentences: up to 5.x,
# inputs: 6.x)
SENTENCE_TRANSFORMERS_ALIASES = {
    "sentences": "texts",
    "inputs": "texts",
    "normalize_embeddings": "normalize",
    "truncate_dim": "dimensions",
    "show_progress_bar": "show_progress",
}
# ... the ones that choose the result's form, with sentence-transformers' defaults (a numpy array of sentence
# embeddings)
SENTENCE_TRANSFORMERS_OUTPUT = {
    "output_value": "sentence_embedding",
    "convert_to_numpy": True,
    "convert_to_tensor": False,
}
# ... and the ones it refuses, with what to use instead (None: no counterpart)
SENTENCE_TRANSFORMERS_NAMES = {
    "device": "Encoder.from_pretrained(device=...)",
    "pool": None,
    "chunk_size": None,
}


def sentence_transformers_options(ours: dict, options: dict) -> tuple[dict, dict]:
    """Resolve sentence-transformers' spellings in ``options`` (the keywords ``Encoder.encode`` did not bind) onto
    ``ours`` (unimae's keyword -> value; None counts as not given) -> (``ours`` updated, ``convert_to_numpy`` and
    ``convert_to_tensor`` with sentence-transformers' defaults filled in).

    A TypeError for one option given under both spellings with different values (``normalize=False,
    normalize_embeddings=True``: no silent winner), and for a keyword neither spells (naming unimae's own)."""
    ours, options = dict(ours), dict(options)
    for name, target in SENTENCE_TRANSFORMERS_ALIASES.items():
        if name not in options or (value := options.pop(name)) is None:
            continue
        given = ours[target]
        if given is not None and not _same(given, value):
            raise TypeError(f"encode() got {target} and {name} (sentence-transformers' spelling of it): pass one")
        ours[target] = value
    output = {name: options.pop(name, default) for name, default in SENTENCE_TRANSFORMERS_OUTPUT.items()}
    refuse_unknown_options(options)
    if (value := output.pop("output_value")) != "sentence_embedding":
        raise ValueError(f"output_value={value!r}: unimae's encode returns sentence embeddings only")
    return ours, output


def _same(a, b) -> bool:
    """Whether two spellings of one option carry the same value (the same object, or equal scalars)."""
    scalars = (numbers.Number, str)
    return a is b or (isinstance(a, scalars) and isinstance(b, scalars) and bool(a == b))


def refuse_unknown_options(options: dict) -> None:
    """A TypeError for keywords ``Encoder.encode`` does not take, naming what to use instead where there is
    something (silently ignoring a keyword would hand out other vectors than asked for)."""
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


def check_dimensions(dimensions: int | None, full: int, spec) -> None:
    """``dimensions`` must be None or 1..full; a prefix the adapter (``spec``, an EmbeddingSpec) was not trained for
    gets a warning, once per process for each size (its vectors are usable but were never trained to stand
    alone)."""
    if dimensions is None:
        return
    if isinstance(dimensions, bool) or not isinstance(dimensions, numbers.Integral) or not 1 <= dimensions <= full:
        raise ValueError(f"dimensions must be an integer from 1 to {full} (this model's size), got {dimensions!r}")
    if dimensions < full and dimensions not in spec.matryoshka_dims and not spec.rotation:
        _warn_untrained(int(dimensions), tuple(spec.matryoshka_dims))


@functools.cache
def _warn_untrained(dimensions: int, trained: tuple[int, ...]) -> None:
    logger.warning(
        "dimensions=%d: this adapter was not trained to embed with %d dimensions (Matryoshka dimensions: %s)",
        dimensions,
        dimensions,
        list(trained) or "none",
    )
