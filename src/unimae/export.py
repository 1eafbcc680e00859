"""Export a base model + adapter for the ecosystem.

- ``hf``: a plain Hugging Face model directory (LoRA merged into float32 weights) with a model
  card stating pooling, EOS handling and the training recipe. transformers loads it for generation and
  for embeddings as the card says (for UniMAE: the last-layer state at an appended EOS; the card and
  ``unimae.json`` name the attention and pooling of other methods).
- ``sentence-transformers``: the same weights as a SentenceTransformer directory: Transformer
  module + Pooling. For causal ``eos`` (UniMAE) it is last-token pooling with a tokenizer whose
  post-processor appends EOS after truncation, so ``SentenceTransformer(dir).encode(texts)`` gives
  unimae's ``eos`` embeddings; causal ``mean`` maps to mean pooling. An adapter whose
  :class:`~unimae.embedding.spec.EmbeddingSpec` the format cannot express (bidirectional attention
  of MNTP, GEM's summary tokens and mask, echo) is refused with a message instead of exported wrongly.
- ``gguf``: one GGUF file for llama.cpp (``--output FILE.gguf``, ``gguf_type`` f32/f16/bf16/q8_0), pooling
  ``last``; clients append EOS (see :mod:`unimae.gguf_export`). Only causal last-token (``eos``) adapters.
- ``gguf-lora``: the adapter alone as a llama.cpp LoRA-adapter GGUF (``gguf_type`` f32/f16), applied with
  ``--lora`` on a GGUF of the base model (see :mod:`unimae.gguf_lora_export`). Refuses as ``gguf`` does, and
  adapters that are not low-rank pairs on linear weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from unimae.adapter import ADAPTER_META, adapter_meta, adapter_revision, embedding_spec, load_with_adapter
from unimae.embedding.spec import EmbeddingSpec
from unimae.files import atomic_write_json, check_writable, writing

FORMATS = ("hf", "sentence-transformers", "gguf", "gguf-lora")


_CARD_KEYS = ("method", "recipe", "steps", "batch_size", "max_length", "lr", "alpha", "p_mar", "p_mrc", "lora_r")
_CARD_KEYS += ("lora_alpha", "data")


def _usage(spec: EmbeddingSpec, fmt: str) -> str:
    if spec.is_last_token:
        return (
            "last token. The tokenizer's EOS token is appended **after** truncation and the embedding is the "
            "last-layer hidden state at that EOS (UniMAE's `h_eos`). In the sentence-transformers export the "
            "tokenizer appends EOS itself; with plain transformers, append `tokenizer.eos_token_id` to the ids "
            "yourself and read the hidden state at the last real token (mind left padding)."
        )
    note = (
        "" if fmt == "sentence-transformers" else " Plain transformers runs causal attention: apply the rule yourself."
    )
    return f"{spec.describe()} (unimae `EmbeddingSpec`, also in `unimae.json`).{note}"


def _model_card(model: str, adapter: str | None, fmt: str, spec: EmbeddingSpec) -> str:
    cfg = adapter_meta(adapter).get("training_config", {})
    recipe = ", ".join(f"{k}={cfg[k]}" for k in _CARD_KEYS if k in cfg) or "base model, no adapter"
    return f"""---
library_name: {"sentence-transformers" if fmt == "sentence-transformers" else "transformers"}
tags: [unimae, sentence-embeddings, text-generation]
---
# {Path(model).name} + UniMAE

Exported by unimae from base model `{model}` and adapter `{adapter}` (LoRA merged, float32).
One model, two jobs: it generates text as the base model does, and it embeds sentences.

- **Pooling:** {_usage(spec, fmt)}
- **Similarity:** cosine.
- **Training recipe:** {recipe}.
{_prompt_lines(spec)}"""


def _prompt_lines(spec: EmbeddingSpec) -> str:
    """Model-card lines for the prompts and Matryoshka dimensions an adapter was trained with ('' without)."""
    lines = [f"- **Prompt `{name}`:** `{text!r}` (prepended to the text)" for name, text in spec.prompts]
    if spec.prompts:
        lines.append("  (sentence-transformers: `encode_query` / `encode_document`; llama.cpp: prepend it yourself)")
    if spec.matryoshka_dims:
        dims = ", ".join(map(str, spec.matryoshka_dims))
        lines.append(f"- **Matryoshka dimensions:** {dims} (keep the first k coordinates, then re-normalise)")
    return "".join(line + "\n" for line in lines)


def merged_model(model: str, adapter: str | None):
    """(float32 model with the adapter merged, tokenizer)."""
    import torch

    merged, tokenizer, _ = load_with_adapter(model, adapter, torch.float32, merge=True)
    return merged, tokenizer


def save_merged(model: str, adapter: str | None, directory: str | Path) -> None:
    """Write the float32 base with the adapter merged, and its tokenizer, as a Hugging Face folder."""
    merged, tokenizer = merged_model(model, adapter)
    merged.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def check_exportable(spec: EmbeddingSpec, fmt: str) -> None:
    """ValueError if ``fmt`` cannot express how this adapter embeds."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {FORMATS}")
    if fmt == "sentence-transformers" and not (spec.attention == "causal" and spec.pooling in ("eos", "mean")):
        raise ValueError(
            f"this adapter embeds with {spec.describe()}, which a sentence-transformers model cannot express "
            "(it runs the model with causal attention and last-token or mean pooling); export --format hf and "
            "embed with unimae instead"
        )
    if fmt in ("gguf", "gguf-lora") and not spec.is_last_token:
        raise ValueError(
            f"this adapter embeds with {spec.describe()}, which a GGUF model cannot express (llama.cpp runs "
            "causal attention and pools the last token); export --format hf and embed with unimae instead"
        )


