"""``--method gem``: summary tokens + the GEM attention rule; ``(1 - a) L_NTP + a L_contrastive``.

Embeds with the ``gem`` attention rule and ``summary`` pooling over the summary tokens.
"""

from __future__ import annotations

import torch

from unimae.batch import Batch
from unimae.embedding_spec import EmbeddingSpec
from unimae.masking import example_generator
from unimae.methods.base import Method, ViewDropoutMixin, pad_right, pooled_batch
from unimae.methods.registry import register_method
from unimae.tokenization import encode_with_eos, spare_special_tokens


def summary_tokens(tokenizer, n: int) -> list[int]:
    """GEM's summary tokens: the ``n`` highest-id spare special tokens (never in plain text)."""
    spare = spare_special_tokens(tokenizer)
    if len(spare) < n:
        raise ValueError(f"the tokenizer has {len(spare)} spare special tokens; --num-summary-tokens {n} needs {n}")
    return [token_id for _, token_id in spare[:n]]


@register_method
class GEM(ViewDropoutMixin, Method):
    """Batches: input_ids, attention_mask, summary (B, T) for NTP rows (some with the summary block inserted);
    view_ids, view_mask, view_pool (B, T') for the contrastive views (summary tokens appended)."""

    name = "gem"

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        self.summary_ids = summary_tokens(ctx.tokenizer, config.num_summary_tokens)

    def build_objective(self, llm):
        from unimae.losses.gem import GEMObjective

        c = self.config
        return GEMObjective(llm, c.gem_switch_step, c.temperature, c.ce_chunk_size)

    def _insert_block(self, ids: list[int], index: int) -> tuple[list[int], list[int]]:
        """One NTP row: plain (share ``gem_plain_share``) or with the summary block at a random inner place."""
        tok, n = self.ctx.tokenizer, len(self.summary_ids)
        gen = example_generator(self.config.seed, index)
        start = 1 if tok.bos_token_id is not None and ids[0] == tok.bos_token_id else 0
        if torch.rand(1, generator=gen).item() < self.config.gem_plain_share or len(ids) - start < 2:
            return ids, [0] * len(ids)
        at = int(torch.randint(start + 1, len(ids), (1,), generator=gen))  # at least one token before
        return ids[:at] + self.summary_ids + ids[at:], [0] * at + [1] * n + [0] * (len(ids) - at)

    def collate(self, texts, indices) -> Batch:
        tok, n = self.ctx.tokenizer, len(self.summary_ids)
        encoded = encode_with_eos(tok, texts, self.config.max_length - n, warn=False)
        rows, flags = zip(*(self._insert_block(ids, i) for ids, i in zip(encoded, indices, strict=True)), strict=True)
        ids, mask = pad_right(list(rows), tok.pad_token_id)
        summary, _ = pad_right(list(flags), 0)
        view = pooled_batch(tok, texts, self.config.max_length, self.embedding_spec())
        return Batch(
            input_ids=ids,
            attention_mask=mask,
            summary=summary.bool(),
            view_ids=view["input_ids"],
            view_mask=view["attention_mask"],
            view_pool=view["pool_mask"],
        )

    def embedding_spec(self) -> EmbeddingSpec:
        return EmbeddingSpec(attention="gem", pooling="summary", summary_ids=tuple(self.summary_ids))
