"""The contract of a training objective: an nn.Module from a :class:`~unimae.data.batch.Batch` to named losses.

``forward(batch)`` returns a dict of scalars: ``"loss"`` (what is back-propagated, a mean over the
micro-batch's examples so accumulation and processes do not change the update of a per-example loss; an
InfoNCE loss contrasts the texts of one micro-batch, so there the micro-batch size sets the negatives)
plus detached parts for the log (``"mar"``, ``"mrc"``, ...). The trainer calls ``set_step(step)`` before
every optimizer step; objectives with a schedule over steps (GEM's NTP -> contrastive switch) override it.
An objective owns its auxiliary heads (the MRC tiny decoder): saving the LLM never writes them.

An objective that must run its own backward passes (a gradient cache: embed the whole batch without a
graph, take the loss's gradient w.r.t. the embeddings, then re-run each mini-batch with grad) sets
``runs_own_backward = True`` and implements ``forward_backward(batch, backward)``: the trainer then calls
that instead of ``forward`` + backward, and ``backward(tensor)`` applies the trainer's scaling
(accumulation) and mixed-precision/DDP handling to whatever the objective back-propagates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from unimae.data.batch import Batch


class Objective(nn.Module):
    """Base class: holds the (LoRA-wrapped) LLM as ``self.llm`` so DDP/FSDP wrap one module."""

    def __init__(self, llm: nn.Module):
        super().__init__()
        self.llm = llm

    def set_step(self, step: int) -> None:
        """Called with the 0-based optimizer step before it runs; no-op unless the objective has a schedule."""

    runs_own_backward: ClassVar[bool] = False

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def forward_backward(self, batch: Batch, backward: Callable[[torch.Tensor], None]) -> dict[str, torch.Tensor]:
        """Losses of ``batch`` with the gradients already accumulated (only if ``runs_own_backward``)."""
        raise NotImplementedError
