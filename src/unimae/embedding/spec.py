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

Two more fields describe how the adapter was trained to be used, and travel with it:

- ``prompts``: named text prefixes (``{"query": "Instruct: ...\nQuery: ", "document": ""}``), as
  sentence-transformers' ``prompts``: ``Encoder.encode(texts, prompt_name="query")`` embeds
  ``prompt + text`` (the prompt counts toward ``max_length``; truncation cuts the text's end, never the
  prompt). ``contrastive --query-prompt`` trains with them.
- ``matryoshka_dims``: the prefix lengths the adapter was trained to embed with on their own
  (``contrastive --matryoshka-dims``); ``Encoder.encode(dimensions=k)`` keeps the first k coordinates.
- ``rotation``: with ``unimae rotation`` fitted, the fingerprint of a PCA rotation (stored beside the weights,
  :mod:`unimae.embedding.rotation`): ``dimensions=k`` keeps the first k principal coordinates instead; the
  full-size vector is unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from unimae.embedding.attention import ATTENTION_RULES
from unimae.embedding.pooling import POOLINGS, PooledInput, build_inputs, pooled_forward


@dataclass(frozen=True)
class EmbeddingSpec:
    """Attention rule + pooling (+ the pooling's options) of an embedding."""

    attention: str = field(default="causal", metadata={"help": f"Attention rule while embedding: {ATTENTION_RULES}."})
    pooling: str = field(
        default="eos", metadata={"help": "Which last-layer states are averaged (unimae.embedding.pooling)."}
    )
    summary_ids: tuple[int, ...] = field(default=(), metadata={"help": "summary pooling: GEM's summary token ids."})
    echo_template: bool = field(default=False, metadata={"help": "echo pooling: wrap the text in Echo's prompt."})
    prompts: tuple[tuple[str, str], ...] = field(
        default=(), metadata={"help": "Named prompts (name, text prefix), e.g. ('query', 'Instruct: ...')."}
    )
    matryoshka_dims: tuple[int, ...] = field(
        default=(), metadata={"help": "Prefix dimensions trained to embed on their own (Matryoshka); () none."}
    )

    rotation: str = field(
        default="",
        metadata={"help": "Fingerprint of the PCA rotation applied before a Matryoshka prefix (embedding.rotation)."},
    )

    def __post_init__(self):
        if self.attention not in ATTENTION_RULES:
            raise ValueError(f"unknown attention rule {self.attention!r}; choose one of {ATTENTION_RULES}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {self.pooling!r}; choose one of {sorted(POOLINGS)}")
        object.__setattr__(self, "summary_ids", tuple(int(i) for i in self.summary_ids))
        if self.pooling == "summary" and not self.summary_ids:
            raise ValueError("summary pooling needs summary_ids (the GEM summary tokens of the adapter)")
        prompts = self.prompts.items() if isinstance(self.prompts, dict) else self.prompts
        object.__setattr__(self, "prompts", tuple(sorted((str(k), str(v)) for k, v in prompts)))
        dims = tuple(sorted({int(d) for d in self.matryoshka_dims}))
        if any(d < 1 for d in dims):
            raise ValueError(f"matryoshka_dims must be positive, got {list(dims)}")
        object.__setattr__(self, "matryoshka_dims", dims)

    @property
    def prompt_map(self) -> dict[str, str]:
        """The named prompts as a dict (name -> text prefix)."""
        return dict(self.prompts)

    def prompt(self, name: str | None) -> str:
        """The text prefix of prompt ``name`` ('' for None); an unknown name is an error naming the known ones."""
        if name is None:
            return ""
        known = self.prompt_map
        if name not in known:
            raise ValueError(
                f"unknown prompt {name!r}: this model's prompts are {sorted(known) or 'none'} "
                "(set them with `unimae train --method contrastive --query-prompt ...`)"
            )
        return known[name]

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
        kept["rotation"] = self.rotation if pooling == self.pooling and not options else ""  # fitted on these vectors
        return dataclasses.replace(self, pooling=pooling, summary_ids=(), echo_template=False, **{**kept, **options})

    def build_inputs(
        self, tokenizer, texts: Sequence[str], max_length: int, prompt: str = "", warn: bool = True
    ) -> list[PooledInput]:
        """Token ids and pool masks of ``texts`` for this pooling, each text after the text prefix ``prompt``;
        ``warn=False``: no TextTooLongWarning for a truncated text (a caller that refuses it instead)."""
        texts = with_prompt(texts, prompt)
        return build_inputs(self.pooling, tokenizer, texts, max_length, warn=warn, **self.pooling_options)

    def forward(self, model, input_ids, attention_mask, pool_mask) -> torch.Tensor:
        """(B, T) ids, mask and pool mask -> (B, D) embeddings under this attention rule."""
        return pooled_forward(model, input_ids, attention_mask, pool_mask, self.attention)

    def to_dict(self) -> dict:
        """The JSON form kept in ``unimae.json`` and index manifests."""
        out = {"attention": self.attention, "pooling": self.pooling, "pooling_options": self.pooling_options}
        if self.prompts:  # absent when empty: adapters and indexes written before these fields read the same
            out["prompts"] = self.prompt_map
        if self.matryoshka_dims:
            out["matryoshka_dims"] = list(self.matryoshka_dims)
        if self.rotation:
            out["rotation"] = self.rotation
        return out

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
            prompts=tuple((data.get("prompts") or {}).items()),
            matryoshka_dims=tuple(data.get("matryoshka_dims") or ()),
            rotation=str(data.get("rotation") or ""),
        )

    def at_size(self, dimensions: int, full: int) -> EmbeddingSpec:
        """This spec as vectors of ``dimensions`` coordinates see it: at the full size the rotation changes nothing
        (it applies to prefixes only), so it is dropped there."""
        return dataclasses.replace(self, rotation="") if dimensions >= full else self

    def describe(self) -> str:
        """One line for model cards and error messages."""
        extra = f", summary tokens {list(self.summary_ids)}" if self.summary_ids else ""
        extra += f", prompts {sorted(self.prompt_map)}" if self.prompts else ""
        extra += f", Matryoshka dimensions {list(self.matryoshka_dims)}" if self.matryoshka_dims else ""
        extra += f", prefixes after the PCA rotation {self.rotation}" if self.rotation else ""
        return f"{self.attention} attention, {self.pooling} pooling{extra}"


def with_prompt(texts: Sequence[str], prompt: str) -> list[str]:
    """``prompt + text`` for every text, the text without its outer whitespace.

    Decision (ours): the [EOS] embedding reads the last text token, and a trailing space is a token of its own
    to these tokenizers; the training texts have no outer whitespace (the pair files are whitespace-collapsed),
    so stripping it embeds a text as training did (TwitterURLCorpus' test texts all end in a space). Every path
    that embeds goes through here: the encoder, the mteb wrapper (and its cache keys), the llama.cpp engine.
    """
    return [prompt + text.strip() if isinstance(text, str) else text for text in texts]  # non-str: tokenizer's error
