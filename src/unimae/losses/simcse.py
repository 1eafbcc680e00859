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

from unimae.losses.cross_entropy import logit_softcap
from unimae.losses.info_nce import info_nce
from unimae.losses.next_token import NextTokenLoss
from unimae.losses.objective import Objective
from unimae.pooling import last_hidden, pool, pooled_forward


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
    """forward(batch) -> {"loss", "contrastive"[, "lm"]}; batch rows: B queries, B positives, then K hard negatives.

    Batch keys: input_ids, attention_mask, pool_mask (2B + K, T), ``num_queries`` = B, and optionally
    ``false_negatives`` (B, B + K) bool: candidates left out of query i's softmax. ``symmetric``: also each
    positive against the queries (``info_nce(..., symmetric=True)``).

    ``lm_weight`` > 0 adds ``lm_weight x L_LM``, L_LM the next-token cross-entropy of the B positives (each
    text's mean over its tokens, then the mean over texts; ``lm_texts`` > 0: of the first ``lm_texts`` of them
    only), computed from the same forward pass as their embeddings: GritLM's joint objective (Muennighoff et
    al. 2024, Eq. 3, ``L = L_Rep + lambda L_Gen``), here on the pairs' own positives rather than separate
    instruction data, so that the adapter keeps generating.

    ``matryoshka_dims`` (Kusupati et al. 2022, Matryoshka Representation Learning, arXiv:2205.13147): the loss is
    ``sum_{m in M} L_InfoNCE(z[:, :m])`` over M = the full dimension D and each given prefix size m, every
    prefix re-normalised before the cosine (``info_nce`` normalises), weights 1: what sentence-transformers'
    ``MatryoshkaLoss`` computes around its inner loss. That class wraps a SentenceTransformer module's forward;
    here the embeddings are already pooled (and cached by the gradient cache), so the sum is taken directly.
    """

    def __init__(
        self,
        llm: nn.Module,
        temperature: float = 0.05,
        attention: str = "causal",
        symmetric: bool = False,
        lm_weight: float = 0.0,
        lm_texts: int = 0,
        ce_chunk_size: int = 1024,
        matryoshka_dims: tuple[int, ...] = (),
    ):
        super().__init__(llm)
        self.temperature, self.attention, self.symmetric = temperature, attention, symmetric
        self.lm_weight, self.lm_texts = lm_weight, lm_texts
        self.ntp = NextTokenLoss(ce_chunk_size, logit_softcap(llm.config))
        full = llm.config.hidden_size
        if any(m > full for m in matryoshka_dims):
            raise ValueError(f"--matryoshka-dims {list(matryoshka_dims)}: each must be at most the model's size {full}")
        self.dims = tuple(sorted({*matryoshka_dims, full}))  # M: the prefix sizes, the full vector last

    def loss(self, z: torch.Tensor, batch) -> torch.Tensor:
        """Pooled embeddings z (2B + K, D) of ``batch``'s rows -> the InfoNCE loss (summed over ``self.dims``)."""
        b = int(batch["num_queries"])
        exclude = batch.get("false_negatives")
        losses = [
            info_nce(
                z[:b, :m], z[b:, :m], self.temperature, exclude=exclude, symmetric=self.symmetric
            )  # (B, m) vs (B+K, m)
            for m in self.dims
        ]
        return losses[0] if len(losses) == 1 else torch.stack(losses).sum()

    def embed(self, batch, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """Pooled embeddings (len(rows), D) of some rows of ``batch``."""
        hidden, _, _, pool_mask = self._hidden(batch, rows)
        return pool(hidden, pool_mask)

    def embed_and_lm(self, batch, rows: torch.Tensor | slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """(:meth:`embed`, these rows' share of ``lm_weight x L_LM``: see :meth:`lm_share`), from one forward."""
        hidden, ids, mask, pool_mask = self._hidden(batch, rows)
        return pool(hidden, pool_mask), self.lm_share(hidden, ids, mask, rows, batch)

    def _hidden(self, batch, rows: torch.Tensor | slice):
        """(last-layer states (R, T', D), input ids, attention mask, pool mask (R, T')) of some rows, the padding
        columns they all share cut off (positions come from the mask, so cutting pads is exact)."""
        mask = batch["attention_mask"][rows]  # (R, T)
        used = mask.any(0).nonzero()
        cols = slice(int(used.min()), int(used.max()) + 1)
        ids, mask, pool_mask = batch["input_ids"][rows][:, cols], mask[:, cols], batch["pool_mask"][rows][:, cols]
        return last_hidden(self.llm, ids, mask, pool_mask, self.attention), ids, mask, pool_mask

    def lm_share(self, hidden, ids, mask, rows: torch.Tensor | slice, batch) -> torch.Tensor:
        """``lm_weight`` x the sum over the scored positives among ``rows`` of each one's mean next-token CE, / the
        number of scored positives (B, or ``lm_texts``): the shares of any split of the batch into rows add up to
        ``lm_weight x L_LM``. hidden (R, T, D), ids / mask (R, T) right-padded -> scalar (0 without scored
        positives among the rows, or with ``lm_weight`` 0)."""
        b = int(batch["num_queries"])
        scored = min(b, self.lm_texts) if self.lm_texts else b  # rows b .. b + scored - 1
        index = torch.arange(batch["input_ids"].shape[0], device=ids.device)[rows]  # (R,) row numbers in the batch
        positive = (index >= b) & (index < b + scored)  # (R,)
        if self.lm_weight == 0 or not positive.any():
            return hidden.new_zeros((), dtype=torch.float32)
        mean = self.ntp(hidden[positive], ids[positive], mask[positive], self.llm.get_output_embeddings())
        return self.lm_weight * mean * positive.sum() / scored

    def forward(self, batch) -> dict[str, torch.Tensor]:
        z, lm = self.embed_and_lm(batch)  # (2B + K, D), scalar
        contrastive = self.loss(z, batch)
        out = {"loss": contrastive + lm, "contrastive": contrastive.detach()}
        return {**out, "lm": (lm / self.lm_weight).detach()} if self.lm_weight else out


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
        lm = torch.zeros(())
        for rows, state in zip(chunks, states, strict=True):
            state.restore()  # same dropout masks as in (1)
            part, lm_part = self.embed_and_lm(batch, rows)  # (3) one chunk with its graph; its share of L_LM
            backward((part * grad[rows]).sum() + lm_part)
            lm = lm + lm_part.detach()
        after.restore()
        out = {"loss": (loss + lm).detach(), "contrastive": loss.detach()}
        return {**out, "lm": lm / self.lm_weight} if self.lm_weight else out
