"""Save and load trained adapters, with a fingerprint of the base model they belong to.

An adapter directory is a plain PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``)
plus ``unimae.json`` (:class:`AdapterMeta`): the base model's fingerprint, the :class:`EmbeddingSpec` it was trained
for (key ``embedding``) and the resolved training config. Loading an adapter onto a different base model
fails with a message saying which one it needs; a damaged adapter file (unreadable, or holding NaN or infinite
weights) fails with a message naming it.
:func:`load_with_adapter` is the one way to get "base model + adapter (+ merged)". An adapter that trains
token rows the base lacks (GEM's new summary tokens, peft ``trainable_token_indices``) gets the base grown to
them after the fingerprint check (which reads the unresized base), and its own tokenizer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from unimae.embedding.rotation import fit_rotation, save_rotation
from unimae.embedding.spec import EmbeddingSpec
from unimae.files import atomic_write_json, read_json, read_log_lines
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


@dataclass(frozen=True)
class TrainingTime:
    """The wall time of the optimizer steps an adapter holds and the CPU models they ran on: recorded in a release
    (and carried into a run continued from it), because the logs of its sittings stay on the machines that ran them."""

    seconds: float = 0.0
    cpu_models: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": round(float(self.seconds), 1), "cpu_models": list(self.cpu_models)}

    @classmethod
    def from_dict(cls, data) -> TrainingTime | None:
        """Inverse of :meth:`to_dict`; None for anything else (an older file, a damaged record)."""
        if not isinstance(data, Mapping) or not isinstance(data.get("seconds"), int | float):
            return None
        return cls(float(data["seconds"]), tuple(str(c) for c in data.get("cpu_models") or ()))

    @classmethod
    def from_log(cls, path: str | Path, up_to: int | None = None) -> TrainingTime:
        """The wall time a run's ``log.jsonl`` logged, each step once (a resumed run logs the steps after its
        checkpoint again: the last record counts), only steps <= ``up_to`` when given (a run that went on past the
        adapter at hand), and the CPU models its ``run.json`` beside records."""
        records = [record for _, record in read_log_lines(path)]
        by_step = {r.get("step", i): r.get("seconds", 0.0) for i, r in enumerate(records)}
        run = Path(path).with_name("run.json")
        record = read_json(run, "run record") if run.is_file() else {}
        cpus = list(record.get("cpu_models", [])) + ([record["cpu_model"]] if record.get("cpu_model") else [])
        seconds = sum(v for step, v in by_step.items() if up_to is None or step <= up_to)
        return cls(seconds, tuple(sorted(set(cpus))))

    def __add__(self, other: TrainingTime | None) -> TrainingTime:
        if other is None:
            return self
        return TrainingTime(self.seconds + other.seconds, tuple(sorted(set(self.cpu_models) | set(other.cpu_models))))


@dataclass(frozen=True)
class ReleaseInfo:
    """``release`` in a released adapter's ``unimae.json`` (written by ``unimae release``)."""

    name: str = ""
    weights_dtype: str = ""
    source_revision: str = ""  # adapter_revision of the adapter it was made from
    training: TrainingTime | None = None  # its steps' wall time (None: a release made before it was recorded)
    source_dtype: str = ""  # how that adapter stored its LoRA weights ("": not recorded, an fp32 one)

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "weights_dtype": self.weights_dtype, "source_revision": self.source_revision}
        out |= {"source_dtype": self.source_dtype} if self.source_dtype else {}
        return {**out, "training": self.training.to_dict()} if self.training else out


