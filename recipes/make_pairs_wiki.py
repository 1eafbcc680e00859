"""Build (query, positive) pairs from shared/data/pretrain/wikipedia_paragraphs.jsonl for --method contrastive.

Two kinds (``--mode``):
- ``ict`` (default; inverse cloze task, Lee et al. 2019): query = one sentence of a paragraph (seeded choice
  among sentences of at least --min-words words), positive = the rest of the paragraph. In --keep-sentence
  of the pairs (default 10%, as Lee et al.) the sentence stays in the positive, so exact overlap is not
  the only signal. Paragraphs with fewer than 3 sentences are skipped. One pair per paragraph.
- ``title``: query = the article title, positive = its first paragraph. One pair per article.

Leakage guard: every article of the enwiki-gensim corpus (the UniMAE training text and, for its held-out
tenth, the RAG benchmark, `unimae check` and `wiki_heldout`) is dropped, by title and by paragraph text;
in this snapshot that removes 'Alchemy' and 'Andre Agassi' (held-out articles, 80 paragraphs) and a few
more. Needs gensim (a unimae dependency); --no-exclude-gensim skips the guard. Known quirk of the source:
pandoc wrote the bold lead term in UPPERCASE ("The 1923 MISSOURI TIGERS FOOTBALL TEAM was ..."); it is kept.

    python recipes/make_pairs_wiki.py --output ../data-pairs/wiki_ict.jsonl

Write the output outside the repository (data is never committed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from pathlib import Path

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")
_PREFIX = 60  # characters of a paragraph compared with the enwiki-gensim passages


def sentences(paragraph: str) -> list[str]:
    """Split on sentence punctuation followed by a capital or digit (abbreviations may split; harmless here)."""
    return [s.strip() for s in _SENTENCE_END.split(paragraph) if s.strip()]


def ict_pair(paragraph: str, rng: random.Random, min_words: int, keep_sentence: float) -> dict | None:
    parts = sentences(paragraph)
    if len(parts) < 3:
        return None
    candidates = [i for i, s in enumerate(parts) if len(s.split()) >= min_words]
    if not candidates:
        return None
    i = rng.choice(candidates)
    keep = rng.random() < keep_sentence
    rest = parts if keep else parts[:i] + parts[i + 1 :]
    return {"query": parts[i], "positive": " ".join(rest)}


def enwiki_gensim_guard() -> tuple[set[str], set[str]]:
    """Titles and paragraph prefixes of every enwiki-gensim article (train and held-out)."""
    from unimae.data.corpus import enwiki_gensim_passages

    titles, prefixes = set(), set()
    for split in ("train", "heldout"):
        for passage_id, text in enwiki_gensim_passages(split):
            titles.add(passage_id.rsplit("#", 1)[0])
            prefixes.add(text[:_PREFIX])
    return titles, prefixes


def build(rows: list[dict], mode: str, seed: int, min_words: int, keep_sentence: float, guard) -> list[dict]:
    titles, prefixes = guard
    rng = random.Random(seed)
    pairs, seen_articles, seen_texts = [], set(), set()
    for row in rows:
        title, text = row["title"].strip(), " ".join(row["text"].split())
        if title in titles or text[:_PREFIX] in prefixes:
            continue
        if mode == "title":
            pair = None if title in seen_articles else {"query": title, "positive": text}
            seen_articles.add(title)
        else:
            pair = ict_pair(text, rng, min_words, keep_sentence)
        if pair and pair["query"] not in seen_texts:
            seen_texts.add(pair["query"])
            pairs.append(pair)
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parents[1]
    data = Path(os.environ.get("UNIMAE_DATA", root.parent / "shared" / "data"))
    parser.add_argument("--pretrain", default=str(data / "pretrain" / "wikipedia_paragraphs.jsonl"))
    parser.add_argument("--output", required=True, help="JSONL to write (outside the repository)")
    parser.add_argument("--mode", choices=("ict", "title"), default="ict")
    parser.add_argument("--min-words", type=int, default=6, help="ict: shortest query sentence, in words")
    parser.add_argument("--keep-sentence", type=float, default=0.1, help="ict: share of pairs keeping the query")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exclude-gensim", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    source = Path(args.pretrain)
    if not source.is_file():
        raise SystemExit(f"{source} not found; pass --pretrain or set UNIMAE_DATA")
    rows = []
    with open(source, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row.get("title"), str) or not isinstance(row.get("text"), str):
                    raise SystemExit(f"{source}, line {number}: expected string 'title' and 'text' fields")
                rows.append(row)
    guard = enwiki_gensim_guard() if args.exclude_gensim else (set(), set())
    pairs = build(rows, args.mode, args.seed, args.min_words, args.keep_sentence, guard)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs)
    tmp.replace(out)
    print(f"wrote {len(pairs)} {args.mode} pairs from {len(rows)} paragraphs to {out}")


if __name__ == "__main__":
    main()
