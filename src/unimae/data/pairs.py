"""Supervised (query, positive[, negative]) pairs: files, a weighted mixture of sources, one source per batch.

``--method contrastive`` reads one or more JSONL files of ``{"query", "positive"[, "negative"]}`` records:

- ``--data a.jsonl,b.jsonl`` (comma-separated) or ``--data mixture.yaml`` (YAML or JSON: a list of
  ``{"path", "weight"}`` entries, or ``{"sources": [...]}``; relative paths are relative to the file).
- Weights: ``--data-weights 2,1`` (one number per source, overrides the file), ``size`` (proportional to
  the number of pairs), ``sqrt`` (to its square root), or empty (the file's weights, else ``size``).
  A source of weight 0 is loaded (and checked) but never sampled.

Each pair keeps the name of its source (``"source"``: the file name without ``.jsonl``), by which
``--symmetric-sources`` chooses the pairs that take no prompts.

Every global batch is drawn from ONE source (harder in-batch negatives; sentence-transformers' multi-dataset
practice): :class:`SourceBatchOrder` chooses the source of batch ``k`` by weighted sampling as a pure
function of ``(seed, k)``, and takes that source's pairs without replacement from a per-epoch permutation
(the remainder of an epoch that does not fill a batch is skipped, so a batch never holds a pair twice).
Resume and any split over processes therefore see the same batches.

:func:`pair_groups` finds false negatives inside a batch: rows whose texts are linked (the same query, the
same positive, a reversed paraphrase pair ...) fall in one group and are left out of each other's softmax.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from unimae.data.corpus import CorpusError, jsonl_records

MIXTURE_SUFFIXES = (".yaml", ".yml", ".json")
WEIGHT_RULES = ("size", "sqrt")


def load_pairs(path: str | Path) -> list[dict]:
    """(query, positive[, negative]) records of a JSONL file; a clear error names a bad line."""
    file = Path(path)
    if file.suffix != ".jsonl" or not file.is_file():
        raise CorpusError(
            f"--method contrastive needs --data FILE.jsonl (or several, comma-separated, or a .yaml/.json "
            f"mixture file) with query, positive and optional negative fields; {str(path)!r} is not such a file"
        )
    records = []
    # UTF-8, JSON, a string query and text (no lone surrogate) in every field, per line
    for number, record in jsonl_records(file, "query", text_fields=("positive", "negative")):
        missing = [k for k in ("query", "positive") if not isinstance(record.get(k), str) or not record[k].strip()]
        if missing:
            raise CorpusError(f"{file}, line {number}: missing or empty field(s) {missing}")
        negative = record.get("negative")
        if negative is not None and not isinstance(negative, str):
            raise CorpusError(f"{file}, line {number}: 'negative' must be a string")
        row = {"query": record["query"], "positive": record["positive"]}
        if negative and negative.strip():
            row["negative"] = negative
        records.append(row)
    if len(records) < 2:
        raise CorpusError(f"{file}: needs at least 2 pairs for in-batch negatives, found {len(records)}")
    return records


@dataclass
class Source:
    """One file of pairs and its sampling weight (``None``: not given, the weight rule decides)."""

    path: Path
    weight: float | None = None

    @property
    def name(self) -> str:
        """The file name without ``.jsonl``: how ``--symmetric-sources`` and each pair's ``source`` name it."""
        return self.path.name.removesuffix(".jsonl")


def parse_sources(data: str) -> list[Source]:
    """``--data`` -> sources: one JSONL file, comma-separated JSONL files, or a YAML/JSON mixture file."""
    if Path(data).suffix in MIXTURE_SUFFIXES:
        return _read_mixture(Path(data))
    paths = [p.strip() for p in data.split(",") if p.strip()]
    if not paths:
        raise CorpusError("--method contrastive needs --data: one or more JSONL files of pairs")
    return [Source(Path(p)) for p in paths]


