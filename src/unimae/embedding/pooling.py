"""Sentence poolings, each a registered rule: how to build the input and which positions to average.

Every pooling is a weighted mean of last-layer states under a per-token *pool mask* that is padded
exactly like the input, so it is correct for left and right padding alike (each tokenizes through
:func:`~unimae.embedding.tokenization.tokenize_bounded`, so a long text costs what ``max_length`` tokens cost):
- ``eos``: EOS appended after truncation; the mask selects that last token (``h_eos``, UniMAE Eq. 2).
- ``mean``: all tokens of the text as the tokenizer makes them (paper row MEAN).
- ``wmean``: the same tokens, the i-th of n weighted i / (n(n+1)/2) (SGPT's position-weighted mean, arXiv
  2202.08904 Eq. 1): under causal attention a later state has read more of the text, so it counts more.
- ``echo``: the text twice; the mask selects the second copy (Springer et al. 2024). Plain
  repetition by default, as in the UniMAE paper; ``echo_template`` wraps it in Echo's prompt.
- ``summary``: GEM's summary tokens (``summary_ids``) appended after the text; the mask selects them
  (their mean). Run it with the ``gem`` attention rule so the summary tokens cannot see each other.

:func:`pooled_forward` runs a batch through the model under an attention rule and pools it; the
Encoder and the contrastive training objectives share it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from unimae.embedding.attention import model_attention_mask
from unimae.embedding.tokenization import encode_with_eos, position_ids_from_mask, tokenize_bounded

ECHO_PROMPT = ("Rewrite the sentence: ", ", rewritten sentence: ")


@dataclass
class PooledInput:
    """One text, tokenized for a pooling: ids and a same-length pool mask (each token's weight; 0: not pooled)."""

    ids: list[int]
    pool: list[int]


Builder = Callable[..., list[PooledInput]]
POOLINGS: dict[str, Builder] = {}


def register_pooling(name: str) -> Callable[[Builder], Builder]:
    def add(fn: Builder) -> Builder:
        POOLINGS[name] = fn
        return fn

    return add


def build_inputs(pooling: str, tokenizer, texts: Sequence[str], max_length: int, **options) -> list[PooledInput]:
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; choose one of {sorted(POOLINGS)}")
    return POOLINGS[pooling](tokenizer, texts, max_length, **options)


@register_pooling("eos")
def _eos(tokenizer, texts, max_length, warn: bool = True, **_) -> list[PooledInput]:
    encoded = encode_with_eos(tokenizer, texts, max_length, warn=warn)  # warn: a TextTooLongWarning on truncation
    return [PooledInput(ids, [0] * (len(ids) - 1) + [1]) for ids in encoded]


@register_pooling("mean")
def _mean(tokenizer, texts, max_length, **_) -> list[PooledInput]:
    encoded = tokenize_bounded(_truncating(tokenizer, max_length), tokenizer, texts, max_length)
    out = []
    for ids in encoded:
        ids = ids or [tokenizer.eos_token_id]  # an empty text still gets one state to average
        out.append(PooledInput(ids, [1] * len(ids)))
    return out


@register_pooling("wmean")
def _wmean(tokenizer, texts, max_length, **_) -> list[PooledInput]:
    return [PooledInput(x.ids, list(range(1, len(x.ids) + 1))) for x in _mean(tokenizer, texts, max_length)]


@register_pooling("echo")
def _echo(tokenizer, texts, max_length, echo_template: bool = False, **_) -> list[PooledInput]:
    with_special = tokenizer("x", add_special_tokens=True)["input_ids"]
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    prefix = with_special[: with_special.index(plain[0])] if plain[0] in with_special else []  # BOS, if any
    before, between = ECHO_PROMPT if echo_template else ("", "")
    before_ids = tokenizer(before, add_special_tokens=False)["input_ids"] if before else []
    between_ids = tokenizer(between, add_special_tokens=False)["input_ids"] if between else []
    budget = max(1, (max_length - len(prefix) - len(before_ids) - len(between_ids)) // 2)
    plain_ids = tokenize_bounded(
        lambda batch: tokenizer(batch, add_special_tokens=False)["input_ids"], tokenizer, texts, budget + 1
    )
    out = []
    for ids in plain_ids:
        ids = ids[:budget] or [tokenizer.eos_token_id]
        first = prefix + before_ids + ids + between_ids
        out.append(PooledInput(first + ids, [0] * len(first) + [1] * len(ids)))
    return out


@register_pooling("summary")
def _summary(tokenizer, texts, max_length, summary_ids: Sequence[int] = (), **_) -> list[PooledInput]:
    if not summary_ids:
        raise ValueError("summary pooling needs summary_ids (the GEM summary tokens of the adapter)")
    budget = max(1, max_length - len(summary_ids))
    encoded = tokenize_bounded(_truncating(tokenizer, budget), tokenizer, texts, budget)
    summary = list(summary_ids)
    return [PooledInput(ids + summary, [0] * len(ids) + [1] * len(summary)) for ids in encoded]


def _truncating(tokenizer, max_length: int) -> Callable[[list[str]], list[list[int]]]:
    """Texts -> ids with special tokens, truncated by the tokenizer to ``max_length`` (its post-processor's
    special tokens kept)."""
    return lambda batch: tokenizer(batch, add_special_tokens=True, truncation=True, max_length=max_length)["input_ids"]


def pooled_forward(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, pool_mask: torch.Tensor, attention: str = "causal"
) -> torch.Tensor:
    """input_ids, attention_mask, pool_mask (B, T) -> (B, D) pooled last-layer states under ``attention``.

    Positions count real tokens only, so the result does not depend on the padding side. For the ``gem``
    rule the pooled tokens are the summary tokens.
    """
    return pool(last_hidden(model, input_ids, attention_mask, pool_mask, attention), pool_mask)


def last_hidden(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, pool_mask: torch.Tensor, attention: str = "causal"
) -> torch.Tensor:
    """The last-layer states that :func:`pooled_forward` pools: (B, T) each -> (B, T, D)."""
    summary = pool_mask.bool() if attention == "gem" else None
    mask = model_attention_mask(attention, attention_mask, model, summary=summary)
    return model.get_decoder()(
        input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from_mask(attention_mask), use_cache=False
    ).last_hidden_state  # (B, T, D)


def pool(hidden: torch.Tensor, pool_mask: torch.Tensor) -> torch.Tensor:
    """Weighted mean: hidden (B, T, D), pool_mask (B, T) of weights (0 outside the pooled tokens) -> (B, D) float32."""
    weights = pool_mask.to(torch.float32).unsqueeze(-1)  # (B, T, 1)
    return (hidden.float() * weights).sum(1) / weights.sum(1).clamp(min=1.0)
