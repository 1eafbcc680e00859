"""Retrieve-and-generate with ONE model: its embedding ([EOS] by default) retrieves, the same weights answer.

The generation prompt starts with exactly the token ids the query's embedding pass saw
(``query + [EOS]``), so the KV cache of that pass is the prefix of the prompt: generation prefills only
the passages and the instruction that follow (GritLM reuses caches the same way). With greedy decoding
the answer is the same as without the cache (tests check it token for token); ``reuse_kv=False`` takes
the uncached path for comparison.

Prompt, as token ids: ``query [EOS]`` + the chat-templated user turn "Passages: [id] text ... Question:
query ..." (the question is repeated next to the answer position, where a small model needs it).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from unimae.adapter import adapter_revision, model_revision
from unimae.embedding.vectors import finish_embeddings
from unimae.encoder import Encoder
from unimae.generation.decoding import decode_tokens
from unimae.generation.prompt import check_fits
from unimae.generation.sampling import GenerationParams
from unimae.generation.stream import GenerationResult, generate_stream
from unimae.release import find_release
from unimae.retrieval.disk_index import DiskIndex, open_index
from unimae.retrieval.index import Hit, VectorIndex, VectorIndexError

logger = logging.getLogger(__name__)

INSTRUCTION = (
    "Answer the question using only the passages above. Cite the passages you use by their id in "
    "square brackets, like [{example}]. If the passages do not contain the answer, say so."
)


@dataclass
class RAGConfig:
    """Retrieval and prompt options."""

    k: int = field(default=3, metadata={"help": "Passages retrieved per question."})
    max_passage_tokens: int = field(default=160, metadata={"help": "Each passage is cut to this many tokens."})
    reuse_kv: bool = field(default=True, metadata={"help": "Reuse the query's embedding KV cache as prefix."})

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")


@dataclass
class RAGPrompt:
    """A question made ready to answer: the retrieved passages and the generation prompt.

    ``cache``: the query embedding pass's KV cache, a prefix of ``ids`` (None when not reused)."""

    hits: list[Hit]
    ids: list[int]
    cache: Any = None


@dataclass
class RAGAnswer:
    """An answer, the passages it was given, and how much of the prompt came from the cache."""

    text: str
    hits: list[Hit]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str
    seconds_to_first_token: float | None = None

    def to_json(self, model: str) -> dict:
        """The ``rag.answer`` object: what ``POST /v1/rag`` returns (both engines) and ``unimae ask --json`` prints."""
        return {
            "object": "rag.answer",
            "model": model,
            "answer": self.text,
            "passages": passages_json(self.hits),
            "finish_reason": self.finish_reason,
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "cached_prompt_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens,
            },
        }


def passages_json(hits: list[Hit]) -> list[dict]:
    """Retrieved passages as JSON rows (id, text, cosine score), as every RAG answer lists them."""
    return [{"id": h.id, "text": h.text, "score": h.score} for h in hits]


