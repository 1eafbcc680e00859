"""The disk store (IVF-PQ candidates, exact rerank from a memory-mapped vectors.npy): the flat index's top-k,
exact scores, the single-process shards and resume rules, `unimae index --store disk` / `ask`, and clear
refusals of damaged files."""

import json
import shutil

import numpy as np
import pytest
from conftest import SENTENCES

from unimae.cli import main
from unimae.embedding.spec import EmbeddingSpec
from unimae.encoder import Encoder
from unimae.retrieval.disk_index import DiskIndex, DiskIndexConfig, open_index
from unimae.retrieval.index import IndexConfig, VectorIndex, VectorIndexError

PASSAGES = [(f"p{i}", text) for i, text in enumerate(SENTENCES)]


class TableEncoder:
    """The parts of an Encoder an index build reads; the passage "v<i>" embeds as row i of ``vectors``."""

    def __init__(self, vectors: np.ndarray):
        self.vectors, self.calls = vectors, []
        self.spec, self.max_length, self.precision, self.adapter_merged = EmbeddingSpec(), 64, "fp32", False
        self.embedding_dim = vectors.shape[1]

    def encode_document(self, texts, **kwargs) -> np.ndarray:
        self.calls.append(len(texts))
        return self.vectors[[int(t[1:]) for t in texts]]  # (n, D)


def synthetic(n: int, dim: int = 32, seed: int = 0) -> np.ndarray:
    """(n, dim) unit rows of low intrinsic dimension (rank 8 + 10% noise), as encoders' embeddings are; the same
    distribution for every seed (corpus and queries)."""
    basis = np.random.default_rng(1234).standard_normal((8, dim)) * np.linspace(2, 0.5, 8)[:, None]  # (8, D)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)) @ basis + 0.1 * rng.standard_normal((n, dim))  # (n, D)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def table_passages(n: int) -> list[tuple[str, str]]:
    return [(f"s{i}", f"v{i}") for i in range(n)]


@pytest.fixture(scope="module")
def synthetic_stores(tmp_path_factory):
    """(corpus vectors (3000, 32), the flat index, the disk store) of the same synthetic corpus."""
    root = tmp_path_factory.mktemp("stores")
    vectors = synthetic(3000)
    passages = table_passages(len(vectors))
    flat = VectorIndex.build(TableEncoder(vectors), passages, root / "flat", IndexConfig(shard_size=500))
    config = DiskIndexConfig(shard_size=500, nprobe=8)  # 8 of 76 cells, 200 candidates reranked
    disk = DiskIndex.build(TableEncoder(vectors), passages, root / "disk", config)
    return vectors, flat, disk


def test_disk_store_finds_the_flat_index_top_k_with_exact_scores(synthetic_stores):
    vectors, flat, disk = synthetic_stores
    queries = synthetic(50, seed=1)
    exact, found = flat.search(queries, k=10), disk.search(queries, k=10)
    recall = np.mean([len({h.id for h in e} & {h.id for h in f}) / 10 for e, f in zip(exact, found, strict=True)])
    assert recall >= 0.95, f"recall@10 {recall:.3f} against the flat index"
    for query, hits in zip(queries, found, strict=True):
        rows = vectors[[int(h.id[1:]) for h in hits]]  # (10, D)
        np.testing.assert_allclose([h.score for h in hits], rows @ query, atol=1e-5)  # exact cosines, not PQ's
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
        assert all(h.text == f"v{h.id[1:]}" for h in hits)
    assert disk.kind == "disk" and len(disk) == len(flat) == 3000 and disk.dim == flat.dim == 32
    assert disk.ivf.code_size * disk.ivf.ntotal <= vectors.nbytes / 10, "PQ codes: a fraction of the flat vectors"


def test_disk_store_is_exact_when_every_candidate_is_reranked(synthetic_stores, tmp_path):
    vectors, flat, _ = synthetic_stores
    passages = table_passages(len(vectors))
    config = DiskIndexConfig(shard_size=500, rerank=len(vectors))
    disk = DiskIndex.build(TableEncoder(vectors), passages, tmp_path / "idx", config)
    queries = synthetic(20, seed=2)
    for exact, found in zip(flat.search(queries, k=5), disk.search(queries, k=5), strict=True):
        assert [h.id for h in found] == [h.id for h in exact]
        np.testing.assert_allclose([h.score for h in found], [h.score for h in exact], atol=1e-5)


