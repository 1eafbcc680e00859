"""``--method gem`` (arXiv:2506.04344; docs/methods.md, "GEM"): summary tokens, the ``gem`` attention rule and
``L = (1 - a) L_NTP + a L_contrastive``. Embeds with the ``gem`` rule and ``summary`` pooling.

The paper's recipe is the default; [open] marks what the paper leaves open, our choice and its flag
(fields of :class:`GEMOptions`):

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
from dataclasses import dataclass, field

import torch

from unimae.data.batch import Batch
from unimae.data.masking import example_generator
from unimae.embedding.pooling import PooledInput
from unimae.embedding.spec import EmbeddingSpec
from unimae.embedding.tokenization import encode_with_eos, spare_special_tokens
from unimae.losses.gem import GEMObjective
from unimae.models import grow_vocabulary
from unimae.training.config import TrainConfig, choice_field
from unimae.training.methods.base import Method, decayed_lr, has_bos, pad_right
from unimae.training.methods.options import DropoutViewOptions
from unimae.training.methods.registry import register_method

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


@dataclass
class GEMOptions(DropoutViewOptions):
    """GEM's summary tokens, rows, positives and two-phase schedule (its InfoNCE temperature, and the dropout of
    ``--gem-positives dropout``, come from :class:`~unimae.training.methods.options.DropoutViewOptions`).

    The paper's recipe is the default; ``[open]`` marks the choices the paper leaves to us.
    """

    # --recipe paper: the paper's contrastive lr, 1e-5 after 1e-4, and one micro-batch per step. The CPU recipe keeps
    # --lr: the paper's 1e-5 is for full fine-tuning, and with LoRA it leaves GEM below Echo pooling
    # (docs/results.md, "GEM as its paper describes it").
    recipes = {"paper": {"gem_contrastive_lr_scale": 0.1}}
    full_batch_recipes = ("paper",)

    num_summary_tokens: int = field(
        default=1, metadata={"help": "Summary tokens per text, k (paper: 1; ablation 1, 2, 5, 10)."}
    )
    gem_plain_share: float = field(
        default=0.8, metadata={"help": "Share of NTP rows without the summary block, p (paper: 0.8)."}
    )
    gem_switch_step: int = field(
        default=100, metadata={"help": "Steps of NTP before the loss switches to contrastive (paper: 100)."}
    )
    gem_summary_tokens: str = choice_field(
        "new",
        ("new", "spare"),
        "'new' (k new special tokens <|summary_i|> added to the tokenizer, embedding rows grown, "
        "as the paper) or 'spare' (the tokenizer's k highest spare special tokens, no resize).",
    )
    gem_summary_init: str = choice_field(
        "mean",
        ("mean", "eos"),
        "[open] Initial input-embedding rows of new summary tokens: 'mean' (mean of the "
        "vocabulary's rows; with a tied head their logit starts at the average token's) or 'eos' (a copy of "
        "EOS's row, so the untrained summary state is h_eos; with a tied head their logit starts at EOS's).",
    )
    gem_train_summary_rows: bool = field(
        default=True,
        metadata={
            "help": "Train the summary tokens' embedding rows (peft trainable_token_indices; only those rows "
            "are saved); --no-gem-train-summary-rows with --gem-summary-tokens spare is the earlier behaviour."
        },
    )
    gem_block_position: str = choice_field(
        "uniform",
        ("uniform", "inner"),
        "[open] Where the block goes in an NTP row: 'uniform' over the gaps with >= 1 text token "
        "before it and >= 1 token after it (the final EOS counts), or 'inner' (>= 1 text token after it too).",
    )
    gem_positives: str = choice_field(
        "prefix",
        ("prefix", "dropout"),
        "The contrastive positive of a text: 'prefix' (the same row with --gem-prefix-dropout of "
        "its text tokens dropped, as the paper; no model dropout) or 'dropout' (a second pass with --dropout "
        "on --dropout-on, SimCSE style; the earlier behaviour).",
    )
    gem_prefix_dropout: float = field(
        default=0.5,
        metadata={
            "help": "[open] Share of a text's tokens (BOS kept) dropped to make its positive: round(share x n) "
            "tokens, at least 1 and at most n - 1. 0.5: harder positives; on SmolLM2 (300 steps, 7 dev tasks) "
            "58.89 against 55.09 at 0.2."
        },
    )
    gem_learn_logit_scale: bool = field(
        default=True,
        metadata={
            "help": "Learn the InfoNCE logit scale (CLIP style, starting at 1 / --temperature = 20); "
            "--no-gem-learn-logit-scale keeps 1 / --temperature fixed."
        },
    )
    gem_max_logit_scale: float = field(
        default=100.0, metadata={"help": "Upper clamp of the learnable logit scale (paper, CLIP: 100)."}
    )
    gem_contrastive_lr_scale: float = field(
        default=1.0,
        metadata={
            "help": "[decision] Learning rate of the contrastive phase as a multiple of --lr, which the NTP "
            "phase uses. 1: LoRA at the paper's 1e-5 (0.1, --recipe paper) barely moves: on SmolLM2 300 steps "
            "score 44.88 on the dev suite at 0.1 and 53.32 at 1 (Echo pooling 45.82)."
        },
    )
    gem_lr_schedule: str = choice_field(
        "cosine",
        ("cosine", "constant"),
        "Contrastive-phase schedule: 'cosine' (from --lr x --gem-contrastive-lr-scale to 0 at "
        "--steps) or 'constant'. The NTP phase is constant at --lr.",
    )

    def check(self, config: TrainConfig, world_size: int) -> None:
        """GEM's numbers, named as flags; a warning for a run that never reaches the contrastive phase."""
        super().check(config, world_size)
        self._check_shares()
        if self.num_summary_tokens < 1:
            raise ValueError(f"num_summary_tokens must be >= 1, got {self.num_summary_tokens}")
        if config.max_length < self.num_summary_tokens + 2:
            raise ValueError(
                f"--max-length {config.max_length} leaves no room for a text token and EOS beside "
                f"--num-summary-tokens {self.num_summary_tokens}; raise --max-length"
            )
        if self.gem_summary_tokens == "new" and not self.gem_train_summary_rows:
            raise ValueError(
                "new summary tokens have no pretrained embedding rows and must be trained: drop "
                "--no-gem-train-summary-rows or pass --gem-summary-tokens spare"
            )
        if config.steps <= self.gem_switch_step:
            logger.warning(
                "gem: --steps %d <= --gem-switch-step %d: the run is NTP only (the paper: 1,000 steps, switch at 100)",
                config.steps,
                self.gem_switch_step,
            )

    def _check_shares(self) -> None:
        if not 0.0 <= self.gem_plain_share <= 1.0:
            raise ValueError(f"--gem-plain-share must be in [0, 1], got {self.gem_plain_share}")
        if not 0.0 <= self.gem_prefix_dropout < 1.0:
            raise ValueError(f"--gem-prefix-dropout must be in [0, 1), got {self.gem_prefix_dropout}")
        if self.gem_switch_step < 0:
            raise ValueError(f"--gem-switch-step must be >= 0, got {self.gem_switch_step}")
        if self.gem_contrastive_lr_scale < 0:
            raise ValueError(f"--gem-contrastive-lr-scale must be >= 0, got {self.gem_contrastive_lr_scale}")
        if self.gem_max_logit_scale <= 0:
            raise ValueError(f"--gem-max-logit-scale must be > 0, got {self.gem_max_logit_scale}")


