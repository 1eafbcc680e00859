"""A persistent FAISS vector index of passages, embedded as the encoder's ``EmbeddingSpec`` says ([EOS] by default).

Layout of an index folder::

    manifest.json     model, adapter revision, pooling, dim, kind, passage fingerprint, complete flag, sha256
    passages.jsonl    {"id", "text"} per passage, in index order
    shards/00000256.npy  (shard_size, D) float32 unit vectors, named by first passage, written one by one
    shards/00000256.sha256  the SHA-256 of that shard's file, written right after it
    index.faiss       the FAISS index over all shards (inner product on unit vectors = cosine)
    rescore.faiss     binary kind, int8 rescoring: the trained 8-bit scalar quantizer (no vectors)
    rescore.npy       binary kind, int8 rescoring: (N, D) uint8 codes, memory-mapped, read per candidate

Passages are embedded as documents (the adapter's ``document`` prompt, if it has one; queries are embedded with
its ``query`` prompt by :mod:`unimae.retrieval.rag`). ``dimensions`` builds the index over the first k coordinates
(re-normalised; for an adapter trained with Matryoshka dimensions). Index kinds and memory per vector (D dims):

=======  ===================================================================  ==============
kind     FAISS index                                                          bytes / vector
=======  ===================================================================  ==============
flat     ``IndexFlatIP``: exact cosine                                        4 D
hnsw     ``IndexHNSWFlat``: approximate, graph                                4 D + graph
ivf      ``IndexIVFFlat``: approximate, inverted lists                        4 D
sq8      ``IndexScalarQuantizer`` QT_8bit: int8 codes, per-dimension ranges   D
         trained on the corpus (FAISS's calibration); float query against
         the decoded codes
binary   ``IndexBinaryFlat``: sign bits (sentence-transformers'               D / 8 in RAM
         ``quantize_embeddings(..., "ubinary")``), Hamming search for         (+ D on disk)
         ``rescore_multiplier`` x k candidates, rescored with the float
         query (``rescore``, below)
=======  ===================================================================  ==============

Rescoring a binary index (``IndexConfig.rescore``; the papers and libraries leave the choice open, so it is a flag):

- ``int8`` (default): the candidates are rescored with the float query against their int8 codes (FAISS's 8-bit
  scalar quantizer, ranges trained on the corpus, as the ``sq8`` kind), kept on disk in ``rescore.npy`` and
  memory-mapped, so a search reads only the candidates' rows: sentence-transformers' "binary retrieval + int8
  rescoring" recipe. RAM holds the sign bits (1/32 of float); the disk holds D more bytes a vector. Loading
  reads the file once, to check its SHA-256, as it does ``index.faiss``.
- ``bits``: the candidates are rescored against their own sign bits (sentence-transformers'
  ``semantic_search_faiss``): nothing more on disk, lower quality (measured in docs/results.md). Indexes built
  before this option are read this way.

Every file is written to a temporary name, fsynced and renamed into place, so a killed ``unimae index`` (or a
power cut) leaves finished shards and no half-written file; running it again resumes at the first missing shard.
An index whose manifest says ``complete: false`` refuses to load; the final manifest is written after the folders
holding the renamed files are fsynced, so it never says ``complete`` for a file that did not reach the disk.

One build at a time: a build holds an advisory lock (``flock``) on ``.unimae-build.lock`` inside the folder from
its first check to its last write, and a second build of the folder (``--overwrite`` too) fails at once naming
the folder (:func:`build_lock`). Opening a finished index takes no lock.

Integrity: a resumed build reuses a shard only if its bytes still match the SHA-256 recorded when it was
written (one damaged in place, same size, is embedded again; shards of builds older than these hashes are
checked by shape only), and never writes NaN or infinite vectors. A finished manifest records the SHA-256 of
every shard and of ``index.faiss`` (key ``sha256``); loading checks ``index.faiss`` against it, the passages
against their fingerprint and the FAISS index's dimension against the manifest's. Manifests written before
the hashes load with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from filelock import FileLock, Timeout
from tqdm.auto import tqdm

from unimae.embedding.spec import EmbeddingSpec
from unimae.embedding.vectors import check_dimensions, finish_embeddings
from unimae.files import atomic_write, atomic_write_json, atomic_write_text, file_sha256, fsync_folder, read_json

logger = logging.getLogger(__name__)

INDEX_KINDS = ("flat", "hnsw", "ivf", "sq8", "binary")
RESCORERS = ("int8", "bits")
RESCORE_CODEC, RESCORE_CODES = "rescore.faiss", "rescore.npy"
# Every file a store writes beside the shards, manifest and passages (this module's, then the disk store's): a build
# removes those its store does not write, so an earlier build of another kind or store leaves nothing behind.
STORE_FILES = ("index.faiss", RESCORE_CODEC, RESCORE_CODES, "vectors.npy", "ivfpq.faiss", "passages.offsets.npy")
FORMAT_VERSION = 1
LOCK_FILE = ".unimae-build.lock"


class VectorIndexError(ValueError):
    """The index folder cannot be used as asked; the message says why and what to do."""


@dataclass
class IndexConfig:
    """How passages are embedded and searched."""

    kind: str = field(
        default="flat", metadata={"help": "flat = exact search; hnsw or ivf = approximate, for large corpora."}
    )
    shard_size: int = field(default=256, metadata={"help": "Passages embedded and saved per shard (the resume unit)."})
    batch_size: int = field(default=16, metadata={"help": "Passages per forward pass."})
    hnsw_m: int = field(default=32, metadata={"help": "HNSW graph degree."})
    ivf_nlist: int | None = field(default=None, metadata={"help": "IVF cells; default about 4*sqrt(N)."})
    ivf_nprobe: int = field(default=16, metadata={"help": "IVF cells searched per query."})
    dimensions: int | None = field(
        default=None, metadata={"help": "Index the first k coordinates (Matryoshka); default: all of them."}
    )
    rescore_multiplier: int = field(
        default=4, metadata={"help": "binary: candidates per result found by Hamming distance, then rescored."}
    )
    rescore: str = field(
        default="int8",
        metadata={
            "help": "binary: rescore the candidates against int8 codes on disk (int8) or their sign bits (bits)."
        },
    )

    def __post_init__(self):
        if self.kind not in INDEX_KINDS:
            raise ValueError(f"index kind must be one of {INDEX_KINDS}, got {self.kind!r}")
        if min(self.shard_size, self.batch_size, self.rescore_multiplier, self.hnsw_m, self.ivf_nprobe) < 1:
            raise ValueError("shard_size, batch_size, rescore_multiplier, hnsw_m and ivf_nprobe must be >= 1")
        for name in ("dimensions", "ivf_nlist"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.rescore not in RESCORERS:
            raise ValueError(f"rescore must be one of {RESCORERS}, got {self.rescore!r}")


@dataclass
class Hit:
    """One retrieved passage: its id, text and cosine score."""

    id: str
    text: str
    score: float


def passages_fingerprint(passages: list[tuple[str, str]]) -> str:
    digest = hashlib.sha256()
    for pid, text in passages:
        digest.update(pid.encode() + b"\0" + text.encode() + b"\0")
    return digest.hexdigest()[:16]


def _faiss():
    try:
        import faiss
    except ImportError as err:
        raise ImportError("the vector index needs FAISS: pip install 'unimae[serve]' (faiss-cpu)") from err
    return faiss


def _build_faiss(vectors: np.ndarray, config: IndexConfig):
    """vectors (N, D) float32 unit rows -> a FAISS inner-product index."""
    faiss = _faiss()
    n, dim = vectors.shape
    if config.kind == "binary":
        index = faiss.IndexBinaryFlat(8 * _binary_codes(vectors[:1]).shape[1])
        index.add(_binary_codes(vectors))
        return index
    if config.kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif config.kind == "sq8":
        index = faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
        index.train(vectors)  # per-dimension min/max of the corpus
    elif config.kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
    else:
        nlist = min(n, config.ivf_nlist or max(1, min(n // 39, int(4 * np.sqrt(n)))))  # FAISS: >= 39 points a cell
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.train(vectors)
        index.nprobe = min(config.ivf_nprobe, nlist)
    index.add(vectors)
    return index


def _binary_codes(vectors: np.ndarray) -> np.ndarray:
    """(N, D) float -> (N, ceil(D / 8)) uint8 sign bits, by sentence-transformers' ``quantize_embeddings``."""
    return finish_embeddings(vectors, None, False, "ubinary")


