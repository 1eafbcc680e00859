"""``--method mntp`` (LLM2Vec step 1): masked next-token prediction under bidirectional attention.

Embeds with bidirectional attention and ``mean`` pooling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from unimae.data.batch import Batch
from unimae.data.masking import example_generator, mar_corrupt
from unimae.embedding.spec import EmbeddingSpec
from unimae.embedding.tokenization import encode_with_eos
from unimae.losses.mntp import MNTPObjective
from unimae.training.config import MethodOptions, TrainConfig
from unimae.training.methods.base import Method, pad_right
from unimae.training.methods.registry import register_method


@dataclass
class MNTPOptions(MethodOptions):
    """Masked next-token prediction (LLM2Vec step 1)."""

    mntp_p_mask: float = field(default=0.2, metadata={"help": "Share of input tokens masked (LLM2Vec: 0.2)."})

    def check(self, config: TrainConfig, world_size: int) -> None:
        super().check(config, world_size)
        if not 0.0 < self.mntp_p_mask < 1.0:
            raise ValueError(f"mntp_p_mask must be in (0, 1), got {self.mntp_p_mask}")


@register_method
class MNTP(Method):
    """Batches: input_ids, corrupted_ids, attention_mask, targets (B, T) (targets = masked real tokens)."""

    name = "mntp"
    options_class = MNTPOptions

    def build_objective(self, llm):
        return MNTPObjective(llm, self.config.ce_chunk_size)

    def collate(self, texts, indices) -> Batch:
        tok, c = self.ctx.tokenizer, self.config
        rows = encode_with_eos(tok, texts, c.max_length, warn=False)
        # token i is predicted from the output at i - 1, so the first token (BOS or not) is never masked: a
        # masked first token would only corrupt the context, with no prediction of it to learn from
        corrupted = [
            mar_corrupt(ids, self.options.mntp_p_mask, self.ctx.mask_id, True, example_generator(c.seed, index))
            for ids, index in zip(rows, indices, strict=True)
        ]
        ids, mask = pad_right(rows, tok.pad_token_id)
        noisy, _ = pad_right(corrupted, tok.pad_token_id)
        return Batch(input_ids=ids, corrupted_ids=noisy, attention_mask=mask, targets=(noisy != ids) & mask.bool())

    def embedding_spec(self) -> EmbeddingSpec:
        return EmbeddingSpec(attention="bidirectional", pooling="mean")
