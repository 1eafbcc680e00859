"""How hard each distillation term pulls: gradient norms on the embeddings of real training batches.

``--distill-loss listwise`` (a KL over each query's candidates) and ``similarity`` (a mean squared gap over every pair
of the batch's cosines) differ in size by orders of magnitude, so a weight that suits one says nothing about the
other. This script embeds one batch of ``--pairs`` pairs from each ``--data`` file with ``--adapter`` (its prompts
as the recipe gives them: the query prompt on an asymmetric source's queries), has ``--teacher`` embed their raw
texts, and reports the Frobenius norm of the gradient on the (2B + K, D) embeddings of InfoNCE (summed over the
Matryoshka sizes, as trained), of ``L_KD`` and of ``L_SIM``. ``weight_equal_to_listwise``: the similarity weight
whose gradient equals the listwise term's at ``--listwise-weight`` on the same batch; ``weight_equal_to_info_nce``:
the one whose gradient equals InfoNCE's (each the mean over the batches).

    python benchmarks/distill_balance.py --model gemma3-270m --adapter runs/gemma3-270m/retriever/adapter \\
        --teacher ~/.cache/unimae-teachers/all-mpnet-base-v2 --data $UNIMAE_DATA/train/snli_subset_cat.jsonl \\
        $UNIMAE_DATA/train/medquad_qa.jsonl --output results/retrieval-gemma3-kdsim/distill-balance.json

Embeddings are computed without gradients through the model (the norms are of d loss / d z): a measure of each
term's pull on the vectors, not of the weight update it makes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from unimae.encoder import Encoder
from unimae.files import update_json
from unimae.losses.distillation import in_batch_distillation, similarity_distillation
from unimae.losses.info_nce import info_nce
from unimae.runtime.memory import cpu_model
from unimae.training.teacher import load_teacher


def batch_texts(path: Path, pairs: int, seed: int) -> tuple[list[str], list[str], list[str]]:
    """(queries, positives, negatives) of ``pairs`` pairs drawn from one JSONL file (a batch is one source)."""
    rows = [json.loads(line) for line in path.open(encoding="utf-8") if line.strip()]
    rows = random.Random(seed).sample(rows, min(pairs, len(rows)))
    return [r["query"] for r in rows], [r["positive"] for r in rows], [r["negative"] for r in rows if r.get("negative")]


def gradient_norms(z: torch.Tensor, b: int, teacher, texts: list[str], dims: list[int]) -> dict[str, float]:
    """z (2B + K, D) -> the gradient norm on z of each term (module doc)."""
    sims = teacher.similarities(texts)  # (2B + K, 2B + K)
    terms = {
        "info_nce": lambda v: sum(info_nce(v[:b, :m], v[b:, :m], 0.05) for m in dims),
        "listwise": lambda v: in_batch_distillation(v[:b], v[b:], sims[:b, b:], 0.05, 0.05),
        "similarity": lambda v: similarity_distillation(v, sims),
    }
    out = {}
    for name, term in terms.items():
        v = z.detach().clone().requires_grad_(True)
        loss = term(v)
        (grad,) = torch.autograd.grad(loss, v)
        out[name], out[f"{name}_value"] = float(grad.norm()), float(loss)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--teacher", required=True, help="A sentence-transformers model folder or Hub id.")
    parser.add_argument("--data", type=Path, nargs="+", required=True, help="Pair files, one batch from each.")
    parser.add_argument("--pairs", type=int, default=256, help="Pairs per batch (the recipe's batch size).")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--dims", default="64,128,256", help="Matryoshka sizes trained beside the full vector.")
    parser.add_argument("--listwise-weight", type=float, default=4.0)
    parser.add_argument("--symmetric", default="snli,mrpc,parasci,medical_question_entailment", help="Sources "
                        "(file-name substrings) whose queries take no prompt.")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    encoder = Encoder.from_pretrained(args.model, adapter=args.adapter)
    encoder.max_seq_length = args.max_length
    teacher = load_teacher(args.teacher, args.max_length)
    dims = sorted({*(int(d) for d in args.dims.split(",") if d), encoder.embedding_dim})
    symmetric = [s for s in args.symmetric.split(",") if s]
    rows = {}
    for path in args.data:
        queries, positives, negatives = batch_texts(path, args.pairs, args.seed)
        prompt = "" if any(s in path.name for s in symmetric) else (encoder.prompts.get("query") or "")
        z = torch.from_numpy(encoder.encode([prompt + q for q in queries] + positives + negatives, prompt=""))
        rows[path.stem] = gradient_norms(z.float(), len(queries), teacher, queries + positives + negatives, dims)
        for term in ("listwise", "info_nce"):
            rows[path.stem][f"ratio_{term}_to_similarity"] = rows[path.stem][term] / rows[path.stem]["similarity"]
        print(path.stem, json.dumps(rows[path.stem]), flush=True)
    mean = lambda key: sum(r[key] for r in rows.values()) / len(rows)  # noqa: E731
    summary = {
        "weight_equal_to_listwise": args.listwise_weight * mean("ratio_listwise_to_similarity"),
        "weight_equal_to_info_nce": mean("ratio_info_nce_to_similarity"),
        "listwise_weight": args.listwise_weight,
        "batches": rows,
        "adapter": args.adapter,
        "teacher": Path(args.teacher).name,
        "cpu": cpu_model(),
        "command": "python benchmarks/distill_balance.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    print(
        json.dumps({k: summary[k] for k in ("weight_equal_to_listwise", "weight_equal_to_info_nce", "listwise_weight")})
    )
    update_json(args.output, {"distill_balance": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