def _read_mixture(file: Path) -> list[Source]:
    if not file.is_file():
        raise CorpusError(f"mixture file {file} does not exist")
    text = file.read_text(encoding="utf-8")
    try:
        if file.suffix == ".json":
            values = json.loads(text)
        else:
            import yaml

            try:
                values = yaml.safe_load(text)
            except yaml.YAMLError as err:  # not a ValueError
                raise ValueError(str(err)) from err
    except (ValueError, ImportError) as err:  # json parse errors are ValueErrors
        raise CorpusError(f"mixture file {file} cannot be parsed: {err}") from err
    entries = values.get("sources") if isinstance(values, dict) else values
    how = "a list of {path, weight} entries (or {sources: [...]})"
    if not isinstance(entries, list) or not entries:
        raise CorpusError(f"mixture file {file}: expected {how}")
    sources = []
    for number, entry in enumerate(entries, start=1):
        entry = {"path": entry} if isinstance(entry, str) else entry
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or set(entry) - {"path", "weight"}:
            raise CorpusError(f"mixture file {file}, entry {number}: expected {how}, got {entry!r}")
        weight = entry.get("weight")
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, int | float)):
            raise CorpusError(f"mixture file {file}, entry {number}: weight must be a number, got {weight!r}")
        path = Path(entry["path"]).expanduser()
        sources.append(Source(path if path.is_absolute() else file.parent / path, weight))
    given = [s.weight is not None for s in sources]
    if any(given) and not all(given):
        raise CorpusError(f"mixture file {file}: give a weight for every entry or for none")
    return sources


def resolve_weights(sources: list[Source], sizes: list[int], rule: str) -> list[float]:
    """Sampling weight per source from ``--data-weights`` (numbers, 'size', 'sqrt' or '') and the file's."""
    rule = rule.strip()
    if rule and rule not in WEIGHT_RULES:
        try:
            weights = [float(w) for w in rule.split(",")]
        except ValueError:
            raise CorpusError(
                f"--data-weights {rule!r}: give one number per --data file (comma-separated), 'size' or 'sqrt'"
            ) from None
        if len(weights) != len(sources):
            raise CorpusError(f"--data-weights has {len(weights)} numbers for {len(sources)} --data sources")
    elif not rule and sources[0].weight is not None:
        weights = [float(s.weight) for s in sources]
    elif rule == "sqrt":
        weights = [math.sqrt(n) for n in sizes]
    else:
        weights = [float(n) for n in sizes]
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise CorpusError(f"data weights must be >= 0 with a positive sum, got {weights}")
    return weights


@dataclass
class Mixture:
    """All pairs, concatenated source after source (``sizes[s]`` of source ``s``; :class:`SourceBatchOrder`
    turns those into offsets), and each source's sampling weight."""

    sources: list[Source]
    pairs: list[dict]
    sizes: list[int]
    weights: list[float]

    def order(self, batch_size: int, seed: int) -> SourceBatchOrder:
        return SourceBatchOrder(self.sizes, self.weights, batch_size, seed)

    def source_pairs(self, index: int) -> list[dict]:
        """The pairs of source ``index``, in file order."""
        start = source_offsets(self.sizes)[index]
        return self.pairs[start : start + self.sizes[index]]

    def describe(self) -> str:
        total = sum(self.weights)
        return ", ".join(
            f"{s.path.name}: {n} pairs, p={w / total:.3f}"
            for s, n, w in zip(self.sources, self.sizes, self.weights, strict=True)
        )


def load_mixture(data: str, weights: str, batch_size: int) -> Mixture:
    """Read every source of ``--data`` and resolve the weights; a sampled source must fill a batch."""
    sources = parse_sources(data)
    seen = set()
    for source in sources:
        if source.path.resolve() in seen:
            raise CorpusError(f"--data lists {source.path} twice; give it a larger weight instead")
        seen.add(source.path.resolve())
    per_source = [load_pairs(s.path) for s in sources]
    sizes = [len(p) for p in per_source]
    resolved = resolve_weights(sources, sizes, weights)
    for source, size, weight in zip(sources, sizes, resolved, strict=True):
        if weight > 0 and size < batch_size:
            raise CorpusError(
                f"{source.path} has {size} pairs, fewer than --batch-size {batch_size}: every batch is drawn "
                "from one source; lower --batch-size, merge the file with another, or give it weight 0"
            )
    pairs = [{**pair, "source": source.name} for source, rows in zip(sources, per_source, strict=True) for pair in rows]
    return Mixture(sources, pairs, sizes, resolved)


def source_offsets(sizes: list[int]) -> list[int]:
    """Where each source starts in the concatenated pairs: ``[0, sizes[0], sizes[0] + sizes[1], ...]``."""
    return [sum(sizes[:i]) for i in range(len(sizes))]


