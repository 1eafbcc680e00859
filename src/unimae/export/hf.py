"""Hugging Face folders: ``hf`` (a plain transformers model) and ``sentence-transformers``, each with a model card.

See :mod:`unimae.export` for what each format holds and which adapters it refuses.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from unimae.adapter import ADAPTER_META, adapter_meta, merged_model, save_merged
from unimae.embedding.rotation import load_rotation, save_rotation
from unimae.embedding.spec import EmbeddingSpec
from unimae.export.base import ST_POOLING_MODES
from unimae.files import atomic_write_json, writing
from unimae.training.config import flat_values

_CARD_KEYS = ("method", "recipe", "steps", "batch_size", "max_length", "lr", "alpha", "p_mar", "p_mrc", "lora_r")
_CARD_KEYS += ("lora_alpha", "data")


def _usage(spec: EmbeddingSpec, fmt: str) -> str:
    if spec.is_last_token:
        return (
            "last token. The tokenizer's EOS token is appended **after** truncation and the embedding is the "
            "last-layer hidden state at that EOS (UniMAE's `h_eos`). In the sentence-transformers export the "
            "tokenizer appends EOS itself; with plain transformers, append `tokenizer.eos_token_id` to the ids "
            "yourself and read the hidden state at the last real token (mind left padding). unimae embeds each "
            "text without its outer whitespace (`text.strip()`): strip texts before encoding here too."
        )
    note = (
        "" if fmt == "sentence-transformers" else " Plain transformers runs causal attention: apply the rule yourself."
    )
    return f"{spec.describe()} (unimae `EmbeddingSpec`, also in `unimae.json`).{note}"


def _model_card(model: str, adapter: str | None, fmt: str, spec: EmbeddingSpec) -> str:
    cfg = flat_values(adapter_meta(adapter).training_config)
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
{_requirement_line(fmt)}{_prompt_lines(spec)}"""


def _requirement_line(fmt: str) -> str:
    """The sentence-transformers version a sentence-transformers export needs: the one that wrote it, major version
    and up (its ``modules.json`` names that version's module classes; 5.x fails on a 6.x folder with ``No module
    named 'sentence_transformers.base'``)."""
    if fmt != "sentence-transformers":
        return ""
    from importlib.metadata import version

    major = version("sentence-transformers").split(".")[0]
    return (
        f"- **Requires:** `sentence-transformers>={major}` (this folder was written by sentence-transformers "
        f"{version('sentence-transformers')}; older major versions cannot load its modules: use the `hf` export "
        "with plain transformers there).\n"
    )


def _prompt_lines(spec: EmbeddingSpec) -> str:
    """Model-card lines for the prompts and Matryoshka dimensions an adapter was trained with ('' without)."""
    lines = [f"- **Prompt `{name}`:** `{text!r}` (prepended to the text)" for name, text in spec.prompts]
    if spec.prompts:
        lines.append("  (sentence-transformers: `encode_query` / `encode_document`; llama.cpp: prepend it yourself)")
    if spec.matryoshka_dims and spec.rotation:
        dims = ", ".join(map(str, spec.matryoshka_dims))
        lines.append(
            f"- **Matryoshka dimensions:** {dims} and any other k, after a PCA rotation (sentence-transformers: its "
            "Dense module rotates, `truncate_dim=k` keeps the first k; elsewhere multiply by the first k rows of "
            "the rotation, `Encoder.rotation` in unimae, then re-normalise). Its full-size vectors are thus the "
            "rotation of unimae's: the same cosines among themselves, but do not mix them with vectors unimae "
            "wrote (an index built by `unimae index`)"
        )
    elif spec.matryoshka_dims:
        dims = ", ".join(map(str, spec.matryoshka_dims))
        lines.append(
            f"- **Matryoshka dimensions:** {dims} (keep the first k coordinates, then re-normalise; "
            "sentence-transformers: `SentenceTransformer(folder, truncate_dim=k)`, `normalize_embeddings=True`)"
        )
    return "".join(line + "\n" for line in lines)


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


def export_folder(model: str, adapter: str | None, out: Path, fmt: str, spec: EmbeddingSpec, max_length: int) -> Path:
    """Write the ``hf`` or ``sentence-transformers`` export of ``model`` + ``adapter`` into the new (or empty)
    folder ``out`` with its model card; return ``out``. Built in a partial folder renamed into place at the end.
    The output folder and the adapter's rotation (a missing or altered one) are checked before the merge."""
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new --output directory")
    rotation = load_rotation(adapter, spec.rotation) if spec.rotation else None  # (D, D)
    partial = out.with_name(f".{out.name}.partial")  # built here and renamed into place once complete, so a
    shutil.rmtree(partial, ignore_errors=True)  # failed export leaves nothing at `out` and can simply be rerun
    partial.mkdir(parents=True)
    with writing(out, partial=partial):  # a failure (a full disk) deletes the partial folder
        if fmt == "hf":
            save_merged(model, adapter, partial)
            atomic_write_json(partial / ADAPTER_META, {"base_model": model, "embedding": spec.to_dict()})
            if rotation is not None:  # the card tells users to multiply by it
                save_rotation(partial, rotation)
        else:
            _save_sentence_transformers(model, adapter, partial, spec, max_length, rotation)
        (partial / "README.md").write_text(_model_card(model, adapter, fmt, spec))
    if out.exists():
        out.rmdir()  # empty (checked above)
    partial.rename(out)
    return out


def _save_sentence_transformers(
    model, adapter, out: Path, spec: EmbeddingSpec, max_length: int, rotation: np.ndarray | None
) -> None:
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
    mode = ST_POOLING_MODES[spec.pooling]
    width = getattr(word, "get_embedding_dimension", None) or word.get_word_embedding_dimension  # renamed in 6.x
    pooling = models.Pooling(width(), pooling_mode=mode)
    prompts = spec.prompt_map or None  # encode_query / encode_document use the "query" / "document" prompts
    modules = [word, pooling, *_rotation_module(rotation)]
    SentenceTransformer(modules=modules, similarity_fn_name="cosine", prompts=prompts).save(str(out))
    shutil.rmtree(transformer_dir)
    add_legacy_pooling_keys(out, mode)


# sentence-transformers < 5.4 (and vLLM before it learned the new format) read the pooling from these flags.
LEGACY_POOLING_KEYS = {
    "mean": "pooling_mode_mean_tokens",
    "weightedmean": "pooling_mode_weightedmean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}


def _rotation_module(rotation: np.ndarray | None) -> list:
    """[a Dense layer z -> R z] for an adapter's Matryoshka ``rotation`` (:mod:`unimae.embedding.rotation`), else
    []: the export's vectors are then rotated (every cosine unchanged) and ``truncate_dim=k`` keeps the first k
    principal coordinates, as unimae's ``dimensions=k`` does."""
    if rotation is None:
        return []
    import torch
    from sentence_transformers import models

    d = rotation.shape[0]
    weight = torch.from_numpy(rotation)  # (D, D)
    return [models.Dense(d, d, bias=False, activation_function=torch.nn.Identity(), init_weight=weight)]


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
