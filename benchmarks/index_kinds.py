"""Retrieval quality and memory per index kind and Matryoshka size: SciFact nDCG@10 and RAG retrieval acc@1.

For one model + adapter, each ``--kinds`` x ``--dimensions`` setup builds a unimae ``VectorIndex`` (the path
``unimae index`` takes: documents with the adapter's document prompt, queries with its query prompt, the first
k coordinates re-normalised) over

- SciFact (the local data folder's ``retrieval/SciFact``: 5,183 abstracts, 300 queries), scored by nDCG@10 with
  ``pytrec_eval`` (what mteb's retrieval evaluator uses) on the top 100 of each query;
- the held-out enwiki-gensim paragraphs, with the RAG benchmark's questions (``benchmarks/load_test.py``: the
  first 12 words of a seeded sample of the paragraphs), scored by retrieval acc@1 (the top hit is the
  question's own paragraph).

Each corpus and its queries are embedded once, at the full size (float32 unit rows, with the adapter's document and
query prompts); every kind and size is indexed and queried from those vectors (the first k coordinates, after the
adapter's rotation if it has one, re-normalised: what ``encode(dimensions=k)`` and ``unimae index --dimensions k``
give). ``--cache-dir`` reads and fills the embedding cache of an ``unimae evaluate embeddings --output-dir`` folder
(same model, adapter and ``--max-length``; mteb's SciFact texts are the same title + text), so after the dev suite
SciFact costs nothing. Kinds are ``unimae index``'s
(``binary`` rescored with int8 codes on disk, its default) and ``binary-bits`` (``--kind binary --rescore bits``).
Memory is FAISS's bytes per vector held in RAM (the serialized index over the vector count, x 1M for the table);
``disk`` adds what search reads from disk (the int8 rescoring codes; the float shards every index keeps for
resuming are not counted). Writes ``--output`` (one entry per setup, other entries kept) with the CPU model.

    python benchmarks/index_kinds.py --model gemma3-270m --adapter unimae-gemma3-270m-retriever \\
        --data-dir ../shared/data --kinds flat sq8 binary binary-bits --dimensions 0 256 128
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from unimae.files import update_json
from unimae.retrieval.index import IndexConfig
from unimae.runtime.memory import cpu_model

ROOT = Path(__file__).resolve().parents[1]


def scifact(data_dir: Path) -> tuple[list[tuple[str, str]], dict[str, str], dict[str, dict[str, int]]]:
    """(corpus passages (id, title + text), queries {id: text}, qrels {query: {doc: relevance}})."""
    folder = data_dir / "retrieval" / "SciFact"
    corpus = []
    for line in open(folder / "corpus.jsonl", encoding="utf-8"):
        row = json.loads(line)
        corpus.append((row["_id"], f"{row.get('title', '')} {row['text']}".strip()))
    queries = {row["_id"]: row["text"] for row in map(json.loads, open(folder / "queries.jsonl", encoding="utf-8"))}
    qrels: dict[str, dict[str, int]] = {}
    for line in open(folder / "qrels" / "test.tsv", encoding="utf-8").read().splitlines()[1:]:
        query, doc, score = line.split("\t")
        qrels.setdefault(query, {})[doc] = int(score)
    return corpus, {q: queries[q] for q in qrels if q in queries}, qrels


def rag_questions(count: int) -> tuple[list[tuple[str, str]], list[str], list[int]]:
    """(held-out passages, questions, the index of each question's own passage), as the RAG benchmark draws them."""
    from unimae.data.corpus import load_passages

    passages = load_passages("enwiki-gensim:heldout")
    chosen = random.Random(0).sample(range(len(passages)), count)
    return passages, [" ".join(passages[i][1].split()[:12]) for i in chosen], chosen


def index_config(kind: str, dims: int | None) -> IndexConfig:
    """``binary-bits``: the binary index rescored against its sign bits; other kinds as ``unimae index --kind``."""
    name, _, rescore = kind.partition("-")
    return IndexConfig(kind=name, dimensions=dims or None, **({"rescore": rescore} if rescore else {}))


def build(encoder, passages, kind: str, dims: int | None, folder: Path):
    from unimae.retrieval.index import VectorIndex

    return VectorIndex.build(encoder, passages, folder, index_config(kind, dims))


def ndcg10(index, query_ids: list[str], vectors: np.ndarray, qrels) -> float:
    """nDCG@10 of the top 100 hits of each query (``vectors`` (Q, k) unit rows, in ``query_ids`` order)."""
    import pytrec_eval

    hits = index.search(vectors, k=100)
    run = {q: {h.id: h.score for h in found} for q, found in zip(query_ids, hits, strict=True)}
    scores = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10"}).evaluate(run)
    return float(np.mean([scores[q]["ndcg_cut_10"] for q in query_ids]))


def acc1(index, passages, vectors: np.ndarray, chosen) -> float:
    """The share of questions (``vectors`` (Q, k)) whose top hit is their own passage."""
    hits = index.search(vectors, k=1)
    return float(np.mean([h[0].id == passages[i][0] for h, i in zip(hits, chosen, strict=True)]))


def full_vectors(encoder, texts: list[str], prompt_name: str, cache) -> np.ndarray:
    """(N, D) unit rows of ``texts`` after the adapter's ``prompt_name`` prompt ('' without one): ``encode``'s
    path, through ``cache`` (an evaluation's embedding cache, keyed by prompt + text as mteb's evaluation keys
    them) when given."""
    from unimae.embedding.spec import with_prompt

    prompted = with_prompt(texts, encoder.spec.prompt_map.get(prompt_name, ""))
    raw = cache.get_or_compute(prompted, encoder.encode) if cache else encoder.encode(prompted)  # (N, D)
    return raw / np.linalg.norm(raw, axis=1, keepdims=True)


def bytes_per_vector(folder: Path, count: int, names=("index.faiss",)) -> float:
    return sum((folder / name).stat().st_size for name in names if (folder / name).is_file()) / count


def memory(folder: Path, count: int) -> dict[str, float]:
    """Bytes per vector in RAM (the FAISS index) and on disk read by search (+ int8 rescoring codes), per 1M."""
    ram, disk = bytes_per_vector(folder, count), bytes_per_vector(folder, count, ("index.faiss", "rescore.npy"))
    return {
        "bytes_per_vector": round(ram, 1),
        "mb_per_million": round(ram * 1e6 / 2**20, 1),
        "disk_mb_per_million": round(disk * 1e6 / 2**20, 1),
    }


def main() -> None:
    from unimae.encoder import Encoder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--adapter")
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--kinds", nargs="+", default=["flat", "sq8", "binary", "binary-bits"])
    parser.add_argument("--dimensions", nargs="+", type=int, default=[0], help="0: the full size.")
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--label", default="adapter")
    parser.add_argument("--max-length", type=int, default=512, help="Tokens per text, EOS included.")
    parser.add_argument("--cache-dir", type=Path, help="An `unimae evaluate embeddings` output folder: its cache.")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    encoder = Encoder.from_pretrained(args.model, adapter=args.adapter, max_length=args.max_length)
    cache = evaluation_cache(args.cache_dir, encoder, args.model, args.adapter) if args.cache_dir else None
    corpus, queries, qrels = scifact(args.data_dir)
    passages, questions, chosen = rag_questions(args.questions)
    output = args.output or ROOT / "results" / f"retrieval-{args.model.split('-')[0]}" / "index-kinds.json"
    corpora = {"sci": corpus, "rag": passages}
    query_ids = list(queries)
    with tempfile.TemporaryDirectory() as tmp:
        # each corpus and its queries embedded once, at the full size (unit rows); every setup is seeded from these
        full = {
            name: full_vectors(encoder, [t for _, t in texts], "document", cache) for name, texts in corpora.items()
        }
        asked = {
            "sci": full_vectors(encoder, [queries[q] for q in query_ids], "query", cache),
            "rag": full_vectors(encoder, questions, "query", cache),
        }
        for dims in args.dimensions:
            for kind in args.kinds:
                start = time.perf_counter()
                folders = {name: Path(tmp) / f"{name}-{kind}-{dims}" for name in full}
                for name, texts in corpora.items():
                    seed(folders[name], encoder, texts, index_config(kind, dims), full[name])
                sci = build(encoder, corpus, kind, dims, folders["sci"])
                rag = build(encoder, passages, kind, dims, folders["rag"])
                entry = {
                    "model": args.model,
                    "adapter": args.adapter,
                    "kind": kind,
                    "rescore": index_config(kind, dims).rescore if kind.startswith("binary") else "-",
                    "dimensions": dims or encoder.embedding_dim,
                    "scifact_ndcg10": round(ndcg10(sci, query_ids, cut(encoder, asked["sci"], dims), qrels) * 100, 2),
                    "rag_acc1": acc1(rag, passages, cut(encoder, asked["rag"], dims), chosen),
                    "max_length": args.max_length,
                    **memory(folders["sci"], len(corpus)),
                    "seconds": round(time.perf_counter() - start, 1),
                    "cpu_model": cpu_model(),
                }
                print(json.dumps(entry))
                update_json(output, {f"{args.label}/{kind}/{entry['dimensions']}": entry})


def evaluation_cache(folder: Path, encoder, model: str, adapter: str | None):
    """The embedding cache ``unimae evaluate embeddings --output-dir folder`` keeps for this encoder."""
    from unimae.adapter import adapter_revision, model_revision
    from unimae.evaluation.embeddings import open_embedding_cache
    from unimae.release import resolve_adapter

    return open_embedding_cache(
        folder, encoder, model, model_revision(model), adapter_revision(resolve_adapter(adapter))
    )


def cut(encoder, full: np.ndarray, dims: int | None) -> np.ndarray:
    """(N, D) full-size unit rows -> (N, k): what ``encode(..., dimensions=k, normalize=True)`` gives."""
    from unimae.embedding.vectors import finish_embeddings

    return finish_embeddings(full, dims or None, normalize=True, rotation=encoder.rotation)


def seed(folder: Path, encoder, passages, config, full: np.ndarray) -> None:
    """Write the shards and manifest that ``VectorIndex.build(encoder, passages, folder, config)`` would embed, from
    ``full`` (N, D) unit rows: the first k (rotated, if the adapter has a rotation) coordinates re-normalised
    (what ``encode(dimensions=k)`` gives, up to float rounding), so the build resumes them and only indexes."""
    from unimae.retrieval.index import index_manifest, write_shard

    vectors = cut(encoder, full, config.dimensions)  # (N, k)
    (folder / "shards").mkdir(parents=True)
    for start in range(0, len(passages), config.shard_size):
        write_shard(folder / "shards", start, vectors[start : start + config.shard_size])
    (folder / "manifest.json").write_text(json.dumps(index_manifest(encoder, passages, config, None)))


if __name__ == "__main__":
    main()
