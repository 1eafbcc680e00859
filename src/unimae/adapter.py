"""Save and load trained adapters, with a fingerprint of the base model they belong to.

An adapter directory is a plain PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``)
plus ``unimae.json``: the base model's fingerprint, pooling and the resolved training config.
Loading an adapter onto a different base model fails with a message saying which one it needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from pathlib import Path

import torch

ADAPTER_META = "unimae.json"
INIT_ADAPTER = "init_adapter"  # a stage-1 adapter (kept inside a stage-2 one) merged into the base first
_VOLATILE_CONFIG_KEYS = {
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "architectures",
    "use_cache",
    "_attn_implementation_autoset",
}


def base_fingerprint(model) -> str:
    """Hash of the base model's architecture config and a sample of its input embeddings."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    embed = model.get_input_embeddings().weight
    sample = embed[:: max(1, embed.shape[0] // 64), :8].detach().cpu()  # (64, 8)
    digest.update(sample.to(torch.bfloat16).view(torch.int16).numpy().tobytes())  # same for fp32/bf16 copies
    return digest.hexdigest()[:24]


def write_adapter_meta(directory: str | Path, fingerprint: str, model_spec: str, **extra) -> None:
    meta = {"base_model": model_spec, "base_fingerprint": fingerprint, "pooling": "eos", **extra}
    (Path(directory) / ADAPTER_META).write_text(json.dumps(meta, indent=2) + "\n")


@contextlib.contextmanager
def quiet_peft():
    """Silence the FutureWarning peft 0.21 triggers through a transformers API that transformers 5 deprecates."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def attach_adapter(model, adapter: str | Path, is_trainable: bool = False):
    """Wrap ``model`` with the PEFT adapter in ``adapter`` after checking it belongs to this base."""
    from peft import PeftModel

    directory = Path(adapter)
    if not (directory / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{directory} is not an adapter directory (no adapter_config.json); pass the 'adapter' folder "
            "written by `unimae train`"
        )
    meta_path = directory / ADAPTER_META
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    expected = meta.get("base_fingerprint")
    if expected and expected != base_fingerprint(model):
        raise ValueError(
            f"adapter {directory} was trained on base model {meta.get('base_model')!r}, not on the model "
            f"loaded here; pass --model {meta.get('base_model')}"
        )
    if meta.get("init_adapter"):  # stage 2 trained on base + stage 1: merge stage 1 in fp32 first
        dtype = next(model.parameters()).dtype
        model = attach_adapter(model.float(), directory / meta["init_adapter"]).merge_and_unload().to(dtype)
    try:
        with quiet_peft():
            return PeftModel.from_pretrained(model, directory, is_trainable=is_trainable)
    except RuntimeError as err:  # shape mismatch when the architecture differs
        raise ValueError(f"adapter {directory} does not fit this base model: {err}") from err


def adapter_revision(adapter: str | None) -> str:
    """Content hash of the adapter weights (the 'revision' of a trained model); 'base' without one."""
    if adapter is None:
        return "base"
    digest = hashlib.sha256()
    for path in sorted(Path(adapter).glob("adapter_model.*")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def adapter_meta(adapter: str | Path | None) -> dict:
    """The unimae.json written next to an adapter by `unimae train` ({} without one)."""
    if adapter is None:
        return {}
    path = Path(adapter) / ADAPTER_META
    return json.loads(path.read_text()) if path.is_file() else {}


def embedding_settings(adapter: str | Path | None) -> dict:
    """How an adapter embeds: {"attention", "pooling", "pooling_options"} (causal + eos by default)."""
    meta = adapter_meta(adapter).get("embedding", {})
    return {
        "attention": meta.get("attention", "causal"),
        "pooling": meta.get("pooling", "eos"),
        "pooling_options": meta.get("pooling_options", {}),
    }
