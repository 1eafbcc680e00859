"""Output-head cross-entropy computed in row chunks, so B x T x V logits never exist at once.

Where a call's log-probabilities (N x V in fp32) would take more than ``recompute_above_mb`` (default
:data:`RECOMPUTE_ABOVE_MB`), each chunk's logits are recomputed in the backward pass (activation
checkpointing), so the peak memory is one chunk of logits, not the whole batch's: at 262k vocabulary and
2k rows that is the difference between ~2 GB and ~0.5 GB per chunk of 512 rows. Below it the chunks keep
their log-probabilities for the backward pass instead: the same numbers, one output-head matmul fewer per
row (SmolLM2's default recipe, 49k vocabulary and at most 1,024 rows per loss: 200 MB kept; the training
step's speed: benchmarks/train_step.py, docs/results.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

RECOMPUTE_ABOVE_MB = 1024.0  # keep a call's fp32 log-probabilities for backward up to this size, else recompute


def recomputes_logits(rows: int, vocab: int, recompute_above_mb: float = RECOMPUTE_ABOVE_MB) -> bool:
    """Whether a loss call over ``rows`` x ``vocab`` logits recomputes them in backward (its fp32
    log-probabilities would take more than ``recompute_above_mb``)."""
    return rows * vocab * 4 > recompute_above_mb * 2**20


def logit_softcap(config) -> float | None:
    """The cap ``c`` of ``c * tanh(logits / c)`` the model's forward applies to its logits (Gemma 2), or None."""
    return getattr(config, "final_logit_softcapping", None)


def output_projection(head: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (V, D), bias or None) of the LLM's output head, as its forward uses them.

    A head wrapped by peft's trainable tokens (``trainable_token_indices`` on a model with tied embeddings)
    keeps its trained rows as a delta beside the frozen matrix: they are merged in here, so a trained token
    row counts in the softmax exactly as in the model's own forward.
    """
    adapter = getattr(head, "token_adapter", None)
    if adapter is not None and not adapter.disable_adapters and adapter.active_adapters:
        weight = adapter.get_merged_weights(adapter.active_adapters)
    else:
        weight = head.weight
    base = getattr(head, "original_module", None) or getattr(adapter, "base_layer", None) or head
    return weight, getattr(base, "bias", None)


def head_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None
) -> torch.Tensor:
    """``softcap(hidden @ weight.T + bias)``, the output head as the LLM's forward applies it. (n, D) -> (n, V)."""
    logits = F.linear(hidden, weight, bias)  # (n, V)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def _chunk_loss(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, softcap: float | None
) -> torch.Tensor:
    return F.cross_entropy(head_logits(hidden, weight, bias, softcap).float(), targets, reduction="none")  # (n,)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = 1024,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    recompute_above_mb: float = RECOMPUTE_ABOVE_MB,
) -> torch.Tensor:
    """Per-row CE of ``softcap(hidden @ weight.T + bias)`` against ``targets``.

    hidden: (N, D); weight: (V, D); targets: (N,) -> (N,) float32 losses. ``recompute_above_mb``: recompute
    the chunks' logits in backward when N x V fp32 values exceed it (see the module doc); 0: always.
    """
    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, dtype=torch.float32)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    recompute = grad and recomputes_logits(hidden.shape[0], weight.shape[0], recompute_above_mb)
    pieces = []
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        if recompute:
            pieces.append(
                checkpoint(_chunk_loss, hidden[rows], weight, bias, targets[rows], softcap, use_reentrant=False)
            )
        else:
            pieces.append(_chunk_loss(hidden[rows], weight, bias, targets[rows], softcap))
    return torch.cat(pieces)  # (N,)


def per_example_mean(token_losses: torch.Tensor, example_ids: torch.Tensor, num_examples: int) -> torch.Tensor:
    """Mean over examples of each example's mean token loss.

    Normalizing per example makes the loss of a global batch independent of how it is split into
    micro-batches and processes. token_losses, example_ids: (N,) -> scalar.
    """
    sums = torch.zeros(num_examples, dtype=token_losses.dtype, device=token_losses.device)
    sums = sums.index_add(0, example_ids, token_losses)  # (B,)
    counts = torch.bincount(example_ids, minlength=num_examples).clamp(min=1)  # (B,)
    return (sums / counts).mean()
