"""``--method simcse``: InfoNCE between two dropout views of each text, in-batch negatives (Gao et al. 2021).

Trains (and embeds with) the ``--init-adapter``'s spec, e.g. causal ``eos`` after UniMAE or bidirectional
``mean`` after MNTP; ``--pooling`` overrides the pooling.
"""

from __future__ import annotations

from dataclasses import dataclass

from unimae.embedding.spec import EmbeddingSpec
from unimae.losses.simcse import SimCSEObjective
from unimae.training.methods.base import Method, ViewDropoutMixin, pooled_batch
from unimae.training.methods.options import DropoutViewOptions, pooling_field
from unimae.training.methods.registry import register_method


@dataclass
class SimCSEOptions(DropoutViewOptions):
    """Unsupervised SimCSE: the temperature, the views' dropout and the pooling to train."""

    full_batch_recipes = ("paper",)

    pooling: str = pooling_field()


def init_spec_with_pooling(pooling: str, ctx) -> EmbeddingSpec:
    """The init adapter's spec (causal eos without one), with ``pooling`` unless it is 'auto'."""
    return ctx.init_spec if pooling == "auto" else ctx.init_spec.with_pooling(pooling)


@register_method
class SimCSE(ViewDropoutMixin, Method):
    """Batches: input_ids, attention_mask, pool_mask (B, T); the objective runs each row twice."""

    name = "simcse"
    options_class = SimCSEOptions

    def build_objective(self, llm):
        return SimCSEObjective(llm, self.options.temperature, self.embedding_spec().attention)

    def collate(self, texts, indices):
        return pooled_batch(self.ctx.tokenizer, texts, self.config.max_length, self.embedding_spec())

    def embedding_spec(self) -> EmbeddingSpec:
        return init_spec_with_pooling(self.options.pooling, self.ctx)
