"""Write a unimae LoRA adapter as a llama.cpp LoRA-adapter GGUF: one base GGUF, adapters swapped at load time.

The format (what llama.cpp's ``convert_lora_to_gguf.py`` writes and ``llama_adapter_lora_init`` reads):
``general.type = adapter``, ``adapter.type = lora``, ``adapter.lora.alpha``, ``general.architecture`` of the
base, and for each adapted weight ``W`` of the base GGUF (n_out, n_in) two tensors, ``{name}.lora_a``
(r, n_in) and ``{name}.lora_b`` (n_out, r) in numpy order. llama.cpp computes

    W x + s * B (A x),   s = scale * alpha / r,  or s = scale when alpha is 0,

with ``scale`` from ``--lora-scaled FILE SCALE`` (1 for ``--lora FILE``). What unimae merges is
``W' = W + sum over stages of gamma B A`` with peft's per-module ``gamma`` (alpha / r, alpha / sqrt(r) with
rsLoRA, ``rank_pattern`` / ``alpha_pattern``). So the file stores ``B`` pre-multiplied by ``gamma`` and
``alpha = 0``: llama.cpp then adds exactly peft's delta at scale 1, whatever the ranks. A stage-2 adapter
(``init_adapter``: trained on base + stage 1) becomes one pair per weight by concatenating along r:
``[B1 B2] [A1; A2] = B1 A1 + B2 A2``.

Names and row order are the merged export's (:mod:`unimae.export.gguf`): the same ``TensorNameMap``, and
Llama's q/k permutation applied to the rows of ``B``, so the adapter fits a base GGUF from ``--format gguf``
without an adapter, or from llama.cpp's ``convert_hf_to_gguf.py``, of the same base model.

Refused, nothing written: an embedding rule other than causal last-token (as ``--format gguf``), and what is
not a low-rank pair on a linear weight: DoRA, ``modules_to_save``, trained token rows, trained biases, LoRA on
an embedding layer, and LoRA on the output head of a model with tied embeddings (its GGUF has no output
tensor: llama.cpp reuses ``token_embd.weight``). Those adapters export with ``--format gguf`` (merged).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from unimae.adapter import adapter_folder, adapter_meta, adapter_revision, attach_adapter, embedding_spec
from unimae.export.base import check_exportable
from unimae.export.gguf import (
    arch_rule,
    base_config,
    encode_tensor,
    file_types,
    finish_gguf,
    gguf_tensor_name,
    llama_cpp_rows,
    tensor_name_map,
    unimae_keys,
)
from unimae.files import atomic_write, check_writable
from unimae.models import load_model

LORA_TYPES = ("f32", "f16")
_MERGED_INSTEAD = "export --format gguf (the LoRA merged into one file) instead"
# peft LoraConfig fields whose non-default value adds something that is not a low-rank pair on a linear weight.
_INEXPRESSIBLE = {
    "use_dora": "DoRA (a trained magnitude per output row)",
    "modules_to_save": "fully trained module copies (modules_to_save)",
    "trainable_token_indices": "trained token embedding rows (trainable_token_indices)",
    "lora_bias": "a trained bias on lora_B (lora_bias)",
    "layer_replication": "replicated layers (layer_replication)",
    "target_parameters": "LoRA on parameters rather than modules (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
}


def export_gguf_lora(model: str, adapter: str | Path | None, output: str | Path, out_type: str = "f16") -> Path:
    """Write ``adapter`` (trained on base ``model``) to ``output`` as a llama.cpp LoRA-adapter GGUF; return its
    path. ``out_type``: f32 or f16. ValueError, with nothing written, for what the format cannot express; the
    output and what :func:`check_before_load` can tell are checked before the base model loads."""
    if adapter is None:
        raise ValueError("--format gguf-lora writes an adapter: pass --adapter DIR (the base is --format gguf)")
    if out_type not in LORA_TYPES:
        raise ValueError(f"unknown GGUF LoRA type {out_type!r}; choose one of {LORA_TYPES}")
    out = Path(output)
    if out.suffix != ".gguf":
        raise ValueError(f"--output {out} must be a file name ending in .gguf for --format gguf-lora")
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new --output file")
    check_writable(out.parent)
    spec = embedding_spec(adapter)
    check_exportable(spec, "gguf-lora")
    check_before_load(model, Path(adapter))
    base, tokenizer, _ = load_model(model)
    rule = arch_rule(base.config)
    tensors = list(_lora_tensors(base, Path(adapter), rule, file_types()[out_type][0]))
    extra = {"base_model": model, "adapter_revision": adapter_revision(str(adapter))}

    def write(tmp: Path) -> None:
        from gguf import GGUFType, GGUFWriter, Keys

        writer = GGUFWriter(tmp, rule.gguf_arch)
        writer.add_type(GGUFType.ADAPTER)
        writer.add_string(Keys.Adapter.TYPE, "lora")
        writer.add_float32(Keys.Adapter.LORA_ALPHA, 0.0)  # peft's scaling is folded into lora_b
        writer.add_file_type(int(file_types()[out_type][1]))
        finish_gguf(writer, unimae_keys(tokenizer, spec, extra), tensors)

    out.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(out, write)


def check_before_load(model: str, adapter: Path) -> None:
    """Refuse, before the base model loads, what needs neither its weights nor its modules: a base
    architecture the exporter does not map (:func:`~unimae.export.gguf.arch_rule`) and an adapter stage whose
    peft config is not plain low-rank pairs (DoRA, modules_to_save, trained biases or token rows...), and, from
    the names of its stored weights, LoRA on an embedding layer or on a tied output head. LoRA on another layer
    that is not linear is found once the adapter is attached."""
    from peft import PeftConfig

    config = base_config(model)
    if config is not None:
        arch_rule(config)
    tied = config is not None and bool(getattr(config, "tie_word_embeddings", False))
    for stage in adapter_stages(adapter):
        _check_expressible(PeftConfig.from_pretrained(str(adapter_folder(stage))), stage)
        _check_weight_names(stage, tied)


def adapter_stages(adapter: Path) -> list[Path]:
    """The adapter directories whose deltas add up to ``adapter``'s model: its ``init_adapter`` chain, then it."""
    init = adapter_meta(adapter).init_adapter
    return [*(adapter_stages(adapter / init) if init else []), adapter]


