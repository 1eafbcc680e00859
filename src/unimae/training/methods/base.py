"""The contract of a training method: what it trains on, how it batches, what it optimizes, how it embeds.

A :class:`Method` names its options class (``options_class``, a :class:`~unimae.training.config.MethodOptions`
subclass that ``TrainConfig.options`` holds: the method's flags, recipe values and checks). It is built once per run
from the resolved, validated config and a :class:`Context`; the trainer asks it,
in this order: ``load_data()`` (the examples), ``lora_dropout`` / ``attention_dropout`` (while building the
LoRA model), ``prepare_model(model)`` and ``lora_extra()`` (the base model before LoRA, extra LoRA
fields), ``build_objective(llm)`` (the :class:`~unimae.losses.objective.Objective` nn.Module to
optimize), ``lr_lambda(step)`` (the learning-rate multiplier of each step),
``example_order(num_examples, seed)`` (which example fills each global batch position),
``collate(examples, indices)`` per micro-batch (a :class:`~unimae.data.batch.Batch`; randomness must
come from ``(seed, example index)`` so resume and any process split reproduce it), and at the end
``embedding_spec()`` (written into the adapter's ``unimae.json``). Add a method by subclassing and
decorating it with :func:`unimae.training.methods.register_method`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from unimae.data.batch import Batch
from unimae.data.corpus import load_texts
from unimae.data.order import DataOrder
from unimae.embedding.spec import EmbeddingSpec
from unimae.embedding.tokenization import pad_batch
from unimae.training.config import MethodOptions, TrainConfig

if TYPE_CHECKING:
    from unimae.losses.objective import Objective


@dataclass
class Context:
    """What the trainer resolved for a run: the tokenizer, the mask token and the init adapter's spec."""

    tokenizer: object
    mask_id: int
    init_spec: EmbeddingSpec


class Method:
    """Base class; subclasses set ``name`` (and ``options_class`` when they have options) and implement
    ``build_objective``, ``collate``, ``embedding_spec``."""

    name: ClassVar[str]
    options_class: ClassVar[type[MethodOptions]] = MethodOptions

    def __init__(self, config: TrainConfig, ctx: Context):
        self.config, self.ctx = config, ctx

    @property
    def options(self) -> MethodOptions:
        """This method's options (``config.options``)."""
        return self.config.options

    def load_data(self) -> list:
        """The training examples (texts by default; ``collate`` receives a slice of them)."""
        return load_texts(self.config.data)

    def example_order(self, num_examples: int, seed: int):
        """Which example fills each global example index: an object whose ``text_index(i)`` is an index into
        ``load_data()``'s list, a pure function of (seed, i) so resume and any process split reproduce it
        (global batch k holds indices ``k*batch_size ..``). Default: :class:`~unimae.data.order.DataOrder`, every
        epoch a fresh permutation of all examples; ``contrastive`` draws each batch from one source."""
        return DataOrder(num_examples, seed)

    @property
    def lora_dropout(self) -> float:
        return self.config.lora_dropout

    @property
    def attention_dropout(self) -> float:
        """Attention-probability dropout while training (0: leave the model's own rate)."""
        return 0.0

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The base model before LoRA is added (e.g. new token rows); unchanged by default."""
        return model

    def lora_extra(self) -> dict:
        """Extra ``peft.LoraConfig`` fields (e.g. ``trainable_token_indices``); none by default."""
        return {}

    def fixed_on_resume(self, step: int) -> set[str]:
        """Settings a ``--resume`` from ``step`` may otherwise change that this method's run so far depends on
        (a schedule over ``--steps`` already under way); none by default."""
        return set()

    def lr_lambda(self, step: int) -> float:
        """Multiplier of ``--lr`` at 0-based optimizer step ``step`` (the trainer's ``LambdaLR``); a pure
        function of the step, so resume reproduces it. Default 1.0: constant (UniMAE paper App. C)."""
        return 1.0

    def build_objective(self, llm: torch.nn.Module) -> Objective:
        raise NotImplementedError

    def collate(self, examples: Sequence, indices: Sequence[int]) -> Batch:
        raise NotImplementedError

    def embedding_spec(self) -> EmbeddingSpec:
        raise NotImplementedError


class ViewDropoutMixin:
    """simcse and gem: two views of a text differ by dropout (``--dropout``, options
    :class:`~unimae.training.methods.options.DropoutViewOptions`), acting where ``--dropout-on`` says.

    Attention dropout by default (as LLM2Vec): a fresh LoRA has B = 0, so LoRA dropout alone leaves the
    two views identical until the first update.
    """

    config: TrainConfig

    @property
    def lora_dropout(self) -> float:
        o = self.config.options
        return o.dropout if o.dropout_on == "lora" else self.config.lora_dropout

    @property
    def attention_dropout(self) -> float:
        o = self.config.options
        return o.dropout if o.dropout_on == "attention" else 0.0


def decayed_lr(schedule: str, step: int, start: int, steps: int, scale: float = 1.0) -> float:
    """Multiplier of ``--lr`` at 0-based step ``step``: 1 before ``start``, then ``scale`` times the schedule's factor
    of the progress p = (step - start) / (steps - start): constant 1, linear 1 - p, or cosine (1 + cos(pi p)) / 2
    (SGDR, arXiv:1608.03983, without restarts), 0 at ``steps``. The supervised contrastive stage's
    ``--lr-schedule`` (scale 1) and GEM's contrastive phase (``--gem-contrastive-lr-scale``) share it."""
    if step < start:
        return 1.0
    progress = min(1.0, (step - start) / max(1, steps - start))
    if schedule == "linear":
        return scale * (1.0 - progress)
    if schedule == "cosine":
        return scale * 0.5 * (1.0 + math.cos(math.pi * progress))
    return scale


def pad_right(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids -> (B, T) ids and (B, T) 0/1 mask, right-padded."""
    return pad_batch(rows, pad_id, "right")


def pooled_batch(tokenizer, texts: Sequence[str], max_length: int, spec: EmbeddingSpec, **extra) -> Batch:
    """Texts tokenized for ``spec``'s pooling -> Batch(input_ids, attention_mask, pool_mask (B, T), **extra)."""
    inputs = spec.build_inputs(tokenizer, texts, max_length)
    ids, mask = pad_right([i.ids for i in inputs], tokenizer.pad_token_id)
    pool_mask, _ = pad_right([i.pool for i in inputs], 0)
    return Batch(input_ids=ids, attention_mask=mask, pool_mask=pool_mask, **extra)


def has_bos(tokenizer, ids: Sequence[int]) -> bool:
    return tokenizer.bos_token_id is not None and len(ids) > 0 and ids[0] == tokenizer.bos_token_id