def test_disk_store_tunes_nprobe_to_the_target_recall(synthetic_stores, tmp_path):
    vectors, flat, _ = synthetic_stores
    passages = table_passages(len(vectors))
    fixed = DiskIndexConfig(nprobe=1, target_recall=0)
    fixed = DiskIndex.build(TableEncoder(vectors), passages, tmp_path / "fixed", fixed)
    assert fixed.ivf.nprobe == fixed.manifest["ivfpq"]["nprobe"] == 1 and "recall_at_10" not in fixed.manifest["ivfpq"]
    config = DiskIndexConfig(nprobe=1, target_recall=0.99, tune_queries=100)
    tuned = DiskIndex.build(TableEncoder(vectors), passages, tmp_path / "tuned", config)
    record = tuned.manifest["ivfpq"]
    assert tuned.ivf.nprobe == record["nprobe"] > 1 and record["recall_at_10"] >= 0.99 and record["queries"] == 100
    queries = synthetic(50, seed=3)
    recall = [
        len({h.id for h in e} & {h.id for h in f}) / 10
        for e, f in zip(flat.search(queries, k=10), tuned.search(queries, k=10), strict=True)
    ]
    assert np.mean(recall) >= 0.95, "fresh queries find what the tuning promised"


def test_disk_store_embeds_like_the_single_process_index_and_resumes(tiny_model_dirs, tmp_path):
    encoder = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), precision="fp32", max_length=64)
    flat = VectorIndex.build(encoder, PASSAGES, tmp_path / "flat", IndexConfig(shard_size=5))
    disk = DiskIndex.build(encoder, PASSAGES, tmp_path / "disk", DiskIndexConfig(shard_size=5))
    assert isinstance(open_index(tmp_path / "disk"), DiskIndex) and isinstance(
        open_index(tmp_path / "flat"), VectorIndex
    )
    assert list(disk.passages) == PASSAGES and disk.passages[-1] == PASSAGES[-1]
    hits = disk.search(encoder.encode([t for _, t in PASSAGES], normalize=True), k=2)
    assert [h[0].id for h in hits] == [pid for pid, _ in PASSAGES] and all(abs(h[0].score - 1) < 1e-4 for h in hits)
    same = ("embedding", "dim", "count", "passages", "precision", "merged", "max_length")
    assert {k: disk.manifest[k] for k in same} == {k: flat.manifest[k] for k in same}

    shards = sorted((tmp_path / "disk" / "shards").glob("*.npy"))
    reference = np.load(shards[1])
    shards[1].write_bytes(shards[1].read_bytes()[:-8] + b"\0" * 8)  # damaged in place, same size
    shards[2].unlink()
    calls = []
    original = encoder.encode_document
    encoder.encode_document = lambda texts, **kw: calls.append(len(texts)) or original(texts, **kw)
    DiskIndex.build(encoder, PASSAGES, tmp_path / "disk", DiskIndexConfig(shard_size=5))
    assert calls == [5, 2], "only the damaged and the missing shard are embedded again"
    np.testing.assert_allclose(np.load(shards[1]), reference, atol=1e-6)

    calls.clear()
    moved = DiskIndex.build(encoder, PASSAGES, tmp_path / "flat", DiskIndexConfig(shard_size=5))
    assert calls == [] and not (tmp_path / "flat" / "index.faiss").exists(), "a memory index's shards are reused"
    np.testing.assert_allclose(moved.vectors, np.asarray(disk.vectors), atol=1e-6)


def test_index_store_disk_on_the_command_line_and_ask(tiny_model_dirs, corpus_file, tmp_path, capsys):
    from unimae.retrieval.rag import RAG, load_index_and_encoder

    out = tmp_path / "idx"
    base = ["index", "--model", str(tiny_model_dirs["llama"]), "--corpus", str(corpus_file), "--precision", "fp32"]
    base += ["--max-length", "64", "--shard-size", "5", "--output-dir", str(out)]
    assert main([*base, "--store", "disk", "--nprobe", "4"]) == 0
    assert "wrote a disk index of 12 passages" in capsys.readouterr().out
    assert main([*base, "--nprobe", "4"]) == 2 and "add --store disk" in capsys.readouterr().err
    assert main([*base, "--store", "disk", "--kind", "hnsw"]) == 2 and "--kind" in capsys.readouterr().err
    encoder, index = load_index_and_encoder(out, precision="fp32")
    assert isinstance(index, DiskIndex) and index.manifest["config"]["nprobe"] == 4
    hit = RAG(encoder, index).retrieve(SENTENCES[3], k=1)[0]
    assert (hit.id, hit.text) == ("3", SENTENCES[3])
    assert main([*base[:-1], str(tmp_path / "flat")]) == 0 and "wrote a flat index" in capsys.readouterr().out
    assert isinstance(load_index_and_encoder(tmp_path / "flat", precision="fp32")[1], VectorIndex)


