"""The default order of training examples: every epoch a fresh permutation of all of them.

A pure function of (seed, global example index), so resume and any split over processes and micro-batches
reproduce it; :meth:`unimae.training.methods.base.Method.example_order` returns one unless the method groups its
batches (``contrastive``: one source per batch, :class:`~unimae.data.pairs.SourceBatchOrder`).
"""

from __future__ import annotations

import torch


class DataOrder:
    """Example order as a pure function of (seed, global example index): epochs reshuffle."""

    def __init__(self, num_texts: int, seed: int):
        self.num_texts = num_texts
        self.seed = seed
        self._perms: dict[int, list[int]] = {}

    def text_index(self, example: int) -> int:
        epoch, offset = divmod(example, self.num_texts)
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed + 7919 * epoch)
            self._perms[epoch] = torch.randperm(self.num_texts, generator=gen).tolist()
        return self._perms[epoch][offset]