def prompt_tail(tokenizer, query: str, hits: list[Hit], max_passage_tokens: int = 160) -> list[int]:
    """Token ids of the part of the RAG prompt after the query: passages, question, instruction, answer cue.

    With a chat template it is one user turn (plus the assistant header); otherwise plain text ending
    in "Answer:". Each passage is cut to ``max_passage_tokens`` tokens.
    """

    def cut(text: str) -> str:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return text if len(ids) <= max_passage_tokens else tokenizer.decode(ids[:max_passage_tokens]) + " ..."

    passages = "\n\n".join(f"[{hit.id}] {cut(hit.text)}" for hit in hits)
    user = f"Passages:\n{passages}\n\nQuestion: {query}\n\n" + INSTRUCTION.format(example=hits[0].id if hits else "id")
    if getattr(tokenizer, "chat_template", None):
        text = "\n" + tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = f"\n\n{user}\n\nAnswer:"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class RAG:
    """Question answering over a :class:`VectorIndex` with one :class:`~unimae.encoder.Encoder`."""

    def __init__(self, encoder, index: VectorIndex, config: RAGConfig | None = None):
        full = encoder.embedding_dim
        if encoder.spec.at_size(index.dim, full) != index.spec.at_size(index.dim, full):
            raise ValueError(
                f"the index was built with {index.spec.describe()} but the encoder embeds with "
                f"{encoder.spec.describe()}; load the encoder with the index's model and adapter"
            )
        if index.dim > encoder.embedding_dim:
            raise ValueError(f"index dimension {index.dim} > encoder dimension {encoder.embedding_dim}")
        self.encoder, self.index, self.config = encoder, index, config or RAGConfig()
        # queries take the adapter's query prompt (documents were indexed with its document prompt), and are cut
        # to the index's Matryoshka prefix
        self.prompt_name = "query" if "query" in encoder.spec.prompt_map else None
        self.dimensions = index.dim if index.dim < encoder.embedding_dim else None
        # Queries embedded with a pooling other than eos are tokenized with truncation to the encoder's length,
        # prompts without: one fast tokenizer switched between the two fails ("Already borrowed") while another
        # thread uses it, so those queries get their own copy, always called the same way.
        self._query_tokenizer = encoder.tokenizer if encoder.spec.is_last_token else copy.deepcopy(encoder.tokenizer)

    def retrieve(self, query: str, k: int | None = None) -> list[Hit]:
        return self.index.search(self._embed(query, _call)[None], k or self.config.k)[0]

    def _embed(self, query: str, on_model: Callable[..., Any]):
        """The query's normalised embedding (D,), its forward run through ``on_model``."""
        spec = self.encoder.spec
        inputs = spec.build_inputs(
            self._query_tokenizer, [query], self.encoder.max_length, spec.prompt(self.prompt_name)
        )
        return self._fit(on_model(self.encoder.encode_inputs, inputs, normalize=True)[0])

    def _fit(self, vector: np.ndarray) -> np.ndarray:
        """A unit query vector (D,) -> its index-sized prefix (k,), re-normalised (unchanged at full size)."""
        if not self.dimensions:
            return vector
        return finish_embeddings(vector[None], self.dimensions, True, rotation=self.encoder.rotation)[0]

    def prompt_tail(self, query: str, hits: list[Hit]) -> list[int]:
        """Token ids that follow ``query [EOS]`` in the generation prompt."""
        return prompt_tail(self.encoder.tokenizer, query, hits, self.config.max_passage_tokens)

    def check_budget(self, query: str, max_new_tokens: int, prompt_tokens: int | None = None) -> None:
        """ValueError for an empty question, a question longer than the model's context (tokenized only that far),
        or a prompt (``prompt_tokens``; else the question twice) that leaves no room for ``max_new_tokens`` in
        the context."""
        if not query.strip():
            raise ValueError("the question is empty")
        context = self.encoder.context
        if prompt_tokens is None:
            question = len(self.encoder.prompt_ids(query, limit=context))
            check_fits(question, context, "the question")
            prompt_tokens = 2 * (question + 1)
        if context is not None and prompt_tokens + max_new_tokens > context:
            raise ValueError(
                f"the prompt ({prompt_tokens} tokens) and {max_new_tokens} new tokens exceed the model's context "
                f"of {context} tokens; shorten the question or lower k / max_tokens"
            )

    def prepare(
        self,
        query: str,
        params: GenerationParams,
        k: int | None = None,
        reuse_kv: bool | None = None,
        on_model: Callable[..., Any] | None = None,
    ) -> RAGPrompt:
        """Embed the query, retrieve, and build the prompt; ValueError when it leaves no room for
        ``params.max_new_tokens`` (see :meth:`check_budget`), so a server can answer 400 before it streams.

        ``on_model(fn, *args)``: runs the query's embedding pass (the server's ``ModelLock.run``, so every
        forward stays on one thread); by default it runs here.
        """
        on_model = on_model or _call
        self.check_budget(query, params.max_new_tokens)
        reuse = self.config.reuse_kv if reuse_kv is None else reuse_kv
        if self.encoder.spec.is_last_token:
            embed = self.encoder.encode_with_cache
            vector, query_ids, cache = on_model(
                embed, query, normalize=True, prompt_name=self.prompt_name
            )  # (D,), ids, KV
            vector = self._fit(vector)
        else:  # the embedding pass is not a causal prefix of the prompt: nothing to reuse
            vector, cache, reuse = self._embed(query, on_model), None, False
            query_ids = self.encoder.prompt_ids(query) + [self.encoder.tokenizer.eos_token_id]
        hits = self.index.search(vector[None], k or self.config.k)[0]
        ids = query_ids + self.prompt_tail(query, hits)
        self.check_budget(query, params.max_new_tokens, len(ids))
        return RAGPrompt(hits, ids, cache if reuse else None)

    def stream(
        self,
        query: str,
        params: GenerationParams | None = None,
        k: int | None = None,
        reuse_kv: bool | None = None,
        cancel: threading.Event | None = None,
        decode: Callable[..., Iterator[int]] = decode_tokens,
        on_model: Callable[..., Any] | None = None,
        prompt: RAGPrompt | None = None,
    ) -> Iterator[list[Hit] | str | RAGAnswer]:
        """Yield the retrieved hits, then answer text pieces, then the :class:`RAGAnswer`.

        ``prompt``: what :meth:`prepare` made of ``query`` (else it is made here, with ``k``, ``reuse_kv`` and
        ``on_model``). ``cancel`` (set by a caller whose client left) ends the generation within a token.
        ``decode``: the token source (see :func:`~unimae.generation.stream.generate_stream`; the server's batching
        scheduler).
        """
        params = params or GenerationParams(max_new_tokens=128)
        prompt = prompt or self.prepare(query, params, k, reuse_kv, on_model)
        hits = prompt.hits
        yield hits
        start, first = time.perf_counter(), None
        result: GenerationResult | None = None
        for item in generate_stream(
            self.encoder.model,
            self.encoder.tokenizer,
            prompt.ids,
            params,
            precision=self.encoder.precision,
            past_key_values=prompt.cache,
            cancel=cancel,
            decode=decode,
        ):
            if isinstance(item, GenerationResult):
                result = item
            else:
                first = first if first is not None else time.perf_counter() - start
                yield item
        yield RAGAnswer(
            text=result.text,
            hits=hits,
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            completion_tokens=result.completion_tokens,
            finish_reason=result.finish_reason,
            seconds_to_first_token=first,
        )

    def answer(self, query: str, **kwargs) -> RAGAnswer:
        for item in self.stream(query, **kwargs):
            if isinstance(item, RAGAnswer):
                return item
        raise RuntimeError("RAG ended without an answer")