def test_a_jsonl_corpus_builds_a_disk_store_read_on_demand(tiny_model_dirs, tmp_path, capsys, monkeypatch):
    """`unimae index --store disk` reads a .jsonl corpus through PassageFile (offsets, not texts, in RAM): the
    store, its fingerprint included, is the one the passages as a list give."""
    import unimae.data.corpus as corpus
    from unimae.data.passage_file import PassageFile

    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": pid, "text": text}) + "\n" for pid, text in PASSAGES))
    opened = []
    original = PassageFile.open
    monkeypatch.setattr(PassageFile, "open", classmethod(lambda cls, *a: opened.append(a) or original(*a)))
    out = tmp_path / "idx"
    args = ["index", "--model", str(tiny_model_dirs["llama"]), "--corpus", str(path), "--precision", "fp32"]
    assert main([*args, "--max-length", "64", "--shard-size", "5", "--output-dir", str(out), "--store", "disk"]) == 0
    assert len(opened) == 1 and "wrote a disk index of 12 passages" in capsys.readouterr().out
    encoder = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), precision="fp32", max_length=64)
    eager = DiskIndex.build(encoder, corpus.load_passages(str(path)), tmp_path / "eager", DiskIndexConfig(shard_size=5))
    lazy = open_index(out)
    assert list(lazy.passages) == PASSAGES and lazy.manifest["passages"] == eager.manifest["passages"]
    np.testing.assert_allclose(np.asarray(lazy.vectors), np.asarray(eager.vectors), atol=1e-6)


