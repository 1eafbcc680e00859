"""Does an adapter still generate text, or loop? Greedy continuations of a few plain prompts, and how much they repeat.

The generation suite scores likelihoods of given answers; it does not show a model that, left to itself, says
"Paris Paris Paris ...". For each ``--adapters`` entry (``label=path``, ``none`` for the base model) an
``Encoder`` (``--model``, ``--precision``) continues each prompt greedily for ``--new-tokens`` tokens
(``Encoder.generate``, plain text, no chat template), and the continuation's words (split on whitespace) give:

- ``distinct_words``: distinct words / words, averaged over the prompts (1.0: no word twice);
- ``repeated_trigrams``: 1 - distinct word 3-grams / 3-grams, averaged (0.0: no 3-gram twice; a loop -> near 1).

Each measure comes with its standard error over the prompts (``*_se``), and each adapter beside the base model of the
same run with the paired difference of its repeated 3-grams from the base's, prompt by prompt, and that difference's
standard error (``vs_base``): eight prompts cannot tell a small difference from the prompts' spread.

Prompt sets (``--prompt-set``): ``plain``, the eight fixed prompts below (the default; earlier results used them);
``wiki-heldout``, the first ``--prompt-words`` words of ``--prompts`` held-out Wikipedia paragraphs (the local data
folder's enwiki-gensim held-out split, evenly spaced through it), text that no training stage saw.

Deterministic (greedy), so one run per setup. Writes ``--output`` (default
``results/generation-<model short name>/greedy-repetition.json`` for ``plain``,
``greedy-repetition-wiki-heldout.json`` for the other set), one entry per label, other labels kept. Greedy
continuations differ between CPUs (their bf16 kernels round differently), so a base row run again elsewhere can
differ from the one earlier rows were paired with: that one is then kept as ``base@<its CPU>`` and those rows'
``vs_base`` name it (``paired_with``), so no paired difference is read against a base it was not computed from.

    python benchmarks/greedy_repetition.py --model gemma3-270m --adapters none \\
        unimae=runs/gemma3-270m/unimae-p0.5/adapter retrieval=runs/gemma3-270m/unimae-p0.5-simcse-sup/adapter
    python benchmarks/greedy_repetition.py --model smollm2-135m --prompt-set wiki-heldout --prompts 64 \\
        --adapters none release=unimae-smollm2-135m-retriever
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from tqdm import tqdm

from unimae.adapter import adapter_revision
from unimae.files import read_json, update_json
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


def prompt_set(name: str, count: int, words: int) -> list[str]:
    """The prompts of set ``name`` (see the module doc): the fixed eight, or the first ``words`` words of ``count``
    held-out Wikipedia paragraphs spaced evenly through the split."""
    if name == "plain":
        return PROMPTS
    from unimae.data.corpus import load_passages

    passages = load_passages("enwiki-gensim:heldout")
    if not 1 <= count <= len(passages):
        raise SystemExit(f"--prompts must be between 1 and {len(passages)} (the held-out paragraphs), got {count}")
    chosen = [passages[i * len(passages) // count][1] for i in range(count)]
    return [" ".join(text.split()[:words]) for text in chosen]


def standard_error(values: list[float]) -> float:
    """The standard error of the mean of ``values`` (0 for fewer than two)."""
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0


def score(model: str, adapter: str | None, precision: str, new_tokens: int, prompts: list[str]) -> dict:
    """The setup's continuations, their mean repetition measures and those means' standard errors."""
    from unimae.encoder import Encoder
    from unimae.generation.sampling import GenerationParams

    encoder = Encoder.from_pretrained(model, adapter=adapter, precision=precision)
    params = GenerationParams(max_new_tokens=new_tokens)
    texts = [encoder.generate(prompt, params=params) for prompt in tqdm(prompts, desc=adapter or "base", leave=False)]
    measures = [repetition(text) for text in texts]
    means = {key: round(statistics.mean(m[key] for m in measures), 4) for key in measures[0]}
    errors = {f"{key}_se": round(standard_error([m[key] for m in measures]), 4) for key in measures[0]}
    return {
        "adapter": adapter,
        "revision": adapter_revision(resolve_adapter(adapter)),  # a release card quotes only its own adapter's
        **means,
        **errors,
        "continuations": dict(zip(prompts, texts, strict=True)),
    }


def versus_base(result: dict, base: dict) -> dict:
    """The paired difference of ``result``'s repeated 3-grams from ``base``'s over the same prompts, and its
    standard error: positive means the adapter repeats more."""
    pairs = [
        (repetition(text)["repeated_trigrams"], repetition(base["continuations"][prompt])["repeated_trigrams"])
        for prompt, text in result["continuations"].items()
    ]
    differences = [a - b for a, b in pairs]
    return {
        "repeated_trigrams_diff": round(statistics.mean(differences), 4),
        "repeated_trigrams_diff_se": round(standard_error(differences), 4),
        "prompts_more": sum(d > 0 for d in differences),
        "prompts_fewer": sum(d < 0 for d in differences),
    }


def keep_earlier_base(previous: dict, update: dict) -> dict:
    """Entries to write beside ``update`` so that rows of ``previous`` (the output file's) stay paired with the base
    they were compared with: when ``update`` replaces a ``base`` row whose continuations differ, the old one as
    ``base@<its CPU>`` and each kept row's ``vs_base`` naming it in ``paired_with``; nothing otherwise."""
    old, new = previous.get("base"), update.get("base")
    if not (isinstance(old, dict) and new) or old.get("continuations") == new.get("continuations"):
        return {}
    key = f"base@{old.get('cpu_model') or 'unknown CPU'}"
    while key in previous and previous[key] != old:  # an earlier kept base of that CPU stays too
        key += "'"
    kept = {key: old}
    for label, row in previous.items():
        if label not in update and isinstance(row, dict) and "vs_base" in row and "paired_with" not in row["vs_base"]:
            kept[label] = {**row, "vs_base": {**row["vs_base"], "paired_with": key}}
    return kept


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--adapters", nargs="+", default=["none"], help="label=path, or none (the base model)")
    parser.add_argument("--precision", default="bf16", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-set", default="plain", choices=["plain", "wiki-heldout"])
    parser.add_argument("--prompts", type=int, default=64, help="wiki-heldout: how many paragraphs (default 64)")
    parser.add_argument("--prompt-words", type=int, default=8, help="wiki-heldout: words of each (default 8)")
    parser.add_argument("--output", type=Path)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    name = "greedy-repetition.json" if args.prompt_set == "plain" else f"greedy-repetition-{args.prompt_set}.json"
    output = args.output or ROOT / "results" / f"generation-{args.model.split('-')[0]}" / name
    prompts = prompt_set(args.prompt_set, args.prompts, args.prompt_words)
    update = {}
    for entry in args.adapters:
        label, _, path = entry.partition("=")
        adapter = None if entry == "none" else path or label
        result = score(args.model, adapter, args.precision, args.new_tokens, prompts)
        result.update(model=args.model, precision=args.precision, new_tokens=args.new_tokens, cpu_model=cpu_model())
        result.update(prompt_set=args.prompt_set, prompts=len(prompts))
        if "base" in update and entry != "none":
            result["vs_base"] = versus_base(result, update["base"])
        update["base" if entry == "none" else label] = result
        print(
            f"{label:>12}: distinct words {result['distinct_words']:.3f}, repeated 3-grams "
            f"{result['repeated_trigrams']:.3f} | {next(iter(result['continuations'].values()))[:70]!r}",
            flush=True,
        )
    previous = read_json(output, "repetition result") if output.is_file() else {}
    update_json(output, {**update, **keep_earlier_base(previous, update)})
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
