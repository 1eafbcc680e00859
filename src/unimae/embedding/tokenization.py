"""Tokenize texts the UniMAE way: BOS as the tokenizer does it, truncate, then append EOS ourselves.

The EOS token is always present (docs/methods.md, "The UniMAE objective"), whatever the tokenizer's own
``add_eos_token`` habit, so that ``h_eos`` has a fixed place to live.

Cost bounded by ``max_length``, not by the text: a text is cut to :func:`char_budget` characters before it is
tokenized (:func:`tokenize_bounded`), so a 50 MB line costs what ``max_length`` tokens cost; a generation prompt
is cut the same way to what the model's context needs (:func:`ids_within`). Why the cut never
changes the tokens kept: every token covers at most ``L`` characters of the text, ``L`` the length of the
longest string in the vocabulary (a byte-level string has one character per byte, and a character is at least
one byte; a SentencePiece string one per character; a byte-fallback ``<0xNN>`` is longer than its byte). So a
text of ``n`` tokens or fewer has at most ``n L`` characters and is never cut, and the first ``n`` tokens of a
longer one end within ``n L`` characters. The cut, ``L + 64`` characters beyond them, can only change the
tokens of the word it falls in (and of the spaces before it): pre-tokenizers split words independently, and
within a word longer than that margin only BPE merges reaching across it could carry the change back (none
seen: tests/test_hostile_input.py compares cut and whole tokenizations of long space runs, one-word texts and
mixed scripts). A normalizer that merges or drops characters (NFC composing three into one) could break the
first step; a cut text that comes out with fewer tokens than needed is therefore tokenized again with twice
the characters, until it has them or is whole.

A prompt refused for its length reads less still (:func:`ids_within`): that bound is for the worst text, 81
characters a token for SmolLM2, where prose takes 4-5, so a 4 MB prompt against an 8k context was cut to 660k
characters, 150k tokens, about 0.13 GB of tokenizer memory (which a server's worker thread kept) to learn what
its first 8,193 tokens tell. A fast tokenizer's offsets say where the ids end in the text, so the prompt is
first cut to :data:`PROSE_CHARS` characters a token (:func:`prose_cut`); if the cut gives more than ``limit``
ids and the first ``limit + 1`` end at least ``2 L + 64`` characters before it (``L`` more than the rule above:
offsets may leave out a token's edge spaces), those are the whole text's ids and the text is too long.
Otherwise the worst-case cut follows (at most ``PROSE_CHARS / L`` more work, 7% for SmolLM2).
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

_MARGIN_CHARS = 64  # beyond the budget's tokens: the word the cut falls in, whose tokens the cut may change
PROSE_CHARS = 6  # characters a token in the first cut of a long prompt (ids_within): prose has 4-5
_LONGEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (vocabulary size, longest)


class TextTooLongWarning(UserWarning):
    """Texts were truncated to ``max_length`` tokens."""


def encode_with_eos(tokenizer, texts: Sequence[str], max_length: int, warn: bool = True) -> list[list[int]]:
    """Token ids per text: tokenizer ids (BOS as it adds it) truncated to max_length - 1, plus EOS.

    ``warn``: emit a TextTooLongWarning (once per max_length) when a text is truncated; training
    turns it off since truncating long paragraphs is the recipe.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (one token and EOS), got {max_length}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"text {i} is a {type(text).__name__}, not a str")

    def encode(batch: list[str]) -> list[list[int]]:
        return tokenizer(batch, add_special_tokens=True, truncation=False)["input_ids"]

    encoded = tokenize_bounded(encode, tokenizer, texts, max_length + 2)  # kept, the tokenizer's own EOS, one more
    eos = tokenizer.eos_token_id
    out, truncated = [], 0
    for ids in encoded:
        if ids and ids[-1] == eos:  # the tokenizer appended EOS itself; we add it exactly once
            ids = ids[:-1]
        if len(ids) > max_length - 1:
            ids = ids[: max_length - 1]
            truncated += 1
        out.append(ids + [eos])
    if truncated and warn:
        warnings.warn(
            f"texts longer than max_length={max_length} tokens were truncated (EOS is kept at the end)",
            TextTooLongWarning,
            stacklevel=2,
        )
    return out


def longest_token_chars(tokenizer) -> int:
    """Characters in the longest string of ``tokenizer``'s vocabulary, added tokens included; computed once per
    tokenizer (again if tokens are added to it)."""
    size = len(tokenizer)
    cached = _LONGEST.get(tokenizer)
    if cached is None or cached[0] != size:
        cached = (size, max(map(len, tokenizer.get_vocab()), default=1))
        _LONGEST[tokenizer] = cached
    return cached[1]


def char_budget(tokenizer, tokens: int) -> int:
    """Characters of any text that hold its first ``tokens`` tokens and a word more (module docstring)."""
    return (tokens + 1) * longest_token_chars(tokenizer) + _MARGIN_CHARS


