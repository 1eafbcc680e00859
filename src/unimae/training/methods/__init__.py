"""Training methods: each is a :class:`~unimae.training.methods.base.Method` (data, collator, objective, embedding
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

Each module also holds its method's options (``UniMAEOptions``, ``GEMOptions``, ...; shared ones in
:mod:`unimae.training.methods.options`), nested in ``TrainConfig.options``. The adapter records how it embeds (its
:class:`~unimae.embedding.spec.EmbeddingSpec`, ``embedding`` in unimae.json), so
``Encoder.from_pretrained(..., adapter)`` uses the right attention and pooling. Add a method with a new module
here and ``@register_method``.
"""

from unimae.training.methods import contrastive, gem, mntp, simcse, unimae  # noqa: F401  (registers the methods)
from unimae.training.methods.base import Context, Method
from unimae.training.methods.contrastive import ContrastiveOptions, load_pairs
from unimae.training.methods.gem import GEMOptions, summary_tokens
from unimae.training.methods.mntp import MNTPOptions
from unimae.training.methods.registry import METHOD_REGISTRY, get_method, register_method
from unimae.training.methods.simcse import SimCSEOptions
from unimae.training.methods.unimae import UniMAEOptions

__all__ = [
    "METHOD_REGISTRY",
    "Context",
    "ContrastiveOptions",
    "GEMOptions",
    "MNTPOptions",
    "Method",
    "SimCSEOptions",
    "UniMAEOptions",
    "get_method",
    "load_pairs",
    "register_method",
    "summary_tokens",
]
