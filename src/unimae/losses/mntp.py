"""MNTP, LLM2Vec step 1 (BehnamGhader et al. 2024): masked next-token prediction under BIDIRECTIONAL attention.

A share of input tokens is replaced by the mask token; with every token seeing every other, the
state at position i - 1 predicts the ORIGINAL token i, scored only where token i was masked:
``L_MNTP = mean_b mean_{i masked} CE(x_i | h_{i-1})``.

Two choices the papers leave to us: every chosen token becomes the mask token (no BERT-style 80/10/10
split of mask / random / kept), and the loss is a mean per text, then over texts (each text weighs the
same, however many of its tokens were masked; a text with none masked adds 0), where a mean over all
masked tokens of the batch would weigh long texts more.
"""

from __future__ import annotations

import torch
from torch import nn

from unimae.embedding.attention import model_attention_mask
from unimae.losses.cross_entropy import logit_softcap
from unimae.losses.next_token import NextTokenLoss
from unimae.losses.objective import Objective


class MNTPObjective(Objective):
    """forward(batch) -> {"loss", "mntp"}; batch: input_ids, corrupted_ids, attention_mask, targets (B, T)."""

    def __init__(self, llm: nn.Module, chunk_size: int = 1024):
        super().__init__(llm)
        self.ntp = NextTokenLoss(chunk_size, logit_softcap(llm.config))

    def forward(self, batch) -> dict[str, torch.Tensor]:
        mask = model_attention_mask("bidirectional", batch["attention_mask"], self.llm)
        hidden = self.llm.get_decoder()(
            input_ids=batch["corrupted_ids"], attention_mask=mask, use_cache=False
        ).last_hidden_state  # (B, T, D)
        loss = self.ntp(
            hidden, batch["input_ids"], batch["attention_mask"], self.llm.get_output_embeddings(), batch["targets"]
        )
        return {"loss": loss, "mntp": loss.detach()}
