"""Text generation with the same weights that embed: text pieces as tokens come, stop strings, cancel.

One code path serves ``Encoder.generate``, ``unimae ask`` and the server's completions/chat routes:
``generate_stream`` runs the token loop of :mod:`unimae.generation.decoding` (prefill, then one forward per
token) in the caller's thread and yields text pieces as tokens come, then a :class:`GenerationResult`;
``generate_text`` collects it. A prefix ``past_key_values`` (e.g. the KV cache of the query's embedding
pass, see ``unimae.retrieval.rag``) is copied into the generation's cache, so only the uncached tail of the prompt
is prefilled.

Greedy output is token-identical to ``model.generate(do_sample=False)`` in fp32 (tests/test_generation.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from unimae.generation.decoding import decode_tokens, eos_token_ids
from unimae.generation.kv_cache import reusable_prefix
from unimae.generation.sampling import GenerationParams


@dataclass
class GenerationResult:
    """What a finished generation produced; ``finish_reason`` is 'stop' or 'length' as in OpenAI.

    ``cached_tokens``: prompt tokens taken from ``past_key_values`` instead of being prefilled.
    """

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    cached_tokens: int = 0


class _Detokenizer:
    """Token ids -> text pieces, as they come: a piece is released once it decodes to whole characters.

    Decodes a short window (the tokens since the last released piece, with the previous piece as
    context) rather than the whole completion at each token, as text-generation-inference does.
    """

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens, self.prefix, self.read = tokenizer, [], 0, 0

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.tokens.append(token)
        return self.flush(final=False)

    def flush(self, final: bool = True) -> str:
        """The text not released yet; ``final=False`` holds back an incomplete multi-byte character."""
        before = self._decode(self.tokens[self.prefix : self.read])
        after = self._decode(self.tokens[self.prefix :])
        if len(after) <= len(before) or (not final and after.endswith("\ufffd")):
            return ""
        self.prefix, self.read = self.read, len(self.tokens)
        return after[len(before) :]


def _cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """Text up to the earliest stop string, and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def generate_stream(
    model,
    tokenizer,
    input_ids: list[int],
    params: GenerationParams,
    precision: str = "fp32",
    past_key_values=None,
    cancel: threading.Event | None = None,
    decode: Callable[..., Iterator[int]] = decode_tokens,
) -> Iterator[str | GenerationResult]:
    """Yield text pieces of the continuation of ``input_ids``, then one :class:`GenerationResult`.

    The token loop runs in the caller's thread, one token per iteration of this iterator: the model's
    forwards stay on one thread (see :mod:`unimae.runtime.threads`). Stop strings are cut from the text
    (never streamed); ``past_key_values`` must hold the KV cache of a prefix of ``input_ids`` and is not
    modified. Setting ``cancel`` (from any thread) ends the generation within a token; so does closing
    this iterator early (it sets ``cancel``).

    ``decode``: the token source, with :func:`~unimae.generation.decoding.decode_tokens`'s signature and contract (the
    server passes its in-flight batching scheduler's, :meth:`unimae.serving.scheduler.GenerationScheduler.decode`).
    """
    if not input_ids:
        raise ValueError("the prompt is empty")
    cancel = cancel or threading.Event()
    eos = set() if params.ignore_eos else eos_token_ids(model, tokenizer)
    cached = reusable_prefix(past_key_values, len(input_ids))
    tokens = decode(model, input_ids, params, eos, precision, past_key_values, cancel)
    detokenizer = _Detokenizer(tokenizer)
    hold = max((len(s) - 1 for s in params.stop), default=0)  # a tail that could start a stop string
    text, sent, stopped, count, last = "", 0, False, 0, None
    try:
        for token in tokens:
            if cancel.is_set():
                break
            count, last = count + 1, token
            text += detokenizer.add(token)
            visible, stopped = _cut_at_stop(text, params.stop)
            safe = len(visible) if stopped else len(visible) - hold
            if safe > sent:
                yield visible[sent:safe]
                sent = safe
            if stopped:
                break
    finally:
        cancel.set()  # a consumer that stopped early (stop string, client gone) ends the token source too
        if hasattr(tokens, "close"):
            tokens.close()
    if not stopped:
        text += detokenizer.flush()
        visible, stopped = _cut_at_stop(text, params.stop)
    if len(visible) > sent:
        yield visible[sent:]
    finish = "stop" if stopped or last in eos or count < params.max_new_tokens else "length"
    yield GenerationResult(visible, len(input_ids), count, finish, cached)


def generate_text(model, tokenizer, input_ids: list[int], params: GenerationParams, **kwargs) -> GenerationResult:
    """Run :func:`generate_stream` to the end and return its result."""
    for item in generate_stream(model, tokenizer, input_ids, params, **kwargs):
        if isinstance(item, GenerationResult):
            return item
    raise RuntimeError("generation ended without a result")