@dataclass(frozen=True)
class AdapterMeta:
    """``unimae.json``, what an adapter folder holds beside its PEFT files: the base model it belongs to, how it
    embeds and how it was trained.

    :meth:`from_dict` reads the files of every version: the first ones' top-level ``pooling`` becomes the
    ``embedding``, and keys it does not know are kept in ``extra`` (and written back by :meth:`to_dict`)."""

    base_model: str = field(default="", metadata={"help": "The --model it was trained on."})
    base_fingerprint: str = field(default="", metadata={"help": "base_fingerprint of that model ('': unchecked)."})
    embedding: EmbeddingSpec = field(default_factory=EmbeddingSpec, metadata={"help": "How it embeds."})
    trained_steps: int | None = field(default=None, metadata={"help": "Optimizer steps it holds."})
    mask_token: str | None = field(default=None, metadata={"help": "The mask token its run chose."})
    method: str | None = field(default=None, metadata={"help": "The --method that trained it."})
    init_adapter: str | None = field(
        default=None, metadata={"help": "Folder (inside this one) of the stage-1 adapter to merge into the base first."}
    )
    init_lora_revision: str | None = field(
        default=None, metadata={"help": "--init-lora: the revision of the adapter whose LoRA it started from."}
    )
    training_config: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "TrainConfig.to_dict() of its run (flat in older files)."}
    )
    continued_from_step: int | None = field(
        default=None, metadata={"help": "--continue-adapter: the step the adapter it continued held."}
    )
    continued_from_training: TrainingTime | None = field(
        default=None, metadata={"help": "--continue-adapter of a release: the wall time of the steps it held."}
    )
    distill_from_step: int | None = field(
        default=None,
        metadata={
            "help": "--continue-adapter of an adapter distilled from the same teacher at the same weight (a distilled "
            "cooldown lengthened): the step that distillation began at (None: at continued_from_step)."
        },
    )
    release: ReleaseInfo | None = field(default=None, metadata={"help": "Set in a release folder."})
    extra: dict[str, Any] = field(default_factory=dict, metadata={"help": "Keys this version does not know."})

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; fields that are unset (None, empty) are left out."""
        optional = {
            "trained_steps": self.trained_steps,
            "mask_token": self.mask_token,
            "method": self.method,
            "init_adapter": self.init_adapter,
            "init_lora": None if self.init_lora_revision is None else {"revision": self.init_lora_revision},
            "training_config": self.training_config or None,
            "continued_from": self._continued_from(),
            "release": None if self.release is None else self.release.to_dict(),
        }
        out = {"base_model": self.base_model, "base_fingerprint": self.base_fingerprint}
        out["embedding"] = self.embedding.to_dict()
        return {**out, **{k: v for k, v in optional.items() if v is not None}, **self.extra}

    @property
    def distill_start(self) -> int | None:
        """The step its distillation began at, if it was distilled from a continued adapter: ``distill_from_step``
        where a lengthening recorded it, else the step it continued from (None: not continued)."""
        return self.continued_from_step if self.distill_from_step is None else self.distill_from_step

    def _continued_from(self) -> dict[str, Any] | None:
        if self.continued_from_step is None:
            return None
        out = {"step": self.continued_from_step}
        if self.continued_from_training:
            out["training"] = self.continued_from_training.to_dict()
        return out if self.distill_from_step is None else {**out, "distill_from": self.distill_from_step}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> AdapterMeta:
        """Inverse of :meth:`to_dict`, for the files of every version (``None``/``{}``: an empty record)."""
        data = dict(data or {})
        if "embedding" not in data and "pooling" in data:  # the first version: causal attention, this pooling
            data["embedding"] = {"pooling": data.pop("pooling")}
        continued, release = data.pop("continued_from", None), data.pop("release", None)
        continued = continued if isinstance(continued, Mapping) else {}
        init_lora = data.pop("init_lora", None)
        plain = ("base_model", "base_fingerprint", "trained_steps", "mask_token", "method", "init_adapter")
        return cls(
            **{name: data.pop(name) for name in plain if name in data},
            embedding=EmbeddingSpec.from_dict(data.pop("embedding", None)),
            training_config=dict(data.pop("training_config", None) or {}),
            init_lora_revision=init_lora.get("revision") if isinstance(init_lora, Mapping) else None,
            continued_from_step=continued.get("step"),
            continued_from_training=TrainingTime.from_dict(continued.get("training")),
            distill_from_step=continued.get("distill_from"),
            release=_release_info(release),
            extra=data,  # what is left: keys this version does not know
        )


def _release_info(data) -> ReleaseInfo | None:
    """``release`` of a unimae.json (its known keys) as a ReleaseInfo; None without one."""
    if not isinstance(data, Mapping):
        return None
    names = {f.name for f in dataclasses.fields(ReleaseInfo)} - {"training"}
    known = {k: str(v) for k, v in data.items() if k in names}
    return ReleaseInfo(**known, training=TrainingTime.from_dict(data.get("training")))


def write_adapter_meta(directory: str | Path, meta: AdapterMeta) -> None:
    """Write ``meta`` as the ``unimae.json`` of the adapter folder ``directory``, atomically."""
    atomic_write_json(Path(directory) / ADAPTER_META, meta.to_dict())


@contextlib.contextmanager
def quiet_peft():
    """Silence the FutureWarning peft 0.21 triggers through a transformers API that transformers 5 deprecates."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def adapter_folder(adapter: str | Path) -> Path:
    """``adapter`` as a folder holding an adapter (its adapter_config.json), else an error saying what to pass."""
    directory = Path(adapter)
    if not (directory / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{directory} is not an adapter directory (no adapter_config.json); pass the 'adapter' folder "
            "written by `unimae train`, or the name of a release (`unimae models` lists them)"
        )
    return directory


