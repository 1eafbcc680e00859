"""Gradient cache for the supervised contrastive objective: a batch far larger than one forward graph.

Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup" (arXiv:2101.06983);
sentence-transformers' ``CachedMultipleNegativesRankingLoss``. InfoNCE couples every text of the
batch, so a batch of 256 pairs would need one forward graph over 512+ texts. Instead (1) embed all texts
without a graph, in chunks, (2) compute the loss on the (N, D) embeddings and its gradient g = dL/dz,
(3) re-run each chunk with a graph and back-propagate ``sum(z_chunk * g_chunk)``, whose parameter gradient
is the chunk's share of dL/dtheta. The sum over chunks is the one-big-batch gradient; memory is one chunk's
graph. Each chunk's RNG state is saved before (1) and restored before (3), so dropout draws the same masks.

Steps (1) and (2) run in ``forward``, which returns the loss as a leaf tensor; step (3) is a hook on that leaf,
so it runs inside the caller's ordinary ``loss.backward()``, scaled by the gradient the loss receives there
(the trainer's ``1 / accum``).

The LM term (``lm_weight`` > 0) is computed in step (3) only (its ``--lm-data`` texts, if any, after the chunks,
in chunks of their own): its value is known once the graph passes have run,
so step (1) never runs the output head. ``forward`` therefore returns values that backward completes: until
``backward()``, ``"loss"`` holds the contrastive part alone and ``"lm"`` is NaN; the hook then writes
``contrastive + lm_weight x L_LM`` into ``"loss"`` and ``L_LM`` into ``"lm"``, in place (the contract in
:mod:`unimae.losses.objective`). Read the values after backward, as the trainer does. Under ``torch.no_grad()``
(evaluation, no backward to come) ``forward`` computes every value at once.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from unimae.losses.supervised_contrastive import ContrastiveObjective


class _RngState:
    """The CPU (and current CUDA device's) RNG state, to replay dropout exactly (sentence-transformers' RandContext)."""

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)


class _AutocastState:
    """The autocast setting of ``device_type`` now, to re-enter in the backward pass (which may run on another
    thread, without the caller's ``torch.autocast``), as ``torch.amp.custom_bwd`` does."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.enabled = torch.is_autocast_enabled(device_type)
        self.dtype = torch.get_autocast_dtype(device_type)
        self.cache = torch.is_autocast_cache_enabled()

    def enter(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled, cache_enabled=self.cache)


class _Values:
    """The tensors ``forward`` returned that the hook completes (not the loss leaf itself: a hook holding its own
    tensor would make a reference cycle), written in place, so a second backward writes the same values."""

    def __init__(self, contrastive: torch.Tensor, total: torch.Tensor, lm: torch.Tensor):
        self.contrastive, self.total, self.lm = contrastive, total, lm

    def complete(self, lm: torch.Tensor, lm_weight: float) -> None:
        """lm: ``lm_weight x L_LM`` (a scalar) -> the loss ``contrastive + lm_weight x L_LM``, ``"lm"`` = L_LM."""
        with torch.no_grad():
            self.total.copy_(self.contrastive + lm)
            if lm_weight:
                self.lm.copy_(lm / lm_weight)


class GradCacheContrastiveObjective(ContrastiveObjective):
    """:class:`ContrastiveObjective` with a gradient cache over chunks of ``chunk_size`` texts (see the module doc).

    ``forward(batch)`` returns the same losses as the parent's once backward has run (before it, ``"loss"`` is the
    contrastive part and ``"lm"`` NaN: see the module doc), and ``backward()`` of its ``"loss"`` leaves the same
    parameter gradients (tested), with one chunk's graph in memory at a time, for one extra no-grad forward of
    the LLM's body (no output head). Texts are chunked in order of length, so a chunk carries little padding.
    In-batch negatives span the batch handed in, so the trainer's micro-batch must be the whole batch, on one
    process (the re-runs happen inside backward, outside any DDP wrapper's forward). The LM term needs no cache:
    it is a sum over texts, so each chunk back-propagates its own share with its graph in step (3), and its
    value is summed there.
    """

    def __init__(self, llm: nn.Module, *args, chunk_size: int = 32, **kwargs):
        super().__init__(llm, *args, **kwargs)
        if chunk_size < 1:
            raise ValueError(f"the gradient cache needs a chunk size >= 1, got {chunk_size}")
        self.chunk_size = chunk_size

    def forward(self, batch) -> dict[str, torch.Tensor]:
        lengths = batch["attention_mask"].sum(1)  # (N,)
        order = torch.argsort(lengths, descending=True, stable=True)  # longest first: peak memory shows at once
        chunks = list(order.split(self.chunk_size))
        backward = torch.is_grad_enabled()  # else evaluation: no hook, the LM value computed here
        states, parts, lm = [], [], torch.zeros((), device=lengths.device)
        with torch.no_grad():
            for rows in chunks:  # (1) embeddings without a graph (and without backward to come, the LM term)
                states.append(_RngState())
                if backward:
                    parts.append(self.embed(batch, rows))  # (R, D)
                else:
                    part, lm_part = self.embed_and_lm(batch, rows)  # (R, D), scalar
                    parts.append(part)
                    lm = lm + lm_part
            if not backward:
                lm = lm + sum(self.lm_data_share(batch, rows) for rows in self._lm_data_chunks(batch))
        z = torch.empty(len(order), parts[0].shape[-1], device=parts[0].device)  # (N, D)
        z[order] = torch.cat(parts)
        if not backward:
            contrastive, logged = self.loss_and_log(z, batch)
            out = {"loss": contrastive + lm, "contrastive": contrastive, **logged}
            return {**out, "lm": lm / self.lm_weight} if self.lm_weight else out
        z.requires_grad_(True)
        contrastive, logged = self.loss_and_log(z, batch)
        (grad,) = torch.autograd.grad(contrastive, z)  # (2) (N, D) dL/dz: the cache
        contrastive = contrastive.detach()
        total = (contrastive + lm).detach()  # lm is 0 here: the contrastive part, in the total's dtype
        loss = total.detach().requires_grad_(True)  # the leaf; shares total's storage, which the hook completes
        lm_value = torch.full((), torch.nan, device=z.device)  # L_LM, filled by the hook
        values = _Values(contrastive, total, lm_value)
        amp = _AutocastState(z.device.type)
        loss.register_hook(
            partial(self._replay, batch=batch, chunks=chunks, states=states, grad=grad, amp=amp, values=values)
        )
        out = {"loss": loss, "contrastive": contrastive, **logged}
        return {**out, "lm": lm_value} if self.lm_weight else out

    def _lm_data_chunks(self, batch) -> list[torch.Tensor]:
        """Row numbers of the batch's ``--lm-data`` texts in chunks of ``chunk_size`` (none without them)."""
        if not self.lm_weight or "lm_input_ids" not in batch:
            return []
        return list(torch.arange(batch["lm_input_ids"].shape[0]).split(self.chunk_size))

    def _replay(self, grad_output: torch.Tensor, batch, chunks, states, grad, amp: _AutocastState, values) -> None:
        """(3), the hook on L: each chunk re-run with its graph and its share of L back-propagated, times
        ``grad_output`` (dOut/dL of the caller's backward); then the LM term's value, summed over the chunks, is
        written into the returned values. The RNG is left as the hook found it."""
        outer = _RngState()
        lm = torch.zeros((), device=grad.device)
        with torch.enable_grad(), amp.enter():
            for rows, state in zip(chunks, states, strict=True):
                state.restore()  # same dropout masks as in (1)
                part, lm_part = self.embed_and_lm(batch, rows)  # (R, D), this chunk's share of lm_weight x L_LM
                torch.autograd.backward(((part * grad[rows]).sum() + lm_part) * grad_output)
                lm = lm + lm_part.detach()
            for rows in self._lm_data_chunks(batch):  # the --lm-data texts: a sum over texts, no cache needed
                lm_part = self.lm_data_share(batch, rows)  # this chunk's share of lm_weight x L_LM
                torch.autograd.backward(lm_part * grad_output)
                lm = lm + lm_part.detach()
        outer.restore()
        values.complete(lm, self.lm_weight)
