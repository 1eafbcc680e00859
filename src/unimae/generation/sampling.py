"""Decoding options and how the next token is picked: greedy, or a temperature / top-p draw.

Named as in the OpenAI API. Sampling divides by the temperature, keeps the smallest set of tokens whose
probability reaches ``top_p`` (as transformers' ``TopPLogitsWarper``) and draws from a ``torch.Generator``
seeded with ``params.seed``: a seeded request is reproducible and leaves the global RNG alone. Logits
with a NaN or no finite maximum (damaged weights, an overflow) raise :class:`NonFiniteLogitsError` rather
than give a token: greedy would pick the NaN's position, and a draw would fail inside ``torch.multinomial``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class GenerationParams:
    """Decoding options, named as in the OpenAI API; ``temperature == 0`` means greedy."""

    max_new_tokens: int = field(default=64, metadata={"help": "Most tokens to generate."})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy; > 0 samples."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass (with temperature > 0)."})
    stop: list[str] = field(default_factory=list, metadata={"help": "Strings that end the generation."})
    seed: int | None = field(default=None, metadata={"help": "Seed for sampling (reproducible outputs)."})
    ignore_eos: bool = field(
        default=False, metadata={"help": "Go on after an end-of-sequence token (fixed-length runs, benchmarks)."}
    )

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")


class NonFiniteLogitsError(RuntimeError):
    """The model gave NaN or infinite next-token scores: no token can be picked from them."""


def pick_token(logits: torch.Tensor, params: GenerationParams, generator: torch.Generator | None) -> int:
    """The next token from last-position ``logits`` (1, V): argmax, or a temperature / top-p draw.
    :class:`NonFiniteLogitsError` if a score is NaN or the top one is infinite (-inf scores below a finite top
    are a mask, kept)."""
    scores = logits.float()  # (1, V)
    top = scores.max(-1, keepdim=True)  # (1, 1) value and index; a NaN anywhere makes the value NaN
    if not torch.isfinite(top.values).all():
        raise NonFiniteLogitsError(
            f"the model gave non-finite next-token scores (top score {top.values.item()}): its weights are "
            "damaged or overflow on this prompt"
        )
    if params.temperature == 0:
        return int(top.indices)
    # shifted so the top score is 0 before dividing: a tiny temperature then gives -inf scores, never inf - inf
    scores = (scores - top.values) / params.temperature
    if params.top_p < 1:
        ordered, order = torch.sort(scores, descending=False)  # (1, V) ascending
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - params.top_p
        drop[..., -1] = False  # keep at least the most likely token
        scores = scores.masked_fill(drop.scatter(1, order, drop), -float("inf"))
    return int(torch.multinomial(scores.softmax(-1), 1, generator=generator))