def test_v1_rag_answers_from_a_disk_store(tiny_model_dirs, tmp_path):
    pytest.importorskip("fastapi", reason="the server needs pip install 'unimae[serve]'")
    from fastapi.testclient import TestClient

    from unimae.retrieval.rag import load_index_and_encoder
    from unimae.serving.app import create_app
    from unimae.serving.config import ServerConfig

    model = str(tiny_model_dirs["llama"])
    encoder = Encoder.from_pretrained(model, precision="fp32", max_length=64)
    source = {"model": model, "adapter": None, "adapter_revision": "base"}
    DiskIndex.build(encoder, PASSAGES, tmp_path / "idx", DiskIndexConfig(shard_size=5), source=source)
    encoder, index = load_index_and_encoder(tmp_path / "idx", precision="fp32")  # as `unimae serve --index` does
    with TestClient(create_app(encoder, ServerConfig(max_new_tokens=8), index)) as client:
        answer = client.post("/v1/rag", json={"query": SENTENCES[4], "k": 2, "max_tokens": 4})
        health = client.get("/health").json()
        _break_last_line(tmp_path / "idx" / "passages.jsonl")  # read per hit: damaged while serving
        damaged = client.post("/v1/rag", json={"query": SENTENCES[4], "k": len(PASSAGES), "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    assert answer.json()["passages"][0]["id"] == "p4" and health["index_passages"] == len(PASSAGES)
    assert damaged.status_code == 500 and damaged.json()["error"]["code"] == "index_damaged"  # not the query's fault


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _zero_rows(path):
    data = bytearray(path.read_bytes())
    data[-4 * 32 * 10 :] = bytes(4 * 32 * 10)  # the last 10 rows (32 float32 each)
    path.write_bytes(bytes(data))


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _break_last_line(path):
    data = bytearray(path.read_bytes())
    data[-3] = ord("\\")  # same size, the last record no longer JSON
    path.write_bytes(bytes(data))


def _unfinish(path):
    path.write_text(json.dumps({**json.loads(path.read_text()), "complete": False}))


@pytest.mark.parametrize(
    ("name", "damage", "message"),
    [
        ("vectors.npy", _truncate, r"vectors\.npy cannot be read"),
        ("vectors.npy", _zero_rows, "not unit vectors"),
        ("vectors.npy", lambda p: p.unlink(), r"vectors\.npy is missing"),
        ("ivfpq.faiss", _flip_byte, "does not match the SHA-256"),
        ("ivfpq.faiss", lambda p: p.unlink(), r"ivfpq\.faiss is missing"),
        ("passages.offsets.npy", _flip_byte, "does not match the SHA-256"),
        ("passages.jsonl", _truncate, r"does not match passages\.jsonl"),
        ("passages.jsonl", _break_last_line, "line 300, is damaged"),
        ("manifest.json", _unfinish, "incomplete"),
        ("manifest.json", lambda p: p.write_text("{"), "damaged"),
    ],
)
def test_damaged_disk_store_files_are_refused_clearly(synthetic_stores, tmp_path, name, damage, message):
    vectors = synthetic_stores[0][:300]
    DiskIndex.build(TableEncoder(vectors), table_passages(300), tmp_path / "idx", DiskIndexConfig(shard_size=100))
    damage(tmp_path / "idx" / name)
    with pytest.raises(VectorIndexError, match=message):
        open_index(tmp_path / "idx")


def test_disk_store_refuses_a_memory_index_and_bad_settings(synthetic_stores, tmp_path):
    _, flat, _ = synthetic_stores
    shutil.copytree(flat.directory, tmp_path / "flat")
    with pytest.raises(VectorIndexError, match="memory index"):
        DiskIndex.load(tmp_path / "flat")
    with pytest.raises(ValueError, match="rerank"):
        DiskIndexConfig(rerank=0)
    with pytest.raises(ValueError, match="pq_m must divide"):
        DiskIndex.build(TableEncoder(synthetic(100)), table_passages(100), tmp_path / "bad", DiskIndexConfig(pq_m=5))
    with pytest.raises(VectorIndexError, match="no passages"):
        DiskIndex.build(TableEncoder(synthetic(1)), [], tmp_path / "empty")


def test_tiny_corpora_index_or_are_refused_clearly(tmp_path):
    """FAISS's own training errors never reach the user: cells and codebooks fit the rows there are."""
    with pytest.raises(VectorIndexError, match="at least 2 passages"):
        DiskIndex.build(TableEncoder(synthetic(1)), table_passages(1), tmp_path / "one")
    two = DiskIndex.build(TableEncoder(synthetic(2)), table_passages(2), tmp_path / "two", DiskIndexConfig(pq_m=4))
    assert two.search(synthetic(2)[:1], k=1)[0][0].id == "s0"
    ivf = IndexConfig(kind="ivf", ivf_nlist=100)  # more cells than passages: as many cells as passages
    built = VectorIndex.build(TableEncoder(synthetic(10)), table_passages(10), tmp_path / "ivf", ivf)
    assert built.index.nlist == 10 and built.search(synthetic(10)[3:4], k=1)[0][0].id == "s3"
    for bad in ({"ivf_nlist": 0}, {"hnsw_m": 0}, {"ivf_nprobe": 0}):
        with pytest.raises(ValueError, match="must be >= 1"):
            IndexConfig(**bad)


def test_a_passages_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    VectorIndex.build(TableEncoder(synthetic(3)), table_passages(3), tmp_path / "idx")
    path = tmp_path / "idx" / "passages.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + b'{"id": "s1", "text": "v\xff1"}\n' + lines[2])
    with pytest.raises(VectorIndexError, match=r"passages\.jsonl, line 2, is damaged"):
        VectorIndex.load(tmp_path / "idx")


def test_switching_store_or_kind_in_one_folder_leaves_no_other_stores_files(tmp_path):
    from unimae.retrieval.disk_index import IVFPQ, OFFSETS, VECTORS
    from unimae.retrieval.index import STORE_FILES

    assert {VECTORS, IVFPQ, OFFSETS} <= set(STORE_FILES)
    vectors, passages, folder = synthetic(50), table_passages(50), tmp_path / "idx"
    VectorIndex.build(TableEncoder(vectors), passages, folder, IndexConfig(kind="binary"))
    DiskIndex.build(TableEncoder(vectors), passages, folder, DiskIndexConfig(pq_m=4))
    assert not any((folder / name).exists() for name in ("index.faiss", "rescore.npy", "rescore.faiss"))
    VectorIndex.build(TableEncoder(vectors), passages, folder)  # back to a flat memory index
    assert sorted(n for n in STORE_FILES if (folder / n).exists()) == ["index.faiss"]
    assert VectorIndex.load(folder).search(vectors[7:8], k=1)[0][0].id == "s7"
    for store in (VectorIndex.load(folder), DiskIndex.build(TableEncoder(vectors), passages, tmp_path / "disk")):
        with pytest.raises(ValueError, match="k must be >= 1"):
            store.search(vectors[:1], k=0)