class SourceBatchOrder:
    """Global example index -> index into the concatenated pairs; every global batch comes from ONE source.

    Batch ``k`` (examples ``k*B .. k*B+B-1``) is drawn from source ``source_of(k)``, sampled with the weights
    as a pure function of ``(seed, k)`` (blocks of draws from seeded generators); it is that source's ``n``-th
    batch (``n`` = earlier batches of the same source) and holds positions ``b*B .. b*B+B-1`` of the
    permutation of the source's epoch ``e``, where ``(e, b) = divmod(n, size // B)``.
    """

    BLOCK = 1024  # steps per block of source draws

    def __init__(self, sizes: list[int], weights: list[float], batch_size: int, seed: int):
        if any(w > 0 and n < batch_size for n, w in zip(sizes, weights, strict=True)):
            raise ValueError(f"every source with a weight > 0 must fill a batch of {batch_size}: sizes {sizes}")
        self.sizes, self.batch_size, self.seed = sizes, batch_size, seed
        self.offsets = source_offsets(sizes)
        self.batches_per_epoch = [n // batch_size for n in sizes]
        self.probs = torch.tensor(weights, dtype=torch.float64)
        self._sources: list[int] = []  # source of every batch drawn so far
        self._ordinals: list[int] = []  # its count among earlier batches of that source
        self._counts = [0] * len(sizes)
        self._perms: dict[tuple[int, int], list[int]] = {}

    def _extend(self, step: int) -> None:
        while len(self._sources) <= step:
            block = len(self._sources) // self.BLOCK
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + block)
            for source in torch.multinomial(self.probs, self.BLOCK, replacement=True, generator=gen).tolist():
                self._sources.append(source)
                self._ordinals.append(self._counts[source])
                self._counts[source] += 1

    def source_of(self, step: int) -> int:
        """The source index of global batch ``step`` (0-based; the log's step ``step + 1``)."""
        self._extend(step)
        return self._sources[step]

    def text_index(self, example: int) -> int:
        step, offset = divmod(example, self.batch_size)
        self._extend(step)
        source, n = self._sources[step], self._ordinals[step]
        epoch, batch = divmod(n, self.batches_per_epoch[source])
        return self.offsets[source] + self._perm(source, epoch)[batch * self.batch_size + offset]

    def _perm(self, source: int, epoch: int) -> list[int]:
        key = (source, epoch)
        if key not in self._perms:
            if len(self._perms) > 64:  # batches move forward: old epochs are not asked for again
                self._perms.clear()
            gen = torch.Generator().manual_seed(self.seed + 7919 * epoch + 104_729 * (source + 1))
            self._perms[key] = torch.randperm(self.sizes[source], generator=gen).tolist()
        return self._perms[key]


def pair_groups(records: list[dict]) -> tuple[list[int], list[int]]:
    """Groups of a batch's rows and of its hard negatives (in collate order: rows with a negative).

    Texts are linked through each row's (query, positive); rows whose texts connect (a shared query or
    positive, a reversed paraphrase pair, chains of these) share a group, so one row's positive is not
    another's negative. A hard negative takes the group of an equal query/positive text in the batch, else
    a group of its own. Returns (group per row, group per hard negative).
    """
    parent: dict[str, str] = {}

    def find(text: str) -> str:
        while parent[text] != text:
            parent[text] = parent[parent[text]]
            text = parent[text]
        return text

    for r in records:
        for text in (r["query"], r["positive"]):
            parent.setdefault(text, text)
        parent[find(r["query"])] = find(r["positive"])
    ids: dict[str, int] = {}
    rows = [ids.setdefault(find(r["query"]), len(ids)) for r in records]
    negatives = []
    for r in records:
        if r.get("negative"):
            root = find(r["negative"]) if r["negative"] in parent else None
            negatives.append(ids[root] if root in ids else len(ids) + len(negatives))
    return rows, negatives


def sample_pair_texts(data: str, per_source: int, seed: int = 0) -> list[str]:
    """Both texts (query, positive) of ``per_source`` pairs drawn from each source of ``data`` (``--data`` of the
    contrastive method: JSONL files or a mixture file), seeded; a source with fewer pairs gives all of them."""
    rng = random.Random(seed)
    texts = []
    for source in parse_sources(data):
        pairs = load_pairs(source.path)
        for pair in rng.sample(pairs, min(per_source, len(pairs))):
            texts += [pair["query"], pair["positive"]]
    return texts
