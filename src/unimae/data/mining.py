"""Hard negatives mined with the model itself from the pairs' own positives (positive-aware mining).

For each pair of a source, the candidates are the positives of that source (all, or a seeded pool of
``pool_size`` of them plus the positives of the pairs being mined). The model embeds the query as training
does (the query prompt on asymmetric sources, none on symmetric ones; documents with the 'document' prompt
if the adapter has one) and ranks the candidates by cosine similarity. A candidate whose score is above the
pair's own positive score ``s+`` less a relative margin,

    s(q, c) > s+ - |s+| * relative_margin,                                         (1)

is dropped as a likely false negative (NV-Retriever's positive-aware "TopK-PercPos", Moreira et al. 2024,
arXiv:2407.15831, which found a 5% margin best; sentence-transformers' ``mine_hard_negatives`` calls it
``relative_margin``), as is any candidate whose text equals the pair's query or positive. Of the survivors
ranked ``range_min .. range_max - 1`` the pair takes one negative: the highest ('top') or one drawn at random
('random'). The contrastive method reads one ``"negative"`` per pair, so one is mined.

Decisions the papers leave open, all flags: mining within each source (the batches hold one source, so its
in-batch negatives are that source's already), one negative per pair, keeping a source's own hand-made
negative (``keep_given``) rather than replacing it.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from unimae.files import atomic_write_json, atomic_write_text, read_json

SAMPLING = ("top", "random")

logger = logging.getLogger(__name__)


@dataclass
class MiningConfig:
    """How negatives are chosen (the equation (1) filter and the rank window)."""

    relative_margin: float = field(
        default=0.05, metadata={"help": "Drop candidates scoring above s+ - |s+| x this (eq. 1); 0: only above s+."}
    )
    range_min: int = field(default=0, metadata={"help": "Skip the first N surviving candidates (0: the hardest)."})
    range_max: int = field(default=10, metadata={"help": "Consider surviving candidates ranked below N."})
    sampling: str = field(
        default="top", metadata={"help": "'top': the highest in the window; 'random': any of it.", "choices": SAMPLING}
    )
    pool_size: int = field(
        default=0,
        metadata={"help": "Candidates per source: a seeded sample of N positives plus the mined pairs' (0: all)."},
    )
    keep_given: bool = field(default=True, metadata={"help": "Keep a pair's own negative instead of mining one."})
    seed: int = field(
        default=0, metadata={"help": "Seeds the pool sample and 'random'; with --steps, the training's --seed."}
    )

    def __post_init__(self):
        if not 0 <= self.relative_margin < 1:
            raise ValueError(f"relative_margin must be in [0, 1), got {self.relative_margin}")
        if not 0 <= self.range_min < self.range_max:
            raise ValueError(f"need 0 <= range_min < range_max, got {self.range_min} and {self.range_max}")
        if self.sampling not in SAMPLING:
            raise ValueError(f"sampling must be one of {SAMPLING}, got {self.sampling!r}")
        if self.pool_size < 0:
            raise ValueError(f"pool_size must be >= 0, got {self.pool_size}")


@dataclass
class Picks:
    """Per query: the chosen pool index (-1: none survived), and how many candidates eq. (1) dropped."""

    index: list[int]
    dropped_by_margin: int


def pick_negatives(
    queries: torch.Tensor,
    pool: torch.Tensor,
    positive: torch.Tensor,
    excluded: list[list[int]],
    config: MiningConfig,
    chunk: int = 1024,
) -> Picks:
    """One negative per query from ``pool`` by eq. (1) and the rank window.

    queries (Q, D) and pool (P, D): unit vectors; positive (Q,): each query's pool index of its own positive;
    excluded: per query, pool indices never to take (texts equal to its query or positive).
    """
    rng = random.Random(config.seed)
    index, dropped = [], 0
    window = min(config.range_max, pool.shape[0])
    for start in range(0, queries.shape[0], chunk):
        scores = queries[start : start + chunk] @ pool.T  # (q, P)
        rows = torch.arange(scores.shape[0])
        own = scores[rows, positive[start : start + chunk]]  # (q,) s+
        threshold = own - own.abs() * config.relative_margin  # (q,) eq. (1)
        for row, banned in enumerate(excluded[start : start + chunk]):
            scores[row, banned] = float("-inf")
        too_close = scores > threshold[:, None]  # (q, P)
        dropped += int(too_close.sum())
        scores[too_close] = float("-inf")
        top, which = scores.topk(window, dim=1)  # (q, window)
        for values, candidates in zip(top.tolist(), which.tolist(), strict=True):
            alive = [c for v, c in zip(values, candidates, strict=True) if v != float("-inf")][config.range_min :]
            index.append(-1 if not alive else alive[0] if config.sampling == "top" else rng.choice(alive))
    return Picks(index, dropped)


def mine_source(
    pairs: list[dict],
    rows: list[int],
    embed_queries,
    embed_documents,
    config: MiningConfig,
) -> tuple[list[dict], dict]:
    """``pairs`` with a mined ``"negative"`` on each of ``rows`` (pairs keep their order); and its counts.

    embed_queries / embed_documents: texts -> (N, D) float32 arrays (the model's query and document sides).
    """
    keep = [r for r in rows if not (config.keep_given and pairs[r].get("negative"))]
    pool_texts = _pool(pairs, keep, config)
    where = {text: i for i, text in enumerate(pool_texts)}
    stats = {"pairs": len(pairs), "asked": len(rows), "kept_given": len(rows) - len(keep), "pool": len(pool_texts)}
    if not keep:
        return pairs, {**stats, "mined": 0, "none_found": 0, "dropped_by_margin": 0}
    pool = _unit(embed_documents(pool_texts))  # (P, D)
    queries = _unit(embed_queries([pairs[r]["query"] for r in keep]))  # (Q, D)
    positive = torch.tensor([where[pairs[r]["positive"]] for r in keep])  # (Q,)
    excluded = [[where[t] for t in (pairs[r]["query"], pairs[r]["positive"]) if t in where] for r in keep]
    picks = pick_negatives(queries, pool, positive, excluded, config)
    out = list(pairs)
    for r, i in zip(keep, picks.index, strict=True):
        if i >= 0:
            out[r] = {**pairs[r], "negative": pool_texts[i]}
    none = picks.index.count(-1)
    return out, {**stats, "mined": len(keep) - none, "none_found": none, "dropped_by_margin": picks.dropped_by_margin}


def _pool(pairs: list[dict], rows: list[int], config: MiningConfig) -> list[str]:
    """Unique candidate texts: every positive, or a seeded sample of ``pool_size`` plus those of ``rows``."""
    chosen = range(len(pairs))
    if config.pool_size and config.pool_size < len(pairs):
        sample = random.Random(config.seed).sample(range(len(pairs)), config.pool_size)
        chosen = sorted(set(sample) | set(rows))
    return list(dict.fromkeys(pairs[i]["positive"] for i in chosen))


def _unit(vectors) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.as_tensor(vectors, dtype=torch.float32), dim=-1)


def rows_drawn(sizes: list[int], weights: list[float], steps: int, batch_size: int, seed: int) -> list[list[int]]:
    """Per source, the (sorted, file-local) rows that the first ``steps`` batches of the contrastive method draw
    (:class:`~unimae.data.pairs.SourceBatchOrder`, the same seed and weights as ``unimae train``)."""
    from unimae.data.pairs import SourceBatchOrder

    order = SourceBatchOrder(sizes, weights, batch_size, seed)
    drawn: list[set[int]] = [set() for _ in sizes]
    for step in range(steps):
        source = order.source_of(step)
        examples = range(step * batch_size, (step + 1) * batch_size)
        drawn[source].update(order.text_index(e) - order.offsets[source] for e in examples)
    return [sorted(rows) for rows in drawn]


def mine_pairs(
    data: str,
    output_dir: str | Path,
    encoder,
    config: MiningConfig,
    symmetric_sources: Sequence[str] = (),
    steps: int = 0,
    batch_size: int = 256,
    weights: str = "sqrt",
    embed_batch_size: int = 32,
    identity: dict | None = None,
) -> dict:
    """Mine every source of ``data`` (``--data`` of the contrastive method) into ``output_dir/<file>.jsonl``:
    the same pairs in the same order (so ``unimae train`` draws the same batches from them), a mined negative
    added. ``steps`` > 0: only the pairs the first ``steps`` batches of ``batch_size`` draw (seed ``config.seed``,
    ``weights``), for a budgeted run; the rest are written as they were. ``encoder``: an
    :class:`~unimae.encoder.Encoder`, whose 'query' / 'document' prompts embed the asymmetric sources' sides.

    Resumable: ``output_dir/mining.json`` holds the settings and each finished source's counts; a later call
    with the same settings skips those sources, with other settings it refuses the folder.
    """
    from unimae.data.pairs import load_mixture

    mixture = load_mixture(data, weights, batch_size if steps else 2)  # a batch must fill only when drawn
    rows = (
        rows_drawn(mixture.sizes, mixture.weights, steps, batch_size, config.seed)
        if steps
        else [list(range(n)) for n in mixture.sizes]
    )
    out = Path(output_dir)
    record = out / "mining.json"
    settings = {**asdict(config), "steps": steps, "batch_size": batch_size, "weights": weights}
    settings.update(symmetric_sources=sorted(symmetric_sources), max_length=encoder.max_length, **(identity or {}))
    done = read_json(record, "mining record") if record.is_file() else {"settings": settings, "sources": {}}
    if done.get("settings") != settings:
        raise ValueError(f"{out} holds pairs mined with other settings ({record}); choose another --output-dir")
    out.mkdir(parents=True, exist_ok=True)
    for index, (source, chosen) in enumerate(zip(mixture.sources, rows, strict=True)):
        target = out / source.path.name
        if source.name in done["sources"] and target.is_file():
            continue
        began = time.perf_counter()
        symmetric = source.name in symmetric_sources
        pairs = [{k: v for k, v in p.items() if k != "source"} for p in mixture.source_pairs(index)]
        mined, stats = mine_source(
            pairs,
            chosen,
            _side(encoder, "query", symmetric, embed_batch_size),
            _side(encoder, "document", symmetric, embed_batch_size),
            config,
        )
        atomic_write_text(target, "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in mined))
        done["sources"][source.name] = {**stats, "seconds": round(time.perf_counter() - began, 1)}
        atomic_write_json(record, done)
        logger.info("%s: %s", source.name, done["sources"][source.name])
    return done


def _side(encoder, name: str, symmetric: bool, batch_size: int):
    """texts -> vectors as training embeds one side: no prompt on symmetric sources, else the adapter's ``name``
    prompt (none if it has no such prompt)."""
    prompt = "" if symmetric or name not in encoder.spec.prompt_map else encoder.spec.prompt(name)
    return lambda texts: encoder.encode(texts, batch_size=batch_size, prompt=prompt, show_progress=len(texts) > 256)
