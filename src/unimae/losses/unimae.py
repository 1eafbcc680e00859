"""The UniMAE joint objective (Eq. 6): ``L = alpha * L_MAR + L_MRC`` from ONE forward pass.

The LLM runs once over the MAR-corrupted input; its last-layer states give the MAR logits
(Eq. 1) and ``h_eos``, the state at the appended EOS (Eq. 2), which feeds the MRC tiny decoder.
``mrc_input="clean"`` (a diagnostic, not the paper) takes ``h_eos`` from a second pass over the clean
text instead, to tell apart "MAR corrupts the input" from "h_eos is trained on corrupted text but
used on clean text".
"""

from __future__ import annotations

import torch
from torch import nn

from unimae.data.batch import Batch
from unimae.embedding.tokenization import last_token_index
from unimae.losses.cross_entropy import logit_softcap
from unimae.losses.mrc import MRCLoss, TinyDecoder
from unimae.losses.next_token import NextTokenLoss
from unimae.losses.objective import Objective

# Where h_eos comes from: the MAR-corrupted pass (Eq. 2, one forward) or a second pass over the clean text.
MRC_INPUTS = ("corrupted", "clean")


def decoder_heads(config) -> int:
    """Attention heads for the tiny decoder: the LLM's count if it divides the width, else 1."""
    heads = getattr(config, "num_attention_heads", 1)
    return heads if config.hidden_size % heads == 0 else 1


class UniMAEObjective(Objective):
    """Holds the (LoRA-wrapped) LLM and the MRC loss, so DDP/FSDP wrap one module.

    forward(batch) -> {"loss", "mar", "mrc"} scalars; batch: input_ids, corrupted_ids, attention_mask
    (B, T) and mrc_visible (B, T, T + 1) from :class:`~unimae.data.masking.UniMAECollator`.
    """

    def __init__(
        self,
        llm: nn.Module,
        alpha: float,
        max_positions: int,
        chunk_size: int = 1024,
        mrc_heads: int = 0,
        mrc_intermediate_size: int = 0,
        mrc_positions: str = "scaled",
        mrc_input: str = "corrupted",
    ):
        super().__init__(llm)
        if mrc_input not in MRC_INPUTS:
            raise ValueError(f"mrc_input must be one of {MRC_INPUTS}, got {mrc_input!r}")
        self.mrc_input = mrc_input
        config = llm.config
        self.alpha = alpha
        softcap = logit_softcap(config)
        self.mar = NextTokenLoss(chunk_size, softcap)
        decoder = TinyDecoder(
            hidden_size=config.hidden_size,
            num_heads=mrc_heads or decoder_heads(config),
            intermediate_size=mrc_intermediate_size or getattr(config, "intermediate_size", 4 * config.hidden_size),
            max_positions=max_positions,
            eps=getattr(config, "rms_norm_eps", 1e-6),
            positions=mrc_positions,
        )
        self.mrc = MRCLoss(decoder, chunk_size, softcap)

    def _last_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return self.llm.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # (B, T, D)

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        mask = batch["attention_mask"]
        hidden = self._last_hidden(batch["corrupted_ids"], mask)  # (B, T, D) one pass: MAR logits and h_eos
        head = self.llm.get_output_embeddings()
        mar = self.mar(hidden, batch["input_ids"], mask, head)
        if self.mrc_input == "clean":  # diagnostic: h_eos of the uncorrupted text, as embedded at inference
            hidden = self._last_hidden(batch["input_ids"], mask)  # (B, T, D)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        h_eos = hidden[rows, last_token_index(mask)]  # (B, D) Eq. 2
        mrc = self.mrc(h_eos, batch["input_ids"], mask, batch["mrc_visible"], self.llm.get_input_embeddings(), head)
        return {"loss": self.alpha * mar + mrc, "mar": mar.detach(), "mrc": mrc.detach()}
