"""``--method contrastive``: supervised InfoNCE on (query, positive[, negative]) pairs (UniMAE App. D).

In-batch negatives plus the hard negatives of the batch, without the batch's known false negatives
(``--mask-false-negatives``); ``--symmetric-loss`` adds the positive -> queries direction; ``--lm-weight``
adds a next-token loss on the positives (GritLM's joint objective), so that the adapter keeps generating; with
``--lm-data`` on texts of another source instead (GritLM's separate generative data).
``--data`` takes several files (or a mixture file) with ``--data-weights``; every global batch is drawn from one source
(:mod:`unimae.data.pairs`). ``--grad-cache-chunk N`` embeds the batch in chunks of N texts with a gradient cache,
so large batches fit in memory. Trains (and embeds with) the ``--init-adapter``'s spec, as SimCSE does:
causal attention and the [EOS] state after UniMAE, so generation and KV reuse are unchanged.

Prompts (``--query-prompt``, ``--document-prompt``): the queries (and documents) of every source but
``--symmetric-sources`` are embedded after the prompt's text; a symmetric source's pairs (paraphrases, NLI)
take none, as texts are embedded outside retrieval. The prompts are saved in the adapter's spec.
``--query-prompt-dropout p`` trains a share p of the asymmetric queries without the prompt (a choice of this
project, not of the papers: short unprompted texts, which mteb embeds without a prompt outside retrieval, stay in
the training distribution).
``--matryoshka-dims`` sums InfoNCE over the full vector and each truncated prefix (see
:class:`~unimae.losses.supervised_contrastive.ContrastiveObjective`); the dimensions are saved in the spec as well.
``--distill-teacher`` (a sentence-transformers model) adds in-batch distillation: each query's softmax over the
batch's candidates also matches the teacher's (:mod:`unimae.losses.distillation`; this project's option, not the
papers'), weighted by ``--distill-weight``; ``--distill-loss similarity`` matches the teacher's cosine of every pair of
the batch's texts instead (Jasper and Stella's similarity loss).
``--lr-schedule linear|cosine`` decays ``--lr`` from step ``--lr-decay-from`` to 0 at ``--steps`` (constant by
default, UniMAE App. C; the decay is this project's option, see :meth:`Contrastive.lr_lambda`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from unimae.data.corpus import load_texts
from unimae.data.pairs import Mixture, SourceBatchOrder, load_mixture, load_pairs, pair_groups
from unimae.embedding.spec import EmbeddingSpec
from unimae.embedding.tokenization import encode_with_eos
from unimae.losses.distillation import DISTILL_LOSSES
from unimae.losses.grad_cache import GradCacheContrastiveObjective
from unimae.losses.supervised_contrastive import ContrastiveObjective
from unimae.runtime.precision import resolve_device
from unimae.training.config import TrainConfig, choice_field
from unimae.training.methods.base import Context, Method, decayed_lr, pad_right, pooled_batch
from unimae.training.methods.options import InfoNCEOptions, pooling_field
from unimae.training.methods.registry import register_method
from unimae.training.methods.simcse import init_spec_with_pooling
from unimae.training.teacher import Teacher, load_teacher

__all__ = ["Contrastive", "ContrastiveOptions", "load_pairs"]

logger = logging.getLogger(__name__)

LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class ContrastiveOptions(InfoNCEOptions):
    """Supervised InfoNCE on pairs: data mixture, loss variants, the next-token term, prompts, Matryoshka
    dimensions and the gradient cache."""

    pooling: str = pooling_field()
    data_weights: str = field(
        default="",
        metadata={
            "help": "--data may list several JSONL files (comma-separated) or be a .yaml/.json mixture file "
            "([{path, weight}, ...]); every batch is drawn from one of them with these sampling weights: one "
            "number per file (comma-separated), 'size' (proportional to its pairs), 'sqrt', or empty (the mixture "
            "file's weights, else 'size')."
        },
    )
    symmetric_loss: bool = field(
        default=False,
        metadata={"help": "Symmetric InfoNCE, the mean of query -> positives and positive -> queries."},
    )
    mask_false_negatives: bool = field(
        default=True,
        metadata={
            "help": "Leave a batch's known false negatives out of the softmax (rows sharing a query or a positive, "
            "reversed paraphrase pairs)."
        },
    )
    lm_weight: float = field(
        default=0.0,
        metadata={
            "help": "Add this weight x the next-token loss of the pairs' positives to InfoNCE (GritLM's joint "
            "objective, on the positives' own text), so the adapter keeps generating; 0: off. Costs an output-head "
            "pass over the positives' tokens."
        },
    )
    lm_texts: int = field(
        default=0,
        metadata={
            "help": "With --lm-weight: the next-token loss on the first N positives of each batch only (0: all); the "
            "output head over a 262k vocabulary makes scoring all 256 of a batch costly (docs/methods.md). With "
            "--lm-data: N texts of that source per batch (0: as many as the batch has pairs)."
        },
    )
    lm_data: str = field(
        default="",
        metadata={
            "help": "[decision] With --lm-weight: the next-token term reads texts of this source instead of the "
            "positives (GritLM's separate generative data): 'enwiki-gensim' (the default corpus' training "
            "articles), a .txt/.jsonl/.parquet file or a Hub dataset, as --data of the unsupervised methods; each "
            "batch draws --lm-texts of them in a seeded order (every text once before any repeats). Costs a "
            "forward and backward of those texts; empty: the positives."
        },
    )
    query_prompt: str = field(
        default="",
        metadata={
            "help": "Text prefix of the queries of asymmetric sources (all sources but --symmetric-sources), saved "
            "as the adapter's 'query' prompt (Encoder.encode_query, mteb's query prompt, the server's "
            "input_type=query); empty: no prompts."
        },
    )
    query_prompt_dropout: float = field(
        default=0.0,
        metadata={
            "help": "Share of asymmetric queries trained without --query-prompt (each drawn from the seed and the "
            "example's index, so resume and any process split give the same): short unprompted texts stay in the "
            "training distribution beside prompted queries (0: every query gets it)."
        },
    )
    document_prompt: str = field(
        default="",
        metadata={
            "help": "Text prefix of the positives and negatives of asymmetric sources, saved as the adapter's "
            "'document' prompt; empty: documents embed as they are."
        },
    )
    symmetric_sources: str = field(
        default="",
        metadata={
            "help": "--data sources (file names without .jsonl, comma-separated) whose pairs are symmetric "
            "(paraphrase, NLI): neither side gets a prompt, as texts embed outside retrieval."
        },
    )
    matryoshka_dims: str = field(
        default="",
        metadata={
            "help": "Also train these prefix sizes of the embedding to stand alone (comma-separated, e.g. "
            "64,128,256): InfoNCE summed over the full vector and each truncated, re-normalised prefix "
            "(sentence-transformers' MatryoshkaLoss, weights 1); empty: off."
        },
    )
    lr_schedule: str = choice_field(
        "constant",
        LR_SCHEDULES,
        "[decision] Multiplier of --lr over the run: 'constant' (UniMAE App. C, the papers' supervised stages), or "
        "'linear' / 'cosine' from 1 at --lr-decay-from to 0 at --steps (sentence-transformers' default is linear "
        "with warm-up). A run continued from a release decays over its own steps with --lr-decay-from set to the "
        "release's step.",
    )
    lr_decay_from: int = field(
        default=0,
        metadata={
            "help": "With --lr-schedule linear or cosine: the step (0-based, counted over the whole run, a continued "
            "adapter's steps included) where the decay starts; the steps before it keep --lr."
        },
    )
    distill_teacher: str = field(
        default="",
        metadata={
            "help": "[decision] A sentence-transformers model (folder or Hub id) to distill from: each query's "
            "softmax over the batch's candidates also matches the teacher's, KL(teacher || student) (RocketQAv2's "
            "listwise distillation, arXiv:2110.07367) times --distill-weight; the teacher embeds the pairs' raw "
            "texts (no prompts). Needs the whole batch in one micro-batch on one process; empty: off."
        },
    )
    distill_weight: float = field(default=1.0, metadata={"help": "With --distill-teacher: the weight of its term."})
    distill_loss: str = choice_field(
        "listwise",
        DISTILL_LOSSES,
        "[decision] With --distill-teacher: 'listwise', each query's softmax over the batch's candidates matches the "
        "teacher's (KL, at --distill-temperature); 'similarity', the student's cosine of every pair of the batch's "
        "texts (queries, positives, negatives) matches the teacher's (mean squared difference; Jasper and Stella, "
        "arXiv:2412.19048): graded similarities, including those of unrelated texts. Its term is much smaller than "
        "the KL: weigh it accordingly (docs/methods.md).",
    )
    distill_temperature: float = field(
        default=0.05,
        metadata={
            "help": "With --distill-teacher: the temperature of the teacher's softmax over its cosines (0.05: the "
            "scale 20 that sentence-transformers' all-* models were trained with)."
        },
    )
    grad_cache_chunk: int = field(
        default=0,
        metadata={
            "help": "Gradient cache, embedding the batch in chunks of N texts (0: off), so a large batch needs one "
            "chunk's memory; needs --micro-batch-size equal to --batch-size (in-batch negatives span the whole "
            "batch) and one process."
        },
    )

    @property
    def negatives_span_batch(self) -> bool:
        return self.grad_cache_chunk > 0

    @property
    def dims(self) -> tuple[int, ...]:
        """``--matryoshka-dims`` as sorted integers."""
        return parse_dims(self.matryoshka_dims)

    @property
    def symmetric(self) -> set[str]:
        """The ``--symmetric-sources`` names."""
        return {name.strip() for name in self.symmetric_sources.split(",") if name.strip()}

    def check(self, config: TrainConfig, world_size: int) -> None:
        super().check(config, world_size)
        for name in ("lm_weight", "lm_texts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        parse_dims(self.matryoshka_dims)  # a ValueError naming --matryoshka-dims
        if not 0 <= self.query_prompt_dropout <= 1:
            raise ValueError(f"--query-prompt-dropout must be in [0, 1], got {self.query_prompt_dropout}")
        self._check_schedule(config)
        self._check_grad_cache(config, world_size)
        self._check_distill(config, world_size)
        self._warn_unused()

    def _check_distill(self, config: TrainConfig, world_size: int) -> None:
        if self.distill_weight < 0 or self.distill_temperature <= 0:
            raise ValueError(
                f"--distill-weight must be >= 0 and --distill-temperature > 0, got {self.distill_weight} and "
                f"{self.distill_temperature}"
            )
        if self.distill_teacher and (config.micro_batch_size != config.batch_size or world_size > 1):
            raise ValueError(
                "--distill-teacher scores each query against the whole batch's candidates: it needs "
                f"--micro-batch-size equal to --batch-size ({config.batch_size}, got {config.micro_batch_size}; "
                "--grad-cache-chunk keeps memory bounded) and one process"
            )

    def _warn_unused(self) -> None:
        """A warning for each option set where nothing reads it (the run goes on without it)."""
        unused = {
            "--lm-texts (without --lm-weight)": self.lm_texts and not self.lm_weight,
            "--lm-data (without --lm-weight)": self.lm_data and not self.lm_weight,
            "--query-prompt-dropout (without --query-prompt)": self.query_prompt_dropout and not self.query_prompt,
            "--lr-decay-from (with --lr-schedule constant)": self.lr_decay_from and self.lr_schedule == "constant",
            "--distill-weight/-temperature/-loss (without --distill-teacher)": not self.distill_teacher
            and (self.distill_weight, self.distill_temperature, self.distill_loss)
            != (type(self).distill_weight, type(self).distill_temperature, type(self).distill_loss),
            "--distill-temperature (with --distill-loss similarity)": self.distill_loss == "similarity"
            and self.distill_temperature != type(self).distill_temperature,
        }
        for option, ignored in unused.items():
            if ignored:
                logger.warning("%s does nothing in this run", option)

    def _check_schedule(self, config: TrainConfig) -> None:
        if self.lr_decay_from < 0:
            raise ValueError(f"--lr-decay-from must be >= 0, got {self.lr_decay_from}")
        if self.lr_schedule != "constant" and self.lr_decay_from >= config.steps:
            raise ValueError(
                f"--lr-schedule {self.lr_schedule} decays from --lr-decay-from {self.lr_decay_from} to 0 at --steps "
                f"{config.steps}: the decay must start before the last step"
            )

    def _check_grad_cache(self, config: TrainConfig, world_size: int) -> None:
        chunk = self.grad_cache_chunk
        if chunk < 0:
            raise ValueError(f"--grad-cache-chunk must be >= 0 (0 = off), got {chunk}")
        if chunk and config.micro_batch_size != config.batch_size:
            raise ValueError(
                f"--grad-cache-chunk needs --micro-batch-size equal to --batch-size ({config.batch_size}, got "
                f"{config.micro_batch_size}): the gradient cache is what splits the batch, and in-batch negatives "
                "must span the whole batch"
            )
        if chunk and world_size > 1:
            raise ValueError(
                "--grad-cache-chunk runs on one process: split over processes, each would see only its shard's "
                "negatives and run several backward passes per step under DDP; drop the launcher (use --threads) "
                "or set --grad-cache-chunk 0"
            )


@register_method
class Contrastive(Method):
    """Batches: rows = B queries, B positives, then the hard negatives; ``num_queries`` = B;
    ``false_negatives`` (B, B + K) bool when ``--mask-false-negatives``."""

    name = "contrastive"
    options_class = ContrastiveOptions

    def __init__(self, config: TrainConfig, ctx: Context):
        super().__init__(config, ctx)
        self.mixture: Mixture | None = None

    def load_data(self) -> list[dict]:
        self.mixture = load_mixture(self.config.data, self.options.data_weights, self.config.batch_size)
        names = {source.name for source in self.mixture.sources}
        unknown = sorted(self.options.symmetric - names)
        if unknown:
            raise ValueError(
                f"--symmetric-sources names {unknown}, which are not among the --data sources {sorted(names)}"
            )
        logger.info("contrastive pairs: %s", self.mixture.describe())
        if self.options.lm_data and self.options.lm_weight:
            logger.info("next-token term: %d texts of %s", len(self.lm_corpus), self.options.lm_data)
        return self.mixture.pairs

    def example_order(self, num_examples: int, seed: int) -> SourceBatchOrder:
        """One source per global batch (needs ``load_data`` first)."""
        if self.mixture is None or len(self.mixture.pairs) != num_examples:
            raise RuntimeError("Contrastive.example_order needs the pairs of load_data()")
        return self.mixture.order(self.config.batch_size, seed)

    def fixed_on_resume(self, step: int) -> set[str]:
        decaying = self.options.lr_schedule != "constant" and step > self.options.lr_decay_from
        return {"steps"} if decaying else set()  # a decay under way ends at --steps: another would bend it

    def lr_lambda(self, step: int) -> float:
        """Multiplier of ``--lr`` at 0-based step ``step``: ``decayed_lr`` of ``--lr-schedule`` from
        ``--lr-decay-from`` to ``--steps``."""
        return decayed_lr(self.options.lr_schedule, step, self.options.lr_decay_from, self.config.steps)

    def build_objective(self, llm):
        o = self.options
        args = (llm, o.temperature, self.embedding_spec().attention, o.symmetric_loss)
        kwargs = {"lm_weight": o.lm_weight, "lm_texts": o.lm_texts, "ce_chunk_size": self.config.ce_chunk_size}
        if o.dims:
            kwargs["matryoshka_dims"] = o.dims
        if o.distill_teacher:
            kwargs.update(
                distill_weight=o.distill_weight, teacher_temperature=o.distill_temperature, distill_loss=o.distill_loss
            )
        if o.grad_cache_chunk:
            return GradCacheContrastiveObjective(*args, chunk_size=o.grad_cache_chunk, **kwargs)
        return ContrastiveObjective(*args, **kwargs)

    def collate(self, records, indices):
        query, document = self._prompts(r.get("source") for r in records)
        queries = [self._query_prefix(query, i) + r["query"] for r, i in zip(records, indices, strict=True)]
        texts = queries + [document + r["positive"] for r in records]
        texts += [document + r["negative"] for r in records if r.get("negative")]
        extra = {"num_queries": len(records)}
        if self.options.mask_false_negatives:
            rows, negatives = pair_groups(list(records))
            groups, candidates = torch.tensor(rows), torch.tensor(rows + negatives)
            extra["false_negatives"] = groups[:, None] == candidates[None, :]  # (B, B + K); diagonal kept by info_nce
        if self.options.distill_teacher:
            extra.update(self._teacher_targets(records))
        if self.options.lm_data and self.options.lm_weight:
            extra.update(self._lm_batch(indices))
        return pooled_batch(self.ctx.tokenizer, texts, self.config.max_length, self.embedding_spec(), **extra)

    def _teacher_targets(self, records) -> dict[str, torch.Tensor]:
        """The teacher's cosines of a batch's raw texts (no prompts): ``teacher_scores`` (B, B + K), queries against
        candidates, for ``--distill-loss listwise``; ``teacher_similarities`` (2B + K, 2B + K), every text against
        every other in the batch's row order, for ``similarity``."""
        queries = [r["query"] for r in records]
        documents = [r["positive"] for r in records] + [r["negative"] for r in records if r.get("negative")]
        if self.options.distill_loss == "similarity":
            return {"teacher_similarities": self.teacher.similarities([*queries, *documents])}
        return {"teacher_scores": self.teacher.scores(queries, documents)}

    def _lm_batch(self, indices) -> dict[str, torch.Tensor]:
        """``--lm-data`` rows of a batch: ``lm_input_ids``, ``lm_attention_mask`` (N, T), N = ``--lm-texts`` (or the
        batch's pairs); the text of the batch's j-th example (global index i) is the i-th of the source's seeded
        order, so resume and any split over processes read the same texts."""
        count = min(len(indices), self.options.lm_texts or len(indices))
        texts = [self.lm_corpus[lm_position(i, len(self.lm_corpus), self.config.seed)] for i in indices[:count]]
        tok = self.ctx.tokenizer
        ids, mask = pad_right(encode_with_eos(tok, texts, self.config.max_length, warn=False), tok.pad_token_id)
        return {"lm_input_ids": ids, "lm_attention_mask": mask}

    @functools.cached_property
    def lm_corpus(self) -> list[str]:
        """The ``--lm-data`` texts (loaded by ``load_data``, else at the first batch)."""
        return load_texts(self.options.lm_data)

    @functools.cached_property
    def teacher(self) -> Teacher:
        """The ``--distill-teacher``, loaded at its first batch on the training's ``--device``."""
        return load_teacher(self.options.distill_teacher, self.config.max_length, resolve_device(self.config.device))

    def _prompts(self, sources) -> tuple[str, str]:
        """(query prefix, document prefix) of a batch: '' for a symmetric source's pairs (a batch is one source)."""
        if set(sources) & self.options.symmetric:
            return "", ""
        return self.options.query_prompt, self.options.document_prompt

    def _query_prefix(self, prompt: str, index: int) -> str:
        """``prompt``, or '' for the share ``--query-prompt-dropout`` of queries, drawn from (seed, global example
        index) alone: the same queries lose it on resume and on any split over processes."""
        dropout = self.options.query_prompt_dropout
        if not prompt or not dropout:
            return prompt
        return "" if random.Random(f"{self.config.seed}/{index}").random() < dropout else prompt

    def embedding_spec(self) -> EmbeddingSpec:
        o = self.options
        spec = init_spec_with_pooling(o.pooling, self.ctx)
        prompts = {**spec.prompt_map}
        if o.query_prompt or o.document_prompt:
            prompts.update(query=o.query_prompt, document=o.document_prompt)
        dims = o.dims or spec.matryoshka_dims
        return dataclasses.replace(spec, prompts=tuple(prompts.items()), matryoshka_dims=dims)


def lm_position(index: int, size: int, seed: int) -> int:
    """The ``--lm-data`` text read for global example ``index``: position ``index mod size`` of a permutation of the
    ``size`` texts drawn afresh (from ``seed``) for each pass over them."""
    epoch, offset = divmod(index, size)
    return int(_pass_order(size, seed, epoch)[offset])


@functools.lru_cache(maxsize=2)
def _pass_order(size: int, seed: int, epoch: int) -> np.ndarray:
    """(size,) the order of the ``--lm-data`` texts in pass ``epoch`` (kept for the batches of a pass)."""
    return np.random.default_rng([seed, epoch]).permutation(size)


def parse_dims(text: str) -> tuple[int, ...]:
    """``--matryoshka-dims`` '64,128,256' -> (64, 128, 256); '' -> ()."""
    try:
        dims = tuple(sorted({int(d) for d in text.split(",") if d.strip()}))
    except ValueError:
        raise ValueError(f"--matryoshka-dims takes comma-separated integers such as 64,128,256, got {text!r}") from None
    if any(d < 1 for d in dims):
        raise ValueError(f"--matryoshka-dims must be positive, got {text!r}")
    return dims
