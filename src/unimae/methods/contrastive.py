"""``--method contrastive``: supervised InfoNCE on (query, positive[, negative]) pairs (UniMAE App. D).

In-batch negatives plus the hard negatives of the batch, without the batch's known false negatives
(``--mask-false-negatives``); ``--symmetric-loss`` adds the positive -> queries direction; ``--lm-weight``
adds a next-token loss on the positives (GritLM's joint objective), so that the adapter keeps generating.
``--data`` takes several files (or a mixture file) with ``--data-weights``; every global batch is drawn from one source
(:mod:`unimae.data.pairs`). ``--grad-cache-chunk N`` embeds the batch in chunks of N texts with a gradient cache,
so large batches fit in memory. Trains (and embeds with) the ``--init-adapter``'s spec, as SimCSE does:
causal attention and the [EOS] state after UniMAE, so generation and KV reuse are unchanged.

Prompts (``--query-prompt``, ``--document-prompt``): the queries (and documents) of every source but
``--symmetric-sources`` are embedded after the prompt's text; a symmetric source's pairs (paraphrases, NLI)
take none, as texts are embedded outside retrieval. The prompts are saved in the adapter's spec.
``--matryoshka-dims`` sums InfoNCE over the full vector and each truncated prefix (see
:class:`~unimae.losses.supervised_contrastive.ContrastiveObjective`); the dimensions are saved in the spec as well.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from unimae.data.pairs import Mixture, SourceBatchOrder, load_mixture, load_pairs, pair_groups
from unimae.embedding.spec import EmbeddingSpec
from unimae.losses.grad_cache import GradCacheContrastiveObjective
from unimae.losses.supervised_contrastive import ContrastiveObjective
from unimae.methods.base import Context, Method, pooled_batch
from unimae.methods.registry import register_method
from unimae.methods.simcse import init_spec_with_pooling

if TYPE_CHECKING:
    from unimae.training.config import TrainConfig

__all__ = ["Contrastive", "load_pairs"]

logger = logging.getLogger(__name__)


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@register_method
class Contrastive(Method):
    """Batches: rows = B queries, B positives, then the hard negatives; ``num_queries`` = B;
    ``false_negatives`` (B, B + K) bool when ``--mask-false-negatives``."""

    name = "contrastive"

    def __init__(self, config: TrainConfig, ctx: Context):
        super().__init__(config, ctx)
        self.mixture: Mixture | None = None
        chunk = config.grad_cache_chunk
        if chunk < 0:
            raise ValueError(f"--grad-cache-chunk must be >= 0 (0 = off), got {chunk}")
        if chunk and config.micro_batch_size != config.batch_size:
            raise ValueError(
                f"--grad-cache-chunk needs --micro-batch-size equal to --batch-size ({config.batch_size}, got "
                f"{config.micro_batch_size}): the gradient cache is what splits the batch, and in-batch negatives "
                "must span the whole batch"
            )
        if chunk and _world_size() > 1:
            raise ValueError(
                "--grad-cache-chunk runs on one process: split over processes, each would see only its shard's "
                "negatives and run several backward passes per step under DDP; drop the launcher (use --threads) "
                "or set --grad-cache-chunk 0"
            )

        self.matryoshka_dims = parse_dims(config.matryoshka_dims)
        self.symmetric = {name.strip() for name in config.symmetric_sources.split(",") if name.strip()}

    def load_data(self) -> list[dict]:
        self.mixture = load_mixture(self.config.data, self.config.data_weights, self.config.batch_size)
        names = {source.name for source in self.mixture.sources}
        unknown = sorted(self.symmetric - names)
        if unknown:
            raise ValueError(
                f"--symmetric-sources names {unknown}, which are not among the --data sources {sorted(names)}"
            )
        logger.info("contrastive pairs: %s", self.mixture.describe())
        return self.mixture.pairs

    def example_order(self, num_examples: int, seed: int) -> SourceBatchOrder:
        """One source per global batch (needs ``load_data`` first)."""
        if self.mixture is None or len(self.mixture.pairs) != num_examples:
            raise RuntimeError("Contrastive.example_order needs the pairs of load_data()")
        return self.mixture.order(self.config.batch_size, seed)

    def build_objective(self, llm):
        c = self.config
        args = (llm, c.temperature, self.embedding_spec().attention, c.symmetric_loss)
        kwargs = {"lm_weight": c.lm_weight, "lm_texts": c.lm_texts, "ce_chunk_size": c.ce_chunk_size}
        if self.matryoshka_dims:
            kwargs["matryoshka_dims"] = self.matryoshka_dims
        if c.grad_cache_chunk:
            return GradCacheContrastiveObjective(*args, chunk_size=c.grad_cache_chunk, **kwargs)
        return ContrastiveObjective(*args, **kwargs)

    def collate(self, records, indices):
        query, document = self._prompts(r.get("source") for r in records)
        texts = [query + r["query"] for r in records] + [document + r["positive"] for r in records]
        texts += [document + r["negative"] for r in records if r.get("negative")]
        extra = {"num_queries": len(records)}
        if self.config.mask_false_negatives:
            rows, negatives = pair_groups(list(records))
            groups, candidates = torch.tensor(rows), torch.tensor(rows + negatives)
            extra["false_negatives"] = groups[:, None] == candidates[None, :]  # (B, B + K); diagonal kept by info_nce
        return pooled_batch(self.ctx.tokenizer, texts, self.config.max_length, self.embedding_spec(), **extra)

    def _prompts(self, sources) -> tuple[str, str]:
        """(query prefix, document prefix) of a batch: '' for a symmetric source's pairs (a batch is one source)."""
        if set(sources) & self.symmetric:
            return "", ""
        return self.config.query_prompt, self.config.document_prompt

    def embedding_spec(self) -> EmbeddingSpec:
        spec = init_spec_with_pooling(self.config, self.ctx)
        prompts = {**spec.prompt_map}
        if self.config.query_prompt or self.config.document_prompt:
            prompts.update(query=self.config.query_prompt, document=self.config.document_prompt)
        dims = self.matryoshka_dims or spec.matryoshka_dims
        return dataclasses.replace(spec, prompts=tuple(prompts.items()), matryoshka_dims=dims)


def parse_dims(text: str) -> tuple[int, ...]:
    """``--matryoshka-dims`` '64,128,256' -> (64, 128, 256); '' -> ()."""
    try:
        dims = tuple(sorted({int(d) for d in text.split(",") if d.strip()}))
    except ValueError:
        raise ValueError(f"--matryoshka-dims takes comma-separated integers such as 64,128,256, got {text!r}") from None
    if any(d < 1 for d in dims):
        raise ValueError(f"--matryoshka-dims must be positive, got {text!r}")
    return dims
