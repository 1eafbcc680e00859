"""GEM (arXiv:2506.04344; docs/methods.md, "GEM"): summary tokens + an attention mask that forces them to summarize.

``L = (1 - a) L_NTP + a L_contrastive``, ``a`` = 0 for the first ``switch_step`` steps, 1 after.

- ``L_NTP``: next-token cross-entropy on rows of which some carry the summary block (``unimae.training.methods.gem``),
  under the ``gem`` attention rule: text after the block cannot see the text before it (so the prefix reaches
  the suffix only through the summary states) and summary tokens cannot see each other. Every token except
  the summary tokens is a target, the suffix included.
- ``L_contrastive``: InfoNCE over cosine similarities of summary embeddings (mean of the summary tokens'
  last-layer states, the block appended at the end as at inference), anchor i against the B positives, with
  a learnable logit scale ``s``: ``logits = s * cos(a_i, c_j)``, ``s = exp(log_scale)`` starting at
  ``1 / temperature`` (20) and clamped to at most ``max_logit_scale`` (100), as CLIP (Radford et al. 2021).
  "CLIP-style" is read as the learnable, clamped scale only: the loss runs one way, each anchor against the
  positives (our choice; CLIP also averages the positives-against-anchors direction, which the paper does not
  state).
- The prefix includes BOS: suffix tokens cannot see it either (the paper's rule read literally; the suffix
  then has no attention-sink token and attends to the summary block and itself).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from unimae.embedding.attention import model_attention_mask
from unimae.embedding.pooling import pooled_forward
from unimae.embedding.tokenization import position_ids_from_mask
from unimae.losses.cross_entropy import logit_softcap
from unimae.losses.info_nce import info_nce
from unimae.losses.next_token import NextTokenLoss
from unimae.losses.objective import Objective


class GEMObjective(Objective):
    """forward(batch) -> {"loss", and "ntp" or "contrastive" + "logit_scale"}; the trainer sets the step.

    Batch (``GEM.collate``): ``input_ids``, ``attention_mask``, ``summary`` (B, T) for NTP; ``view_ids``,
    ``view_mask``, ``view_pool`` (2B, T') for the contrastive term: rows 0..B-1 anchors, B..2B-1 their positives.
    ``log_scale`` (a parameter, the log of the logit scale, as CLIP) is trained when ``learn_logit_scale``;
    being trainable, it is in the trainer's checkpoints.
    """

    def __init__(
        self,
        llm: nn.Module,
        switch_step: int = 100,
        temperature: float = 0.05,
        chunk_size: int = 1024,
        learn_logit_scale: bool = True,
        max_logit_scale: float = 100.0,
    ):
        super().__init__(llm)
        self.switch_step = switch_step
        self.max_log_scale = math.log(max_logit_scale)
        initial = torch.tensor(math.log(1.0 / temperature), dtype=torch.float32)
        self.log_scale = nn.Parameter(initial, requires_grad=learn_logit_scale)
        self.ntp = NextTokenLoss(chunk_size, logit_softcap(llm.config))
        self.step = 0

    def set_step(self, step: int) -> None:
        self.step = step

    def logit_scale(self) -> torch.Tensor:
        """exp(log_scale) after clamping the parameter itself to ``max_logit_scale`` (CLIP clamps it after each
        step; here before each use, so a value pushed past the cap can come back)."""
        with torch.no_grad():
            self.log_scale.clamp_(max=self.max_log_scale)
        return self.log_scale.exp()

    def forward(self, batch) -> dict[str, torch.Tensor]:
        if self.step < self.switch_step:  # a = 0: generation keeps training, summary tokens learn to carry the prefix
            mask = model_attention_mask("gem", batch["attention_mask"], self.llm, summary=batch["summary"])
            hidden = self.llm.get_decoder()(
                input_ids=batch["input_ids"],
                attention_mask=mask,
                position_ids=position_ids_from_mask(batch["attention_mask"]),
                use_cache=False,
            ).last_hidden_state  # (B, T, D)
            head = self.llm.get_output_embeddings()  # a tied head: with the trained summary rows (NextTokenLoss)
            loss = self.ntp(hidden, batch["input_ids"], batch["attention_mask"], head, ~batch["summary"])
            if self.log_scale.requires_grad:  # DDP wants every trainable parameter in the graph; gradient 0
                loss = loss + 0.0 * self.log_scale
            return {"loss": loss, "ntp": loss.detach()}
        z = pooled_forward(self.llm, batch["view_ids"], batch["view_mask"], batch["view_pool"], "gem")  # (2B, D)
        half = z.shape[0] // 2
        scale = self.logit_scale()
        loss = info_nce(z[:half], z[half:], 1.0 / scale)  # logits = scale * cos
        return {"loss": loss, "contrastive": loss.detach(), "logit_scale": scale.detach()}
