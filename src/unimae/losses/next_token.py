"""Next-token cross-entropy through the LLM's own (chunked) output head: the plain language-model loss.

``L = mean_b mean_t CE(x_{t+1} | h_t)`` over the scored positions of each example (all by default), a mean per
example, then over the batch. Four objectives use it: UniMAE's MAR loss (Eq. 1: the ORIGINAL next tokens
given the MAR-corrupted prefix, ``L_MAR = sum_t CE(x_t | x~_<t)``, averaged per example), MNTP (only the masked
tokens scored), GEM's NTP term and the contrastive method's LM term (``--lm-weight``).
"""

from __future__ import annotations

import torch
from torch import nn

from unimae.losses.cross_entropy import chunked_cross_entropy, output_projection, per_example_mean


class NextTokenLoss(nn.Module):
    """Next-token CE through the LLM's own (chunked) output head.

    Inputs: hidden (B, T, D) last-layer states of the (possibly corrupted) input; input_ids (B, T) the
    original tokens; attention_mask (B, T); output_head the LLM's nn.Linear head (not owned
    here). Output: scalar.
    """

    def __init__(self, chunk_size: int = 1024, softcap: float | None = None):
        super().__init__()
        self.chunk_size = chunk_size
        self.softcap = softcap

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        output_head: nn.Module,
        target_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``target_mask`` (B, T) bool: score only these tokens (MNTP: the masked ones); default all."""
        batch = hidden.shape[0]
        has_target = attention_mask[:, 1:].bool()  # (B, T-1) position t predicts token t+1
        if target_mask is not None:
            has_target = has_target & target_mask[:, 1:]
        rows = hidden[:, :-1][has_target]  # (n, D)
        targets = input_ids[:, 1:][has_target]  # (n,)
        example = torch.arange(batch, device=hidden.device)[:, None].expand_as(has_target)[has_target]  # (n,)
        weight, bias = output_projection(output_head)  # (V, D), (V,) or None
        losses = chunked_cross_entropy(rows, weight, targets, self.chunk_size, bias, self.softcap)
        return per_example_mean(losses, example, batch)
