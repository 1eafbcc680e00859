"""In-batch distillation: the student's softmax over a batch's candidates matches a teacher's.

``L_KD = 1/B sum_i KL(p_i^T || p_i^S)``, with ``p_i^S = softmax_j(cos(a_i, c_j) / tau)`` the student's InfoNCE
distribution of query i over the batch's candidates (its positive, the other positives, the hard negatives) and
``p_i^T = softmax_j(s_ij / tau_T)`` the teacher's, from the teacher's cosine similarities ``s_ij`` of the same
texts. This is RocketQAv2's listwise distillation (Ren et al. 2021, arXiv:2110.07367, Eq. 6: KL between the
re-ranker's and the retriever's distributions over a query's candidates), here with a bi-encoder teacher and the
in-batch candidates: the student learns how similar the non-matching texts are, not only which one matches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MASKED = -1e4  # a logit whose probability is 0 in float32, finite so that 0 x (masked - masked) stays 0


def in_batch_distillation(
    anchors: torch.Tensor,
    candidates: torch.Tensor,
    teacher_scores: torch.Tensor,
    temperature: float | torch.Tensor = 0.05,
    teacher_temperature: float = 0.05,
    *,
    exclude: torch.Tensor | None = None,
) -> torch.Tensor:
    """anchors (B, D), candidates (N, D), teacher_scores (B, N) cosines -> scalar ``L_KD`` (module doc).

    ``exclude`` (B, N) bool: candidates left out of both distributions (the batch's known false negatives, as
    ``info_nce`` leaves them out); the diagonal is never excluded."""
    if teacher_scores.shape != (anchors.shape[0], candidates.shape[0]):
        raise ValueError(
            f"teacher scores {tuple(teacher_scores.shape)} do not match the batch: ({anchors.shape[0]}, "
            f"{candidates.shape[0]}) expected (queries x candidates)"
        )
    a = F.normalize(anchors.float(), dim=-1)  # (B, D)
    c = F.normalize(candidates.float(), dim=-1)  # (N, D)
    student = a @ c.T / temperature  # (B, N)
    teacher = teacher_scores.to(student.device).float() / teacher_temperature  # (B, N)
    if exclude is not None:
        drop = exclude.to(student.device).bool() & ~torch.eye(*student.shape, dtype=torch.bool, device=a.device)
        student, teacher = student.masked_fill(drop, MASKED), teacher.masked_fill(drop, MASKED)
    log_s, log_t = F.log_softmax(student, dim=-1), F.log_softmax(teacher, dim=-1)  # (B, N)
    return F.kl_div(log_s, log_t, log_target=True, reduction="batchmean")
