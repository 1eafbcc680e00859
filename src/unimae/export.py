"""Export a base model + adapter for the ecosystem.

- ``hf``: a plain Hugging Face model directory (LoRA merged into float32 weights) with a model
  card stating pooling, EOS handling and the training recipe. transformers loads it for generation
  and for embeddings (last-layer state at an appended EOS).
- ``sentence-transformers``: the same weights as a SentenceTransformer directory: Transformer
  module + last-token Pooling, and a tokenizer whose post-processor appends EOS after truncation,
  so ``SentenceTransformer(dir).encode(texts)`` gives unimae's ``eos`` embeddings.
"""

from __future__ import annotations

import json
from pathlib import Path

FORMATS = ("hf", "sentence-transformers")


def _model_card(model: str, adapter: str | None, fmt: str) -> str:
    recipe = "base model, no adapter"
    if adapter and (Path(adapter) / "unimae.json").is_file():
        meta = json.loads((Path(adapter) / "unimae.json").read_text())
        cfg = meta.get("training_config", {})
        recipe = ", ".join(
            f"{k}={cfg[k]}"
            for k in (
                "method",
                "recipe",
                "steps",
                "batch_size",
                "max_length",
                "lr",
                "alpha",
                "p_mar",
                "p_mrc",
                "lora_r",
                "lora_alpha",
                "data",
            )
            if k in cfg
        )
    return f"""---
library_name: {"sentence-transformers" if fmt == "sentence-transformers" else "transformers"}
tags: [unimae, sentence-embeddings, text-generation]
---
# {Path(model).name} + UniMAE

Exported by unimae from base model `{model}` and adapter `{adapter}` (LoRA merged, float32).
One model, two jobs: it generates text as the base model does, and it embeds sentences.

- **Pooling:** last token. The tokenizer's EOS token is appended **after** truncation and the
  embedding is the last-layer hidden state at that EOS (UniMAE's `h_eos`).
- **EOS handling:** in the sentence-transformers export the tokenizer appends EOS itself; with
  plain transformers, append `tokenizer.eos_token_id` to the ids yourself and read the hidden
  state at the last real token (mind left padding).
- **Similarity:** cosine.
- **Training recipe:** {recipe}.
"""


def merged_model(model: str, adapter: str | None):
    """(float32 model with the adapter merged, tokenizer)."""
    import torch

    from unimae.adapter import attach_adapter
    from unimae.models import load_model

    base, tokenizer, _ = load_model(model, dtype=torch.float32)
    if adapter:
        base = attach_adapter(base, adapter).merge_and_unload()
    return base, tokenizer


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


def export(model: str, adapter: str | None, output: str | Path, fmt: str = "hf", max_length: int = 512) -> Path:
    """Write the export to ``output``; return its path."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {FORMATS}")
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new --output directory")
    merged, tokenizer = merged_model(model, adapter)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "hf":
        merged.save_pretrained(out)
        tokenizer.save_pretrained(out)
    else:
        from sentence_transformers import SentenceTransformer, models

        transformer_dir = out / "_transformer"
        merged.save_pretrained(transformer_dir)
        append_eos_post_processor(tokenizer)
        tokenizer.padding_side = "right"
        tokenizer.chat_template = None  # sentence-transformers >= 6 would wrap every text in it
        tokenizer.save_pretrained(transformer_dir)
        word = models.Transformer(str(transformer_dir), max_seq_length=max_length)
        pooling = models.Pooling(word.get_word_embedding_dimension(), pooling_mode="lasttoken")
        SentenceTransformer(modules=[word, pooling], similarity_fn_name="cosine").save(str(out))
        import shutil

        shutil.rmtree(transformer_dir)
    (out / "README.md").write_text(_model_card(model, adapter, fmt))
    return out
