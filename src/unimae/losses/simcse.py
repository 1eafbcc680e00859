"""SimCSE (Gao et al. 2021, arXiv:2104.08821), unsupervised: a text against itself under another dropout mask.

Every text passes twice in one forward (the batch doubled); dropout set by the trainer (``--dropout-on``:
attention by default, as LLM2Vec's SimCSE stage; or LoRA) makes the two views differ; view 2 of text i is the
positive of view 1, the other texts are negatives (InfoNCE, temperature 0.05). Pools with any rule/attention.
"""

from __future__ import annotations

import torch
from torch import nn

from unimae.embedding.pooling import pooled_forward
from unimae.losses.info_nce import info_nce
from unimae.losses.objective import Objective


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
