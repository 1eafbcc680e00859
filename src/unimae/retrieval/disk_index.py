"""A vector store that does not hold the corpus in RAM: IVF-PQ candidates in memory, exact rerank from disk.

Search for the query q (Q, D) unit rows, ``k`` results:

1. candidates ``C = top-c(q . x~)`` by FAISS ``IndexIVFPQ`` (inner product): the ``nprobe`` nearest of ``nlist``
   k-means cells, scored against product-quantised codes x~ (``m`` sub-vectors of D / m dims, ``2**nbits``
   centroids each: ``m`` bytes per vector at 8 bits), ``c = max(k, rerank)``;
2. exact cosine ``s_i = q . x_i`` for i in C, x_i read from ``vectors.npy`` (float32, memory-mapped,
   ``MADV_RANDOM``: a query reads its ~c rows, no read-ahead);
3. the top ``k`` of s, best first.

``nprobe`` is set at build time: from ``DiskIndexConfig.nprobe`` it doubles until recall@10 against exact search
reaches ``target_recall`` (0.95), measured with 200 corpus vectors as queries (their own rows left out); the
manifest records the nprobe and the recall (``ivfpq``). How many cells hold a query's neighbours depends on the
corpus, so a fixed nprobe would promise a recall it cannot know.

Why this design (issue 45): at D = 576 (SmolLM2) a flat index keeps 4 D = 2,304 bytes per vector in RAM
(2.3 GB per million, 230 GB for 100 M). Here RAM holds ``m`` = D / 12 = 48 bytes of PQ code + an 8-byte id per
vector (56 bytes, 1/41 of flat) plus the ``nlist`` x D coarse centroids; the float vectors stay on disk and only
the pages of the reranked rows are touched. PQ alone loses recall (its codes blur close neighbours); reranking
``rerank`` (200) candidates exactly recovers it, so the returned scores are the flat index's exact cosines. The
alternatives: HNSW keeps the float vectors and a graph in RAM (more than flat); FAISS ``OnDiskInvertedLists``
moves the *codes* to disk, which is not where the memory is and makes every probe a random read; LanceDB /
Qdrant embed the same IVF-PQ + refine algorithm behind a second storage format and dependency. This keeps
unimae's folder layout (manifest, shards, passages), so the resume rules of :mod:`unimae.retrieval.index` apply
unchanged.
Passages are not loaded either: ``passages.offsets.npy`` holds each line's byte offset in ``passages.jsonl``
and a hit's text is read on demand.

Layout (the manifest, ``passages.jsonl`` and ``shards/`` of :mod:`unimae.retrieval.index`, plus)::

    vectors.npy            (N, D) float32 unit rows, gathered from the shards, read through a memory map
    ivfpq.faiss            the IndexIVFPQ over the same rows (trained on an evenly spaced sample)
    passages.offsets.npy   (N + 1,) int64 byte offsets of passages.jsonl's lines

The manifest says ``"store": "disk"``; :func:`open_index` opens a folder as this or a
:class:`~unimae.retrieval.index.VectorIndex` by it.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from unimae.data.passage_file import MappedRecords
from unimae.embedding.spec import EmbeddingSpec
from unimae.files import atomic_write, file_sha256
from unimae.retrieval.index import (
    Hit,
    VectorIndex,
    VectorIndexError,
    _faiss,
    _read_manifest,
    _shard_path,
    begin_build,
    build_lock,
    embed_missing_shards_here,
    finished_manifest,
    index_manifest,
    remove_stale_files,
    search_queries,
    write_manifest,
)

logger = logging.getLogger(__name__)

STORE = "disk"
VECTORS = "vectors.npy"
IVFPQ = "ivfpq.faiss"
OFFSETS = "passages.offsets.npy"
_ADD_ROWS = 65536  # vectors added to the IVF-PQ index per step while building
_NORM_SAMPLE = 64  # rows of vectors.npy checked to be unit vectors when a store is opened


@dataclass
class DiskIndexConfig:
    """How passages are embedded (as :class:`~unimae.retrieval.index.IndexConfig`) and how the disk store searches."""

    shard_size: int = field(default=256, metadata={"help": "Passages embedded and saved per shard (the resume unit)."})
    batch_size: int = field(default=16, metadata={"help": "Passages per forward pass."})
    dimensions: int | None = field(
        default=None, metadata={"help": "Index the first k coordinates (Matryoshka); default: all of them."}
    )
    nlist: int | None = field(default=None, metadata={"help": "IVF cells; default about 4*sqrt(N)."})
    nprobe: int = field(
        default=16, metadata={"help": "IVF cells searched per query: the least, raised at build for target_recall."}
    )
    target_recall: float = field(
        default=0.95,
        metadata={
            "help": "Build: double nprobe until recall@10 against exact search, with tune_queries corpus vectors as "
            "queries, reaches this (0: keep nprobe)."
        },
    )
    tune_queries: int = field(default=200, metadata={"help": "Corpus vectors that measure recall while tuning."})
    pq_m: int | None = field(
        default=None, metadata={"help": "PQ sub-quantizers = code bytes per vector; default: a divisor of D near D/12."}
    )
    rerank: int = field(
        default=200, metadata={"help": "PQ candidates per query re-scored exactly against the vectors on disk."}
    )
    train_size: int = field(
        default=100_000, metadata={"help": "Vectors (evenly spaced) that train the cells and PQ codebooks, at least."}
    )

    def __post_init__(self):
        if min(self.shard_size, self.batch_size, self.nprobe, self.rerank, self.train_size, self.tune_queries) < 1:
            raise ValueError("shard_size, batch_size, nprobe, rerank, train_size and tune_queries must be >= 1")
        if not 0 <= self.target_recall <= 1:
            raise ValueError(f"target_recall must be in [0, 1], got {self.target_recall}")
        for name in ("dimensions", "nlist", "pq_m"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def kind(self) -> str:
        return STORE


class DiskPassages(MappedRecords):
    """The (id, text) passages of a store, read from ``passages.jsonl`` on demand (nothing is loaded)."""

    def __init__(self, path: Path, offsets: np.ndarray):
        super().__init__(path)
        self.offsets = offsets  # (N + 1,) int64

    @classmethod
    def open(cls, directory: Path, count: int) -> DiskPassages:
        """The passages of a finished store, checked against their offsets; clear errors for damaged files."""
        path, offsets_path = directory / "passages.jsonl", directory / OFFSETS
        for needed in (path, offsets_path):
            if not needed.is_file():
                raise VectorIndexError(f"{needed} is missing; rebuild the index with `unimae index --store disk`")
        offsets = _map_array(offsets_path)
        if offsets.shape != (count + 1,) or offsets[0] != 0 or offsets[-1] != path.stat().st_size:
            raise VectorIndexError(
                f"{offsets_path} does not match {path.name} ({count} passages, {path.stat().st_size} bytes); "
                "rebuild the index with `unimae index --store disk --overwrite`"
            )
        passages = cls(path, offsets)
        passages.check()
        return passages

    def check(self) -> None:
        """Parse the first and the last record (a damaged file is refused on opening, not in a request)."""
        for i in (0, len(self) - 1):
            self[i]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def _read(self, i: int) -> tuple[str, str]:
        try:
            record = json.loads(self._map[self.offsets[i] : self.offsets[i + 1]])
            return record["id"], record["text"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
            raise VectorIndexError(
                f"{self.path}, line {i + 1}, is damaged ({err}); rebuild the index with `unimae index --overwrite`"
            ) from err


class DiskIndex:
    """Passages + their embeddings in a disk store. Build with :meth:`build`, open with :meth:`load` (or
    :func:`open_index`); searches like :class:`~unimae.retrieval.index.VectorIndex`."""

    def __init__(self, directory: Path, manifest: dict, passages: Sequence, ivf, vectors: np.ndarray):
        self.directory, self.manifest, self.passages = directory, manifest, passages
        self.ivf, self.vectors = ivf, vectors  # vectors (N, D) float32, memory-mapped

    def __len__(self) -> int:
        return len(self.passages)

    @classmethod
    def build(
        cls,
        encoder,
        passages: list[tuple[str, str]],
        directory: str | Path,
        config: DiskIndexConfig | None = None,
        source: dict | None = None,
        overwrite: bool = False,
    ) -> DiskIndex:
        """Embed ``passages`` with ``encoder`` shard by shard into ``directory`` (resuming as
        :meth:`VectorIndex.build <unimae.retrieval.index.VectorIndex.build>` does), then write the disk store.

        Memory stays bounded: shards are written one by one, gathered into ``vectors.npy`` through a memory
        map, and the IVF-PQ index is trained on a sample and filled ``_ADD_ROWS`` vectors at a time. The folder's
        build lock is held throughout (:func:`~unimae.retrieval.index.build_lock`).
        """
        if not passages:
            raise VectorIndexError("no passages to index")
        config = config or DiskIndexConfig()
        directory = Path(directory)
        manifest = _manifest(encoder, passages, config, source)
        with build_lock(directory):
            shards = begin_build(directory, manifest, config, overwrite)
            _write_passages(directory, passages)
            starts = embed_missing_shards_here(encoder, passages, shards, config, manifest["dim"])
            _gather_vectors(shards, starts, directory / VECTORS, (len(passages), manifest["dim"]))
            vectors = _map_array(directory / VECTORS)  # (N, D)
            ivf = _train_ivfpq(vectors, config)
            tuned = _tune_nprobe(ivf, vectors, config)
            atomic_write(directory / IVFPQ, lambda tmp: _faiss().write_index(ivf, str(tmp)), fsync=True)
            (directory / "index.faiss").unlink(missing_ok=True)  # a memory store built here before: superseded
            manifest["ivfpq"] = {"nlist": ivf.nlist, "m": ivf.pq.M, "nbits": ivf.pq.nbits, **tuned}
            manifest["sha256"] = {name: file_sha256(directory / name) for name in (IVFPQ, OFFSETS, VECTORS)}
            manifest["complete"] = True
            write_manifest(directory, manifest)
            remove_stale_files(directory, [IVFPQ, OFFSETS, VECTORS])  # a memory index's files, if it was one before
        return cls.load(directory)

    @classmethod
    def load(cls, directory: str | Path) -> DiskIndex:
        """Open a finished store; clear errors for a missing, incomplete or damaged one."""
        directory = Path(directory)
        manifest = finished_manifest(directory)
        if manifest.get("store") != STORE:
            raise VectorIndexError(f"{directory} holds a memory index, not a disk store; open it with open_index")
        count, dim = int(manifest["count"]), int(manifest["dim"])
        _check_hashes(directory, manifest)
        passages = DiskPassages.open(directory, count)
        vectors = _open_vectors(directory / VECTORS, (count, dim))
        ivf = _read_ivfpq(directory / IVFPQ, count)
        ivf.nprobe = int(manifest["ivfpq"]["nprobe"])
        return cls(directory, manifest, passages, ivf, vectors)

    @property
    def kind(self) -> str:
        return STORE

    @property
    def dim(self) -> int:
        """The dimension of its vectors (a Matryoshka prefix of the model's, or all of them)."""
        return int(self.manifest["dim"])

    @property
    def spec(self) -> EmbeddingSpec:
        """How the passages were embedded."""
        return EmbeddingSpec.from_dict(self.manifest["embedding"])

    def search(self, queries: np.ndarray, k: int = 4) -> list[list[Hit]]:
        """queries (Q, D) unit vectors -> the top-``k`` passages for each, best first, with exact cosines."""
        queries = search_queries(queries, self.dim, k)  # (Q, D)
        found = _search(self.ivf, self.vectors, queries, min(k, len(self)), int(self.manifest["config"]["rerank"]))
        return [[Hit(*self.passages[int(i)], float(s)) for i, s in zip(*row, strict=True)] for row in found]


def _search(ivf, vectors: np.ndarray, queries: np.ndarray, k: int, rerank: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """queries (Q, D) -> for each, (ids (k,), exact cosines (k,)), best first: the IVF-PQ index's top
    ``max(k, rerank)`` candidates re-scored against the float ``vectors`` (N, D)."""
    _, candidates = ivf.search(queries, min(len(vectors), max(k, rerank)))  # (Q, c) ids, -1 where cells ran short
    found = []
    for query, row in zip(queries, candidates, strict=True):
        ids = np.unique(row[row >= 0])  # (c',) sorted: rows are read in file order
        scores = vectors[ids] @ query  # (c',)
        best = np.argsort(-scores, kind="stable")[:k]
        found.append((ids[best], scores[best]))
    return found


def open_index(directory: str | Path) -> VectorIndex | DiskIndex:
    """Open the index in ``directory`` as its manifest says: a :class:`DiskIndex` (``--store disk``) or a
    :class:`~unimae.retrieval.index.VectorIndex`."""
    manifest_path = Path(directory) / "manifest.json"
    if manifest_path.is_file() and _read_manifest(manifest_path).get("store") == STORE:
        return DiskIndex.load(directory)
    return VectorIndex.load(directory)


def _manifest(encoder, passages: list[tuple[str, str]], config: DiskIndexConfig, source: dict | None) -> dict:
    """The manifest of :meth:`VectorIndex.build <unimae.retrieval.index.VectorIndex.build>` (same fields, so the
    same resume rules), plus the store."""
    return {**index_manifest(encoder, passages, config, source), "store": STORE}


def _check_hashes(directory: Path, manifest: dict) -> None:
    """VectorIndexError unless ``ivfpq.faiss`` and the passage offsets match the SHA-256 recorded at build time
    (``vectors.npy``, too large to hash at every start, is checked by shape and a sample of unit rows)."""
    for name in (IVFPQ, OFFSETS):
        path = directory / name
        if not path.is_file():
            raise VectorIndexError(f"{path} is missing; rebuild the index with `unimae index --store disk`")
        if file_sha256(path) != manifest["sha256"][name]:
            raise VectorIndexError(
                f"{path} does not match the SHA-256 in manifest.json: it was changed or damaged after the index "
                "was built; rerun `unimae index --store disk` with the same arguments to rebuild it from its shards"
            )


def _write_passages(directory: Path, passages: list[tuple[str, str]]) -> None:
    """passages.jsonl (the lines :class:`~unimae.retrieval.index.VectorIndex` writes) and their byte offsets,
    streamed; both fsynced."""
    offsets = np.zeros(len(passages) + 1, dtype=np.int64)  # (N + 1,)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as handle:
            for i, (pid, text) in enumerate(passages):
                line = (json.dumps({"id": pid, "text": text}) + "\n").encode()
                handle.write(line)
                offsets[i + 1] = offsets[i] + len(line)

    atomic_write(directory / "passages.jsonl", write, fsync=True)
    atomic_write(directory / OFFSETS, lambda tmp: _save(tmp, offsets), fsync=True)


def _gather_vectors(shards: Path, starts: range, path: Path, shape: tuple[int, int]) -> None:
    """Copy the shards, in order, into one (N, D) float32 ``.npy`` through a memory map (never all in RAM)."""

    def write(tmp: Path) -> None:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=shape)  # (N, D)
        for start in starts:
            shard = np.load(_shard_path(shards, start))  # (n, D)
            out[start : start + len(shard)] = shard
        out.flush()
        del out

    atomic_write(path, write, fsync=True)


def _train_ivfpq(vectors: np.ndarray, config: DiskIndexConfig):
    """vectors (N, D) unit rows (memory-mapped) -> a trained, filled FAISS IndexIVFPQ (inner product)."""
    faiss = _faiss()
    n, dim = vectors.shape
    if n < 2:
        raise VectorIndexError("the disk store's product quantizer needs at least 2 passages; use the memory store")
    nlist = min(n, config.nlist or max(1, min(n // 39, int(4 * math.sqrt(n)))))  # FAISS: >= 39 points per cell
    m = config.pq_m or _default_pq_m(dim)
    if dim % m:
        raise ValueError(f"pq_m must divide the dimension {dim}, got {m}")
    sample = np.linspace(0, n - 1, min(n, max(config.train_size, 39 * nlist))).astype(np.int64)  # (T,)
    train = np.ascontiguousarray(vectors[sample])  # (T, D)
    nbits = int(min(8, math.log2(len(train)), max(1, math.log2(max(2, len(train) // 39)))))  # 2**nbits <= rows;
    # 256 centroids once there are 39 x 256 rows
    index = faiss.IndexIVFPQ(faiss.IndexFlatIP(dim), dim, nlist, m, nbits, faiss.METRIC_INNER_PRODUCT)
    index.cp.min_points_per_centroid = index.pq.cp.min_points_per_centroid = 1  # small corpora: no warnings
    index.train(train)
    for start in range(0, n, _ADD_ROWS):
        index.add(np.ascontiguousarray(vectors[start : start + _ADD_ROWS]))  # (<= _ADD_ROWS, D)
    return index


def _tune_nprobe(ivf, vectors: np.ndarray, config: DiskIndexConfig) -> dict:
    """Set ``ivf.nprobe`` to the least of ``config.nprobe`` doubled (up to nlist) whose recall@10 against exact
    search reaches ``config.target_recall``, measured with ``tune_queries`` evenly spaced corpus vectors as queries
    (each one's own row left out) -> {"nprobe", "recall_at_10", "queries"} for the manifest."""
    n = len(vectors)
    ivf.nprobe = min(config.nprobe, ivf.nlist)
    k = min(10, n - 1)
    if config.target_recall <= 0 or k < 1:
        return {"nprobe": ivf.nprobe}
    rows = np.linspace(0, n - 1, min(n, config.tune_queries)).astype(np.int64)  # (T,)
    queries = np.ascontiguousarray(vectors[rows])  # (T, D)
    truth = _exact_top(vectors, queries, k + 1)  # (T, k + 1)
    while True:
        found = _search(ivf, vectors, queries, k + 1, config.rerank)
        recall = float(np.mean([_recall(f, t, r) for (f, _), t, r in zip(found, truth, rows, strict=True)]))
        if recall >= config.target_recall or ivf.nprobe >= ivf.nlist:
            break
        ivf.nprobe = min(ivf.nlist, 2 * ivf.nprobe)
    if recall < config.target_recall:
        logger.warning(
            "the disk store reaches recall@10 %.3f < %.2f with every cell probed: raise --rerank or --pq-m",
            recall,
            config.target_recall,
        )
    logger.info("disk store: nprobe %d of %d cells, recall@10 %.3f", ivf.nprobe, ivf.nlist, recall)
    return {"nprobe": ivf.nprobe, "recall_at_10": recall, "queries": len(rows)}


def _recall(found: np.ndarray, truth: np.ndarray, own: int) -> float:
    """The share of the exact neighbours ``truth`` (but the query's own row) that ``found`` holds."""
    wanted = set(truth.tolist()) - {int(own)}
    return len(wanted & set(found.tolist())) / max(1, len(wanted))


def _exact_top(vectors: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """queries (T, D) -> the ids (T, k) of their ``k`` highest inner products in ``vectors`` (N, D), unordered;
    read ``_ADD_ROWS`` rows at a time."""
    best_scores = np.full((len(queries), 0), -np.inf, dtype=np.float32)  # (T, <= k)
    best_ids = np.zeros((len(queries), 0), dtype=np.int64)  # (T, <= k)
    for start in range(0, len(vectors), _ADD_ROWS):
        chunk = np.asarray(vectors[start : start + _ADD_ROWS])  # (c, D)
        scores = np.concatenate([best_scores, queries @ chunk.T], axis=1)  # (T, k + c)
        ids = np.concatenate(
            [best_ids, np.broadcast_to(np.arange(start, start + len(chunk)), (len(queries), len(chunk)))], axis=1
        )
        keep = np.argpartition(-scores, min(k, scores.shape[1]) - 1, axis=1)[:, :k]  # (T, k)
        best_scores, best_ids = np.take_along_axis(scores, keep, 1), np.take_along_axis(ids, keep, 1)
    return best_ids


def _default_pq_m(dim: int) -> int:
    """The largest divisor of ``dim`` that is at most dim / 12 (12+ dims per sub-quantizer), at least 1."""
    return max(m for m in range(1, max(1, dim // 12) + 1) if dim % m == 0)


def _open_vectors(path: Path, shape: tuple[int, int]) -> np.ndarray:
    """vectors.npy memory-mapped, checked: its shape, dtype, and a sample of rows being unit vectors."""
    if not path.is_file():
        raise VectorIndexError(f"{path} is missing; rebuild the index with `unimae index --store disk --overwrite`")
    vectors = _map_array(path)
    if vectors.shape != shape or vectors.dtype != np.float32:
        raise VectorIndexError(
            f"{path} holds {vectors.dtype} {vectors.shape}, not float32 {shape}; "
            "rebuild the index with `unimae index --store disk --overwrite`"
        )
    sample = np.linspace(0, shape[0] - 1, min(shape[0], _NORM_SAMPLE)).astype(np.int64)
    norms = np.linalg.norm(vectors[sample], axis=1)  # (S,)
    if not np.all(np.abs(norms - 1) < 1e-3):
        raise VectorIndexError(
            f"{path} is damaged (rows that are not unit vectors); rebuild with `unimae index --store disk --overwrite`"
        )
    return vectors


def _map_array(path: Path) -> np.ndarray:
    """A ``.npy`` file as a read-only array over a memory map advised for random access (no read-ahead)."""
    try:
        header = np.load(path, mmap_mode="r")  # parses and checks the header and the file's length
        if not isinstance(header, np.memmap) or not header.flags.c_contiguous or header.dtype.hasobject:
            raise ValueError("not a C-ordered numeric array")
        shape, dtype, offset = header.shape, header.dtype, header.offset
        del header
        with open(path, "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (ValueError, OSError, EOFError) as err:
        raise VectorIndexError(
            f"{path} cannot be read ({err}); rebuild the index with `unimae index --store disk --overwrite`"
        ) from err
    if hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)


def _read_ivfpq(path: Path, count: int):
    faiss = _faiss()
    if not path.is_file():
        raise VectorIndexError(f"{path} is missing; rebuild the index with `unimae index --store disk --overwrite`")
    try:
        index = faiss.read_index(str(path))
    except RuntimeError as err:
        raise VectorIndexError(f"{path} cannot be read ({err}); rebuild with `unimae index --store disk`") from err
    if not isinstance(index, faiss.IndexIVFPQ) or index.ntotal != count:
        raise VectorIndexError(
            f"{path} is not an IVF-PQ index of {count} vectors; rebuild with `unimae index --store disk --overwrite`"
        )
    return index


def _save(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as handle:
        np.save(handle, array)
