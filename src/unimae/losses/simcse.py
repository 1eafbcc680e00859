"""Contrastive objectives on pooled embeddings: unsupervised SimCSE and supervised (query, positive, negative).

SimCSE (Gao et al. 2021): every text passes twice in one forward (the batch doubled); dropout set by
the trainer (``--dropout-on``: attention by default, as LLM2Vec's SimCSE stage; or LoRA) makes the two views differ;
view 2 of text i is the positive of view 1, the other texts are negatives (InfoNCE, temperature 0.05).
Supervised (UniMAE App. D): queries against their positives, with the other positives and the hard
negatives as negatives (optionally symmetric, minus known false negatives). Both pool with any rule/attention.

Gradient cache (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited
Setup"; sentence-transformers' ``CachedMultipleNegativesRankingLoss``): InfoNCE couples every text of the
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

from unimae.losses.contrastive import info_nce
from unimae.losses.objective import Objective
from unimae.pooling import pooled_forward


class SimCSEObjective(Objective):
    """forward(batch) -> {"loss", "simcse"}; batch: input_ids, attention_mask, pool_mask (B, T)."""

    def __init__(self, llm: nn.Module, temperature: float = 0.05, attention: str = "causal"):
        super().__init__(llm)
        self.temperature, self.attention = temperature, attention

    def forward(self, batch) -> dict[str, torch.Tensor]:
        ids, mask, pool_mask = (torch.cat([batch[k], batch[k]]) for k in ("input_ids", "attention_mask", "pool_mask"))
        z = pooled_forward(self.llm, ids, mask, pool_mask, self.attention)  # (2B, D) two dropout views
        half = z.shape[0] // 2
        loss = info_nce(z[:half], z[half:], self.temperature)
        return {"loss": loss, "simcse": loss.detach()}


class ContrastiveObjective(Objective):
    """forward(batch) -> {"loss", "contrastive"}; batch rows: B queries, B positives, then K hard negatives.

    Batch keys: input_ids, attention_mask, pool_mask (2B + K, T), ``num_queries`` = B, and optionally
    ``false_negatives`` (B, B + K) bool: candidates left out of query i's softmax. ``symmetric``: also each
    positive against the queries (``info_nce(..., symmetric=True)``).
    """

    def __init__(self, llm: nn.Module, temperature: float = 0.05, attention: str = "causal", symmetric: bool = False):
        super().__init__(llm)
        self.temperature, self.attention, self.symmetric = temperature, attention, symmetric

    def loss(self, z: torch.Tensor, batch) -> torch.Tensor:
        """Pooled embeddings z (2B + K, D) of ``batch``'s rows -> the InfoNCE loss."""
        b = int(batch["num_queries"])
        exclude = batch.get("false_negatives")
        return info_nce(z[:b], z[b:], self.temperature, exclude=exclude, symmetric=self.symmetric)  # (B, D) vs (B+K, D)

    def embed(self, batch, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """Pooled embeddings (len(rows), D) of some rows of ``batch``, padding columns they all share cut off."""
        mask = batch["attention_mask"][rows]  # (R, T)
        used = mask.any(0).nonzero()
        cols = slice(int(used.min()), int(used.max()) + 1)  # positions come from the mask: cutting pads is exact
        ids, pool_mask = batch["input_ids"][rows][:, cols], batch["pool_mask"][rows][:, cols]
        return pooled_forward(self.llm, ids, mask[:, cols], pool_mask, self.attention)

    def forward(self, batch) -> dict[str, torch.Tensor]:
        z = self.embed(batch)  # (2B + K, D)
        loss = self.loss(z, batch)
        return {"loss": loss, "contrastive": loss.detach()}


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
    handed in, so the trainer's micro-batch must be the whole batch, on one process.
    """

    runs_own_backward = True

    def __init__(
        self,
        llm: nn.Module,
        temperature: float = 0.05,
        attention: str = "causal",
        symmetric: bool = False,
        chunk_size: int = 32,
    ):
        super().__init__(llm, temperature, attention, symmetric)
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
        for rows, state in zip(chunks, states, strict=True):
            state.restore()  # same dropout masks as in (1)
            part = self.embed(batch, rows)  # (3) one chunk with its graph
            backward((part * grad[rows]).sum())
        after.restore()
        return {"loss": loss.detach(), "contrastive": loss.detach()}