def tokenize_bounded(
    encode: Callable[[list[str]], list[list[int]]], tokenizer, texts: Sequence[str], tokens: int
) -> list[list[int]]:
    """``encode(texts)`` (token ids per text, truncated or not) with each text cut to ``char_budget(tokens)``
    characters first: the whole texts' ids, in every id the caller keeps.

    ``tokens``: how many ids a cut text must give for the cut not to matter (what the caller keeps, special
    tokens included, and one more where ``encode`` does not truncate). A cut text that gives fewer is encoded
    again with twice the characters (module docstring).
    """
    if not texts:
        return []
    limit = char_budget(tokenizer, tokens)
    encoded = encode([text[:limit] for text in texts])
    for i, text in enumerate(texts):
        cut = limit
        while len(encoded[i]) < tokens and cut < len(text):
            cut *= 2
            encoded[i] = encode([text[:cut]])[0]
    return encoded


def ids_within(tokenizer, text: str, limit: int | None, add_special_tokens: bool = True) -> list[int]:
    """The tokenizer's ids of ``text`` if it has at most ``limit`` of them (special tokens included): exactly the
    whole text's. A longer text gives more than ``limit`` ids, those of a first part of it (enough to know it is
    too long; the ids past the limit are not the whole text's): its first ``PROSE_CHARS * (limit + 1)``
    characters where a fast tokenizer's offsets show that is enough, else its first :func:`char_budget`
    characters (module docstring), so a prompt of any size costs what ``limit + 1`` tokens cost. ``limit`` None:
    the whole text, however long."""

    def encode(batch: list[str]) -> list[list[int]]:
        return tokenizer(batch, add_special_tokens=add_special_tokens)["input_ids"]

    if limit is None:
        return encode([text])[0]
    cut = prose_cut(tokenizer, limit + 1)
    if getattr(tokenizer, "is_fast", False) and cut < min(len(text), char_budget(tokenizer, limit + 1)):
        encoded = tokenizer(text[:cut], add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        ids, spans = encoded["input_ids"], encoded["offset_mapping"]
        margin = cut - PROSE_CHARS * (limit + 1)  # 2 L + 64
        if len(ids) > limit and max(end for _, end in spans[: limit + 1]) + margin <= cut:
            return ids
    return tokenize_bounded(encode, tokenizer, [text], limit + 1)[0]


def prose_cut(tokenizer, tokens: int) -> int:
    """Characters of a long prompt's first cut (:func:`ids_within`): ``PROSE_CHARS`` a token for its first
    ``tokens`` tokens, and ``2 L + 64`` more (module docstring)."""
    return PROSE_CHARS * tokens + 2 * longest_token_chars(tokenizer) + _MARGIN_CHARS


def pad_batch(
    sequences: Sequence[Sequence[int]], pad_id: int, side: str = "right"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad to (B, T) ``input_ids`` and ``attention_mask`` on the given side."""
    if side not in ("left", "right"):
        raise ValueError(f"padding side must be 'left' or 'right', got {side!r}")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)  # (B, T)
    for i, seq in enumerate(sequences):
        span = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
        ids[i, span] = torch.tensor(seq, dtype=torch.long)
        mask[i, span] = 1
    return ids, mask


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) positions counted over real tokens only, so left padding does not shift RoPE."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of the last real token, correct for left and right padding."""
    width = attention_mask.shape[-1]
    return width - 1 - attention_mask.flip(-1).long().argmax(-1)


def choose_mask_token(tokenizer, requested: str = "auto") -> tuple[str, int]:
    """Pick the MAR mask token: (token string, id). Never BOS, EOS, PAD or UNK.

    'auto' takes the tokenizer's own mask token if it has one, else the special token with the
    highest id that is not BOS/EOS/PAD/UNK and does not appear in the chat template: a token
    that plain text never contains. A tokenizer with none needs ``mask_token`` set explicitly.
    """
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    if requested != "auto":
        token_id = tokenizer.convert_tokens_to_ids(requested)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"mask token {requested!r} is not in the tokenizer's vocabulary")
        if token_id in reserved:
            raise ValueError(f"mask token {requested!r} is the tokenizer's BOS/EOS/PAD/UNK; choose another")
        return requested, token_id
    if tokenizer.mask_token_id is not None and tokenizer.mask_token_id not in reserved:
        return tokenizer.mask_token, tokenizer.mask_token_id
    candidates = spare_special_tokens(tokenizer)
    if not candidates:
        raise ValueError(
            "the tokenizer has no spare special token to use as the MAR mask token; pass mask_token= "
            "with a token string from its vocabulary"
        )
    return candidates[0]


def spare_special_tokens(tokenizer) -> list[tuple[str, int]]:
    """Special tokens plain text never contains: not BOS/EOS/PAD/UNK and not in the chat template.

    Returned as (token, id), highest id first. Used for the MAR mask token and GEM's summary tokens.
    """
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else " ".join(template.values())
    found = [
        (token_id, added.content)
        for token_id, added in tokenizer.added_tokens_decoder.items()
        if added.special and token_id not in reserved and added.content not in template
    ]
    return [(content, token_id) for token_id, content in sorted(found, reverse=True)]
