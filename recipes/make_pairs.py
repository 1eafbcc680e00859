"""Build a small supervised contrastive set (query, positive, negative) from STSBenchmark TRAIN.

No supervised training set ships in shared/data, and the dev suite scores STSBenchmark's TEST split
only, so the train split is fair to learn from. Positive: the pair's other sentence where the gold
score is >= --min-score. Hard negative: sentence2 of a randomly drawn train pair whose score is
<= --max-negative-score (seeded). It can still leak into the STS tasks of the dev suite (STSBenchmark,
SICK-R, STS17): same sentence sources (captions, news, forums) and the same notion of similarity.

    python recipes/make_pairs.py --output runs/stsb-pairs.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parents[1]
    default = Path(os.environ.get("UNIMAE_DATA", root.parent / "shared" / "data")) / "sts/STSBenchmark/train.jsonl"
    parser.add_argument("--train", default=str(default), help="STSBenchmark train.jsonl")
    parser.add_argument("--output", default="runs/stsb-pairs.jsonl")
    parser.add_argument("--min-score", type=float, default=4.0)
    parser.add_argument("--max-negative-score", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not Path(args.train).is_file():
        raise SystemExit(f"{args.train} not found; pass --train or set UNIMAE_DATA")
    rows = [json.loads(line) for line in open(args.train, encoding="utf-8") if line.strip()]
    positives = [r for r in rows if r["score"] >= args.min_score]
    negatives = [r["sentence2"] for r in rows if r["score"] <= args.max_negative_score]
    rng = random.Random(args.seed)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as handle:
        for row in positives:
            negative = rng.choice(negatives)
            record = {"query": row["sentence1"].strip(), "positive": row["sentence2"].strip(), "negative": negative}
            handle.write(json.dumps(record) + "\n")
    print(f"wrote {len(positives)} (query, positive, negative) rows to {out}")


if __name__ == "__main__":
    main()
