"""The one batch type every training method produces and every objective consumes."""

from __future__ import annotations

import torch


class Batch(dict):
    """Named tensors of one micro-batch (plus plain numbers such as ``num_queries``).

    Every batch has ``attention_mask`` (B, T), 1 = real token; the other keys are the method's own
    (its collator's docstring lists them); read them as ``batch["input_ids"]`` or ``batch.input_ids``.
    ``to`` moves the tensors; ``num_tokens`` counts real tokens.
    """

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"batch has no {name!r}; keys: {sorted(self)}") from None

    def to(self, device: torch.device | str) -> Batch:
        return Batch({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.items()})

    @property
    def num_tokens(self) -> int:
        return int(self["attention_mask"].sum())
