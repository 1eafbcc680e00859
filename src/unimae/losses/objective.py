"""The contract of a training objective: an nn.Module from a :class:`~unimae.data.batch.Batch` to named losses.

``forward(batch)`` returns a dict of scalars: ``"loss"`` (what is back-propagated, a mean over the
micro-batch's examples so accumulation and processes do not change the update of a per-example loss; an
InfoNCE loss contrasts the texts of one micro-batch, so there the micro-batch size sets the negatives)
plus detached parts for the log (``"mar"``, ``"mrc"``, ...). The trainer calls ``set_step(step)`` before
every optimizer step; objectives with a schedule over steps (GEM's NTP -> contrastive switch) override it.
An objective owns its auxiliary heads (the MRC tiny decoder): saving the LLM never writes them.

The trainer back-propagates ``"loss"`` (divided by the accumulation steps) the same way for every objective.
An objective that needs more than one backward pass (the gradient cache: embed the whole batch without a
graph, then re-run each chunk with one) registers a hook on its loss that runs them inside that backward,
scaled by the gradient the loss receives there.

Such an objective may complete its logged values in that backward: a term it computes only in the graph
passes (the gradient cache's LM term) is written into the returned tensors, ``"loss"`` included, in place,
under ``torch.no_grad()``. So the values of ``forward``'s dict are final after the backward of ``"loss"``, not
before (the gradient cache: until then ``"loss"`` holds the contrastive part, ``"lm"`` is NaN); the trainer
reads them only after ``backward``. Under ``torch.no_grad()`` (no backward to come) ``forward`` returns final
values.
"""

from __future__ import annotations

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

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        raise NotImplementedError
