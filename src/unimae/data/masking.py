"""The two random masks of UniMAE, built as explicit tensors, and the training collator.

- MAR corruption (Eq. 1): every position except BOS and the final EOS is replaced by the mask
  token with probability ``p_mar``; pads are never touched.
- MRC key visibility (Eq. 4): query i (predicting x_i) always sees key 0 (``h_eos``); it sees
  token key j >= 1 only if j != i, key j is not a pad and B_ij = 1 with B_ij ~ Bernoulli(1 - p_mrc).

Randomness is drawn per example from a generator seeded by (seed, example index), so a batch's
masks do not depend on how examples are split across processes or micro-batches, and resuming a
run reproduces them exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from unimae.data.batch import Batch
from unimae.embedding.tokenization import pad_batch


def example_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator that depends only on (seed, global example index)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**63 - 1))


def mar_corrupt(ids: Sequence[int], p_mar: float, mask_id: int, keep_first: bool, gen: torch.Generator) -> list[int]:
    """Eq. 1 input corruption of one text (EOS last). EOS is never masked, nor the first token when
    ``keep_first`` (UniMAE: a BOS; MNTP: always, since no position before it could predict it)."""
    ids_t = torch.tensor(ids, dtype=torch.long)  # (N,)
    replace = torch.rand(len(ids), generator=gen) < p_mar  # (N,)
    replace[-1] = False  # the appended EOS
    if keep_first:
        replace[0] = False
    return torch.where(replace, torch.full_like(ids_t, mask_id), ids_t).tolist()


def mrc_visibility(n_tokens: int, width: int, p_mrc: float, gen: torch.Generator) -> torch.Tensor:
    """Eq. 4 key-visibility of one text: (width, width + 1) bool, True = query may attend the key.

    Column 0 is ``h_eos`` (always visible); column j >= 1 is token j - 1. Keys beyond
    ``n_tokens`` are pads and hidden. The diagonal (query i, key i + 1) is always hidden.
    """
    n = n_tokens
    keep = torch.zeros(width, width, dtype=torch.bool)  # (W, W) pad keys stay hidden
    keep[:n, :n] = torch.rand(n, n, generator=gen) >= p_mrc  # B_ij ~ Bernoulli(1 - p_mrc), drawn per text
    keep &= ~torch.eye(width, dtype=torch.bool)  # a query never sees its own token
    return torch.cat([torch.ones(width, 1, dtype=torch.bool), keep], dim=1)  # (W, W + 1)


@dataclass
class UniMAECollator:
    """Build a :class:`Batch` from tokenized texts (lists of ids ending with EOS) and their indices.

    Keys, all right-padded to width T: ``input_ids`` (B, T) original tokens, EOS last; ``corrupted_ids``
    (B, T) MAR inputs; ``attention_mask`` (B, T) 1 = real; ``mrc_visible`` (B, T, T + 1) bool key
    visibility for the tiny decoder.
    """

    pad_id: int
    mask_id: int
    bos_id: int | None
    p_mar: float
    p_mrc: float
    seed: int
    p_mar_sampling: str = "fixed"  # "uniform": each row's rate ~ U(0, p_mar), so some rows stay nearly clean

    def __call__(self, sequences: Sequence[Sequence[int]], indices: Sequence[int]) -> Batch:
        width = max(len(s) for s in sequences)
        corrupted, visible = [], []
        for ids, index in zip(sequences, indices, strict=True):
            gen = example_generator(self.seed, index)
            has_bos = self.bos_id is not None and len(ids) > 1 and ids[0] == self.bos_id
            rate = self.p_mar * torch.rand(1, generator=gen).item() if self.p_mar_sampling == "uniform" else self.p_mar
            corrupted.append(mar_corrupt(ids, rate, self.mask_id, has_bos, gen))
            visible.append(mrc_visibility(len(ids), width, self.p_mrc, gen))
        input_ids, attention_mask = pad_batch(sequences, self.pad_id, "right")
        corrupted_ids, _ = pad_batch(corrupted, self.pad_id, "right")
        return Batch(
            input_ids=input_ids,
            corrupted_ids=corrupted_ids,
            attention_mask=attention_mask,
            mrc_visible=torch.stack(visible),
        )