@register_method
class GEM(Method):
    """Batches (:meth:`collate`): NTP rows ``input_ids``, ``attention_mask``, ``summary`` (B, T); contrastive
    rows ``view_ids``, ``view_mask``, ``view_pool`` (2B, T'): the B texts with the block appended, then their
    B positives."""

    name = "gem"
    options_class = GEMOptions

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        known, o = len(ctx.tokenizer), self.options
        self.summary_ids = summary_tokens(ctx.tokenizer, o.num_summary_tokens, o.gem_summary_tokens)
        self.added_ids = [i for i in self.summary_ids if i >= known]  # new to this tokenizer: rows to make

    @property
    def _dropout_views(self) -> bool:
        return self.options.gem_positives == "dropout"

    @property
    def lora_dropout(self) -> float:
        o = self.options
        return o.dropout if self._dropout_views and o.dropout_on == "lora" else self.config.lora_dropout

    @property
    def attention_dropout(self) -> float:
        o = self.options
        return o.dropout if self._dropout_views and o.dropout_on == "attention" else 0.0

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
            if self.options.gem_summary_init == "eos":
                row = weight[self.ctx.tokenizer.eos_token_id].float()  # (D,)
            else:
                row = weight[: min(fresh)].float().mean(0)  # (D,) over the tokenizer's own tokens
            weight[fresh] = row.to(weight.dtype)
        return model

    def lora_extra(self) -> dict:
        return {"trainable_token_indices": list(self.summary_ids)} if self.options.gem_train_summary_rows else {}

    def fixed_on_resume(self, step: int) -> set[str]:
        cosine = self.options.gem_lr_schedule != "constant" and step > self.options.gem_switch_step
        return {"steps"} if cosine else set()  # a cosine under way ends at --steps: another would bend it

    def lr_lambda(self, step: int) -> float:
        """1 (``--lr``) for the NTP steps, then ``--gem-contrastive-lr-scale`` decayed by a cosine to 0 at
        ``--steps`` (or constant)."""
        o = self.options
        return decayed_lr(o.gem_lr_schedule, step, o.gem_switch_step, self.config.steps, o.gem_contrastive_lr_scale)

    def build_objective(self, llm):
        o = self.options
        if llm.get_input_embeddings().weight.shape[0] <= max(self.summary_ids):
            self.prepare_model(llm)  # a model that did not come through the trainer's prepare_model
        return GEMObjective(
            llm,
            o.gem_switch_step,
            o.temperature,
            self.config.ce_chunk_size,
            learn_logit_scale=o.gem_learn_logit_scale,
            max_logit_scale=o.gem_max_logit_scale,
        )

    def _insert_block(self, ids: list[int], gen: torch.Generator) -> tuple[list[int], list[int]]:
        """One NTP row: plain (share ``gem_plain_share``) or with the block at a random place -> (ids, summary flags).

        The block goes before token ``at``: at least one text token before it (after BOS) and at least one
        token after it (the final EOS counts; ``--gem-block-position inner``: a text token and the EOS).
        """
        tok, n = self.ctx.tokenizer, len(self.summary_ids)
        start = 1 if has_bos(tok, ids) else 0
        last = len(ids) - (2 if self.options.gem_block_position == "inner" else 1)  # the latest place allowed
        if torch.rand(1, generator=gen).item() < self.options.gem_plain_share or last < start + 1:
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
        share = self.options.gem_prefix_dropout
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
