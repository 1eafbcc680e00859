"""``--method unimae`` (default): ``L = alpha * L_MAR + L_MRC`` (UniMAE Eq. 6); embeds with causal ``eos``."""

from __future__ import annotations

from unimae.data.masking import UniMAECollator
from unimae.embedding.spec import EmbeddingSpec
from unimae.embedding.tokenization import encode_with_eos
from unimae.losses import UniMAEObjective
from unimae.methods.base import Method
from unimae.methods.registry import register_method


@register_method
class UniMAE(Method):
    """Batches: :class:`~unimae.data.masking.UniMAECollator` (MAR-corrupted ids and the MRC key mask)."""

    name = "unimae"

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        tok = ctx.tokenizer
        self._collate = UniMAECollator(
            tok.pad_token_id,
            ctx.mask_id,
            tok.bos_token_id,
            config.p_mar,
            config.p_mrc,
            config.seed,
            config.p_mar_sampling,
        )

    def lora_extra(self) -> dict:
        """``--train-mask-token``: the mask token's embedding row trains with the LoRA (peft TrainableTokens)."""
        return {"trainable_token_indices": [self.ctx.mask_id]} if self.config.train_mask_token else {}

    def build_objective(self, llm):
        c = self.config
        return UniMAEObjective(
            llm,
            c.alpha,
            c.max_length,
            c.ce_chunk_size,
            c.mrc_heads,
            c.mrc_intermediate_size,
            c.mrc_positions,
            c.mrc_input,
        )

    def collate(self, texts, indices):
        return self._collate(encode_with_eos(self.ctx.tokenizer, texts, self.config.max_length, warn=False), indices)

    def embedding_spec(self) -> EmbeddingSpec:
        return EmbeddingSpec(attention="causal", pooling="eos")
