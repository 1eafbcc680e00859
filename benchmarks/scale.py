"""Scale: `unimae index --engine ray` against one process, and the flat index against the disk store.

1. Embedding throughput. The first ``2P`` passages of ``--corpus`` (``--passages`` P) are indexed by the
   single-process path (``VectorIndex.build``, the encoder loaded once, torch's default threads) and by
   ``build_on_ray`` on a local Ray of ``--workers`` actors (one model and one CPU each; Ray started once), each at
   P and at 2P passages into fresh folders. End to end (2P passages, the model loads included: the local load
   once, the workers' loads and the task that reads the model's settings in every Ray build) and marginal
   (``P / (t(2P) - t(P))``: fixed costs cancel, what a long job sees). Ratio = Ray's passages/s over one
   process's.
2. The index at each of ``--sizes`` N: (N, ``--dim``) unit vectors are written as shards once, the disk store
   is built over them (its nprobe tuned to recall@10 >= 0.95 at build) and the flat index over the same shards
   (hard links). The vectors are synthetic unless ``--vectors`` gives real embeddings: a mixture of 1,000 topics
   (unit centres) + a deviation of norm 0.6 in a rank-64 subspace with a decaying spectrum + isotropic noise of
   norm 0.1, normalised. Text embeddings are like that: topical, of low intrinsic dimension and anisotropic;
   uniformly random vectors have no near neighbours for any index to find, and make every approximate index
   look broken. The recall measured on them is a property of this distribution: rerun with ``--vectors``
   (e.g. the shards of a real ``unimae index``, concatenated) for a corpus's own.
   Each store is then opened in a fresh process, its files evicted from the page cache first
   (``POSIX_FADV_DONTNEED``): load seconds, resident memory added by the load and by ``--queries`` single
   queries (``RssAnon`` + ``RssFile`` of /proc/self/status: the disk store's touched pages count), query
   latency (p50 / p95; cold = first pass after the eviction, warm = the same queries again). The queries
   are fresh samples of the same distribution; recall@10 = the share of the flat index's top 10 that the
   disk store returns.
3. A worked estimate for 100 M passages on N workers from the measured marginal per-worker throughput (or
   ``--per-worker-pps`` measured elsewhere, e.g. this script's part 1 on a GPU node with
   ``--num-gpus-per-worker 1``): hours, disk for the vectors, RAM for the PQ codes vs a flat index, and the
   write rate the driver must sustain.

Full run (about 8 GB of disk under ``--work-dir`` at 1 M):
``python benchmarks/scale.py --sizes 10000 100000 1000000``; quick check:
``python benchmarks/scale.py --sizes 2000 --quick --output /tmp/scale.json``. Prints a summary and writes JSON
(``--output``, default ``results/scale.json``) with the settings, the CPU (model, cores, instruction-set
flags) and every number above.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

import numpy as np

from unimae.runtime.memory import cpu_model

ROOT = Path(__file__).resolve().parents[1]
TOPICS, RANK, SPREAD, NOISE = 1000, 64, 0.6, 0.1  # the synthetic vectors (see the module docstring)
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16")
QUERY_SEED = 10**12  # the shards' generators are seeded by their first row (< N), the queries' by this
HOURS_FOR = 100_000_000  # passages in the worked estimate
ESTIMATE_WORKERS = (1, 8, 32, 128)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="Model that embeds in part 1.")
    parser.add_argument("--adapter", help="Adapter folder for part 1.")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--corpus", default="enwiki-gensim:train", help="Passages of part 1 (unimae index --corpus).")
    parser.add_argument("--passages", type=int, default=512, help="P: part 1 indexes P and 2P passages.")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--shard-size", type=int, default=64, help="Part 1's shard size.")
    parser.add_argument("--workers", type=int, default=2, help="Ray actors in part 1.")
    parser.add_argument("--num-gpus-per-worker", type=float, default=0)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000], help="Part 2's N.")
    parser.add_argument("--dim", type=int, default=576, help="Part 2's vector size (576: SmolLM2-135M).")
    parser.add_argument("--vectors", help="Part 2 on real embeddings: an (M, D) .npy; the last --queries rows query.")
    parser.add_argument("--queries", type=int, default=200, help="Single queries timed per store.")
    parser.add_argument("--nprobe", type=int, help="Disk store: cells probed (default: DiskIndexConfig's).")
    parser.add_argument("--rerank", type=int, help="Disk store: candidates reranked (default: DiskIndexConfig's).")
    parser.add_argument("--per-worker-pps", type=float, help="Part 3: per-worker passages/s instead of part 1's.")
    parser.add_argument("--skip-embed", action="store_true", help="Skip part 1.")
    parser.add_argument("--skip-index", action="store_true", help="Skip part 2.")
    parser.add_argument("--quick", action="store_true", help="P = 32 and 20 queries (a check that it runs).")
    parser.add_argument("--work-dir", help="Folder for the indexes (default: a temporary one, deleted).")
    parser.add_argument("--output", default=str(ROOT / "results" / "scale.json"))
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: measure one store in this process
    parser.add_argument("--queries-file", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.passages, args.queries = min(args.passages, 32), min(args.queries, 20)
    return args


def cpu() -> dict:
    """The CPU every number was measured on: model, cores, and the SIMD flags FAISS and torch use."""
    flags: set[str] = set()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("flags"):
                flags = set(line.partition(":")[2].split())
                break
    except OSError:
        pass
    from unimae.retrieval.index import _faiss

    simd = [f for f in SIMD_FLAGS if f in flags]
    return {"model": cpu_model(), "cores": os.cpu_count(), "flags": simd, "faiss": _faiss().get_compile_options()}


# --- part 1: embedding throughput -------------------------------------------------------------------------


def embed_part(args: argparse.Namespace, work: Path) -> dict:
    """Single process vs Ray, at P and 2P passages: seconds, passages/s, ratios, per-worker throughput."""
    from unimae.data.corpus import load_passages
    from unimae.retrieval.index import IndexConfig
    from unimae.retrieval.ray_index import EncoderLoad

    passages = load_passages(args.corpus)[: 2 * args.passages]
    if len(passages) < 2 * args.passages:
        raise SystemExit(f"{args.corpus} has {len(passages)} passages; pass --passages {len(passages) // 2} or less")
    load = EncoderLoad(args.model, adapter=args.adapter, max_length=args.max_length, precision=args.precision)
    config = IndexConfig(shard_size=args.shard_size, batch_size=args.batch_size)
    sizes = (args.passages, 2 * args.passages)
    single = time_single(load, passages, sizes, config, work)
    on_ray = time_ray(load, passages, sizes, config, args, work)
    p, q = sizes
    single["pps_end_to_end"] = q / (single["load_s"] + single["seconds"][str(q)])
    on_ray["pps_end_to_end"] = q / on_ray["seconds"][str(q)]
    for result in (single, on_ray):
        extra = result["seconds"][str(q)] - result["seconds"][str(p)]
        result["pps_marginal"] = p / extra if extra > 0.1 * result["seconds"][str(q)] else None  # else noise
    marginal = on_ray["pps_marginal"] and single["pps_marginal"]
    on_ray["per_worker_pps"] = (on_ray["pps_marginal"] or on_ray["pps_end_to_end"]) / args.workers
    return {
        "passages": list(sizes),
        "single": single,
        "ray": on_ray,
        "ratio_end_to_end": on_ray["pps_end_to_end"] / single["pps_end_to_end"],
        "ratio_marginal": on_ray["pps_marginal"] / single["pps_marginal"] if marginal else None,
        "note": "marginal = P / (t(2P) - t(P)); None where t(2P) - t(P) is under 10% of t(2P) (raise --passages)",
    }


def time_single(load, passages: list, sizes: tuple[int, int], config, work: Path) -> dict:
    import torch

    from unimae.retrieval.index import VectorIndex

    tic = time.perf_counter()
    encoder = load.load()
    result = {"load_s": time.perf_counter() - tic, "torch_threads": torch.get_num_threads(), "seconds": {}}
    for n in sizes:
        tic = time.perf_counter()
        VectorIndex.build(encoder, passages[:n], work / f"single-{n}", config)
        result["seconds"][str(n)] = time.perf_counter() - tic
    return result


def time_ray(load, passages: list, sizes: tuple[int, int], config, args: argparse.Namespace, work: Path) -> dict:
    from unimae.retrieval.ray_index import RayConfig, _ray, build_on_ray

    ray = _ray()
    ray_config = RayConfig(workers=args.workers, num_gpus_per_worker=args.num_gpus_per_worker)
    tic = time.perf_counter()
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    result = {"init_s": time.perf_counter() - tic, "workers": args.workers, "seconds": {}}
    try:
        for n in sizes:
            tic = time.perf_counter()
            build_on_ray(load, passages[:n], work / f"ray-{n}", config, ray_config=ray_config)
            result["seconds"][str(n)] = time.perf_counter() - tic
    finally:
        ray.shutdown()
    return result


# --- part 2: flat index vs disk store ---------------------------------------------------------------------


@cache
def basis(dim: int) -> np.ndarray:
    """(RANK, dim) directions, scaled by a decaying spectrum so that ``z @ basis`` has norm about 1 for z ~ N(0, I)."""
    spectrum = np.linspace(1.0, 0.1, RANK)[:, None]  # (RANK, 1)
    rows = np.random.default_rng(20250).standard_normal((RANK, dim)) / math.sqrt(dim)  # (RANK, dim), unit-ish rows
    return rows * spectrum / np.linalg.norm(spectrum)


@cache
def topic_centers(dim: int) -> np.ndarray:
    """(TOPICS, dim) unit topic centres in the span of :func:`basis` (fixed for every sample)."""
    centers = np.random.default_rng(20251).standard_normal((TOPICS, RANK)) @ basis(dim)  # (TOPICS, dim)
    return centers / np.linalg.norm(centers, axis=1, keepdims=True)


def synthetic(count: int, dim: int, seed: int) -> np.ndarray:
    """(count, dim) float32 unit rows: a random topic's centre + SPREAD x a rank-RANK deviation + NOISE x isotropic
    noise (norms about 1, SPREAD and NOISE)."""
    rng = np.random.default_rng(seed)
    topics = rng.integers(TOPICS, size=count)  # (count,)
    within = rng.standard_normal((count, RANK)) @ basis(dim)  # (count, dim)
    noise = rng.standard_normal((count, dim)) / math.sqrt(dim)  # (count, dim)
    x = topic_centers(dim)[topics] + SPREAD * within + NOISE * noise
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


class TableEncoder:
    """The parts of an Encoder an index build reads; the passage "v<i>" embeds as row i of a table that
    ``rows(start, count)`` makes (any shard alone: synthetic rows are drawn from a generator seeded by ``start``)."""

    def __init__(self, dim: int, rows):
        from unimae.embedding.spec import EmbeddingSpec

        self.spec, self.max_length, self.precision, self.adapter_merged = EmbeddingSpec(), 512, "fp32", False
        self.embedding_dim, self.rows = dim, rows

    def encode_document(self, texts: list[str], **kwargs) -> np.ndarray:
        return self.rows(int(texts[0][1:]), len(texts))  # (n, D)


def vector_source(args: argparse.Namespace):
    """(rows(start, count) -> (count, D) unit rows, queries (Q, D), D): synthetic, or ``--vectors`` (its last
    ``--queries`` rows are the queries, the others the corpus)."""
    if not args.vectors:
        queries = synthetic(args.queries, args.dim, seed=QUERY_SEED)
        return (lambda start, count: synthetic(count, args.dim, seed=start)), queries, args.dim
    table = np.load(args.vectors, mmap_mode="r")  # (M, D)
    table_norm = np.linalg.norm

    def rows(start: int, count: int) -> np.ndarray:
        x = np.asarray(table[start : start + count], dtype=np.float32)
        return x / table_norm(x, axis=1, keepdims=True)

    return rows, rows(len(table) - args.queries, args.queries), table.shape[1]


def index_part(args: argparse.Namespace, work: Path) -> list[dict]:
    return [index_size(args, n, work / f"n{n}") for n in args.sizes]


def index_size(args: argparse.Namespace, n: int, folder: Path) -> dict:
    """Build both stores over N vectors, measure each in a fresh process, compare their top 10."""
    from unimae.retrieval.disk_index import DiskIndex, DiskIndexConfig
    from unimae.retrieval.index import IndexConfig, VectorIndex

    rows, query_vectors, dim = vector_source(args)
    if args.vectors and n > len(np.load(args.vectors, mmap_mode="r")) - args.queries:
        raise SystemExit(f"{args.vectors} has too few rows for N={n} and --queries {args.queries}")
    passages = [(f"s{i}", f"v{i}") for i in range(n)]
    shard = 16384
    overrides = {k: getattr(args, k) for k in ("nprobe", "rerank") if getattr(args, k) is not None}
    encoder = TableEncoder(dim, rows)
    tic = time.perf_counter()
    disk = DiskIndex.build(encoder, passages, folder / "disk", DiskIndexConfig(shard_size=shard, **overrides))
    disk_build = time.perf_counter() - tic
    (folder / "flat" / "shards").mkdir(parents=True, exist_ok=True)
    for path in (folder / "disk" / "shards").iterdir():
        os.link(path, folder / "flat" / "shards" / path.name)
    tic = time.perf_counter()
    VectorIndex.build(encoder, passages, folder / "flat", IndexConfig(shard_size=shard))
    flat_build = time.perf_counter() - tic
    queries = folder / "queries.npy"
    np.save(queries, query_vectors)
    flat, found = measure_in_subprocess(folder / "flat", queries), measure_in_subprocess(folder / "disk", queries)
    recall = float(
        np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(flat.pop("ids"), found.pop("ids"), strict=True)])
    )
    flat["build_s"], found["build_s"] = flat_build, disk_build
    found["ivfpq"], found["config"] = disk.manifest["ivfpq"], disk.manifest["config"]
    return {
        "n": n,
        "dim": dim,
        "vectors": args.vectors or "synthetic",
        "flat": flat,
        "disk": found,
        "recall_at_10": recall,
        "memory_ratio_disk_over_flat": found["resident_bytes"] / max(1, flat["resident_bytes"]),
    }


def measure_in_subprocess(directory: Path, queries: Path) -> dict:
    result = directory.parent / f"{directory.name}-measure.json"
    command = [sys.executable, __file__, "--measure", str(directory), "--queries-file", str(queries)]
    subprocess.run([*command, "--result", str(result)], check=True)
    return json.loads(result.read_text())


def measure(directory: Path, queries_file: Path, result: Path, k: int = 10) -> None:
    """In a fresh process: load the store cold, time single queries cold then warm, record memory and top-k."""
    from unimae.retrieval.disk_index import open_index
    from unimae.retrieval.index import _faiss

    _faiss()  # its library's pages are not the index's
    queries = np.load(queries_file)  # (Q, D)
    for path in directory.rglob("*"):
        if path.is_file():
            evict(path)
    before = memory()
    tic = time.perf_counter()
    index = open_index(directory)
    load_s, loaded = time.perf_counter() - tic, memory()
    cold, ids = time_queries(index, queries, k)
    after = memory()
    warm, _ = time_queries(index, queries, k)
    report = {
        "load_s": load_s,
        "rss_anon_bytes": loaded["anon"] - before["anon"],
        "rss_file_bytes_after_queries": after["file"] - before["file"],
        "resident_bytes": after["anon"] + after["file"] - before["anon"] - before["file"],
        "cold_ms": percentiles(cold),
        "warm_ms": percentiles(warm),
        "ids": ids,
    }
    result.write_text(json.dumps(report))


def time_queries(index, queries: np.ndarray, k: int) -> tuple[list[float], list[list[int]]]:
    """Milliseconds of each single query (as `serve` asks them) and the ids it found."""
    seconds, ids = [], []
    for query in queries:
        tic = time.perf_counter()
        hits = index.search(query[None], k)[0]
        seconds.append(1000 * (time.perf_counter() - tic))
        ids.append([int(h.id[1:]) for h in hits])
    return seconds, ids


def percentiles(ms: list[float]) -> dict:
    return {"p50": float(np.percentile(ms, 50)), "p95": float(np.percentile(ms, 95)), "mean": float(np.mean(ms))}


def memory() -> dict:
    """Resident anonymous and file-backed bytes of this process (/proc/self/status)."""
    fields = {}
    for line in open("/proc/self/status", encoding="utf-8"):
        name, _, value = line.partition(":")
        if name in ("RssAnon", "RssFile"):
            fields[name] = int(value.split()[0]) * 1024
    return {"anon": fields.get("RssAnon", 0), "file": fields.get("RssFile", 0)}


def evict(path: Path) -> None:
    """Drop a file's clean pages from the page cache, so the next reads come from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# --- part 3: the 100 M estimate ---------------------------------------------------------------------------


