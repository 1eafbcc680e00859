"""The supervised contrastive objective (UniMAE App. D): queries against their positives, on pooled embeddings.

The other positives and the hard negatives of the batch are the negatives (optionally symmetric, minus known
false negatives); optional terms: the next-token loss of the positives (GritLM's joint objective) and
Matryoshka prefixes. Pools with any rule/attention. :class:`~unimae.losses.grad_cache.GradCacheContrastiveObjective`
computes the same loss over a batch too large for one graph.
"""

from __future__ import annotations

import torch
from torch import nn

from unimae.embedding.pooling import last_hidden, pool
from unimae.losses.cross_entropy import logit_softcap
from unimae.losses.distillation import DISTILL_LOSSES, in_batch_distillation, similarity_distillation
from unimae.losses.info_nce import info_nce
from unimae.losses.next_token import NextTokenLoss
from unimae.losses.objective import Objective


class ContrastiveObjective(Objective):
    """forward(batch) -> {"loss", "contrastive"[, "lm"][, "distill"]}; batch rows: B queries, B positives, then K
    hard negatives.

    Batch keys: input_ids, attention_mask, pool_mask (2B + K, T), ``num_queries`` = B, and optionally
    ``false_negatives`` (B, B + K) bool: candidates left out of query i's softmax. ``symmetric``: also each
    positive against the queries (``info_nce(..., symmetric=True)``).

    ``lm_weight`` > 0 adds ``lm_weight x L_LM``, L_LM the next-token cross-entropy of the B positives (each
    text's mean over its tokens, then the mean over texts; ``lm_texts`` > 0: of the first ``lm_texts`` of them
    only), computed from the same forward pass as their embeddings: GritLM's joint objective (Muennighoff et
    al. 2024, Eq. 3, ``L = L_Rep + lambda L_Gen``), here on the pairs' own positives rather than separate
    instruction data, so that the adapter keeps generating. A batch carrying ``lm_input_ids`` /
    ``lm_attention_mask`` (N, T) (``--lm-data``) takes L_LM over those N texts instead (the same means; GritLM's
    separate generative data), from their own causal forward, and the positives are not scored.

    ``matryoshka_dims`` (Kusupati et al. 2022, Matryoshka Representation Learning, arXiv:2205.13147): the loss is
    ``sum_{m in M} L_InfoNCE(z[:, :m])`` over M = the full dimension D and each given prefix size m, every
    prefix re-normalised before the cosine (``info_nce`` normalises), weights 1: what sentence-transformers'
    ``MatryoshkaLoss`` computes around its inner loss. That class wraps a SentenceTransformer module's forward;
    here the embeddings are already pooled (and cached by the gradient cache), so the sum is taken directly.

    ``distill_weight`` > 0 adds ``distill_weight x L_KD`` (:func:`~unimae.losses.distillation.in_batch_distillation`)
    on the full vector: the batch then carries ``teacher_scores`` (B, B + K), a teacher's cosines of the same
    queries and candidates, softened by ``teacher_temperature``. Part of :meth:`loss`, so the gradient cache
    computes it as it does InfoNCE; the log's ``"contrastive"`` is InfoNCE + that term, and its ``"distill"`` is
    L_KD alone (unweighted). ``distill_loss="similarity"`` takes ``distill_weight x L_SIM``
    (:func:`~unimae.losses.distillation.similarity_distillation`) instead, from ``teacher_similarities``
    (2B + K, 2B + K): the teacher's cosines of every pair of the batch's texts.
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
        distill_weight: float = 0.0,
        teacher_temperature: float = 0.05,
        distill_loss: str = "listwise",
    ):
        super().__init__(llm)
        self.temperature, self.attention, self.symmetric = temperature, attention, symmetric
        self.lm_weight, self.lm_texts = lm_weight, lm_texts
        self.ntp = NextTokenLoss(ce_chunk_size, logit_softcap(llm.config))
        full = llm.config.hidden_size
        if any(m > full for m in matryoshka_dims):
            raise ValueError(f"--matryoshka-dims {list(matryoshka_dims)}: each must be at most the model's size {full}")
        self.dims = tuple(sorted({*matryoshka_dims, full}))  # M: the prefix sizes, the full vector last
        self.distill_weight, self.teacher_temperature = distill_weight, teacher_temperature
        if distill_loss not in DISTILL_LOSSES:
            raise ValueError(f"distill_loss must be one of {DISTILL_LOSSES}, got {distill_loss!r}")
        self.distill_loss = distill_loss

    def loss(self, z: torch.Tensor, batch) -> torch.Tensor:
        """Pooled embeddings z (2B + K, D) of ``batch``'s rows -> the InfoNCE loss (summed over ``self.dims``),
        plus ``distill_weight x L_KD`` when distilling."""
        return self.loss_and_log(z, batch)[0]

    def loss_and_log(self, z: torch.Tensor, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(:meth:`loss`, the log's own terms: ``{"distill": L_KD}`` (unweighted, detached) when distilling)."""
        b = int(batch["num_queries"])
        exclude = batch.get("false_negatives")
        losses = [
            info_nce(
                z[:b, :m], z[b:, :m], self.temperature, exclude=exclude, symmetric=self.symmetric
            )  # (B, m) vs (B+K, m)
            for m in self.dims
        ]
        logged = {}
        if self.distill_weight:
            kd = self._distillation(z, batch, b, exclude)
            losses.append(self.distill_weight * kd)
            logged["distill"] = kd.detach()
        return (losses[0] if len(losses) == 1 else torch.stack(losses).sum()), logged

    def _distillation(self, z: torch.Tensor, batch, b: int, exclude) -> torch.Tensor:
        """The unweighted distillation term of z (2B + K, D): L_KD over the queries' candidates, or L_SIM over every
        pair of texts (``distill_loss``)."""
        key = "teacher_similarities" if self.distill_loss == "similarity" else "teacher_scores"
        if key not in batch:
            raise KeyError(f"distill_weight > 0 needs the batch's {key} (--distill-teacher)")
        if self.distill_loss == "similarity":
            return similarity_distillation(z, batch[key])
        return in_batch_distillation(
            z[:b], z[b:], batch[key], self.temperature, self.teacher_temperature, exclude=exclude
        )

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
        cols = _used_columns(mask)
        ids, mask, pool_mask = batch["input_ids"][rows][:, cols], mask[:, cols], batch["pool_mask"][rows][:, cols]
        return last_hidden(self.llm, ids, mask, pool_mask, self.attention), ids, mask, pool_mask

    def lm_data_share(self, batch, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """``lm_weight`` x the sum over the ``--lm-data`` texts among ``rows`` of each one's mean next-token CE, / the
        number of those texts in the batch (N): the shares of any split into rows add up to ``lm_weight x L_LM``.
        Their own forward with causal attention, as the model generates (0 when the batch has no such texts)."""
        if self.lm_weight == 0 or "lm_input_ids" not in batch:
            return torch.zeros((), device=batch["input_ids"].device)
        mask = batch["lm_attention_mask"][rows]  # (R, T)
        cols = _used_columns(mask)
        ids, mask = batch["lm_input_ids"][rows][:, cols], mask[:, cols]
        hidden = last_hidden(self.llm, ids, mask, mask, "causal")  # (R, T', D)
        mean = self.ntp(hidden, ids, mask, self.llm.get_output_embeddings())
        return self.lm_weight * mean * ids.shape[0] / batch["lm_input_ids"].shape[0]

    def lm_share(self, hidden, ids, mask, rows: torch.Tensor | slice, batch) -> torch.Tensor:
        """``lm_weight`` x the sum over the scored positives among ``rows`` of each one's mean next-token CE, / the
        number of scored positives (B, or ``lm_texts``): the shares of any split of the batch into rows add up to
        ``lm_weight x L_LM``. hidden (R, T, D), ids / mask (R, T) right-padded -> scalar (0 without scored
        positives among the rows, with ``lm_weight`` 0, or when the term reads ``--lm-data`` instead)."""
        b = int(batch["num_queries"])
        scored = min(b, self.lm_texts) if self.lm_texts else b  # rows b .. b + scored - 1
        index = torch.arange(batch["input_ids"].shape[0], device=ids.device)[rows]  # (R,) row numbers in the batch
        positive = (index >= b) & (index < b + scored)  # (R,)
        if self.lm_weight == 0 or "lm_input_ids" in batch or not positive.any():
            return hidden.new_zeros((), dtype=torch.float32)
        mean = self.ntp(hidden[positive], ids[positive], mask[positive], self.llm.get_output_embeddings())
        return self.lm_weight * mean * positive.sum() / scored

    def forward(self, batch) -> dict[str, torch.Tensor]:
        z, lm = self.embed_and_lm(batch)  # (2B + K, D), scalar
        lm = lm + self.lm_data_share(batch)
        contrastive, logged = self.loss_and_log(z, batch)
        out = {"loss": contrastive + lm, "contrastive": contrastive.detach(), **logged}
        return {**out, "lm": (lm / self.lm_weight).detach()} if self.lm_weight else out


def _used_columns(mask: torch.Tensor) -> slice:
    """The columns of a right- or left-padded mask (R, T) that any row uses."""
    used = mask.any(0).nonzero()
    return slice(int(used.min()), int(used.max()) + 1)
