"""GEM (arXiv:2506.04344): summary tokens inserted into text + an attention mask that forces them to summarize.

Training rows (``unimae.methods``): 80% plain text, 20% with the summary tokens inserted at a random
position under the ``gem`` attention rule, where text after the summary tokens cannot see the text
before them (so the prefix must pass through the summary states) and summary tokens cannot see each
other. ``L = (1 - a) L_NTP + a L_contrastive`` with ``a`` = 0 for the first ``switch_step`` steps, 1 after.
``L_NTP``: next-token CE on text tokens (summary tokens are never targets). ``L_contrastive``: SimCSE
InfoNCE between two dropout views of the summary embedding of each text (summary tokens appended at
the end, as at inference); this self-supervised pairing is our reading of the abstract.
"""

from __future__ import annotations

import torch
from torch import nn

from unimae.attention import model_attention_mask
from unimae.losses.contrastive import info_nce
from unimae.losses.mar import MARLoss
from unimae.losses.objective import Objective
from unimae.pooling import pooled_forward
from unimae.tokenization import position_ids_from_mask


class GEMObjective(Objective):
    """forward(batch) -> {"loss", and "ntp" or "contrastive"}; the trainer sets the step (``set_step``)."""

    def __init__(self, llm: nn.Module, switch_step: int = 100, temperature: float = 0.05, chunk_size: int = 1024):
        super().__init__(llm)
        self.switch_step, self.temperature = switch_step, temperature
        self.ntp = MARLoss(chunk_size, getattr(llm.config, "final_logit_softcapping", None))
        self.step = 0

    def set_step(self, step: int) -> None:
        self.step = step

    def forward(self, batch) -> dict[str, torch.Tensor]:
        if self.step < self.switch_step:  # a = 0: generation keeps training, summary tokens learn to carry the prefix
            mask = model_attention_mask("gem", batch["attention_mask"], self.llm, summary=batch["summary"])
            hidden = self.llm.get_decoder()(
                input_ids=batch["input_ids"],
                attention_mask=mask,
                position_ids=position_ids_from_mask(batch["attention_mask"]),
                use_cache=False,
            ).last_hidden_state  # (B, T, D)
            head = self.llm.get_output_embeddings()
            loss = self.ntp(hidden, batch["input_ids"], batch["attention_mask"], head, ~batch["summary"])
            return {"loss": loss, "ntp": loss.detach()}
        ids, mask, pool_mask = (torch.cat([batch[k], batch[k]]) for k in ("view_ids", "view_mask", "view_pool"))
        z = pooled_forward(self.llm, ids, mask, pool_mask, "gem")  # (2B, D) two dropout views
        half = z.shape[0] // 2
        loss = info_nce(z[:half], z[half:], self.temperature)
        return {"loss": loss, "contrastive": loss.detach()}
