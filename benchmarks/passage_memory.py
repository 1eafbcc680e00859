"""RAM to hold a .jsonl corpus for a disk index: the list ``load_passages`` gives against ``open_passages``'s
PassageFile (offsets only), each loaded in a fresh process (peak RSS over the process's RSS before loading).

    python benchmarks/passage_memory.py --passages 200000 --chars 500

Writes a synthetic corpus of ``--passages`` lines of ``--chars`` ASCII characters to a temporary folder and saves
``results/passage-memory.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    """This process's current RSS in MB (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 1e6


def worker(how: str, path: str) -> dict:
    from unimae.data.corpus import load_passages
    from unimae.data.passage_file import open_passages

    before = rss_mb()
    start = time.perf_counter()
    passages = (open_passages if how == "on-demand" else load_passages)(path)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3  # KB -> MB
    return {
        "passages": len(passages),
        "held_mb": round(rss_mb() - before, 1),
        "peak_over_start_mb": round(peak - before, 1),
        "seconds": round(seconds, 2),
    }


def write_corpus(path: Path, count: int, chars: int) -> None:
    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(5000)]
    with open(path, "w") as handle:
        for i in range(count):
            text = " ".join(rng.choices(words, k=chars // 5))[:chars]
            handle.write(json.dumps({"id": f"doc-{i}", "text": text}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passages", type=int, default=200_000)
    parser.add_argument("--chars", type=int, default=500)
    parser.add_argument("--output", type=Path, default=ROOT / "results" / "passage-memory.json")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    from unimae.runtime.memory import cpu_model

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corpus.jsonl"
        write_corpus(path, args.passages, args.chars)
        result = {"passages": args.passages, "chars": args.chars, "file_mb": round(path.stat().st_size / 1e6, 1)}
        for how in ("list", "on-demand"):
            done = subprocess.run(
                [sys.executable, __file__, "--worker", how, str(path)], capture_output=True, text=True, check=True
            )
            result[how] = json.loads(done.stdout.strip().splitlines()[-1])
    result["cpu_model"] = cpu_model()
    print(json.dumps(result, indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
