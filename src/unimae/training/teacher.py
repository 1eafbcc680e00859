"""The teacher of ``--distill-teacher``: a sentence-transformers embedding model's cosine similarities of a batch's
texts, the targets of :func:`~unimae.losses.distillation.in_batch_distillation`.

The teacher embeds the texts as they are in the pairs (no unimae prompt: those belong to the student), cut to the
student's ``--max-length`` tokens (or the teacher's own limit, if lower), without gradients, on the training's
device. sentence-transformers comes with the ``eval`` extra.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

Encode = Callable[[list[str]], torch.Tensor]  # texts -> (len(texts), D) embeddings


class Teacher:
    """``scores(queries, candidates)`` -> (B, N) and ``similarities(texts)`` -> (M, M) cosine similarities, from
    ``encode`` (texts -> embeddings)."""

    def __init__(self, encode: Encode):
        self.encode = encode

    @torch.no_grad()
    def scores(self, queries: Sequence[str], candidates: Sequence[str]) -> torch.Tensor:
        z = F.normalize(self.encode([*queries, *candidates]).float(), dim=-1)  # (B + N, D)
        b = len(queries)
        return z[:b] @ z[b:].T  # (B, N)

    @torch.no_grad()
    def similarities(self, texts: Sequence[str]) -> torch.Tensor:
        """(M, M) cosine similarities of every text with every other (``--distill-loss similarity``)."""
        z = F.normalize(self.encode(list(texts)).float(), dim=-1)  # (M, D)
        return z @ z.T


def load_teacher(name: str, max_length: int, device: str | torch.device = "cpu") -> Teacher:
    """A sentence-transformers model (a folder or a Hub id) as a :class:`Teacher`, its texts cut to
    ``max_length`` tokens (or its own limit)."""
    from unimae.evaluation.reference import load_sentence_transformer

    model = load_sentence_transformer(name, str(device), "--distill-teacher")
    model.max_seq_length = min(max_length, model.max_seq_length or max_length)
    model.eval()
    logger.info(
        "distillation teacher %s (%d dimensions, texts cut to %d tokens)",
        name,
        _dimension(model),
        model.max_seq_length,
    )

    def encode(texts: list[str]) -> torch.Tensor:
        return model.encode(texts, batch_size=64, convert_to_tensor=True, show_progress_bar=False)

    return Teacher(encode)


def _dimension(model) -> int:
    """A sentence-transformers model's embedding size (``get_embedding_dimension`` since 5.x, the older name before)."""
    get = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    return get() or 0
