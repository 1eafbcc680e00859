"""Options that several methods share: InfoNCE over in-batch negatives (simcse, contrastive, gem), the dropout that
makes two views of a text differ (simcse, gem) and the pooling to train (simcse, contrastive).

A field defined here is one ``--flag`` for every method whose options have it (``training/config.py``
``option_groups`` lists it under a heading naming those methods).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from unimae.embedding.pooling import POOLINGS
from unimae.training.config import MethodOptions, TrainConfig, choice_field

logger = logging.getLogger(__name__)

DROPOUT_PLACES = ("attention", "lora")


@dataclass
class InfoNCEOptions(MethodOptions):
    """A method whose InfoNCE negatives are the other texts of the micro-batch.

    The papers contrast each text with the rest of the whole batch (GEM: 31 negatives in a batch of 32), so the
    ``paper`` recipe gives simcse and gem one micro-batch per step (their ``full_batch_recipes``); ``contrastive``
    gets a large batch from its gradient cache. A smaller micro-batch trains, with a warning."""

    temperature: float = field(default=0.05, metadata={"help": "InfoNCE temperature."})

    @property
    def negatives_span_batch(self) -> bool:
        """Whether every text meets the whole batch as negatives, whatever the micro-batch."""
        return False

    def check(self, config: TrainConfig, world_size: int) -> None:
        super().check(config, world_size)
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        micro, batch = config.micro_batch_size, config.batch_size
        if micro < 2:
            raise ValueError(
                f"--method {config.method} contrasts each text with the others in its micro-batch; "
                f"micro_batch_size must be >= 2, got {micro}"
            )
        if micro < batch and not self.negatives_span_batch:
            logger.warning(
                "--method %s contrasts each text with the others in its micro-batch: %d negatives per text, not "
                "the %d of the whole batch; --micro-batch-size %d gives the papers' in-batch negatives (more memory)",
                config.method,
                micro - 1,
                batch - 1,
                batch,
            )


@dataclass
class DropoutViewOptions(InfoNCEOptions):
    """InfoNCE between two views of each text that differ by dropout
    (:class:`~unimae.training.methods.base.ViewDropoutMixin`)."""

    dropout: float = field(
        default=0.1,
        metadata={"help": "Dropout rate that makes the two views of a text differ (gem: see --gem-positives)."},
    )
    dropout_on: str = choice_field(
        "attention",
        DROPOUT_PLACES,
        "Where that dropout acts: 'attention' (attention probabilities, as LLM2Vec) or 'lora' (LoRA inputs; a fresh "
        "LoRA has B = 0, so the views only start to differ after the first step).",
    )

    def check(self, config: TrainConfig, world_size: int) -> None:
        super().check(config, world_size)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


def pooling_field():
    """``--pooling`` of the methods that train the ``--init-adapter``'s embedding spec."""
    return choice_field(
        "auto", lambda: ["auto", *POOLINGS], "Pooling to train; auto = the --init-adapter's (eos without one)."
    )
