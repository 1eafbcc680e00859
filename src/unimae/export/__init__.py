"""Export a base model + adapter for the ecosystem.

- ``hf``: a plain Hugging Face model directory (LoRA merged into float32 weights) with a model
  card stating pooling, EOS handling and the training recipe. transformers loads it for generation and
  for embeddings as the card says (for UniMAE: the last-layer state at an appended EOS; the card and
  ``unimae.json`` name the attention and pooling of other methods).
- ``sentence-transformers``: the same weights as a SentenceTransformer directory: Transformer
  module + Pooling. For causal ``eos`` (UniMAE) it is last-token pooling with a tokenizer whose
  post-processor appends EOS after truncation, so ``SentenceTransformer(dir).encode(texts)`` gives
  unimae's ``eos`` embeddings; causal ``mean`` and ``wmean`` map to mean and weightedmean pooling. An adapter whose
  :class:`~unimae.embedding.spec.EmbeddingSpec` the format cannot express (bidirectional attention
  of MNTP, GEM's summary tokens and mask, echo) is refused with a message instead of exported wrongly.
- ``gguf``: one GGUF file for llama.cpp (``--output FILE.gguf``, ``gguf_type`` f32/f16/bf16/q8_0), pooling
  ``last``; clients append EOS (see :mod:`unimae.export.gguf`). Only causal last-token (``eos``) adapters.
- ``gguf-lora``: the adapter alone as a llama.cpp LoRA-adapter GGUF (``gguf_type`` f32/f16), applied with
  ``--lora`` on a GGUF of the base model (see :mod:`unimae.export.gguf_lora`). Refuses as ``gguf`` does, and
  adapters that are not low-rank pairs on linear weights.
"""

from __future__ import annotations

from pathlib import Path

from unimae.adapter import adapter_folder, embedding_spec
from unimae.export.base import check_exportable
from unimae.export.gguf import export_gguf
from unimae.export.gguf_lora import export_gguf_lora
from unimae.export.hf import export_folder


def export(
    model: str,
    adapter: str | None,
    output: str | Path,
    fmt: str = "hf",
    max_length: int = 512,
    gguf_type: str = "f16",
) -> Path:
    """Write the export to ``output`` (a directory; a ``.gguf`` file for ``gguf`` and ``gguf-lora``); return its
    path. Refuses a spec ``fmt`` cannot express, and what else it can before loading or merging weights."""
    if adapter is not None:
        adapter_folder(adapter)  # a wrong --adapter path fails now, not once the base model has loaded
    spec = embedding_spec(adapter)
    check_exportable(spec, fmt)
    if fmt == "gguf-lora":
        return export_gguf_lora(model, adapter, output, gguf_type)
    if fmt == "gguf":
        return export_gguf(model, adapter, Path(output), spec, gguf_type)
    return export_folder(model, adapter, Path(output), fmt, spec, max_length)
