"""``--method gem`` (arXiv:2506.04344; docs/methods.md, "GEM"): summary tokens, the ``gem`` attention rule and
``L = (1 - a) L_NTP + a L_contrastive``. Embeds with the ``gem`` rule and ``summary`` pooling.

The paper's recipe is the default; [open] marks what the paper leaves open, our choice and its flag
(fields of ``GEMOptions``):

- *Summary tokens*: k (``--num-summary-tokens``, paper 1) new special tokens ``<|summary_i|>``; the embedding
  grows by k rows (:func:`unimae.models.grow_vocabulary`), [open] initialised to the mean of the vocabulary's
  rows (``--gem-summary-init``), and only those rows are trained: peft ``trainable_token_indices``, so the
  adapter holds k rows, not the matrix. ``--gem-summary-tokens spare`` reuses spare special tokens instead.
- *NTP rows*: 20% carry the block (``--gem-plain-share 0.8``), [open] at a place drawn uniformly among the gaps
  with a text token before it and a token after it (``--gem-block-position``); every token but the summary
  tokens is a target, the suffix included (predicted through the bottleneck).
- *Contrastive rows*: the text with the block appended at the end, as at inference; its positive is the same
  row with [open] half of its text tokens dropped (``--gem-prefix-dropout 0.5``; BOS kept, at least one token
  dropped and one kept: harder positives score 3.8 higher than 0.2 on 7 SmolLM2 dev tasks); the other rows are
  its negatives. InfoNCE with a learnable logit scale
  (:class:`unimae.losses.gem.GEMObjective`). No model dropout (``--gem-positives dropout``: the earlier
  SimCSE-style dropout views).
- *Schedule* (:meth:`GEM.lr_lambda`): ``--gem-switch-step`` (100) NTP steps at ``--lr`` (1e-4), then
  contrastive only, [open: the paper says "cosine"] decaying by a cosine to 0 at ``--steps``
  (``--gem-lr-schedule``). The paper's budget: 1,000 steps of 32 rows. [decision] The paper's contrastive lr is
  1e-5 (full fine-tuning; ``--gem-contrastive-lr-scale 0.1`` x ``--lr``, as ``--recipe paper`` sets); our
  default keeps ``--lr`` (scale 1), since LoRA at 1e-5 hardly moves: SmolLM2-135M, 300 steps, dev suite 44.88
  at 0.1 against 53.32 at 1 (Echo pooling 45.82; docs/results.md).
"""

from __future__ import annotations

import logging
import math

import torch

from unimae.data.batch import Batch
from unimae.data.masking import example_generator
from unimae.embedding.pooling import PooledInput
from unimae.embedding.spec import EmbeddingSpec
from unimae.embedding.tokenization import encode_with_eos, spare_special_tokens
from unimae.losses.gem import GEMObjective
from unimae.methods.base import Method, has_bos, pad_right
from unimae.methods.registry import register_method
from unimae.models import grow_vocabulary

logger = logging.getLogger(__name__)

SUMMARY_TOKEN = "<|summary_{}|>"


def summary_tokens(tokenizer, n: int, source: str = "new") -> list[int]:
    """GEM's ``n`` summary token ids. ``new``: the special tokens ``<|summary_0|>`` .. (added to ``tokenizer``
    where it lacks them; the model then needs :func:`~unimae.models.grow_vocabulary`); ``spare``: the ``n``
    highest-id spare special tokens (never in plain text)."""
    if source == "new":
        names = [SUMMARY_TOKEN.format(i) for i in range(n)]
        tokenizer.add_tokens(names, special_tokens=True)  # skips the ones it has
        return tokenizer.convert_tokens_to_ids(names)
    if source != "spare":
        raise ValueError(f"unknown summary-token source {source!r}; choose 'new' or 'spare'")
    spare = spare_special_tokens(tokenizer)
    if len(spare) < n:
        raise ValueError(
            f"the tokenizer has {len(spare)} spare special tokens; --num-summary-tokens {n} needs {n} "
            "(--gem-summary-tokens new adds them)"
        )
    return [token_id for _, token_id in spare[:n]]


