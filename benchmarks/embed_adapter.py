"""Embedding speed with a LoRA adapter: merged vs unmerged, at 32, 128 and 512 tokens per text.

An ``Encoder`` (``--model``, EOS pooling, ``--precision``) loads ``--adapter`` twice: unmerged (the exact
default in bf16: the base in bf16, the LoRA weights apart in float32) and merged (``merge=True``: ``W + dW``
formed in float32, then rounded to the run precision). Each embeds ``--texts`` texts of exactly N tokens
per ``--lengths`` value (EOS included; windows of consecutive tokens of ``pretrain/wikipedia_paragraphs.jsonl``,
so no padding), in batches of ``--batch-size``. The unmerged encoder runs twice per round: as loaded
(peft's per-layer fp32 input cast switched off, :func:`unimae.adapter.skip_input_upcast`) and with that
cast switched back on (``peft-upcast``: how unimae ran before). The setups alternate within each of
``--repeats`` rounds after one warm-up batch each; the median seconds are reported, as tokens/s, with
``unmerged / merged`` time ratios and each setup's tokens/s at its longest length over its shortest.
The embeddings of the unmerged setups must be bit-identical (checked and reported).

    python benchmarks/embed_adapter.py --adapter runs/unimae/adapter     # writes results/speed.json "embedding_adapter"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from unimae.adapter import skip_input_upcast
from unimae.runtime.memory import cpu_model

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "results" / "speed.json"


def token_windows(tokenizer, data_dir: Path, length: int, count: int) -> list[str]:
    """``count`` texts that tokenize to ``length - 1`` tokens (the Encoder appends EOS): consecutive windows
    of the Wikipedia paragraphs' tokens, decoded; re-tokenising a decoded window may shift a token or two,
    so each text is cut to exactly ``length - 1`` tokens once more."""
    ids: list[int] = []
    with open(data_dir / "pretrain" / "wikipedia_paragraphs.jsonl", encoding="utf-8") as handle:
        for line in handle:
            ids += tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
            if len(ids) >= (length + 8) * count:
                break
    size = length - 1
    texts = []
    for i in range(count):
        window = tokenizer.decode(ids[i * (size + 8) : i * (size + 8) + size])
        texts.append(tokenizer.decode(tokenizer(window, add_special_tokens=False)["input_ids"][:size]))
    return texts


def timed(encoder, texts: list[str], batch_size: int) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    embeddings = encoder.encode(texts, batch_size=batch_size)
    return time.perf_counter() - start, np.asarray(embeddings)


def measure(setups: dict, texts: list[str], args) -> dict:
    """{setup: median seconds} over ``args.repeats`` alternating rounds, and whether unmerged runs agree."""
    for encoder, upcast in setups.values():
        skip_input_upcast(encoder.model, skip=not upcast)
        encoder.encode(texts[: args.batch_size], batch_size=args.batch_size)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in setups}
    outputs: dict[str, np.ndarray] = {}
    for _ in range(args.repeats):
        for name, (encoder, upcast) in setups.items():
            skip_input_upcast(encoder.model, skip=not upcast)
            took, outputs[name] = timed(encoder, texts, args.batch_size)
            seconds[name].append(took)
    same = bool(np.array_equal(outputs["unmerged"], outputs["unmerged-peft-upcast"]))
    return {
        "seconds": {k: statistics.median(v) for k, v in seconds.items()},
        "runs": seconds,
        "unmerged_identical": same,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--texts", type=int, default=64, help="Texts per length.")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument(
        "--data-dir", type=Path, default=Path(os.environ.get("UNIMAE_DATA") or ROOT.parent / "shared" / "data")
    )
    parser.add_argument("--output", type=Path, default=OUTPUT)
    return parser.parse_args()


def main() -> None:
    from unimae.encoder import Encoder
    from unimae.files import update_json

    args = parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    kwargs = dict(pooling="eos", precision=args.precision, max_length=max(args.lengths))
    unmerged = Encoder.from_pretrained(args.model, adapter=args.adapter, merge=False, **kwargs)
    merged = Encoder.from_pretrained(args.model, adapter=args.adapter, merge=True, **kwargs)
    setups = {"unmerged": (unmerged, False), "unmerged-peft-upcast": (unmerged, True), "merged": (merged, False)}
    by_length = {}
    for length in args.lengths:
        texts = token_windows(unmerged.tokenizer, args.data_dir, length, args.texts)
        result = measure(setups, texts, args)
        tokens = length * len(texts)
        result["tokens_per_s"] = {name: tokens / s for name, s in result["seconds"].items()}
        result["unmerged_over_merged_time"] = result["seconds"]["unmerged"] / result["seconds"]["merged"]
        by_length[str(length)] = result
        rates = "  ".join(f"{k} {v:7.0f} tok/s" for k, v in result["tokens_per_s"].items())
        print(
            f"{length:4d} tokens/text: {rates}  unmerged/merged time {result['unmerged_over_merged_time']:.2f}",
            flush=True,
        )
    short, long = str(min(args.lengths)), str(max(args.lengths))
    summary = {
        "model": args.model,
        "adapter": args.adapter,
        "precision": unmerged.precision,
        "threads": args.threads,
        "texts_per_length": args.texts,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "cpu_model": cpu_model(),
        "loadavg_before_after": [load_before, os.getloadavg()],
        "lengths": by_length,
        "long_over_short_tokens_per_s": {
            name: by_length[long]["tokens_per_s"][name] / by_length[short]["tokens_per_s"][name] for name in setups
        },
    }
    update_json(args.output, {"embedding_adapter": summary})
    print(f"wrote {args.output} (embedding_adapter); CPU: {summary['cpu_model']}")


if __name__ == "__main__":
    main()
