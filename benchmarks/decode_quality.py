"""What a decode precision costs in quality: next-token distributions of the rounded decode steps against fp32's.

The generation suite scores answers by their likelihood in one forward over the whole text (the prefill), which
the decode-only precisions (``bf16-decode``, ``f16-decode``, ``int8-decode``) leave in fp32: it cannot see them.
Here the decode steps themselves are scored, as llama.cpp's ``llama-perplexity --kl-divergence`` scores its
quantized types against f16: each of ``--passages`` held-out Wikipedia paragraphs (``enwiki-gensim:heldout``, a
seeded sample) is cut to ``--prompt-tokens`` + ``--tokens`` tokens; the prompt is prefilled and the rest fed one
token at a time through the precision's decode steps (the paragraph's own tokens, whatever the model would
pick), and at every fed position:

- ``kl``: KL(p_fp32 || p_precision) of the next-token distributions, in nats, mean over positions;
- ``same_top``: share of positions where both pick the same most likely token (greedy agreement per step);
- ``perplexity``: exp of the mean negative log-likelihood of the paragraph's next tokens.

fp32 is the reference (``kl`` 0, ``same_top`` 1). Deterministic, so one run. Writes ``--output`` (default
``results/generation-<model short name>/decode-quality.json``), one entry per precision, others kept.

    python benchmarks/decode_quality.py --model smollm2-135m --precisions bf16-decode f16-decode int8-decode
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

import torch
from tqdm import tqdm

from unimae.files import update_json
from unimae.runtime.cpu import cpu_facts

ROOT = Path(__file__).resolve().parents[1]


def passages_ids(tokenizer, count: int, length: int) -> list[list[int]]:
    """Token ids of ``count`` seeded held-out paragraphs with at least ``length`` tokens, cut to ``length``."""
    from unimae.data.corpus import load_passages

    passages = load_passages("enwiki-gensim:heldout")
    order = random.Random(0).sample(range(len(passages)), len(passages))
    chosen = []
    for index in order:
        ids = tokenizer(passages[index][1], add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            chosen.append(ids[:length])
        if len(chosen) == count:
            return chosen
    raise SystemExit(f"only {len(chosen)} held-out paragraphs have {length} tokens; lower --tokens or --passages")


def forced_log_probs(encoder, ids: list[int], prompt: int) -> torch.Tensor:
    """Log-probabilities (len(ids) - prompt, V) of the next token at each fed position: ``ids[:prompt]`` prefilled,
    then ``ids[prompt:-1]`` fed one at a time through ``encoder``'s decode steps."""
    from unimae.generation.decoding import forced_logits

    logits = forced_logits(encoder.model, encoder.precision, ids[:prompt], ids[prompt:])  # (N, V)
    return torch.log_softmax(logits, dim=-1)


def compare(reference: torch.Tensor, other: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Sums over positions of KL(reference || other), top-1 agreement and the targets' NLL under ``other``."""
    kl = (reference.exp() * (reference - other)).sum(-1)  # (N,)
    same = reference.argmax(-1) == other.argmax(-1)  # (N,)
    nll = -other.gather(-1, targets[:, None])[:, 0]  # (N,)
    return {"kl": kl.sum().item(), "same_top": same.sum().item(), "nll": nll.sum().item(), "positions": len(targets)}


def measure(args: argparse.Namespace) -> dict[str, dict]:
    """Per precision: mean KL against fp32, top-1 agreement and perplexity over the passages' fed positions."""
    from unimae.encoder import Encoder

    encoders = {p: Encoder.from_pretrained(args.model, precision=p) for p in ("fp32", *args.precisions)}
    passages = passages_ids(encoders["fp32"].tokenizer, args.passages, args.prompt_tokens + args.tokens)
    sums = {p: {"kl": 0.0, "same_top": 0.0, "nll": 0.0, "positions": 0} for p in encoders}
    for ids in tqdm(passages, desc="passages", unit="passage"):
        targets = torch.tensor(ids[args.prompt_tokens :])  # (N,)
        reference = forced_log_probs(encoders["fp32"], ids, args.prompt_tokens)  # (N, V)
        for precision, encoder in encoders.items():
            other = reference if precision == "fp32" else forced_log_probs(encoder, ids, args.prompt_tokens)
            for key, value in compare(reference, other, targets).items():
                sums[precision][key] += value
    return {
        p: {
            "kl": round(s["kl"] / s["positions"], 6),
            "same_top": round(s["same_top"] / s["positions"], 4),
            "perplexity": round(math.exp(s["nll"] / s["positions"]), 3),
            "positions": s["positions"],
        }
        for p, s in sums.items()
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--precisions", nargs="+", default=["bf16-decode", "f16-decode", "int8-decode"])
    parser.add_argument("--passages", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="fed tokens per passage (decode steps)")
    parser.add_argument("--output", type=Path)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    output = args.output or ROOT / "results" / f"generation-{args.model.split('-')[0]}" / "decode-quality.json"
    results = measure(args)
    setup = {"model": args.model, "passages": args.passages, "prompt_tokens": args.prompt_tokens, "tokens": args.tokens}
    machine = cpu_facts()
    for precision, result in results.items():
        print(
            f"{precision:>12}: KL {result['kl']:.5f} nats, same top token {result['same_top']:.2%}, "
            f"perplexity {result['perplexity']:.3f}"
        )
    update_json(output, {p: {**r, **setup, "machine": machine} for p, r in results.items()})
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