def _check(config) -> None:
    """GEM's numbers, named as flags."""
    if not 0.0 <= config.gem_plain_share <= 1.0:
        raise ValueError(f"--gem-plain-share must be in [0, 1], got {config.gem_plain_share}")
    if not 0.0 <= config.gem_prefix_dropout < 1.0:
        raise ValueError(f"--gem-prefix-dropout must be in [0, 1), got {config.gem_prefix_dropout}")
    if config.gem_switch_step < 0:
        raise ValueError(f"--gem-switch-step must be >= 0, got {config.gem_switch_step}")
    if config.gem_contrastive_lr_scale < 0:
        raise ValueError(f"--gem-contrastive-lr-scale must be >= 0, got {config.gem_contrastive_lr_scale}")
    if config.gem_max_logit_scale <= 0:
        raise ValueError(f"--gem-max-logit-scale must be > 0, got {config.gem_max_logit_scale}")
    if config.gem_summary_tokens == "new" and not config.gem_train_summary_rows:
        raise ValueError(
            "new summary tokens have no pretrained embedding rows and must be trained: drop "
            "--no-gem-train-summary-rows or pass --gem-summary-tokens spare"
        )
    if config.max_length < config.num_summary_tokens + 2:
        raise ValueError(
            f"--max-length {config.max_length} leaves no room for a text token and EOS beside "
            f"--num-summary-tokens {config.num_summary_tokens}; raise --max-length"
        )


