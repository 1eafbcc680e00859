"""Embedding-suite benchmark: wall time of the mteb ``dev`` suite and the embedding-cache hit rate.

Runs ``unimae.evaluation.embeddings.evaluate_embeddings`` twice on the same texts into a fresh
output folder: the first pass embeds everything (cold cache), the second must embed nothing
(warm cache). Prints and saves per-task runtimes, total wall time and hits/misses of each pass.

    python benchmarks/eval_suite.py --adapter runs/unimae/adapter --pooling eos
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from unimae.evaluation.embeddings import evaluate_embeddings
from unimae.files import find_data_dir

RESULTS = Path(__file__).resolve().parent / "results"


def default_data_dir() -> str | None:
    found = find_data_dir()  # $UNIMAE_DATA, else ../shared/data
    return str(found) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--adapter", default=None)
    parser.add_argument("--pooling", default="eos")
    parser.add_argument("--tasks", nargs="+", default=["dev"])
    parser.add_argument("--data-dir", default=default_data_dir())
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--output", default=str(RESULTS / "eval_suite.json"))
    args = parser.parse_args()
    if not Path(args.data_dir).is_dir():
        raise SystemExit(f"data folder {args.data_dir} not found; pass --data-dir or set UNIMAE_DATA")

    passes = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("cold", "warm"):
            start = time.perf_counter()
            run = evaluate_embeddings(
                args.model,
                args.tasks,
                Path(tmp),
                adapter=args.adapter,
                pooling=args.pooling,
                data_dir=Path(args.data_dir),
                label="bench",
                batch_size=args.batch_size,
                rerun=True,  # the warm pass must run every task again, from the cache
            )
            seconds = time.perf_counter() - start
            lookups = run.cache_hits + run.cache_misses
            passes.append(
                {
                    "pass": name,
                    "seconds": round(seconds, 1),
                    "task_seconds": run.runtimes,
                    "cache_hits": run.cache_hits,
                    "cache_misses": run.cache_misses,
                    "hit_rate": run.cache_hits / lookups if lookups else None,
                    "errors": run.errors,
                    "scores": run.scores,
                }
            )
            print(
                f"{name:5s} pass: {seconds:7.1f} s  cache hits {run.cache_hits} / {lookups} "
                f"({100 * passes[-1]['hit_rate']:.1f}%)"
            )
            for task, secs in run.runtimes.items():
                print(f"    {task:32s} {secs:8.1f} s")
    payload = {
        "model": args.model,
        "adapter": args.adapter,
        "pooling": args.pooling,
        "tasks": args.tasks,
        "batch_size": args.batch_size,
        "passes": passes,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