def estimate(per_worker_pps: float, dim: int, pq_m: int) -> dict:
    """Hours and storage for HOURS_FOR passages on each of ESTIMATE_WORKERS workers at ``per_worker_pps``."""
    rows = [
        {
            "workers": n,
            "hours": HOURS_FOR / (per_worker_pps * n) / 3600,
            "driver_write_mb_s": per_worker_pps * n * dim * 4 / 1e6,
        }
        for n in ESTIMATE_WORKERS
    ]
    return {
        "passages": HOURS_FOR,
        "per_worker_pps": per_worker_pps,
        "by_workers": rows,
        "vectors_on_disk_gb": HOURS_FOR * dim * 4 / 1e9,
        "flat_index_ram_gb": HOURS_FOR * dim * 4 / 1e9,
        "disk_store_ram_gb": HOURS_FOR * (pq_m + 8) / 1e9,
        "assumes": "linear scaling in workers (Ray Data streams shards; the driver writes dim*4 bytes per passage)",
    }


# --- report -----------------------------------------------------------------------------------------------


def summary(report: dict) -> str:
    lines = [f"CPU: {report['cpu']['model']} ({report['cpu']['cores']} cores; {' '.join(report['cpu']['flags'])})"]
    if "embedding" in report:
        e = report["embedding"]
        lines.append(
            f"embedding {e['passages'][1]} passages: one process {e['single']['pps_end_to_end']:.1f}/s end to end, "
            f"{_fmt(e['single']['pps_marginal'])}/s marginal; Ray x{e['ray']['workers']} "
            f"{e['ray']['pps_end_to_end']:.1f}/s, {_fmt(e['ray']['pps_marginal'])}/s; ratio Ray/one "
            f"{e['ratio_end_to_end']:.2f} end to end, {_fmt(e['ratio_marginal'], 2)} marginal"
        )
    for r in report.get("index", []):
        flat, disk = r["flat"], r["disk"]
        lines.append(
            f"N={r['n']:>9,}: flat {flat['resident_bytes'] / 2**20:8.1f} MiB p50 {flat['warm_ms']['p50']:6.2f} ms | "
            f"disk {disk['resident_bytes'] / 2**20:8.1f} MiB ({r['memory_ratio_disk_over_flat']:.1%}) "
            f"p50 cold {disk['cold_ms']['p50']:6.2f} / warm {disk['warm_ms']['p50']:6.2f} ms | "
            f"recall@10 {r['recall_at_10']:.3f}"
        )
    if "estimate_100m" in report:
        est = report["estimate_100m"]
        lines.append(f"100M passages at {est['per_worker_pps']:.1f} passages/s per worker:")
        lines += [f"  {row['workers']:>4} workers: {row['hours']:9.1f} h" for row in est["by_workers"]]
        lines.append(
            f"  vectors on disk {est['vectors_on_disk_gb']:.0f} GB; RAM flat {est['flat_index_ram_gb']:.0f} GB "
            f"vs disk store {est['disk_store_ram_gb']:.1f} GB"
        )
    return "\n".join(lines)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def run(args: argparse.Namespace) -> dict:
    from unimae.retrieval.disk_index import _default_pq_m

    report = {"settings": {k: v for k, v in vars(args).items() if v is not None}, "cpu": cpu()}
    if args.work_dir:
        Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        work = Path(tmp)
        if not args.skip_embed:
            report["embedding"] = embed_part(args, work)
        if not args.skip_index:
            report["index"] = index_part(args, work)
    pps = args.per_worker_pps or report.get("embedding", {}).get("ray", {}).get("per_worker_pps")
    if pps:
        m = report["index"][-1]["disk"]["ivfpq"]["m"] if report.get("index") else _default_pq_m(args.dim)
        report["estimate_100m"] = estimate(pps, args.dim, m)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.measure:
        measure(Path(args.measure), Path(args.queries_file), Path(args.result))
        return 0
    report = run(args)
    print(summary(report))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
