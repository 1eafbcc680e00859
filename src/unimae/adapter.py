"""Save and load trained adapters, with a fingerprint of the base model they belong to.

An adapter directory is a plain PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``)
plus ``unimae.json``: the base model's fingerprint, the :class:`EmbeddingSpec` it was trained for
(key ``embedding``) and the resolved training config. Loading an adapter onto a different base model
fails with a message saying which one it needs; a damaged adapter file (unreadable, or holding NaN or infinite
weights) fails with a message naming it.
:func:`load_with_adapter` is the one way to get "base model + adapter (+ merged)". An adapter that trains
token rows the base lacks (GEM's new summary tokens, peft ``trainable_token_indices``) gets the base grown to
them after the fingerprint check (which reads the unresized base), and its own tokenizer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

from unimae.embedding.spec import EmbeddingSpec
from unimae.files import atomic_write_json, read_json
from unimae.models import grow_vocabulary, load_model, load_tokenizer

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


def write_adapter_meta(
    directory: str | Path, fingerprint: str, model_spec: str, embedding: EmbeddingSpec, **extra
) -> None:
    """Write ``unimae.json``: base model, its fingerprint, the embedding spec and ``extra`` fields."""
    meta = {"base_model": model_spec, "base_fingerprint": fingerprint, "embedding": embedding.to_dict(), **extra}
    atomic_write_json(Path(directory) / ADAPTER_META, meta)


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
            "written by `unimae train`, or the name of a release (`unimae models` lists them)"
        )
    config = read_json(directory / "adapter_config.json", "adapter config")  # a clear error before peft parses it
    meta = adapter_meta(directory)
    expected = meta.get("base_fingerprint")
    if expected and expected != base_fingerprint(model):
        raise ValueError(
            f"adapter {directory} was trained on base model {meta.get('base_model')!r}, not on the model "
            f"loaded here; pass --model {meta.get('base_model')}"
        )
    if meta.get("init_adapter"):  # stage 2 trained on base + stage 1: merge stage 1 in fp32 first
        dtype = next(model.parameters()).dtype
        model = attach_adapter(model.float(), directory / meta["init_adapter"]).merge_and_unload().to(dtype)
    rows = trained_token_rows(config)
    if rows:  # rows of tokens the training added (GEM's summary tokens): grow the base as training did
        grow_vocabulary(model, max(rows) + 1)
    weights = next(directory.glob("adapter_model.*"), directory / "adapter_model.safetensors")
    try:
        with quiet_peft():
            wrapped = PeftModel.from_pretrained(model, directory, is_trainable=is_trainable)
    except RuntimeError as err:  # shape mismatch when the architecture differs
        raise ValueError(f"adapter {directory} does not fit this base model: {_mismatch_summary(err)}") from err
    except Exception as err:  # safetensors' SafetensorError (truncated/empty file) is not an OSError
        if "safetensor" not in type(err).__name__.lower() and not isinstance(err, (OSError, EOFError)):
            raise
        raise ValueError(
            f"adapter weights {weights} cannot be read ({err}); the file is damaged or incomplete: "
            "copy it again or retrain (`unimae train --resume` finishes an interrupted run)"
        ) from err
    _check_finite_file(weights)
    return wrapped


def _mismatch_summary(err: RuntimeError) -> str:
    """torch's load_state_dict error, one line per weight of another shape (hundreds), as one sentence."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip().startswith("size mismatch for")]
    if not lines:
        return str(err)
    return (
        f"{len(lines)} weights have other shapes here ({lines[0].removeprefix('size mismatch for ')}); "
        "it was trained on another base model: pass that one as --model"
    )


def check_finite(tensors: Iterable[tuple[str, torch.Tensor]], what: str, fix: str) -> None:
    """ValueError "{what}: weight {name} holds NaN or infinite values; {fix}" for the first (name, tensor) pair
    that does."""
    for name, tensor in tensors:
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(f"{what}: weight {name} holds NaN or infinite values; {fix}")


