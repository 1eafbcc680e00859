"""In-batch distillation: the student's softmax over a batch's candidates matches a teacher's (listwise), or its
cosines of every pair of the batch's texts do (:func:`similarity_distillation`).

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

DISTILL_LOSSES = ("listwise", "similarity")  # in_batch_distillation, similarity_distillation
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


def similarity_distillation(z: torch.Tensor, teacher_similarities: torch.Tensor) -> torch.Tensor:
    """z (M, D) embeddings of all a batch's texts, teacher_similarities (M, M) the teacher's cosines of the same
    texts -> scalar ``L_SIM``.

    ``L_SIM = 1/(M(M-1)) sum_{i != j} (cos(z_i, z_j) - t_ij)^2``: the student's cosine matrix of the whole batch
    (queries, positives and hard negatives, each against every other text) matches the teacher's, entry by entry.
    This is the similarity loss of Jasper and Stella (Zhang et al. 2024, arXiv:2412.19048, Sec. 2.2), the
    similarity-preserving distillation of Tung & Mori (2019, arXiv:1907.09682) on cosines: where the listwise KL
    asks each query to rank the candidates as the teacher does at a sharp temperature, this asks every pair of texts
    for the teacher's graded similarity itself, including the pairs of unrelated texts that InfoNCE only pushes
    apart. The diagonal (1 on both sides) is left out."""
    m = z.shape[0]
    if teacher_similarities.shape != (m, m):
        raise ValueError(
            f"teacher similarities {tuple(teacher_similarities.shape)} do not match the batch: ({m}, {m}) expected "
            "(every text against every text)"
        )
    u = F.normalize(z.float(), dim=-1)  # (M, D)
    diff = u @ u.T - teacher_similarities.to(u.device).float()  # (M, M)
    off = ~torch.eye(m, dtype=torch.bool, device=u.device)  # (M, M)
    return diff[off].pow(2).mean()