def _int8_rescored(manifest: dict) -> bool:
    """Whether an index rescores binary candidates with int8 codes on disk (indexes from before the option: no)."""
    config = manifest.get("config", {})
    return config.get("kind") == "binary" and config.get("rescore", "bits") == "int8"


def search_queries(queries: np.ndarray, dim: int, k: int) -> np.ndarray:
    """A search's queries as contiguous float32 rows (Q, D); ValueError for another dimension or k < 1."""
    queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)  # (Q, D)
    if queries.shape[1] != dim:
        raise ValueError(f"query dimension {queries.shape[1]} != index dimension {dim}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return queries


def remove_stale_files(directory: Path, written: list[str]) -> None:
    """Delete the :data:`STORE_FILES` of ``directory`` that the build just finished did not write."""
    for name in STORE_FILES:
        if name not in written:
            (directory / name).unlink(missing_ok=True)


def _write_rescore_store(directory: Path, vectors: np.ndarray) -> None:
    """vectors (N, D) float unit rows -> ``rescore.faiss`` (FAISS's 8-bit scalar quantizer, per-dimension ranges
    trained on them, holding no vectors) and ``rescore.npy`` (N, D) uint8: its codes of every row."""
    faiss = _faiss()
    codec = faiss.IndexScalarQuantizer(vectors.shape[1], faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
    codec.train(vectors)
    codes = codec.sa_encode(vectors)  # (N, D) uint8
    atomic_write(directory / RESCORE_CODEC, lambda tmp: faiss.write_index(codec, str(tmp)), fsync=True)
    atomic_write(directory / RESCORE_CODES, lambda tmp: _save_npy(tmp, codes), fsync=True)


def _save_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as handle:  # a file object: np.save would add ".npy" to the temporary name
        np.save(handle, array)


def _read_rescore_store(directory: Path, count: int) -> tuple:
    """(codec, codes (N, D) uint8 memory-mapped) of an int8-rescored binary index; VectorIndexError if unreadable."""
    try:
        codec = _faiss().read_index(str(directory / RESCORE_CODEC))
        codes = np.load(directory / RESCORE_CODES, mmap_mode="r")
    except (OSError, RuntimeError, ValueError) as err:
        raise VectorIndexError(
            f"{directory}: the binary index's int8 rescoring store cannot be read ({err}); "
            "rerun `unimae index` with the same arguments to rebuild it from its shards"
        ) from err
    if codes.shape != (count, codec.d) or codes.dtype != np.uint8:
        raise VectorIndexError(
            f"{directory / RESCORE_CODES} holds {codes.shape} {codes.dtype} codes, not ({count}, "
            f"{codec.d}) uint8; rerun `unimae index` with the same arguments to rebuild it"
        )
    return codec, codes


def _int8_rescored_search(index, store: tuple, queries: np.ndarray, k: int, multiplier: int, chunk: int = 64):
    """queries (Q, D) float unit rows -> (scores, ids) (Q, k): the Hamming top ``multiplier`` x k of the sign bits,
    rescored by the float query against the candidates' int8 codes (decoded by the corpus-trained quantizer);
    scores are cosines up to the int8 rounding. ``chunk`` queries at a time bound the decoded (chunk, C, D) block."""
    codec, codes = store
    candidates = min(k * multiplier, index.ntotal)
    _, ids = index.search(_binary_codes(queries), candidates)  # (Q, C); FAISS pads with -1 past the corpus
    scores = np.empty(ids.shape, dtype=np.float32)  # (Q, C)
    for start in range(0, len(queries), chunk):
        found = ids[start : start + chunk]  # (q, C)
        rows = np.maximum(found, 0)  # (q, C); a -1 pad reads row 0 and is scored -inf below
        decoded = codec.sa_decode(codes[rows.ravel()]).reshape(*rows.shape, -1)  # (q, C, D), only these rows read
        block = np.einsum("qd,qcd->qc", queries[start : start + chunk], decoded)  # (q, C)
        scores[start : start + chunk] = np.where(found >= 0, block, -np.inf)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # (Q, k)
    return np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)


def _rescored_binary_search(index, queries: np.ndarray, k: int, multiplier: int) -> tuple[np.ndarray, np.ndarray]:
    """queries (Q, D) float unit rows -> (scores, ids) (Q, k) from a binary index: sentence-transformers'
    ``semantic_search_faiss`` (Hamming top ``multiplier`` x k, rescored by the float query against the corpus
    bits b). Its score ``q . b`` is mapped to the cosine of q and the sign vector 2b - 1:
    ``(2 q.b - sum(q)) / (|q| sqrt(D))``, which ranks the same way."""
    from sentence_transformers.util.quantization import semantic_search_faiss

    results, _ = semantic_search_faiss(
        queries, corpus_index=index, corpus_precision="ubinary", top_k=k, rescore=True, rescore_multiplier=multiplier
    )
    dim = queries.shape[1]
    offset = queries.sum(1, keepdims=True)  # (Q, 1)
    scale = np.linalg.norm(queries, axis=1, keepdims=True) * np.sqrt(dim)  # (Q, 1)
    ids = np.full((len(queries), k), -1, dtype=np.int64)
    scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
    for row, found in enumerate(results):
        for col, hit in enumerate(found[:k]):
            ids[row, col] = hit["corpus_id"]
            scores[row, col] = (2 * hit["score"] - offset[row, 0]) / scale[row, 0]
    return scores, ids


def index_manifest(encoder, passages: list[tuple[str, str]], config, source: dict | None) -> dict:
    """A new build's manifest (``complete: false`` until its index is written): what embedded the passages and
    how (the encoder's own ``source``, ``source``'s keys over it), the passages' fingerprint and the store's
    ``config`` (a dataclass); the resume rules compare it."""
    dim = config.dimensions or encoder.embedding_dim
    return {
        "format": FORMAT_VERSION,
        **getattr(encoder, "source", {}),  # the model and adapter an Encoder.from_pretrained loaded
        **(source or {}),
        "pooling": encoder.spec.pooling,
        "embedding": encoder.spec.at_size(dim, encoder.embedding_dim).to_dict(),  # a rotation: prefixes only
        "max_length": encoder.max_length,
        "precision": getattr(encoder, "embedding_precision", encoder.precision),
        "merged": encoder.adapter_merged,
        "dim": dim,
        "count": len(passages),
        "passages": passages_fingerprint(passages),
        "config": asdict(config),
        "complete": False,
    }


def finished_manifest(directory: Path) -> dict:
    """The manifest of a finished index folder; VectorIndexError for a missing or unfinished one."""
    manifest_path = Path(directory) / "manifest.json"
    if not manifest_path.is_file():
        raise VectorIndexError(f"{directory} is not a unimae index (no manifest.json); build one with `unimae index`")
    manifest = _read_manifest(manifest_path)
    if not manifest.get("complete"):
        raise VectorIndexError(f"{directory} is incomplete (indexing was interrupted); rerun `unimae index` to resume")
    return manifest


@contextlib.contextmanager
def build_lock(directory: str | Path) -> Iterator[None]:
    """Hold the build lock of the index folder ``directory`` (created if need be) for the block: a
    :class:`filelock.FileLock` on :data:`LOCK_FILE` inside it (``flock`` on POSIX), taken without waiting
    (VectorIndexError if another build holds it), released on leaving the block, on an error, or when the process
    dies. ``--overwrite`` empties the folder's shards but never deletes the folder, so the lock file can live inside
    it. Re-entrant in its thread (one lock object a path, its count per thread): a caller holding it across two
    builds takes it again as a no-op, while another thread or process is refused."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lock = FileLock(directory / LOCK_FILE, timeout=0, is_singleton=True)
    try:
        lock.acquire()
    except Timeout:
        raise VectorIndexError(
            f"another `unimae index` build holds the index folder {directory} (lock file {LOCK_FILE}); wait for it "
            "to finish or stop it, or choose another --output-dir (--overwrite does not take a folder from a "
            "running build)"
        ) from None
    try:
        yield
    finally:
        lock.release()


def begin_build(directory: Path, manifest: dict, config, overwrite: bool) -> Path:
    """A locked build's first writes: check that ``directory`` may be resumed (else refuse, or empty its shards
    for ``overwrite``), delete a killed build's temporary files and write ``manifest`` (``complete: false``)
    -> the shards folder."""
    shards = directory / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    _check_resumable(directory / "manifest.json", manifest, config, overwrite, shards)
    remove_stale_temporaries(directory, shards)
    write_manifest(directory, manifest)
    return shards


def write_manifest(directory: Path, manifest: dict) -> None:
    """Write ``directory``'s manifest.json so that it lasts through a power cut, after what it vouches for: the
    build's files were fsynced before their renames; their folders are fsynced here, then the manifest, then its
    folder (one fsync each)."""
    fsync_folder(directory / "shards")
    fsync_folder(directory)
    atomic_write_json(directory / "manifest.json", manifest, fsync=True)
    fsync_folder(directory)


class VectorIndex:
    """Passages + their embeddings in FAISS. Build with :meth:`build`, open with :meth:`load`."""

    def __init__(self, directory: Path, manifest: dict, passages: list[tuple[str, str]], index):
        self.directory, self.manifest, self.passages, self.index = directory, manifest, passages, index
        self.rescore_store = _read_rescore_store(directory, len(passages)) if _int8_rescored(manifest) else None

    def __len__(self) -> int:
        return len(self.passages)

    @classmethod
    def build(
        cls,
        encoder,
        passages: list[tuple[str, str]],
        directory: str | Path,
        config: IndexConfig | None = None,
        source: dict | None = None,
        overwrite: bool = False,
    ) -> VectorIndex:
        """Embed ``passages`` with ``encoder`` shard by shard into ``directory`` (resuming), then index them.

        ``source`` (model spec, adapter, corpus) is recorded in the manifest; an existing folder built from
        other passages, another model or adapter is an error unless ``overwrite``. The folder's build lock is
        held throughout (:func:`build_lock`): a second build of it fails at once.
        """
        if not passages:
            raise VectorIndexError("no passages to index")
        config = config or IndexConfig()
        directory = Path(directory)
        manifest = index_manifest(encoder, passages, config, source)
        with build_lock(directory):
            shards = begin_build(directory, manifest, config, overwrite)
            atomic_write_text(
                directory / "passages.jsonl",
                "".join(json.dumps({"id": pid, "text": text}) + "\n" for pid, text in passages),
                fsync=True,
            )
            starts = embed_missing_shards_here(encoder, passages, shards, config, manifest["dim"])
            vectors = np.concatenate([np.load(_shard_path(shards, s)) for s in starts])  # (N, D)
            index, stored = _write_store(directory, manifest, vectors, config)
            manifest["sha256"] = {
                **{name: file_sha256(directory / name) for name in stored},
                "shards": _shard_hashes(shards, range(0, len(passages), config.shard_size)),
            }
            manifest["complete"] = True
            write_manifest(directory, manifest)
        return cls(directory, manifest, passages, index)

    @classmethod
    def load(cls, directory: str | Path) -> VectorIndex:
        """Open a finished index folder; clear errors for a missing, incomplete or damaged one."""
        directory = Path(directory)
        manifest = finished_manifest(directory)
        passages = _read_passages(directory / "passages.jsonl")
        _check_integrity(directory, manifest, passages)
        faiss = _faiss()
        try:
            read = faiss.read_index_binary if manifest.get("config", {}).get("kind") == "binary" else faiss.read_index
            index = read(str(directory / "index.faiss"))
        except RuntimeError as err:
            raise VectorIndexError(
                f"{directory / 'index.faiss'} cannot be read ({err}); rebuild with `unimae index`"
            ) from err
        if index.ntotal != len(passages) or len(passages) != manifest["count"]:
            raise VectorIndexError(
                f"{directory}: index holds {index.ntotal} vectors for {len(passages)} passages; rebuild it"
            )
        _check_dimension(directory, manifest, index)
        if manifest.get("config", {}).get("kind") == "ivf":
            index.nprobe = manifest["config"].get("ivf_nprobe", 16)
        return cls(directory, manifest, passages, index)

    @property
    def kind(self) -> str:
        return self.manifest.get("config", {}).get("kind", "flat")

    @property
    def dim(self) -> int:
        """The dimension of its vectors (a Matryoshka prefix of the model's, or all of them)."""
        return int(self.manifest["dim"])

    @property
    def spec(self) -> EmbeddingSpec:
        """How the passages were embedded (indexes older than the spec recorded only their pooling)."""
        return EmbeddingSpec.from_dict(self.manifest.get("embedding") or {"pooling": self.manifest.get("pooling")})

    def search(self, queries: np.ndarray, k: int = 4) -> list[list[Hit]]:
        """queries (Q, D) unit vectors -> the top-``k`` passages for each, best first."""
        queries = search_queries(queries, self.manifest["dim"], k)  # (Q, D)
        k = min(k, len(self.passages))
        if self.kind == "binary":
            multiplier = self.manifest["config"].get("rescore_multiplier", 4)
            if self.rescore_store is not None:
                scores, ids = _int8_rescored_search(self.index, self.rescore_store, queries, k, multiplier)
            else:
                scores, ids = _rescored_binary_search(self.index, queries, k, multiplier)  # (Q, k) each
        else:
            scores, ids = self.index.search(queries, k)  # (Q, k) each
        return [
            [Hit(*self.passages[i], float(s)) for s, i in zip(row_s, row_i, strict=True) if i >= 0]
            for row_s, row_i in zip(scores, ids, strict=True)
        ]


def _write_store(directory: Path, manifest: dict, vectors: np.ndarray, config: IndexConfig) -> tuple:
    """vectors (N, D) -> the FAISS index, written (fsynced) to ``index.faiss`` with an int8-rescored binary
    index's store, the other stores' files removed -> (index, names of the files written)."""
    index = _build_faiss(vectors, config)
    faiss = _faiss()
    write = faiss.write_index_binary if config.kind == "binary" else faiss.write_index
    atomic_write(directory / "index.faiss", lambda tmp: write(index, str(tmp)), fsync=True)
    stored = ["index.faiss", *([RESCORE_CODEC, RESCORE_CODES] if _int8_rescored(manifest) else [])]
    if len(stored) > 1:
        _write_rescore_store(directory, vectors)
    remove_stale_files(directory, stored)
    return index, stored


def _check_integrity(directory: Path, manifest: dict, passages: list[tuple[str, str]]) -> None:
    """VectorIndexError unless ``index.faiss`` (and an int8-rescored binary index's store) match their recorded
    SHA-256 and the passages their fingerprint (a manifest older than the hashes: a warning, nothing checked)."""
    if manifest.get("passages") not in (None, passages_fingerprint(passages)):
        raise VectorIndexError(
            f"{directory / 'passages.jsonl'} is not the file this index was built from (its fingerprint differs from "
            "manifest.json's); rebuild the index with `unimae index --overwrite`"
        )
    recorded = manifest.get("sha256", {}).get("index.faiss")
    if recorded is None:
        logger.warning(
            "index %s was built before unimae recorded hashes: index.faiss is not verified. Rerun `unimae index` "
            "with the same arguments to record them",
            directory,
        )
        return
    for name in ["index.faiss", *([RESCORE_CODEC, RESCORE_CODES] if _int8_rescored(manifest) else [])]:
        path = directory / name
        if not path.is_file() or file_sha256(path) != manifest["sha256"].get(name):
            raise VectorIndexError(
                f"{path} {'does not match the SHA-256 in manifest.json' if path.is_file() else 'is missing'}: it was "
                "changed or damaged after the index was built; rerun `unimae index` with the same arguments to rebuild "
                "it from its shards"
            )


def _check_dimension(directory: Path, manifest: dict, index) -> None:
    """VectorIndexError unless the FAISS index holds vectors of the manifest's dimension (sign bits: one per
    dimension, padded to whole bytes)."""
    dim = int(manifest["dim"])
    expected = 8 * -(-dim // 8) if manifest.get("config", {}).get("kind") == "binary" else dim
    if index.d != expected:
        raise VectorIndexError(
            f"{directory / 'index.faiss'} holds {index.d}-dimensional vectors, but manifest.json says {expected}; "
            "rerun `unimae index` with the same arguments to rebuild it from its shards"
        )


def _read_manifest(path: Path) -> dict:
    try:
        manifest = read_json(path, "index manifest")
    except ValueError as err:
        raise VectorIndexError(f"{path} is damaged ({err}); rebuild with `unimae index --overwrite`") from err
    if not isinstance(manifest, dict):
        raise VectorIndexError(f"{path} is damaged (not a JSON object); rebuild with `unimae index --overwrite`")
    return manifest


def _read_passages(path: Path) -> list[tuple[str, str]]:
    """The (id, text) records of a finished index; a clear error for a missing or damaged file."""
    if not path.is_file():
        raise VectorIndexError(f"{path} is missing; rebuild the index with `unimae index --overwrite`")
    passages = []
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            try:
                record = json.loads(line.decode("utf-8"))
                passages.append((record["id"], record["text"]))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
                raise VectorIndexError(
                    f"{path}, line {number}, is damaged ({err}); rebuild the index with `unimae index --overwrite`"
                ) from err
    return passages


def _shard_path(shards: Path, start: int) -> Path:
    return shards / f"{start:08d}.npy"


def remove_stale_temporaries(*folders: Path) -> None:
    """Delete the hidden temporary files (``.NAME.tmpPID``, :func:`unimae.files.atomic_write`) that a build killed
    mid-write left in ``folders``: a vectors file's may be as large as the index (one build writes a folder at a
    time)."""
    for folder in folders:
        for stale in folder.glob(".*.tmp*"):
            if stale.is_file():
                stale.unlink(missing_ok=True)


def _check_resumable(manifest_path: Path, manifest: dict, config: IndexConfig, overwrite: bool, shards: Path) -> None:
    """Refuse to resume into a folder whose index was built another way (unless ``overwrite``, which drops its
    embedded ``shards`` instead)."""
    if manifest_path.is_file() and not overwrite:
        old = _read_manifest(manifest_path)
        for key in ("embedding", "precision", "merged", "model_revision"):  # older manifests lack these
            old.setdefault(key, manifest.get(key))
        same = ("format", "model", "model_revision", "adapter_revision", "pooling", "embedding", "max_length")
        same += ("precision", "merged", "passages", "dim")  # a resumed build never mixes shards embedded two ways
        changed = [k for k in same if old.get(k) != manifest.get(k)]
        if changed or old.get("config", {}).get("shard_size") != config.shard_size:
            why = " (the adapter's weights changed: retrained, or a newer release)" * ("adapter_revision" in changed)
            raise VectorIndexError(
                f"{manifest_path.parent} holds an index built with other {', '.join(changed) or 'shard_size'}{why}; "
                "pass --overwrite to rebuild it or choose another --output-dir"
            )
    elif overwrite:
        for stale in [*shards.glob("*.npy"), *shards.glob("*.sha256")]:
            stale.unlink()


def embed_missing_shards_here(encoder, passages: Sequence[tuple[str, str]], shards: Path, config, dim: int) -> range:
    """Embed, in this process, every shard of ``passages`` not already (whole) in ``shards`` (normalized fp32
    ``.npy`` per shard, ``dim`` wide) -> the shards' first rows. Both stores build through it (``config``: an
    :class:`IndexConfig` or a disk store's, for ``shard_size``, ``batch_size`` and ``dimensions``)."""
    starts = range(0, len(passages), config.shard_size)
    todo = [s for s in starts if not _shard_ok(shards, s, config.shard_size, len(passages), dim)]
    if len(todo) < len(starts):
        logger.info("resuming: %d of %d shards already embedded", len(starts) - len(todo), len(starts))
    if todo and config.dimensions:  # its warning (an untrained size) before the progress bar, not inside its line
        check_dimensions(config.dimensions, encoder.embedding_dim, encoder.spec)
    for start in tqdm(todo, desc="index shards", unit="shard", disable=not todo):
        texts = [text for _, text in passages[start : start + config.shard_size]]
        vectors = encoder.encode_document(
            texts, batch_size=config.batch_size, normalize=True, show_progress=False, dimensions=config.dimensions
        )
        write_shard(shards, start, vectors)
    return starts


def _hash_path(shards: Path, start: int) -> Path:
    return shards / f"{start:08d}.sha256"


def write_shard(shards: Path, start: int, vectors: np.ndarray) -> None:
    """Write the (n, D) ``vectors`` of the shard starting at ``start`` atomically (fsynced), then its SHA-256 beside
    it; VectorIndexError for a NaN or infinite vector (the model's weights are damaged)."""
    if not np.isfinite(vectors).all():
        raise VectorIndexError(
            f"the model gave NaN or infinite embeddings for passages {start} to {start + len(vectors) - 1}: its "
            "weights (or the adapter's) are damaged; load them again, or retrain"
        )
    buffer = io.BytesIO()
    np.save(buffer, vectors.astype(np.float32))
    data = buffer.getvalue()
    atomic_write(_shard_path(shards, start), lambda tmp: tmp.write_bytes(data), fsync=True)
    atomic_write_text(_hash_path(shards, start), hashlib.sha256(data).hexdigest() + "\n", fsync=True)


def _shard_hashes(shards: Path, starts: range) -> dict[str, str]:
    """{shard file name: SHA-256} of every shard, as recorded beside it (computed for a shard of an older build)."""
    hashes = {}
    for start in starts:
        recorded = _hash_path(shards, start)
        digest = recorded.read_text().strip() if recorded.is_file() else shard_sha256(_shard_path(shards, start))
        hashes[_shard_path(shards, start).name] = digest
    return hashes


def shard_sha256(path: Path) -> str:
    """The SHA-256 of a shard file, read once per version of the file in this process: a build checks the shards it
    resumes more than once (a Ray build: before its job, for its job, after it), and a shard is rewritten only by a
    rename onto its path (:func:`write_shard`), which changes the inode and the times in the key (a write in place
    changes the times too)."""
    stat = path.stat()
    return _sha256_of(str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


@functools.lru_cache(maxsize=1 << 16)
def _sha256_of(path: str, inode: int, size: int, mtime_ns: int, ctime_ns: int) -> str:
    return file_sha256(path)


def _shard_ok(shards: Path, start: int, size: int, total: int, dim: int) -> bool:
    """True if the shard starting at ``start`` exists with the expected shape and the bytes its recorded SHA-256
    says (a damaged one is redone; one without a record, from an older build, is checked by shape alone)."""
    path = _shard_path(shards, start)
    if not path.is_file():
        return False
    recorded = _hash_path(shards, start)
    if recorded.is_file() and recorded.read_text().strip() != shard_sha256(path):
        logger.warning("shard %s does not match its recorded SHA-256 (changed or damaged); embedding it again", path)
        return False
    try:
        shape = np.load(path, mmap_mode="r").shape
    except (ValueError, OSError, EOFError):
        logger.warning("shard %s is damaged; embedding it again", path)
        return False
    return shape == (min(size, total - start), dim)
