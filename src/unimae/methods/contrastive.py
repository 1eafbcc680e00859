"""``--method contrastive``: supervised InfoNCE on (query, positive[, negative]) pairs (UniMAE App. D).

In-batch negatives plus the hard negatives of the batch. Trains (and embeds with) the ``--init-adapter``'s
spec, as SimCSE does.
"""

from __future__ import annotations

from pathlib import Path

from unimae.corpus import CorpusError, jsonl_records
from unimae.embedding_spec import EmbeddingSpec
from unimae.methods.base import Method, pooled_batch
from unimae.methods.registry import register_method
from unimae.methods.simcse import init_spec_with_pooling


def load_pairs(path: str) -> list[dict]:
    """(query, positive[, negative]) records of a JSONL file; a clear error names a bad line."""
    file = Path(path)
    if file.suffix != ".jsonl" or not file.is_file():
        raise CorpusError(
            f"--method contrastive needs --data FILE.jsonl with query, positive and optional negative fields; "
            f"{path!r} is not such a file (recipes/make_pairs.py builds one from STSBenchmark train)"
        )
    records = []
    for number, record in jsonl_records(file, "query"):  # UTF-8, JSON and a string query, per line
        missing = [k for k in ("query", "positive") if not isinstance(record.get(k), str) or not record[k].strip()]
        if missing:
            raise CorpusError(f"{file}, line {number}: missing or empty field(s) {missing}")
        if "negative" in record and not isinstance(record["negative"], str):
            raise CorpusError(f"{file}, line {number}: 'negative' must be a string")
        records.append(record)
    if len(records) < 2:
        raise CorpusError(f"{file}: needs at least 2 pairs for in-batch negatives, found {len(records)}")
    return records


@register_method
class Contrastive(Method):
    """Batches: rows = B queries, B positives, then the hard negatives; ``num_queries`` = B."""

    name = "contrastive"

    def load_data(self) -> list[dict]:
        return load_pairs(self.config.data)

    def build_objective(self, llm):
        from unimae.losses.simcse import ContrastiveObjective

        return ContrastiveObjective(llm, self.config.temperature, self.embedding_spec().attention)

    def collate(self, records, indices):
        texts = [r["query"] for r in records] + [r["positive"] for r in records]
        texts += [r["negative"] for r in records if r.get("negative")]
        spec = self.embedding_spec()
        return pooled_batch(self.ctx.tokenizer, texts, self.config.max_length, spec, num_queries=len(records))

    def embedding_spec(self) -> EmbeddingSpec:
        return init_spec_with_pooling(self.config, self.ctx)