def _check_finite_file(weights: Path) -> None:
    """ValueError naming ``weights`` (a .safetensors adapter file) if a tensor in it holds NaN or infinite values."""
    from safetensors import safe_open

    if weights.suffix != ".safetensors":
        return
    with safe_open(weights, framework="pt") as handle:
        tensors = ((name, handle.get_tensor(name)) for name in handle.keys())
        check_finite(tensors, f"adapter weights {weights}", "the file is damaged: copy it again or retrain")


def skip_input_upcast(model, skip: bool = True) -> None:
    """Stop peft casting each LoRA layer's input to the adapter's dtype, for a model run under bf16 autocast.

    Unmerged LoRA keeps its weights in float32 (trained, or loaded as trained) beside a bf16 base, so peft
    casts every LoRA layer's bf16 input up to float32, and autocast casts it straight back to bf16 for the
    ``lora_A`` product: two copies of the layer's activations (and of their gradients in training) for no
    change in the numbers (bf16 -> fp32 -> bf16 is exact; in training, LoRA dropout then acts on the bf16
    input, one rounding of ``x / (1 - p)`` either way). Call only where the model always runs under
    bf16 autocast; a float32 run has nothing to cast. ``skip=False`` restores peft's cast (for comparisons).
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = not skip


def load_with_adapter(model: str, adapter: str | Path | None, dtype: torch.dtype, merge: bool = False):
    """(model with ``adapter`` attached or merged, tokenizer, resolved model path).

    Merging happens in float32 (exact) and the merged weights are then cast to ``dtype``; unmerged, the
    base is loaded in ``dtype`` and the LoRA weights stay float32 beside it, as in training.
    """
    merge = merge and adapter is not None
    llm, tokenizer, path = load_model(model, dtype=torch.float32 if merge else dtype)
    if adapter is not None:
        llm = attach_adapter(llm, adapter)
        rows = trained_token_rows(read_json(Path(adapter) / "adapter_config.json", "adapter config"))
        if rows and max(rows) >= len(tokenizer) and (Path(adapter) / "tokenizer_config.json").is_file():
            tokenizer = load_tokenizer(adapter)  # the base's tokenizer plus the tokens the adapter added
    if merge:
        llm = llm.merge_and_unload().to(dtype)
    return llm, tokenizer, path


def trained_token_rows(adapter_config: dict) -> list[int]:
    """Token ids whose embedding rows an adapter trains (peft ``trainable_token_indices``, a list or
    ``{module: ids}``; GEM's summary tokens), from its parsed ``adapter_config.json``; [] for most adapters."""
    indices = adapter_config.get("trainable_token_indices") if isinstance(adapter_config, dict) else None
    indices = indices or []
    if isinstance(indices, dict):
        indices = [i for ids in indices.values() for i in ids]
    return [int(i) for i in indices]


def adapter_revision(adapter: str | None) -> str:
    """Content hash of the adapter weights (the 'revision' of a trained model); 'base' without one."""
    if adapter is None:
        return "base"
    digest = hashlib.sha256()
    for path in sorted(Path(adapter).glob("adapter_model.*")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def model_revision(model: str) -> str | None:
    """For a model folder on disk: a hash of its files' names, sizes and modification times (retraining into
    the same folder changes it); None for a Hub id or a registry name (those name fixed weights)."""
    folder = Path(model)
    if not folder.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.is_file():
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:12]


def adapter_meta(adapter: str | Path | None) -> dict:
    """The unimae.json written next to an adapter by `unimae train` ({} without one)."""
    if adapter is None:
        return {}
    path = Path(adapter) / ADAPTER_META
    return read_json(path, "adapter metadata") if path.is_file() else {}


def embedding_spec(adapter: str | Path | None) -> EmbeddingSpec:
    """How an adapter embeds (causal attention + eos pooling without an adapter or a recorded spec)."""
    return EmbeddingSpec.from_dict(adapter_meta(adapter).get("embedding"))