@register_method
class GEM(Method):
    """Batches (:meth:`collate`): NTP rows ``input_ids``, ``attention_mask``, ``summary`` (B, T); contrastive
    rows ``view_ids``, ``view_mask``, ``view_pool`` (2B, T'): the B texts with the block appended, then their
    B positives."""

    name = "gem"

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        _check(config)
        known = len(ctx.tokenizer)
        self.summary_ids = summary_tokens(ctx.tokenizer, config.num_summary_tokens, config.gem_summary_tokens)
        self.added_ids = [i for i in self.summary_ids if i >= known]  # new to this tokenizer: rows to make
        if config.steps <= config.gem_switch_step:
            logger.warning(
                "gem: --steps %d <= --gem-switch-step %d: the run is NTP only (the paper: 1,000 steps, switch at 100)",
                config.steps,
                config.gem_switch_step,
            )

    @property
    def _dropout_views(self) -> bool:
        return self.config.gem_positives == "dropout"

    @property
    def lora_dropout(self) -> float:
        c = self.config
        return c.dropout if self._dropout_views and c.dropout_on == "lora" else c.lora_dropout

    @property
    def attention_dropout(self) -> float:
        c = self.config
        return c.dropout if self._dropout_views and c.dropout_on == "attention" else 0.0

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Summary tokens new to the tokenizer or the model: grow the vocabulary, set their input rows
        (``--gem-summary-init``)."""
        rows = model.get_input_embeddings().weight.shape[0]
        fresh = [i for i in self.summary_ids if i in self.added_ids or i >= rows]
        if not fresh:
            return model
        grow_vocabulary(model, max(fresh) + 1)
        weight = model.get_input_embeddings().weight  # (V, D); the tied head's too
        with torch.no_grad():
            if self.config.gem_summary_init == "eos":
                row = weight[self.ctx.tokenizer.eos_token_id].float()  # (D,)
            else:
                row = weight[: min(fresh)].float().mean(0)  # (D,) over the tokenizer's own tokens
            weight[fresh] = row.to(weight.dtype)
        return model

    def lora_extra(self) -> dict:
        return {"trainable_token_indices": list(self.summary_ids)} if self.config.gem_train_summary_rows else {}

    def lr_lambda(self, step: int) -> float:
        """1 (``--lr``) for the NTP steps, then ``--gem-contrastive-lr-scale`` decayed by a cosine to 0 at
        ``--steps`` (or constant)."""
        c = self.config
        if step < c.gem_switch_step:
            return 1.0
        if c.gem_lr_schedule == "constant":
            return c.gem_contrastive_lr_scale
        progress = min(1.0, (step - c.gem_switch_step) / max(1, c.steps - c.gem_switch_step))
        return c.gem_contrastive_lr_scale * 0.5 * (1.0 + math.cos(math.pi * progress))

    def build_objective(self, llm):
        c = self.config
        if llm.get_input_embeddings().weight.shape[0] <= max(self.summary_ids):
            self.prepare_model(llm)  # a model that did not come through the trainer's prepare_model
        return GEMObjective(
            llm,
            c.gem_switch_step,
            c.temperature,
            c.ce_chunk_size,
            learn_logit_scale=c.gem_learn_logit_scale,
            max_logit_scale=c.gem_max_logit_scale,
        )

    def _insert_block(self, ids: list[int], gen: torch.Generator) -> tuple[list[int], list[int]]:
        """One NTP row: plain (share ``gem_plain_share``) or with the block at a random place -> (ids, summary flags).

        The block goes before token ``at``: at least one text token before it (after BOS) and at least one
        token after it (the final EOS counts; ``--gem-block-position inner``: a text token and the EOS).
        """
        tok, n = self.ctx.tokenizer, len(self.summary_ids)
        start = 1 if has_bos(tok, ids) else 0
        last = len(ids) - (2 if self.config.gem_block_position == "inner" else 1)  # the latest place allowed
        if torch.rand(1, generator=gen).item() < self.config.gem_plain_share or last < start + 1:
            return ids, [0] * len(ids)
        at = int(torch.randint(start + 1, last + 1, (1,), generator=gen))
        return ids[:at] + self.summary_ids + ids[at:], [0] * at + [1] * n + [0] * (len(ids) - at)

    def _positive(self, anchor: PooledInput, gen: torch.Generator) -> PooledInput:
        """The anchor (text + block) with round(share x n) of its n text tokens dropped (at least 1, at most
        n - 1; BOS kept); a one-token text is its own positive."""
        n_summary = len(self.summary_ids)
        text = anchor.ids[:-n_summary]
        start = 1 if has_bos(self.ctx.tokenizer, text) else 0
        n = len(text) - start
        share = self.config.gem_prefix_dropout
        drop = min(n - 1, max(1, round(share * n))) if share > 0 else 0
        if drop <= 0:
            return anchor
        dropped = set((torch.randperm(n, generator=gen)[:drop] + start).tolist())
        kept = [token for i, token in enumerate(text) if i not in dropped]
        return PooledInput(kept + self.summary_ids, [0] * len(kept) + [1] * n_summary)

    def collate(self, texts, indices) -> Batch:
        """NTP rows (B, T) and contrastive rows (2B, T'): anchors, then positives (prefix dropout; with
        ``--gem-positives dropout`` the anchors again, made to differ by model dropout)."""
        tok, n = self.ctx.tokenizer, len(self.summary_ids)
        gens = [example_generator(self.config.seed, i) for i in indices]  # block, then positive, per example
        # every NTP row, with or without the block, keeps max_length - k tokens of text (one budget for both)
        encoded = encode_with_eos(tok, texts, self.config.max_length - n, warn=False)
        rows, flags = zip(*(self._insert_block(ids, g) for ids, g in zip(encoded, gens, strict=True)), strict=True)
        ids, mask = pad_right(list(rows), tok.pad_token_id)
        summary, _ = pad_right(list(flags), 0)
        anchors = self.embedding_spec().build_inputs(tok, texts, self.config.max_length)
        if self._dropout_views:
            positives = anchors
        else:
            positives = [self._positive(a, g) for a, g in zip(anchors, gens, strict=True)]
        view_ids, view_mask = pad_right([x.ids for x in anchors + positives], tok.pad_token_id)
        view_pool, _ = pad_right([x.pool for x in anchors + positives], 0)
        return Batch(
            input_ids=ids,
            attention_mask=mask,
            summary=summary.bool(),
            view_ids=view_ids,
            view_mask=view_mask,
            view_pool=view_pool,
        )

    def embedding_spec(self) -> EmbeddingSpec:
        return EmbeddingSpec(attention="gem", pooling="summary", summary_ids=tuple(self.summary_ids))
