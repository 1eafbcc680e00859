"""unimae's Encoder as an ``mteb`` 2.x model, with the on-disk embedding cache in front of it.

mteb hands ``encode`` a DataLoader of batches (``batch["text"]``); we gather the texts, look them
up in the cache and embed only the missing ones with ``Encoder.encode`` (length-sorted batches).

Prompts: the adapter's own (its spec's ``prompts``, e.g. ``query`` and ``document``) become the model's
``model_prompts``, and mteb's rule picks one per call (``get_prompt_name``: task name + prompt type, task
name, task type + prompt type, task type, prompt type): a retrieval task's queries get the ``query`` prompt,
its corpus the ``document`` prompt, and tasks without a prompt type (STS, classification, clustering, pair
classification) none. An adapter without prompts embeds every text as it is, as in the UniMAE paper.
"""

from __future__ import annotations

import numpy as np
from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ModelMeta, ScoringFunction

from unimae.embedding.spec import with_prompt
from unimae.embedding.vectors import matryoshka_prefix
from unimae.encoder import Encoder
from unimae.evaluation.embedding_cache import EmbeddingCache


class MTEBEncoder(AbsEncoder):
    """Wrap ``Encoder`` for ``mteb.evaluate``; cosine similarity; float32 output."""

    def __init__(
        self,
        encoder: Encoder,
        name: str,
        revision: str,
        cache: EmbeddingCache | None = None,
        batch_size: int = 32,
        dimensions: int | None = None,
    ):
        if dimensions is not None and not 1 <= dimensions <= encoder.embedding_dim:
            raise ValueError(f"dimensions must be from 1 to {encoder.embedding_dim}, got {dimensions}")
        self.encoder, self.dimensions = encoder, dimensions
        self.cache = cache
        self.batch_size = batch_size
        self.model_prompts = self.validate_task_to_prompt_name(encoder.spec.prompt_map) or {}
        self.mteb_model_meta = ModelMeta(
            loader=None,
            name=name if "/" in name else f"unimae/{name}",
            revision=revision,
            release_date=None,
            languages=["eng-Latn"],
            n_parameters=sum(p.numel() for p in encoder.model.parameters()),
            memory_usage_mb=None,
            max_tokens=encoder.max_length,
            embed_dim=dimensions or encoder.embedding_dim,
            license=None,
            open_weights=True,
            public_training_code=None,
            public_training_data=None,
            framework=["PyTorch"],
            similarity_fn_name=ScoringFunction.COSINE,
            use_instructions=bool(self.model_prompts),
            training_datasets=None,
        )

    def _embed(self, texts: list[str]) -> np.ndarray:
        return self.encoder.encode(texts, batch_size=self.batch_size, show_progress=len(texts) > 2000)

    def encode(self, inputs, *, task_metadata, hf_split, hf_subset, prompt_type=None, **kwargs) -> np.ndarray:
        texts = [text for batch in inputs for text in batch["text"]]
        name = self.get_prompt_name(task_metadata, prompt_type) if self.model_prompts else None
        texts = with_prompt(texts, self.model_prompts[name] if name else "")  # cached under prompt + text
        vectors = self._embed(texts) if self.cache is None else self.cache.get_or_compute(texts, self._embed)
        # (N, k): cosine needs no re-norm; the adapter's rotation first, if it has one
        return matryoshka_prefix(vectors, self.dimensions, self.encoder.rotation)
