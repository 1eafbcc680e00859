"""One model, both jobs: sentence embeddings (``encode``) and text generation (``generate``).

>>> enc = Encoder.from_pretrained("smollm2-135m", adapter="runs/unimae/adapter", pooling="eos")
>>> vectors = enc.encode(["a sentence", "another"], normalize=True)   # (2, D) float32
>>> enc.generate("The capital of France is", max_new_tokens=8)

sentence-transformers' ``SentenceTransformer`` calls work too: ``encode(sentences, normalize_embeddings=True,
truncate_dim=k, convert_to_tensor=True)``, ``similarity(a, b)``, ``get_sentence_embedding_dimension()``,
``max_seq_length``, ``prompts`` (:meth:`Encoder.encode`).

Texts are sorted by length and batched; results come back in input order. Positions are counted
over real tokens, so an embedding does not depend on batch size, batch composition or padding side.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import numbers
import types
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from unimae.adapter import embedding_spec, load_record, load_with_adapter, skip_input_upcast
from unimae.embedding.pooling import PooledInput, pool
from unimae.embedding.rotation import load_rotation
from unimae.embedding.spec import EmbeddingSpec
from unimae.embedding.tokenization import pad_batch
from unimae.embedding.vectors import check_dimensions, finish_embeddings, sentence_transformers_options
from unimae.generation.kv_cache import returned_cache
from unimae.generation.prompt import check_fits, prompt_ids
from unimae.generation.sampling import GenerationParams
from unimae.generation.stream import generate_text
from unimae.release import resolve_adapter
from unimae.runtime.int8 import quantize_linears
from unimae.runtime.memory import tune_allocator
from unimae.runtime.precision import (
    DECODE_ONLY_PRECISIONS,
    autocast,
    resolve_device,
    resolve_inference_precision,
    weight_dtype,
)

logger = logging.getLogger(__name__)


class Encoder:
    """A causal LM (optionally with a LoRA adapter) used as a sentence encoder and a generator.

    How it embeds is one :class:`EmbeddingSpec` (``spec``): pass it, or its parts (``pooling``,
    ``attention`` and pooling options such as ``summary_ids``).

    ``precision``: one of :data:`~unimae.runtime.precision.INFERENCE_PRECISIONS` ('auto', 'bf16', 'fp32',
    'bf16-decode', 'f16-decode', 'int8-decode', 'int8'; :mod:`unimae.runtime.precision` says what each runs and
    what 'auto' picks where).
    With 'int8' the model's linear layers are replaced by dynamically quantized ones here (in place).
    ``device``: 'auto' (or None: a CUDA GPU if there is one, else the CPU), 'cpu', 'cuda' or 'cuda:N'
    (:func:`~unimae.runtime.precision.resolve_device`); the model is moved there.
    """

    def __init__(
        self,
        model,
        tokenizer,
        pooling: str = "eos",
        max_length: int = 512,
        precision: str = "auto",
        device: torch.device | str | None = None,
        padding_side: str = "right",
        attention: str = "causal",
        spec: EmbeddingSpec | None = None,
        **pooling_options,
    ):
        if spec is not None and pooling_options:  # they would be ignored: the spec holds the pooling's options
            raise TypeError(_unexpected_load_options(pooling_options))
        self.spec = spec or EmbeddingSpec(attention=attention, pooling=pooling, **pooling_options)
        tune_allocator()
        self.device = resolve_device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.precision = resolve_inference_precision(precision, self.device)
        if self.precision == "int8":
            quantize_linears(self.model)  # a LoRA adapter's own layers stay fp32
        self.padding_side = padding_side
        self.adapter_merged = False
        self.rotation: np.ndarray | None = None  # (D, D) when the adapter has a Matryoshka rotation (spec.rotation)
        self.source: dict = {}  # from_pretrained: the model and adapter it loaded, for the manifests of indexes

    @property
    def embedding_precision(self) -> str:
        """The precision its embeddings are computed in: 'bf16-decode', 'f16-decode' and 'int8-decode' round the
        decode loop's weights only, so they embed exactly as 'fp32' (what index manifests and evaluation caches
        record, so they stay reusable)."""
        return "fp32" if self.precision in DECODE_ONLY_PRECISIONS else self.precision

    @property
    def pooling(self) -> str:
        return self.spec.pooling

    @property
    def attention(self) -> str:
        return self.spec.attention

    @property
    def pooling_options(self) -> dict:
        return self.spec.pooling_options

    @classmethod
    def from_pretrained(
        cls,
        model: str = "smollm2-135m",
        adapter: str | None = None,
        pooling: str = "auto",
        merge: bool | None = None,
        attention: str | None = None,
        **kwargs,
    ) -> Encoder:
        """Load ``model`` (Hub id, directory, .gguf or offline short name) and optionally ``adapter`` (a folder,
        or the name of a released adapter: :mod:`unimae.release`).

        ``pooling='auto'`` takes the pooling the adapter was trained for (its :class:`EmbeddingSpec`:
        ``eos`` for UniMAE, ``mean`` for MNTP, ``summary`` for GEM; ``eos`` without an adapter); the attention
        rule comes from the adapter unless ``attention`` is given (None: the adapter's).

        ``merge``: fold the LoRA update into the weights (in fp32, then cast to the run precision), so
        inference runs plain matmuls (faster on CPU: ``benchmarks/embed_adapter.py`` measures both). The default
        (None) merges except in bf16: in fp32 the merge is exact; rounding ``W + dW`` to bf16 loses part of the
        small update ``dW`` (on the dev suite it lowered the first UniMAE adapter's scores; docs/results.md,
        "Merged vs unmerged adapter"), while unmerged bf16 keeps ``dW`` apart as
        in training. The int8 precisions merge in fp32 and then quantize ``W + dW`` (int8 adds the same rounding
        noise to ``W`` unmerged, which the adapter was not trained against either; ``int8-decode``,
        ``bf16-decode`` and ``f16-decode`` embed with the exact fp32 merge and round its sum in the decode copies).
        ``merge=True`` trades bf16's exactness for speed (e.g. ``unimae serve --merge``);
        ``merge=False`` also keeps the base model reachable through :meth:`adapter_disabled` (under int8 the
        adapter's own layers then stay fp32 beside the int8 base).

        ``precision`` (in ``kwargs``): see :class:`Encoder`; 'auto' picks 'f16-decode' on x86 CPUs without native
        bf16 (AVX2): fp32 embeddings, fp16 weights in the decode steps (fbgemm).
        """
        unknown = {k: v for k, v in kwargs.items() if k not in (*_POOLING_OPTIONS, *_LOAD_OPTIONS)}
        if unknown:  # refused before the model loads
            raise TypeError(_unexpected_load_options(unknown))
        adapter = resolve_adapter(adapter)  # a folder, or the name of a released adapter
        device = resolve_device(kwargs.get("device"))
        precision = resolve_inference_precision(kwargs.get("precision", "auto"), device)
        kwargs["precision"] = precision  # resolved once: the Encoder quantizes for 'int8'
        spec = _resolve_spec(embedding_spec(adapter), pooling, attention, kwargs)
        merged = adapter is not None and (merge if merge is not None else precision != "bf16")
        llm, tokenizer, _ = load_with_adapter(model, adapter, weight_dtype(precision), merge=merged)
        if adapter is not None and not merged and precision == "bf16":
            skip_input_upcast(llm)  # every forward of an Encoder runs under autocast
        encoder = cls(llm, tokenizer, spec=spec, **kwargs)
        encoder.adapter_merged = merged
        encoder.source = load_record(model, adapter)
        if spec.rotation and adapter is not None:
            encoder.rotation = load_rotation(adapter, spec.rotation)
        return encoder

    def with_pooling(self, pooling: str, **pooling_options) -> Encoder:
        """A view of this encoder (same loaded model) with another pooling."""
        return self.with_spec(self.spec.with_pooling(pooling, **pooling_options))

    def with_spec(self, spec: EmbeddingSpec) -> Encoder:
        """A view of this encoder (same loaded model) that embeds by ``spec`` (attention rule and pooling)."""
        view = copy.copy(self)
        view.spec = spec
        if spec.rotation != self.spec.rotation:  # the rotation was fitted on the adapter's own spec's vectors
            view.spec, view.rotation = dataclasses.replace(spec, rotation=""), None
        return view

    @property
    def embedding_dim(self) -> int:
        return self.model.config.hidden_size

    @torch.inference_mode()
    def encode(
        self,
        texts: str | Sequence[str] | None = None,
        batch_size: int = 32,
        normalize: bool | None = None,
        show_progress: bool | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        dimensions: int | None = None,
        precision: str = "float32",
        ranges: np.ndarray | None = None,
        calibration_embeddings: np.ndarray | None = None,
        **sentence_transformers,
    ) -> np.ndarray | torch.Tensor | list[torch.Tensor]:
        """Embed texts -> (N, D) array (1-D for a single string), in input order.

        ``normalize``: L2-normalise each vector (None: no). ``prompt_name`` picks one of the adapter's prompts
        (``spec.prompts``, e.g. 'query'); ``prompt`` gives the text prefix itself (it wins over ``prompt_name``, as
        in sentence-transformers). ``dimensions``: keep the first k coordinates (Matryoshka; normalised after
        truncation when ``normalize``), of the rotated vector when the adapter has a rotation
        (:mod:`unimae.embedding.rotation`); None: all.
        ``precision``: 'float32', or quantized by sentence-transformers' ``quantize_embeddings``: 'int8' /
        'uint8' (per-dimension ranges from ``ranges`` (2, k) or ``calibration_embeddings`` (M, D), else from these
        embeddings themselves: :func:`~unimae.embedding.vectors.finish_embeddings`), 'binary' / 'ubinary' (sign
        bits packed 8 per byte: D / 8 bytes).

        sentence-transformers' keywords (``sentence_transformers``) are taken as in its ``encode``:
        ``sentences`` / ``inputs`` (``texts``), ``normalize_embeddings`` (``normalize``), ``truncate_dim``
        (``dimensions``), ``show_progress_bar`` (``show_progress``); one option under both spellings with
        different values is a TypeError. ``convert_to_tensor=True`` returns a torch tensor (on the encoder's
        device for float32, on the CPU for quantized codes, as there), ``convert_to_numpy=False`` a list of 1-D
        tensors; ``output_value`` must be 'sentence_embedding'. Any other keyword is a TypeError (``device``:
        choose it at load).
        """
        ours = {"texts": texts, "normalize": normalize, "show_progress": show_progress, "dimensions": dimensions}
        ours, output = sentence_transformers_options(ours, sentence_transformers)
        texts, normalize, show_progress, dimensions = (
            ours[k] for k in ("texts", "normalize", "show_progress", "dimensions")
        )
        if texts is None:
            raise TypeError("encode() needs the texts to embed: a string or a list of strings")
        single = isinstance(texts, str)
        texts = [texts] if single else list(texts)
        check_batch_size(batch_size)
        check_dimensions(dimensions, self.embedding_dim, self.spec)
        prefix = prompt if prompt is not None else self.spec.prompt(prompt_name)
        out = self._encode_blocks(texts, prefix, batch_size, show_progress)  # (N, D)
        out = finish_embeddings(
            out, dimensions, bool(normalize), precision, self.rotation, ranges, calibration_embeddings
        )  # (N, k)
        return self._as_requested(out[0] if single else out, single, precision, **output)

    def _as_requested(
        self, vectors: np.ndarray, single: bool, precision: str, convert_to_numpy: bool, convert_to_tensor: bool
    ) -> np.ndarray | torch.Tensor | list[torch.Tensor]:
        """``vectors`` in the form sentence-transformers' ``encode`` returns for these options: the array, one
        tensor (``convert_to_tensor``), or a list of row tensors (``convert_to_numpy=False``; one tensor for a
        single text). Float vectors go to the encoder's device, quantized codes stay on the CPU (as there)."""
        if convert_to_numpy and not convert_to_tensor:
            return vectors
        tensor = torch.from_numpy(vectors)
        if precision == "float32":
            tensor = tensor.to(self.device)
        return tensor if convert_to_tensor or single else list(tensor)

    def _encode_blocks(self, texts: list[str], prefix: str | None, batch_size: int, show_progress) -> np.ndarray:
        """(N, D) float32 embeddings of ``texts``, tokenized :data:`ENCODE_BLOCK` at a time (token lists of every
        text at once would take gigabytes for a large corpus; the vectors do not depend on the batching)."""
        if len(texts) <= ENCODE_BLOCK:
            inputs = self.spec.build_inputs(self.tokenizer, texts, self.max_length, prompt=prefix) if texts else []
            return self.encode_inputs(inputs, batch_size, normalize=False, show_progress=show_progress)
        out = np.empty((len(texts), self.embedding_dim), dtype=np.float32)
        with tqdm(total=len(texts), desc="encode", unit="text", disable=show_progress is False) as bar:
            for start in range(0, len(texts), ENCODE_BLOCK):
                block = texts[start : start + ENCODE_BLOCK]
                inputs = self.spec.build_inputs(self.tokenizer, block, self.max_length, prompt=prefix)
                out[start : start + len(block)] = self.encode_inputs(inputs, batch_size, progress=bar)
        return out

    def encode_query(self, texts: str | Sequence[str] | None = None, **kwargs) -> np.ndarray:
        """:meth:`encode` with the adapter's 'query' prompt (none if it has no such prompt): retrieval queries.
        A ``prompt_name`` or ``prompt`` given here is used instead, as in sentence-transformers."""
        return self.encode(texts, **self._with_role_prompt("query", kwargs))

    def encode_document(self, texts: str | Sequence[str] | None = None, **kwargs) -> np.ndarray:
        """:meth:`encode` with the adapter's 'document' prompt (none if it has no such prompt): passages.
        A ``prompt_name`` or ``prompt`` given here is used instead, as in sentence-transformers."""
        return self.encode(texts, **self._with_role_prompt("document", kwargs))

    def _with_role_prompt(self, name: str, kwargs: dict) -> dict:
        if kwargs.get("prompt_name") is None and kwargs.get("prompt") is None:
            kwargs = {**kwargs, "prompt_name": name if name in self.spec.prompt_map else None}
        return kwargs

    # sentence-transformers' names for what an Encoder has (SentenceTransformer's API, v3 to v6)

    @property
    def max_seq_length(self) -> int:
        """``max_length`` under sentence-transformers' name: the tokens a text (its prompt and EOS included) is
        cut to. Settable, as there."""
        return self.max_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"max_seq_length must be a positive integer, got {value!r}")
        self.max_length = int(value)

    @property
    def prompts(self) -> Mapping[str, str]:
        """The adapter's named prompts (name -> text prefix, ``spec.prompts``), read-only. Other prompts:
        ``encode(prompt=...)`` per call, or ``with_spec(dataclasses.replace(spec, prompts={...}))``."""
        return types.MappingProxyType(self.spec.prompt_map)

    @property
    def default_prompt_name(self) -> None:
        """None: :meth:`encode` applies no prompt unless asked (encode_query / encode_document pick theirs)."""
        return None

    @property
    def similarity_fn_name(self) -> str:
        """'cosine': what :meth:`similarity` computes (adapters are trained with a cosine InfoNCE loss)."""
        return "cosine"

    def similarity(self, embeddings1, embeddings2) -> torch.Tensor:
        """Cosine similarity of every vector of ``embeddings1`` (N, k) with every vector of ``embeddings2``
        (M, k) -> an (N, M) torch tensor, as sentence-transformers' ``similarity`` (cosine, its default). numpy
        arrays, tensors or lists of either; a 1-D vector counts as one row. The result is on ``embeddings1``'s
        device (the CPU for numpy)."""
        a, b = _as_rows(embeddings1), _as_rows(embeddings2)
        a, b = torch.nn.functional.normalize(a, dim=-1), torch.nn.functional.normalize(b.to(a), dim=-1)
        return a @ b.T

    def similarity_pairwise(self, embeddings1, embeddings2) -> torch.Tensor:
        """Cosine of ``embeddings1[i]`` with ``embeddings2[i]`` for each i -> an (N,) torch tensor, as
        sentence-transformers' ``similarity_pairwise``."""
        a, b = _as_tensor(embeddings1), _as_tensor(embeddings2)
        a, b = torch.nn.functional.normalize(a, dim=-1), torch.nn.functional.normalize(b.to(a), dim=-1)
        return (a * b).sum(-1)

    def get_embedding_dimension(self) -> int:
        """``embedding_dim`` under sentence-transformers 6's name: the size of :meth:`encode`'s vectors by default."""
        return self.embedding_dim

    def get_sentence_embedding_dimension(self) -> int:
        """:meth:`get_embedding_dimension` under sentence-transformers' name before 6.0."""
        return self.get_embedding_dimension()

    @torch.inference_mode()
    def encode_inputs(
        self,
        inputs: Sequence[PooledInput],
        batch_size: int = 32,
        normalize: bool = False,
        show_progress: bool | None = None,
        progress: tqdm | None = None,
    ) -> np.ndarray:
        """Embed texts already tokenized by ``self.spec.build_inputs`` -> (N, D) float32 array, in input order.

        :meth:`encode` is ``build_inputs`` then this; the server tokenizes in its request threads and hands
        the inputs to its batcher, which embeds them with this method chunk by chunk. ``progress``: a bar counting
        texts that each batch advances (a caller's over several calls) instead of this call's own bar of batches.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        out = np.zeros((len(inputs), self.embedding_dim), dtype=np.float32)
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i].ids))
        show = len(inputs) > 4 * batch_size if show_progress is None else show_progress
        starts = range(0, len(order), batch_size)
        for start in tqdm(starts, desc="encode", disable=not show or progress is not None, unit="batch"):
            chosen = order[start : start + batch_size]
            ids, mask = pad_batch([inputs[i].ids for i in chosen], self.tokenizer.pad_token_id, self.padding_side)
            pool_mask, _ = pad_batch([inputs[i].pool for i in chosen], 0, self.padding_side)
            ids, mask, pool_mask = ids.to(self.device), mask.to(self.device), pool_mask.to(self.device)
            with autocast(self.precision, self.device):
                vectors = self.spec.forward(self.model, ids, mask, pool_mask)  # (B, D)
            if normalize:
                vectors = torch.nn.functional.normalize(vectors, dim=-1)
            out[chosen] = vectors.cpu().numpy()
            if progress is not None:
                progress.update(len(chosen))
        return out

    @torch.inference_mode()
    def encode_with_cache(
        self, text: str, normalize: bool = False, prompt_name: str | None = None
    ) -> tuple[np.ndarray, list[int], object]:
        """Embed one text and keep the forward pass's KV cache: (vector (D,), input ids, cache).

        The ids are exactly what :meth:`encode` feeds the model (the prompt's tokens included), so a generation
        prompt that starts with them can reuse the cache as its prefix (``unimae.retrieval.rag``). The vector equals
        ``encode([text], prompt_name=prompt_name)[0]``.
        """
        if self.attention != "causal":
            raise ValueError(f"KV-cache reuse needs causal attention; this encoder embeds with {self.attention!r}")
        prefix = self.spec.prompt(prompt_name)
        item = self.spec.build_inputs(self.tokenizer, [text], self.max_length, prompt=prefix)[0]
        ids = torch.tensor([item.ids], device=self.device)  # (1, T)
        with autocast(self.precision, self.device):
            out = self.model.get_decoder()(
                input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True
            )  # (1, T, D)
        pool_mask = torch.tensor([item.pool], device=self.device)  # (1, T)
        vector = pool(out.last_hidden_state, pool_mask)  # (1, D)
        if normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        return vector[0].cpu().numpy(), list(item.ids), returned_cache(out)

    def adapter_disabled(self):
        """Context manager: run the base model without the adapter (no-op without one)."""
        if self.adapter_merged:
            raise RuntimeError("the adapter is merged into the weights; load with merge=False to disable it")
        disable = getattr(self.model, "disable_adapter", None)
        return disable() if disable is not None else contextlib.nullcontext()

    @property
    def context(self) -> int | None:
        """Tokens of a prompt and its answer the model attends over (its ``max_position_embeddings``; None if its
        config states none)."""
        return getattr(self.model.config, "max_position_embeddings", None)

    def prompt_ids(self, prompt: str | list[dict], chat: bool = False, limit: int | None = None) -> list[int]:
        """Token ids of a prompt: plain text, or (``chat`` / a message list) through the chat template. ``limit``:
        tokenize no further than needed to know the prompt has more than ``limit`` tokens (see
        :func:`unimae.generation.prompt.prompt_ids`)."""
        return prompt_ids(self.tokenizer, prompt, limit, chat)

    def generate(
        self, prompt: str, max_new_tokens: int = 64, chat: bool = False, params: GenerationParams | None = None
    ) -> str:
        """Generate a continuation of ``prompt`` with the same weights (greedy unless ``params`` say so).
        ``params`` may also come second, in ``max_new_tokens``'s place. ValueError for a prompt longer than the
        model's context (tokenized only that far)."""
        if isinstance(max_new_tokens, GenerationParams):
            params, max_new_tokens = max_new_tokens, max_new_tokens.max_new_tokens
        params = params or GenerationParams(max_new_tokens=max_new_tokens)
        ids = self.prompt_ids(prompt, chat=chat, limit=self.context)
        check_fits(len(ids), self.context)
        return generate_text(self.model, self.tokenizer, ids, params, precision=self.precision).text


_POOLING_OPTIONS = ("summary_ids", "echo_template")
_LOAD_OPTIONS = ("max_length", "precision", "device", "padding_side")  # from_pretrained -> Encoder
ENCODE_BLOCK = 4096  # texts tokenized at a time by Encoder.encode (bounded memory; sorted by length within one)


def check_batch_size(batch_size) -> None:
    """``batch_size`` must be a positive integer; a string is most likely a prompt name passed second, where
    sentence-transformers' ``encode`` takes ``prompt_name``."""
    if isinstance(batch_size, str):
        raise TypeError(
            f"batch_size must be an integer, got {batch_size!r}: encode's second parameter is batch_size "
            "(sentence-transformers' is prompt_name): pass prompt_name=... by keyword"
        )
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")


# sentence-transformers' load-time keywords an Encoder does not take, with what to use instead
_LOAD_HINTS = {
    "prompts": "the adapter's own come from its unimae.json; others: encode(prompt=...) or "
    "with_spec(dataclasses.replace(encoder.spec, prompts={...}))",
    "default_prompt_name": "none: encode(prompt_name=...), encode_query, encode_document",
    "similarity_fn_name": "similarity() is cosine",
    "truncate_dim": "pass truncate_dim= (or dimensions=) to encode: an encoder's own vectors, which its indexes "
    "and evaluations use, stay full-size",
}


def _unexpected_load_options(options: dict) -> str:
    """The TypeError message for keywords an Encoder given a spec would otherwise ignore."""
    hints = [f"{name} ({_LOAD_HINTS[name]})" if name in _LOAD_HINTS else name for name in options]
    return f"Encoder() got unexpected keyword arguments: {', '.join(hints)}"


def _as_tensor(vectors) -> torch.Tensor:
    """Vectors (a tensor, an array, a list of either) as one floating-point tensor."""
    if isinstance(vectors, (list, tuple)) and vectors and isinstance(vectors[0], torch.Tensor):
        vectors = torch.stack(list(vectors))
    tensor = vectors if isinstance(vectors, torch.Tensor) else torch.as_tensor(np.asarray(vectors))
    return tensor if tensor.is_floating_point() else tensor.float()


def _as_rows(vectors) -> torch.Tensor:
    """:func:`_as_tensor` as (N, k): a 1-D vector is one row."""
    tensor = _as_tensor(vectors)
    return tensor.unsqueeze(0) if tensor.dim() == 1 else tensor


def _resolve_spec(trained: EmbeddingSpec, pooling: str, attention: str | None, kwargs: dict) -> EmbeddingSpec:
    """The adapter's spec, with the caller's pooling / attention / pooling options (popped from kwargs)."""
    options = {k: kwargs.pop(k) for k in _POOLING_OPTIONS if k in kwargs}
    spec = trained if pooling == "auto" else trained.with_pooling(pooling)
    spec = dataclasses.replace(spec, **options) if options else spec
    spec = dataclasses.replace(spec, attention=attention) if attention else spec
    if dataclasses.replace(spec, rotation="") != dataclasses.replace(trained, rotation=""):
        spec = dataclasses.replace(spec, rotation="")  # the rotation was fitted on the adapter's own spec's vectors
    return spec
