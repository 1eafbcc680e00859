"""RAG time to first token with and without reusing the query's embedding KV cache, by query length.

One model retrieves and answers (``unimae.retrieval.rag.RAG``): the query's embedding pass (``query [EOS]``) is
the start of the generation prompt, so its KV cache can be the prompt's prefix and only the rest is
prefilled. With an 18-token question in a ~450-token prompt the saving is negligible; it matters for
long queries, e.g. a document as the query, as GritLM does (54% less time at 4k tokens on CPU). The
prompt is ``query [EOS]`` + ``--k`` passages (``--max-passage-tokens`` each) + the question repeated +
the instruction, so a query of L tokens makes a prompt of about 2 L + 550 tokens, of which L + 1 come
from the cache with reuse.

Queries are held-out enwiki-gensim paragraphs concatenated and cut to each ``--lengths`` token count;
the index holds the first ``--passages`` held-out paragraphs (flat). For each length and round both
modes run back to back (alternating which goes first), ``--new-tokens`` greedy tokens each; reported:

- ``generation_ttft_s``: from the end of retrieval to the first answer text (``RAGAnswer.seconds_to_first_token``:
  the prefill, all of it without reuse, the part after the query with it, plus the first step);
- ``total_ttft_s``: from the question to the first answer text (adds the embedding pass and the search,
  the same in both modes);
- the saving ``1 - with / without`` of each, and the prompt and cached token counts.
Medians over ``--repeats`` rounds; the answers must be equal with and without reuse (greedy).

    python benchmarks/rag_kv_reuse.py                       # writes results/rag_kv_reuse.json
    python benchmarks/rag_kv_reuse.py --lengths 64 128 --repeats 1   # quick check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from unimae.runtime.memory import cpu_model

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "results" / "rag_kv_reuse.json"


def make_query(tokenizer, paragraphs: list[str], length: int) -> str:
    """The paragraphs joined and cut to ``length`` tokens (decoded back to text)."""
    ids: list[int] = []
    for text in paragraphs:
        ids += tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            break
    return tokenizer.decode(ids[:length])


def ask(rag, query: str, params, reuse: bool) -> dict:
    """One RAG answer, timed from the question to its first text piece."""
    from unimae.retrieval.rag import RAGAnswer

    start, first, answer = time.perf_counter(), None, None
    for item in rag.stream(query, params=params, reuse_kv=reuse):
        if isinstance(item, RAGAnswer):
            answer = item
        elif isinstance(item, str) and item and first is None:
            first = time.perf_counter() - start
    end = time.perf_counter() - start
    return {
        "total_ttft_s": first if first is not None else end,
        "generation_ttft_s": answer.seconds_to_first_token,
        "seconds": end,
        "prompt_tokens": answer.prompt_tokens,
        "cached_tokens": answer.cached_tokens,
        "text": answer.text,
    }


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--adapter", default=None, help="LoRA adapter (default: the base model)")
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--lengths", type=int, nargs="+", default=[250, 1000, 2000], help="query tokens")
    parser.add_argument("--passages", type=int, default=40, help="held-out paragraphs in the index")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-passage-tokens", type=int, default=160)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from unimae.data.corpus import load_passages
    from unimae.encoder import Encoder
    from unimae.generation.sampling import GenerationParams
    from unimae.retrieval.index import VectorIndex
    from unimae.retrieval.rag import RAG, RAGConfig

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    encoder = Encoder.from_pretrained(
        args.model,
        adapter=args.adapter,
        pooling="eos",
        precision=args.precision,
        max_length=int(1.1 * max(args.lengths)) + 16,
    )
    paragraphs = load_passages("enwiki-gensim:heldout")
    with tempfile.TemporaryDirectory() as tmp:
        index = VectorIndex.build(encoder, paragraphs[: args.passages], Path(tmp) / "index")
    rag = RAG(encoder, index, RAGConfig(k=args.k, max_passage_tokens=args.max_passage_tokens))
    rest = [text for _, text in paragraphs[args.passages :]]
    params = GenerationParams(max_new_tokens=args.new_tokens)
    ask(rag, make_query(encoder.tokenizer, rest, 32), params, reuse=True)  # warm-up
    results = []
    for length in args.lengths:
        query = make_query(encoder.tokenizer, rest, length)
        runs: dict[bool, list[dict]] = {True: [], False: []}
        for r in range(args.repeats):
            for reuse in (True, False) if r % 2 == 0 else (False, True):
                runs[reuse].append(ask(rag, query, params, reuse))
        same = all(a["text"] == b["text"] for a, b in zip(runs[True], runs[False], strict=True))
        row = {"query_tokens": length, "same_answer": same}
        for reuse, name in ((True, "with_reuse"), (False, "without_reuse")):
            row[name] = {
                "generation_ttft_s": median([x["generation_ttft_s"] for x in runs[reuse]]),
                "total_ttft_s": median([x["total_ttft_s"] for x in runs[reuse]]),
                "prompt_tokens": runs[reuse][0]["prompt_tokens"],
                "cached_tokens": runs[reuse][0]["cached_tokens"],
                "runs": [{k: v for k, v in x.items() if k != "text"} for x in runs[reuse]],
            }
        for key in ("generation_ttft_s", "total_ttft_s"):
            pairs = zip(runs[True], runs[False], strict=True)
            row[f"saving_{key}"] = median([1 - a[key] / b[key] for a, b in pairs if a[key] and b[key]])
        results.append(row)
        w, wo = row["with_reuse"], row["without_reuse"]
        print(
            f"query {length:5d} tokens, prompt {wo['prompt_tokens']:5d} ({w['cached_tokens']} cached): generation TTFT "
            f"{w['generation_ttft_s']:.2f} s with reuse vs {wo['generation_ttft_s']:.2f} s without "
            f"({100 * row['saving_generation_ttft_s']:.0f}% less); from the question {w['total_ttft_s']:.2f} vs "
            f"{wo['total_ttft_s']:.2f} s ({100 * row['saving_total_ttft_s']:.0f}% less); same answer: {same}",
            flush=True,
        )
    report = {
        "model": args.model,
        "adapter": args.adapter,
        "precision": encoder.precision,
        "threads": args.threads,
        "k": args.k,
        "max_passage_tokens": args.max_passage_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "cpu_model": cpu_model(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
