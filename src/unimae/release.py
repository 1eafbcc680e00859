"""Released adapters: trained adapters that ship in this repository's ``releases/<name>/``, usable by name.

A release folder holds what a user needs to embed and generate with it and nothing to train it further:
``adapter_model.safetensors`` (the LoRA weights in bf16), ``adapter_config.json``, ``unimae.json`` (base model,
its fingerprint, the :class:`~unimae.embedding.spec.EmbeddingSpec` with its prompts and Matryoshka dimensions,
the training config) and a model card ``README.md`` in the Hugging Face format, whose ``model-index`` and tables
are generated from the evaluation's result files (``unimae release --card-only`` regenerates it).

Names resolve like offline models (:func:`resolve_adapter`): ``Encoder.from_pretrained("gemma3-270m",
adapter="unimae-gemma3-270m-retriever")`` finds ``releases/unimae-gemma3-270m-retriever`` from any working
directory (the folders of ``$UNIMAE_RELEASES``, ``:``-separated, are searched first, then the repository's, then
the copies a wheel carries in ``unimae/_releases``: ``setup.py`` puts them there).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
from pathlib import Path

import torch

from unimae.adapter import (
    ADAPTER_META,
    INIT_ADAPTER,
    AdapterMeta,
    ReleaseInfo,
    TrainingTime,
    adapter_meta,
    adapter_revision,
    write_adapter_meta,
)
from unimae.embedding.rotation import load_rotation, rotation_metadata
from unimae.files import atomic_write_text, replace_folder

logger = logging.getLogger(__name__)

RELEASES_ENV = "UNIMAE_RELEASES"
REPOSITORY_RELEASES = Path(__file__).resolve().parents[2] / "releases"  # a source checkout / editable install
PACKAGED_RELEASES = Path(__file__).resolve().parent / "_releases"  # a wheel install (setup.py copies them in)
MAX_WEIGHTS_BYTES = 16 * 2**20
RELEASE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
RELEASE_FILES = ("adapter_model.safetensors", "adapter_config.json", ADAPTER_META, "README.md")


def release_roots() -> list[Path]:
    """Folders searched for release names, in order: ``$UNIMAE_RELEASES`` entries, then the repository's, then a
    wheel's (where it exists)."""
    extra = [Path(p).expanduser() for p in os.environ.get(RELEASES_ENV, "").split(os.pathsep) if p]
    packaged = [PACKAGED_RELEASES] if PACKAGED_RELEASES.is_dir() else []
    return [*extra, REPOSITORY_RELEASES, *packaged]


def available_releases() -> list[str]:
    """Names of the releases found in :func:`release_roots`."""
    names = {p.name for root in release_roots() if root.is_dir() for p in root.iterdir() if _is_release(p)}
    return sorted(names)


def _is_release(folder: Path) -> bool:
    return (folder / "adapter_config.json").is_file() and (folder / ADAPTER_META).is_file()


def find_release(adapter: str | Path) -> str | None:
    """The folder of the release named ``adapter`` (a plain name that is not an existing path), else None."""
    path = Path(adapter).expanduser()
    if path.exists() or len(path.parts) > 1:
        return None
    for root in release_roots():
        if _is_release(root / str(adapter)):
            return str(root / str(adapter))
    return None


def resolve_adapter(adapter: str | Path | None) -> str | None:
    """An adapter argument -> a folder path: an existing path as given, else a release of that name; None stays
    None. A plain name that is neither is an error listing the releases."""
    if adapter is None:
        return None
    path = Path(adapter).expanduser()
    if path.exists() or len(path.parts) > 1:
        return str(path)
    found = find_release(adapter)
    if found:
        return found
    raise FileNotFoundError(
        f"adapter {str(adapter)!r} is neither a folder nor a release; releases: {available_releases() or 'none'} "
        f"(searched {', '.join(map(str, release_roots()))}; ${RELEASES_ENV} adds folders of releases)"
    )


