"""What every export shares: the formats and the check that a format can express how an adapter embeds (the
float32 model with the adapter merged is :func:`unimae.adapter.merged_model`)."""

from __future__ import annotations

from unimae.embedding.spec import EmbeddingSpec

FORMATS = ("hf", "sentence-transformers", "gguf", "gguf-lora")
# unimae pooling -> sentence-transformers' Pooling mode that computes the same vector (their weightedmean weights
# the i-th non-padding token by i, as wmean does)
ST_POOLING_MODES = {"eos": "lasttoken", "mean": "mean", "wmean": "weightedmean"}


def check_exportable(spec: EmbeddingSpec, fmt: str) -> None:
    """ValueError if ``fmt`` cannot express how this adapter embeds."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {FORMATS}")
    if fmt == "sentence-transformers" and not (spec.attention == "causal" and spec.pooling in ST_POOLING_MODES):
        raise ValueError(
            f"this adapter embeds with {spec.describe()}, which a sentence-transformers model cannot express "
            "(it runs the model with causal attention and last-token, mean or weighted-mean pooling); export "
            "--format hf and embed with unimae instead"
        )
    if fmt in ("gguf", "gguf-lora") and not spec.is_last_token:
        raise ValueError(
            f"this adapter embeds with {spec.describe()}, which a GGUF model cannot express (llama.cpp runs "
            "causal attention and pools the last token); export --format hf and embed with unimae instead"
        )
