"""InfoNCE over cosine similarities (SimCSE, supervised contrastive, GEM's contrastive term).

``L = -1/B sum_i log( exp(cos(a_i, c_i)/tau) / sum_j exp(cos(a_i, c_j)/tau) )`` (Gao et al. 2021, Eq. 1):
anchor i's positive is candidate i; every other candidate (the rest of the batch, then any hard
negatives appended after the B positives) is a negative. Options: ``exclude`` leaves known false
negatives out of a row's sum; ``symmetric`` averages in the reverse direction, each positive c_i against
the anchors a_0..a_{B-1} (sentence-transformers' ``MultipleNegativesSymmetricRankingLoss``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def info_nce(
    anchors: torch.Tensor,
    candidates: torch.Tensor,
    temperature: float | torch.Tensor = 0.05,
    *,
    exclude: torch.Tensor | None = None,
    symmetric: bool = False,
) -> torch.Tensor:
    """anchors (B, D), candidates (N >= B, D): row i's positive is candidates[i] -> scalar loss.

    ``exclude`` (B, N) bool: True where candidate j is not a negative of anchor i (a duplicate of its
    positive); the diagonal (the positive itself) is never excluded. ``temperature`` may be a 0-dim tensor
    (GEM: 1 / its learnable logit scale), which the gradient then reaches. ``symmetric``: the mean of the
    anchor -> candidates loss and the positive -> anchors loss (hard negatives only in the first).
    """
    if candidates.shape[0] < anchors.shape[0]:
        raise ValueError("each anchor needs its positive: candidates must hold at least B rows")
    if candidates.shape[0] < 2:
        raise ValueError("InfoNCE needs at least one negative: use a batch of 2 or more texts")
    a = F.normalize(anchors.float(), dim=-1)  # (B, D)
    c = F.normalize(candidates.float(), dim=-1)  # (N, D)
    logits = a @ c.T / temperature  # (B, N)
    b = a.shape[0]
    labels = torch.arange(b, device=a.device)  # (B,)
    if exclude is not None:
        keep_positive = torch.eye(b, logits.shape[1], dtype=torch.bool, device=a.device)  # (B, N)
        logits = logits.masked_fill(exclude.to(a.device).bool() & ~keep_positive, float("-inf"))
    loss = F.cross_entropy(logits, labels)
    if symmetric:
        reverse = logits[:, :b].T  # (B, B): positive i against every anchor; ``exclude`` is symmetric there
        loss = (loss + F.cross_entropy(reverse, labels)) / 2
    return loss
