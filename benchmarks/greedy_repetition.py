"""Does an adapter still generate text, or loop? Greedy continuations of a few plain prompts, and how much they repeat.

The generation suite scores likelihoods of given answers; it does not show a model that, left to itself, says
"Paris Paris Paris ...". For each ``--adapters`` entry (``label=path``, ``none`` for the base model) an
``Encoder`` (``--model``, ``--precision``) continues each prompt greedily for ``--new-tokens`` tokens
(``Encoder.generate``, plain text, no chat template), and the continuation's words (split on whitespace) give:

- ``distinct_words``: distinct words / words, averaged over the prompts (1.0: no word twice);
- ``repeated_trigrams``: 1 - distinct word 3-grams / 3-grams, averaged (0.0: no 3-gram twice; a loop -> near 1).

Deterministic (greedy), so one run per setup. Writes ``--output`` (default
``results/generation-<model short name>/greedy-repetition.json``), one entry per label, other labels kept.

    python benchmarks/greedy_repetition.py --model gemma3-270m --adapters none \\
        unimae=runs/gemma3-270m/unimae-p0.5/adapter retrieval=runs/gemma3-270m/unimae-p0.5-simcse-sup/adapter
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from unimae.adapter import adapter_revision
from unimae.files import update_json
from unimae.release import resolve_adapter
from unimae.runtime.memory import cpu_model

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "The capital of France is",
    "Water boils at",
    "The history of the Roman Empire",
    "To make a cup of tea, first",
    "The best way to learn a language is",
    "Photosynthesis is the process by which",
    "In 1969, the first humans",
    "A good night's sleep helps",
]


def repetition(text: str) -> dict[str, float]:
    """distinct_words and repeated_trigrams (see the module doc) of one continuation."""
    words = text.split()
    trigrams = list(zip(words, words[1:], words[2:], strict=False))
    return {
        "distinct_words": len(set(words)) / len(words) if words else 0.0,
        "repeated_trigrams": 1 - len(set(trigrams)) / len(trigrams) if trigrams else 0.0,
    }


def score(model: str, adapter: str | None, precision: str, new_tokens: int) -> dict:
    """The setup's continuations and their mean repetition measures."""
    from unimae.encoder import Encoder
    from unimae.generation.sampling import GenerationParams

    encoder = Encoder.from_pretrained(model, adapter=adapter, precision=precision)
    params = GenerationParams(max_new_tokens=new_tokens)
    texts = [encoder.generate(prompt, params=params) for prompt in PROMPTS]
    measures = [repetition(text) for text in texts]
    return {
        "adapter": adapter,
        "revision": adapter_revision(resolve_adapter(adapter)),  # a release card quotes only its own adapter's
        **{key: round(statistics.mean(m[key] for m in measures), 4) for key in measures[0]},
        "continuations": dict(zip(PROMPTS, texts, strict=True)),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--adapters", nargs="+", default=["none"], help="label=path, or none (the base model)")
    parser.add_argument("--precision", default="bf16", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--output", type=Path)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    output = args.output or ROOT / "results" / f"generation-{args.model.split('-')[0]}" / "greedy-repetition.json"
    update = {}
    for entry in args.adapters:
        label, _, path = entry.partition("=")
        adapter = None if entry == "none" else path or label
        result = score(args.model, adapter, args.precision, args.new_tokens)
        result.update(model=args.model, precision=args.precision, new_tokens=args.new_tokens, cpu_model=cpu_model())
        update["base" if entry == "none" else label] = result
        print(
            f"{label:>12}: distinct words {result['distinct_words']:.3f}, repeated 3-grams "
            f"{result['repeated_trigrams']:.3f} | {next(iter(result['continuations'].values()))[:70]!r}",
            flush=True,
        )
    update_json(output, update)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
