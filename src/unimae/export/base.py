"""What every export shares: the formats, the check that a format can express how an adapter embeds, and the
float32 model with the adapter merged."""

from __future__ import annotations

from pathlib import Path

from unimae.adapter import load_with_adapter
from unimae.embedding.spec import EmbeddingSpec

FORMATS = ("hf", "sentence-transformers", "gguf", "gguf-lora")


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
