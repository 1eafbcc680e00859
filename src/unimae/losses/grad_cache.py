"""Gradient cache for the supervised contrastive objective: a batch far larger than one forward graph.

Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup" (arXiv:2101.06983);
sentence-transformers' ``CachedMultipleNegativesRankingLoss``. InfoNCE couples every text of the
batch, so a batch of 256 pairs would need one forward graph over 512+ texts. Instead (1) embed all texts
without a graph, in chunks, (2) compute the loss on the (N, D) embeddings and its gradient g = dL/dz,
(3) re-run each chunk with a graph and back-propagate ``sum(z_chunk * g_chunk)``, whose parameter gradient
is the chunk's share of dL/dtheta. The sum over chunks is the one-big-batch gradient; memory is one chunk's
graph. Each chunk's RNG state is saved before (1) and restored before (3), so dropout draws the same masks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from unimae.losses.supervised_contrastive import ContrastiveObjective


class _RngState:
    """The CPU (and current CUDA device's) RNG state, to replay dropout exactly (sentence-transformers' RandContext)."""

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)


class GradCacheContrastiveObjective(ContrastiveObjective):
    """:class:`ContrastiveObjective` with a gradient cache over chunks of ``chunk_size`` texts (see the module doc).

    ``forward_backward(batch, backward)`` leaves the same parameter gradients as ``backward(forward(batch)
    ["loss"])`` (tested), with one chunk's graph in memory at a time, for one extra no-grad forward. Texts
    are chunked in order of length, so a chunk carries little padding. In-batch negatives span the batch
    handed in, so the trainer's micro-batch must be the whole batch, on one process. The LM term needs no
    cache: it is a sum over texts, so each chunk back-propagates its own share with its graph in step (3).
    """

    runs_own_backward = True

    def __init__(self, llm: nn.Module, *args, chunk_size: int = 32, **kwargs):
        super().__init__(llm, *args, **kwargs)
        if chunk_size < 1:
            raise ValueError(f"the gradient cache needs a chunk size >= 1, got {chunk_size}")
        self.chunk_size = chunk_size

    def forward_backward(self, batch, backward: Callable[[torch.Tensor], None]) -> dict[str, torch.Tensor]:
        lengths = batch["attention_mask"].sum(1)  # (N,)
        order = torch.argsort(lengths, descending=True, stable=True)  # longest first: peak memory shows at once
        chunks = list(order.split(self.chunk_size))
        states, parts = [], []
        with torch.no_grad():
            for rows in chunks:  # (1) embeddings without a graph
                states.append(_RngState())
                parts.append(self.embed(batch, rows))
        after = _RngState()
        z = torch.empty(len(order), parts[0].shape[-1], device=parts[0].device)  # (N, D)
        z[order] = torch.cat(parts)
        z.requires_grad_(True)
        with torch.enable_grad():
            loss = self.loss(z, batch)
            (grad,) = torch.autograd.grad(loss, z)  # (2) (N, D) dL/dz: the cache
        lm = torch.zeros((), device=z.device)
        for rows, state in zip(chunks, states, strict=True):
            state.restore()  # same dropout masks as in (1)
            part, lm_part = self.embed_and_lm(batch, rows)  # (3) one chunk with its graph; its share of L_LM
            backward((part * grad[rows]).sum() + lm_part)
            lm = lm + lm_part.detach()
        after.restore()
        out = {"loss": (loss + lm).detach(), "contrastive": loss.detach()}
        return {**out, "lm": lm / self.lm_weight} if self.lm_weight else out