def attach_adapter(model, adapter: str | Path, is_trainable: bool = False):
    """Wrap ``model`` with the PEFT adapter in ``adapter`` after checking it belongs to this base."""
    from peft import PeftModel

    directory = adapter_folder(adapter)
    config = read_json(directory / "adapter_config.json", "adapter config")  # a clear error before peft parses it
    meta = adapter_meta(directory)
    if not (directory / ADAPTER_META).is_file():
        warnings.warn(
            f"{directory} has no {ADAPTER_META}: it loads unchecked against the base model and embeds the default "
            "way (causal attention, eos pooling, no query prompt, no Matryoshka rotation); copy the adapter's "
            f"{ADAPTER_META} with it",
            stacklevel=2,
        )
    if meta.base_fingerprint and meta.base_fingerprint != base_fingerprint(model):
        raise ValueError(
            f"adapter {directory} was trained on base model {meta.base_model!r}, not on the model "
            f"loaded here; pass --model {meta.base_model}"
        )
    if meta.init_adapter:  # stage 2 trained on base + stage 1: merge stage 1 in fp32 first
        dtype = next(model.parameters()).dtype
        model = attach_adapter(model.float(), directory / meta.init_adapter).merge_and_unload().to(dtype)
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


def merged_model(model: str, adapter: str | None):
    """(float32 model with the adapter merged, tokenizer)."""
    merged, tokenizer, _ = load_with_adapter(model, adapter, torch.float32, merge=True)
    return merged, tokenizer


def save_merged(model: str, adapter: str | None, directory: str | Path) -> None:
    """Write the float32 base with the adapter merged, and its tokenizer, as a Hugging Face folder."""
    merged, tokenizer = merged_model(model, adapter)
    merged.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


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


def load_record(model: str, adapter: str | None) -> dict:
    """What names a base model + adapter in an index manifest: the model and a local folder's weights, the adapter
    folder and its weights' revision (a rebuilt folder or retrained adapter is another model: not resumed)."""
    return {
        "model": model,
        "model_revision": model_revision(model),
        "adapter": str(Path(adapter).resolve()) if adapter else None,
        "adapter_revision": adapter_revision(adapter),
    }


def adapter_meta(adapter: str | Path | None) -> AdapterMeta:
    """The unimae.json written next to an adapter by `unimae train` (an empty AdapterMeta without one)."""
    path = None if adapter is None else Path(adapter) / ADAPTER_META
    if not (path and path.is_file()):
        return AdapterMeta()
    data = read_json(path, "adapter metadata")
    try:
        if not isinstance(data, dict):
            raise TypeError(f"a JSON object is expected, not {type(data).__name__}")
        return AdapterMeta.from_dict(data)
    except (TypeError, AttributeError, ValueError) as err:
        raise ValueError(f"adapter metadata {path} is malformed ({err}); retrain or restore the adapter") from err


def embedding_spec(adapter: str | Path | None) -> EmbeddingSpec:
    """How an adapter embeds (causal attention + eos pooling without an adapter or a recorded spec)."""
    return adapter_meta(adapter).embedding


def forget_rotation(adapter: str | Path) -> None:
    """Drop the rotation named in ``adapter``'s ``unimae.json`` (its file stays until a new fit replaces it)."""
    meta = adapter_meta(adapter)
    if meta.embedding.rotation:
        write_adapter_meta(
            adapter, dataclasses.replace(meta, embedding=dataclasses.replace(meta.embedding, rotation=""))
        )


def fit_adapter_rotation(encoder, adapter: str | Path, texts: list[str], batch_size: int = 32):
    """Fit the Matryoshka rotation (:mod:`unimae.embedding.rotation`) of ``adapter`` (loaded as ``encoder``) on
    ``texts`` (embedded as documents), store it beside the weights and name it in the adapter's
    ``unimae.json`` -> (fingerprint, the share of the variance each leading prefix keeps (D,))."""
    vectors = encoder.encode_document(texts, batch_size=batch_size, show_progress=True)  # (N, D) full size: h_eos
    rotation = fit_rotation(vectors)
    centred = vectors - vectors.mean(0)
    variance = ((centred @ rotation.T) ** 2).sum(0)  # (D,) per principal axis
    info = {"texts": str(len(texts)), "max_length": str(encoder.max_length)}
    key = save_rotation(adapter, rotation, info)
    meta = adapter_meta(adapter)
    write_adapter_meta(adapter, dataclasses.replace(meta, embedding=dataclasses.replace(meta.embedding, rotation=key)))
    return key, np.cumsum(variance) / variance.sum()