def append_eos_post_processor(tokenizer) -> None:
    """Replace the fast tokenizer's post-processor with one template: its own leading special tokens
    (BOS, if it adds one), the text, then EOS; truncation keeps room for both, like unimae."""
    from tokenizers import processors

    with_special = tokenizer("x", add_special_tokens=True)["input_ids"]
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    prefix = with_special[: with_special.index(plain[0])] if plain and plain[0] in with_special else []
    names = [tokenizer.convert_ids_to_tokens(i) for i in prefix]
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    single = " ".join([*names, "$A", eos])
    pair = " ".join([*names, "$A", eos, "$B:1", f"{eos}:1"])
    specials = sorted({(name, i) for name, i in zip(names, prefix, strict=True)} | {(eos, eos_id)})
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )


def export(
    model: str,
    adapter: str | None,
    output: str | Path,
    fmt: str = "hf",
    max_length: int = 512,
    gguf_type: str = "f16",
) -> Path:
    """Write the export to ``output`` (a directory; a ``.gguf`` file for ``gguf`` and ``gguf-lora``); return its
    path. Refuses a spec ``fmt`` cannot express."""
    spec = embedding_spec(adapter)
    check_exportable(spec, fmt)
    if fmt == "gguf-lora":
        from unimae.gguf_lora_export import export_gguf_lora

        check_writable(Path(output).parent)  # before the base model is loaded, not after

        return export_gguf_lora(model, adapter, output, gguf_type)
    if fmt == "gguf":
        return _save_gguf(model, adapter, Path(output), spec, gguf_type)
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new --output directory")
    partial = out.with_name(f".{out.name}.partial")  # built here and renamed into place once complete, so a
    shutil.rmtree(partial, ignore_errors=True)  # failed export leaves nothing at `out` and can simply be rerun
    partial.mkdir(parents=True)
    with writing(out, partial=partial):  # a failure (a full disk) deletes the partial folder
        if fmt == "hf":
            save_merged(model, adapter, partial)
            atomic_write_json(partial / ADAPTER_META, {"base_model": model, "embedding": spec.to_dict()})
        else:
            _save_sentence_transformers(model, adapter, partial, spec, max_length)
        (partial / "README.md").write_text(_model_card(model, adapter, fmt, spec))
    if out.exists():
        out.rmdir()  # empty (checked above)
    partial.rename(out)
    return out


def _save_sentence_transformers(model, adapter, out: Path, spec: EmbeddingSpec, max_length: int) -> None:
    from sentence_transformers import SentenceTransformer, models

    transformer_dir = out / "_transformer"
    merged, tokenizer = merged_model(model, adapter)
    merged.save_pretrained(transformer_dir)
    del merged  # sentence-transformers loads its own copy from the folder
    if spec.pooling == "eos":
        append_eos_post_processor(tokenizer)
    tokenizer.padding_side = "right"
    tokenizer.chat_template = None  # sentence-transformers >= 6 would wrap every text in it
    tokenizer.save_pretrained(transformer_dir)
    word = models.Transformer(str(transformer_dir), max_seq_length=max_length)
    mode = "lasttoken" if spec.pooling == "eos" else "mean"
    width = getattr(word, "get_embedding_dimension", None) or word.get_word_embedding_dimension  # renamed in 6.x
    pooling = models.Pooling(width(), pooling_mode=mode)
    prompts = spec.prompt_map or None  # encode_query / encode_document use the "query" / "document" prompts
    SentenceTransformer(modules=[word, pooling], similarity_fn_name="cosine", prompts=prompts).save(str(out))
    shutil.rmtree(transformer_dir)
    add_legacy_pooling_keys(out, mode)


# sentence-transformers < 5.4 (and vLLM before it learned the new format) read the pooling from these flags.
LEGACY_POOLING_KEYS = {"mean": "pooling_mode_mean_tokens", "lasttoken": "pooling_mode_lasttoken"}


def add_legacy_pooling_keys(out: Path, mode: str) -> None:
    """Write the pooling into ``1_Pooling/config.json`` in the old flag format too (``"pooling_mode_lasttoken":
    true``) beside the ``"pooling_mode"`` key that sentence-transformers >= 5.4 writes: readers that only know
    the old keys (vLLM's pooler detection before its support for the new format) then still see last-token
    pooling; sentence-transformers >= 5.4 ignores the old keys when ``pooling_mode`` is present."""
    for config_path in out.glob("*_Pooling/config.json"):
        config = json.loads(config_path.read_text())
        if "pooling_mode" not in config:
            continue  # an older sentence-transformers wrote the flags itself
        config.update({key: name == mode for name, key in LEGACY_POOLING_KEYS.items()})
        atomic_write_json(config_path, config)


def _save_gguf(model: str, adapter: str | None, out: Path, spec: EmbeddingSpec, gguf_type: str) -> Path:
    from unimae.gguf_export import GGUF_TYPES, source_gguf, write_gguf

    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"unknown GGUF type {gguf_type!r}; choose one of {GGUF_TYPES}")
    if out.suffix != ".gguf":
        raise ValueError(f"--output {out} must be a file name ending in .gguf for --format gguf")
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new --output file")
    check_writable(out.parent)  # before minutes of merging, not after
    merged, tokenizer = merged_model(model, adapter)
    extra = {"base_model": model, "adapter_revision": adapter_revision(adapter)}
    return write_gguf(merged, tokenizer, out, gguf_type, spec=spec, source=source_gguf(model), extra=extra)
