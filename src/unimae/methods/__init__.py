"""Training methods: each is a :class:`~unimae.methods.base.Method` (data, collator, objective, embedding
spec) in its own module, plugged into ONE trainer.

=============  ======================================  ==================  ===============
method         objective                               data                embeds with
=============  ======================================  ==================  ===============
unimae         alpha * L_MAR + L_MRC (UniMAE Eq. 6)    text                causal, eos
mntp           masked NTP, bidirectional (LLM2Vec)     text                bidirectional, mean
simcse         InfoNCE of two dropout views            text                the init adapter's (or eos)
contrastive    InfoNCE, in-batch + hard negatives      (query, positive    the init adapter's (or eos)
                                                       [, negative]) JSONL
gem            (1 - a) NTP + a InfoNCE, summary tokens text                gem, summary
=============  ======================================  ==================  ===============

The adapter records how it embeds (its :class:`~unimae.embedding.spec.EmbeddingSpec`, ``embedding`` in
unimae.json), so ``Encoder.from_pretrained(..., adapter)`` uses the right attention and pooling. Add a
method with a new module here and ``@register_method``.
"""

from unimae.methods import contrastive, gem, mntp, simcse, unimae  # noqa: F401  (registers the methods)
from unimae.methods.base import Context, Method
from unimae.methods.contrastive import load_pairs
from unimae.methods.gem import summary_tokens
from unimae.methods.registry import METHOD_REGISTRY, get_method, register_method

__all__ = ["METHOD_REGISTRY", "Context", "Method", "get_method", "load_pairs", "register_method", "summary_tokens"]