def low_rank_pairs(model, adapter: Path) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """{Hugging Face weight name: [(A (r, n_in), gamma * B (n_out, r)) per stage]} of ``adapter`` on ``model``
    (float32). ValueError for an adapter that is not low-rank pairs on linear weights. ``model`` is consumed:
    each stage is attached to the base in turn and unloaded again (only its A and B are read, so the stages
    before it need not be merged in)."""
    from peft.tuners.lora import Linear, LoraLayer

    pairs: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for stage in adapter_stages(adapter):
        peft_model = attach_adapter(model.float(), stage)
        for config in peft_model.peft_config.values():
            _check_expressible(config, stage)
        for name, module in peft_model.get_base_model().named_modules():
            if not isinstance(module, LoraLayer):
                continue
            if not isinstance(module, Linear):
                raise ValueError(_not_linear(stage, name, type(module.get_base_layer()).__name__))
            for key in module.active_adapters:
                a = module.lora_A[key].weight.detach().float().cpu().numpy()  # (r, n_in)
                b = module.lora_B[key].weight.detach().float().cpu().numpy() * module.scaling[key]  # (n_out, r)
                pairs.setdefault(f"{name}.weight", []).append((a, b))
        model = peft_model.unload()
    return pairs


def _check_expressible(config, stage: Path) -> None:
    from peft import LoraConfig

    if not isinstance(config, LoraConfig):
        raise ValueError(f"adapter {stage} is a {config.peft_type} adapter, not LoRA; {_MERGED_INSTEAD}")
    found = [what for field, what in _INEXPRESSIBLE.items() if getattr(config, field, None)]
    if config.bias != "none":
        found.append(f"trained biases (bias={config.bias!r})")
    if found:
        raise ValueError(
            f"adapter {stage} has {', '.join(found)}, which a llama.cpp LoRA adapter cannot express (it holds "
            f"low-rank pairs of linear weights only); {_MERGED_INSTEAD}"
        )


def _check_weight_names(stage: Path, tied: bool) -> None:
    """Refuse, from the tensor names in the stage's weights file alone, LoRA on an embedding layer (peft stores
    its pairs as ``lora_embedding_A/B``) and, where the base ties its embeddings (``tied``), on ``lm_head``. A
    weights file that is not safetensors, or cannot be read, is left to the adapter's load to report."""
    from safetensors import SafetensorError, safe_open

    weights = adapter_folder(stage) / "adapter_model.safetensors"
    try:
        with safe_open(str(weights), "np") as stored:
            keys = list(stored.keys())
    except (OSError, SafetensorError):
        return
    for key in keys:  # e.g. base_model.model.model.embed_tokens.lora_embedding_A
        module, _, kind = key.removeprefix("base_model.model.").partition(".lora_")
        if kind.startswith("embedding_"):
            raise ValueError(_not_linear(stage, module, "Embedding"))
        if tied and module == "lm_head":
            raise ValueError(_tied_head(stage))


def _not_linear(stage: Path, module: str, kind: str) -> str:
    return f"adapter {stage} puts LoRA on {module} ({kind}), not a linear layer; {_MERGED_INSTEAD}"


def _tied_head(stage: Path) -> str:
    return (
        f"adapter {stage} puts LoRA on the output head of a model with tied embeddings; its GGUF has no output "
        f"tensor (llama.cpp reuses token_embd.weight); {_MERGED_INSTEAD}"
    )


def _lora_tensors(model, adapter: Path, rule, qtype) -> Iterator[tuple[str, np.ndarray, object]]:
    """(GGUF name, array, GGML type) of each adapted weight's ``.lora_a`` and ``.lora_b``, in model order."""
    config = model.config
    names = tensor_name_map(config, rule)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, stages in low_rank_pairs(model, adapter).items():
        if tied and hf_name == "lm_head.weight":
            raise ValueError(_tied_head(adapter))
        name = gguf_tensor_name(names, hf_name, config)
        a = np.concatenate([a for a, _ in stages], axis=0)  # (r_total, n_in)
        b = llama_cpp_rows(hf_name, np.concatenate([b for _, b in stages], axis=1), config, rule)  # (n_out, r_total)
        yield (f"{name}.lora_a", *encode_tensor(a, qtype))
        yield (f"{name}.lora_b", *encode_tensor(b, qtype))
