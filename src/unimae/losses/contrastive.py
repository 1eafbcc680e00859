"""InfoNCE over cosine similarities (SimCSE, supervised contrastive, GEM's contrastive term).

``L = -1/B sum_i log( exp(cos(a_i, c_i)/tau) / sum_j exp(cos(a_i, c_j)/tau) )`` (Gao et al. 2021, Eq. 1):
anchor i's positive is candidate i; every other candidate (the rest of the batch, then any hard
negatives appended after the B positives) is a negative.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def info_nce(anchors: torch.Tensor, candidates: torch.Tensor, temperature: float = 0.05) -> torch.Tensor:
    """anchors (B, D), candidates (N >= B, D): row i's positive is candidates[i] -> scalar loss."""
    if candidates.shape[0] < anchors.shape[0]:
        raise ValueError("each anchor needs its positive: candidates must hold at least B rows")
    if candidates.shape[0] < 2:
        raise ValueError("InfoNCE needs at least one negative: use a batch of 2 or more texts")
    a = F.normalize(anchors.float(), dim=-1)  # (B, D)
    c = F.normalize(candidates.float(), dim=-1)  # (N, D)
    logits = a @ c.T / temperature  # (B, N)
    labels = torch.arange(a.shape[0], device=a.device)  # (B,)
    return F.cross_entropy(logits, labels)