def make_release(
    adapter: str | Path,
    name: str,
    root: str | Path = REPOSITORY_RELEASES,
    card: str = "",
    training: TrainingTime | None = None,
) -> Path:
    """Write ``root/name/`` from a trained ``adapter`` folder: its LoRA weights cast to bf16, its config and
    ``unimae.json`` (with ``training``, the wall time of its steps, so a later card or a run continued from the
    release elsewhere still knows it), and ``card`` as README.md. Replaces an earlier release of that name
    (one per model).

    Refuses an adapter trained on top of an init adapter (a release is one LoRA on the base model) and weights
    over 16 MiB in bf16."""
    from safetensors.torch import load_file, save_file

    check_release_name(name)
    source = Path(adapter)
    if not (source / ADAPTER_META).is_file():
        raise FileNotFoundError(f"{source} has no {ADAPTER_META}: pass an adapter folder written by `unimae train`")
    meta = adapter_meta(source)
    if meta.init_adapter or (source / INIT_ADAPTER).exists():
        raise ValueError(f"{source} was trained on top of an init adapter; a release is one LoRA on the base model")
    weights = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(source / "adapter_model.safetensors").items()}
    size = sum(v.numel() * v.element_size() for v in weights.values())
    if size > MAX_WEIGHTS_BYTES:
        raise ValueError(f"{source}: {size / 2**20:.1f} MiB of weights in bf16, over the release limit of 16 MiB")
    out = Path(root) / name
    partial = out.with_name(f".{name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    metadata = {"format": "pt"}
    if meta.embedding.rotation:  # checked, then carried in the weights file (a release is its four files)
        metadata.update(rotation_metadata(load_rotation(source, meta.embedding.rotation)))
    save_file(weights, partial / "adapter_model.safetensors", metadata=metadata)
    _keep_unchanged_weights(out / "adapter_model.safetensors", partial / "adapter_model.safetensors")
    shutil.copy2(source / "adapter_config.json", partial / "adapter_config.json")
    release = ReleaseInfo(name, "bfloat16", source_revision(source), training, source_dtype(source))
    write_adapter_meta(partial, dataclasses.replace(meta, release=release))
    atomic_write_text(partial / "README.md", card)
    replace_folder(partial, out)
    return out


def record_training(release: str | Path, training: TrainingTime | None) -> None:
    """Write ``training`` (its steps' wall time) into a release's ``unimae.json`` where it records another (or
    none); the weights, and so the revision, stay as they are."""
    meta = release_meta(release)
    if training is None or meta.release is None or meta.release.training == training:
        return
    info = dataclasses.replace(meta.release, training=training)
    write_adapter_meta(Path(release), dataclasses.replace(meta, release=info))


def _keep_unchanged_weights(released: Path, written: Path) -> None:
    """Put the released file's bytes back in ``written`` when it holds the same tensors and metadata: safetensors
    orders the metadata keys as it likes, and the release's revision (a hash of the bytes) should name its weights,
    not the write."""
    from safetensors import safe_open

    if not released.is_file():
        return
    try:
        with safe_open(released, "pt") as old, safe_open(written, "pt") as new:
            same = old.metadata() == new.metadata() and sorted(old.keys()) == sorted(new.keys())
            same = same and all(torch.equal(old.get_tensor(k), new.get_tensor(k)) for k in old.keys())
    except Exception:  # noqa: BLE001 - a damaged earlier release is simply replaced
        return
    if same:
        shutil.copyfile(released, written)


def check_release_name(name: str) -> None:
    """A release name is one plain folder name (letters, digits, '.', '_', '-'; not '.' or '..'): the folder
    ``root/name`` is replaced, so an empty or path-like name must never reach it."""
    if not RELEASE_NAME.fullmatch(name or "") or name in (".", ".."):
        raise ValueError(f"release name {name!r}: use one folder name of letters, digits, '.', '_' and '-'")


def source_revision(adapter: str | Path) -> str:
    """The revision of the trained adapter a release is made from: the adapter's own, or, for a release made again
    from a release (bf16 -> bf16: the same weights), the one that release was made from."""
    meta = adapter_meta(adapter)
    return meta.release.source_revision if meta.release else adapter_revision(adapter)


def source_dtype(adapter: str | Path) -> str:
    """How the trained adapter a release is made from stores its LoRA weights ('float32', 'bfloat16'): read from
    its weights file, or, for a release made again from a release, the one recorded there ('' before it was)."""
    from safetensors import safe_open

    meta = adapter_meta(adapter)
    if meta.release:
        return meta.release.source_dtype
    with safe_open(Path(adapter) / "adapter_model.safetensors", framework="pt") as handle:
        dtypes = {str(handle.get_slice(name).get_dtype()) for name in handle.keys()}
    return {"F32": "float32", "BF16": "bfloat16"}.get(dtypes.pop(), "") if len(dtypes) == 1 else ""


def release_revisions(adapter: str | Path) -> tuple[str, ...]:
    """The revisions whose results describe a release made from ``adapter``: the trained adapter's
    (:func:`source_revision`) and, where they differ (``adapter`` is itself a release, or a copy of one), its
    bf16 weights' own."""
    return tuple(dict.fromkeys((source_revision(adapter), adapter_revision(adapter))))


def release_meta(release: str | Path) -> AdapterMeta:
    """The ``unimae.json`` of a release folder (an error when it has none, or a malformed one)."""
    if not (Path(release) / ADAPTER_META).is_file():
        raise FileNotFoundError(f"release {release} has no {ADAPTER_META}; restore the release's files")
    return adapter_meta(release)


def card_scores(card: str) -> dict[str, float]:
    """{task name: main score} from a model card's ``model-index`` block (the YAML front matter)."""
    import yaml

    front = card.split("---", 2)[1] if card.startswith("---") else ""
    data = yaml.safe_load(front) or {}
    scores = {}
    for entry in data.get("model-index", []):
        for result in entry.get("results", []):
            name = result.get("dataset", {}).get("name", "").removeprefix("MTEB ")
            for metric in result.get("metrics", []):
                if metric.get("type") == "main_score":
                    scores[name] = float(metric["value"])
    return scores
