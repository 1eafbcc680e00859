"""How a model turns a text into one vector: the attention rule, the pooling and its options.

An :class:`EmbeddingSpec` is written into every adapter's ``unimae.json`` (key ``embedding``) by the
method that trained it, and read back by everything that embeds or ships embeddings: the Encoder,
the index and RAG (which refuse an index built under another spec), the server and the exports
(which refuse a spec their format cannot express).

=============  ===============  ===============================================================
method         attention        pooling
=============  ===============  ===============================================================
unimae         causal           eos: ``h_eos``, the last-layer state at the EOS appended after
                                truncation (UniMAE Eq. 2)
mntp           bidirectional    mean over the text's tokens
gem            gem              summary: mean of the summary tokens' states (``summary_ids``)
simcse, ...    the init adapter's spec
=============  ===============  ===============================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from unimae.attention import ATTENTION_RULES
from unimae.pooling import POOLINGS, PooledInput, build_inputs, pooled_forward


@dataclass(frozen=True)
class EmbeddingSpec:
    """Attention rule + pooling (+ the pooling's options) of an embedding."""

    attention: str = field(default="causal", metadata={"help": f"Attention rule while embedding: {ATTENTION_RULES}."})
    pooling: str = field(default="eos", metadata={"help": "Which last-layer states are averaged (unimae.pooling)."})
    summary_ids: tuple[int, ...] = field(default=(), metadata={"help": "summary pooling: GEM's summary token ids."})
    echo_template: bool = field(default=False, metadata={"help": "echo pooling: wrap the text in Echo's prompt."})

    def __post_init__(self):
        if self.attention not in ATTENTION_RULES:
            raise ValueError(f"unknown attention rule {self.attention!r}; choose one of {ATTENTION_RULES}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {self.pooling!r}; choose one of {sorted(POOLINGS)}")
        object.__setattr__(self, "summary_ids", tuple(int(i) for i in self.summary_ids))
        if self.pooling == "summary" and not self.summary_ids:
            raise ValueError("summary pooling needs summary_ids (the GEM summary tokens of the adapter)")

    @property
    def pooling_options(self) -> dict:
        """The options the pooling builder takes (only those that apply to this pooling)."""
        if self.pooling == "summary":
            return {"summary_ids": list(self.summary_ids)}
        if self.pooling == "echo" and self.echo_template:
            return {"echo_template": True}
        return {}

    @property
    def is_last_token(self) -> bool:
        """Causal attention and the state of the appended EOS: what llama.cpp/vLLM 'last' pooling computes."""
        return self.attention == "causal" and self.pooling == "eos"

    def with_pooling(self, pooling: str, **options) -> EmbeddingSpec:
        """The same attention rule with another pooling; options of the old pooling are dropped unless
        the pooling stays the same (e.g. 'summary' keeps its summary_ids)."""
        kept = {"summary_ids": self.summary_ids} if pooling == self.pooling == "summary" else {}
        return dataclasses.replace(self, pooling=pooling, summary_ids=(), echo_template=False, **{**kept, **options})

    def build_inputs(self, tokenizer, texts: Sequence[str], max_length: int) -> list[PooledInput]:
        """Token ids and pool masks of ``texts`` for this pooling."""
        return build_inputs(self.pooling, tokenizer, texts, max_length, **self.pooling_options)

    def forward(self, model, input_ids, attention_mask, pool_mask) -> torch.Tensor:
        """(B, T) ids, mask and pool mask -> (B, D) embeddings under this attention rule."""
        return pooled_forward(model, input_ids, attention_mask, pool_mask, self.attention)

    def to_dict(self) -> dict:
        """The JSON form kept in ``unimae.json`` and index manifests."""
        return {"attention": self.attention, "pooling": self.pooling, "pooling_options": self.pooling_options}

    @classmethod
    def from_dict(cls, data: dict | None) -> EmbeddingSpec:
        """Inverse of :meth:`to_dict`; ``None``/``{}`` is the default (causal, eos)."""
        data = data or {}
        options = data.get("pooling_options", {})
        return cls(
            attention=data.get("attention", "causal"),
            pooling=data.get("pooling", "eos"),
            summary_ids=tuple(options.get("summary_ids", ())),
            echo_template=bool(options.get("echo_template", False)),
        )

    def describe(self) -> str:
        """One line for model cards and error messages."""
        extra = f", summary tokens {list(self.summary_ids)}" if self.summary_ids else ""
        return f"{self.attention} attention, {self.pooling} pooling{extra}"