def _call(fn: Callable[..., Any], *args, **kwargs) -> Any:
    return fn(*args, **kwargs)


def _recorded_adapter(recorded: str | None) -> str | None:
    """The adapter an index's manifest names: its folder if it is still there, else, where the folder was a
    release's (the project moved, or another clone reads the index), the release of that name found here (the
    revision check that follows tells whether it holds the same weights)."""
    if recorded is None or Path(recorded).is_dir():
        return recorded
    return find_release(Path(recorded).name) or recorded


def load_index_and_encoder(
    index_dir: str | Path,
    model: str | None = None,
    adapter: str | None = None,
    precision: str = "auto",
    merge: bool | None = None,
    device: str = "auto",
) -> tuple[Encoder, VectorIndex | DiskIndex]:
    """Open the index in ``index_dir`` (a memory or a disk store, as its manifest says) and the encoder that embeds
    queries the way its passages were embedded.

    ``model`` and ``adapter`` default to the ones the index was built with (its manifest); an adapter whose
    revision (content hash of its weights) is not the one recorded in the manifest is refused. The embedding
    spec (attention, pooling and its options) and ``max_length`` always come from the index. ``merge=None``
    merges the LoRA exactly when the index build did. ``device``: where the encoder runs (auto, cpu, cuda, cuda:N).
    """
    index = open_index(index_dir)
    manifest = index.manifest
    adapter = adapter if adapter is not None else _recorded_adapter(manifest.get("adapter"))
    adapter = find_release(adapter) or adapter if adapter is not None else None  # a release name, as the CLI takes
    if adapter is not None and not Path(adapter).is_dir():
        raise VectorIndexError(f"adapter {adapter} does not exist; pass the adapter the index was built with")
    built, given = manifest.get("adapter_revision", "base"), adapter_revision(adapter)
    if given != built:
        recorded = manifest.get("adapter") or "no adapter"
        raise VectorIndexError(
            f"the index in {index_dir} was built with adapter revision {built} ({recorded}), but "
            f"{adapter or 'no adapter'} is revision {given}: another adapter, or the same folder with "
            "other weights since (retrained, a newer release, damaged). Pass the adapter the index was built with, "
            "or rebuild the index with this one (unimae index --overwrite)"
        )
    if model is not None and manifest.get("model") not in (None, model):
        logger.warning(
            "the index in %s was built with model %s, not %s: queries embedded by another model do not match "
            "its passages (fine only if both name the same weights)",
            index_dir,
            manifest["model"],
            model,
        )
    spec = index.spec
    built_weights = manifest.get("model_revision")
    if model is None and built_weights and model_revision(manifest.get("model", "")) not in (None, built_weights):
        logger.warning(
            "the model folder %s changed since the index in %s was built (its files differ): if its weights did, "
            "queries will not match the passages; rebuild with `unimae index --overwrite`",
            manifest["model"],
            index_dir,
        )
    if model is None and not manifest.get("model"):
        raise VectorIndexError(f"the index in {index_dir} records no model; pass the model that built it (--model)")
    encoder = Encoder.from_pretrained(
        model or manifest["model"],
        adapter=adapter,
        pooling=spec.pooling,
        attention=spec.attention,
        max_length=manifest["max_length"],
        precision=precision,
        merge=merge if merge is not None else manifest.get("merged"),
        device=device,
        **spec.pooling_options,
    )
    return encoder, index
