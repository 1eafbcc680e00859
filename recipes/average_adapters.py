"""Average the LoRA weights of adapters from one run (checkpoint averaging, a "uniform soup": Wortsman et al. 2022,
arXiv:2203.05482; along one trajectory, SWA: Izmailov et al. 2018, arXiv:1803.05407).

    python recipes/average_adapters.py --output runs/smollm2-135m/soup/adapter A B [C ...]
    python recipes/average_adapters.py --output runs/gemma3-270m/wise FINETUNED START --weights 0.3 0.7

Every tensor of ``adapter_model.safetensors`` is the mean of the inputs' (in fp32, written in the widest of their
dtypes: fp32 where one input is; ``--dtype bfloat16`` writes a release's own weights, whose bf16 storage is checked
against the fp32 average).
With ``--weights`` it is the weighted mean ``sum_i w_i theta_i / sum_i w_i``: two inputs, a start and a model
trained further from it, give WiSE-FT's interpolation ``(1 - a) theta_start + a theta_ft`` (Wortsman et al. 2022,
arXiv:2109.01903), which trades what the further training gained against what it cost elsewhere.
Decision: the LoRA factors A and B are averaged, not their products B A (whose mean has rank up to 16 x N):
the average is again one rank-16 LoRA, close to the mean of the products while the inputs lie near each other
on one run's path. The inputs must share the base model (fingerprint), LoRA config, tensor names and shapes and
embedding spec; a Matryoshka rotation is dropped (fitted on one input's vectors; refit with `unimae rotation`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from unimae.adapter import adapter_revision
from unimae.files import atomic_write_json, remove, replace_folder, writing

WEIGHTS, CONFIG, META = "adapter_model.safetensors", "adapter_config.json", "unimae.json"


def check_alike(folders: list[Path]) -> dict:
    """The first input's unimae.json, after checking that every input matches it where averaging needs it."""
    first = json.loads((folders[0] / META).read_text())
    config = _lora_config(folders[0])
    for folder in folders[1:]:
        meta = json.loads((folder / META).read_text())
        if meta.get("base_fingerprint") != first.get("base_fingerprint"):
            raise ValueError(f"{folder} was trained on another base model than {folders[0]}")
        if _lora_config(folder) != config:
            raise ValueError(f"{folder}'s {CONFIG} differs from {folders[0]}'s")
        spec = {k: v for k, v in meta["embedding"].items() if k != "rotation"}
        if spec != {k: v for k, v in first["embedding"].items() if k != "rotation"}:
            raise ValueError(f"{folder} embeds by another spec than {folders[0]}")
    return first


def _lora_config(folder: Path) -> dict:
    """adapter_config.json, its target modules as a set (peft writes them in no fixed order)."""
    config = json.loads((folder / CONFIG).read_text())
    return {**config, "target_modules": sorted(config.get("target_modules") or [])}


def average(
    folders: list[Path], weights: list[float] | None = None, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """name -> mean tensor over the inputs' LoRA weights (weighted by ``weights``, normalised to sum 1), in
    ``dtype`` (None: the widest of the inputs')."""
    states = [load_file(str(f / WEIGHTS)) for f in folders]
    for folder, state in zip(folders[1:], states[1:], strict=True):
        if {k: v.shape for k, v in state.items()} != {k: v.shape for k, v in states[0].items()}:
            raise ValueError(f"{folder}'s tensors differ from {folders[0]}'s in names or shapes")
    dtypes = {name: dtype or _widest(s[name].dtype for s in states) for name in states[0]}
    share = None if weights is None else shares(weights)

    def mean(name: str) -> torch.Tensor:
        tensors = [s[name].float() for s in states]
        if share is None:  # the uniform soup, summed as it always was (the same bits as before --weights existed)
            return sum(tensors) / len(tensors)
        return sum(w * t for w, t in zip(share, tensors, strict=True))

    return {name: mean(name).to(dtypes[name]).contiguous() for name in states[0]}


def shares(weights: list[float]) -> list[float]:
    """The weights normalised to sum 1."""
    return [w / sum(weights) for w in weights]


def _widest(dtypes) -> torch.dtype:
    """The dtype of the most bits among ``dtypes`` (the first of those, on a tie)."""
    return max(dtypes, key=lambda dtype: torch.finfo(dtype).bits)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapters", nargs="+", type=Path, help="Adapter folders of one run (at least 2).")
    parser.add_argument("--output", type=Path, required=True, help="New adapter folder for the average.")
    parser.add_argument(
        "--weights",
        type=float,
        nargs="+",
        metavar="W",
        help="One positive weight per adapter, in their order (normalised to sum 1); default equal.",
    )
    parser.add_argument(
        "--dtype",
        choices=["widest", "bfloat16", "float32"],
        default="widest",
        help="Dtype of the written weights: the widest of the inputs' (default), or this one.",
    )
    args = parser.parse_args(argv)
    if len(args.adapters) < 2:
        parser.error("give at least 2 adapter folders")
    if args.weights is not None and len(args.weights) != len(args.adapters):
        parser.error(f"--weights gives {len(args.weights)} weights for {len(args.adapters)} adapters")
    if args.weights is not None and min(args.weights) <= 0:
        parser.error("--weights must all be positive")
    if args.output.exists():
        parser.error(f"{args.output} exists; choose a new --output")
    meta = check_alike(args.adapters)
    state = average(args.adapters, args.weights, None if args.dtype == "widest" else getattr(torch, args.dtype))
    meta["embedding"].pop("rotation", None)
    meta["averaged_from"] = [{"adapter": str(f), "revision": adapter_revision(f)} for f in args.adapters]
    if args.weights is not None:
        for entry, weight in zip(meta["averaged_from"], shares(args.weights), strict=True):
            entry["weight"] = weight
    partial = args.output.with_name(f".{args.output.name}.partial")
    remove(partial)
    partial.mkdir(parents=True)
    with writing(args.output, partial=partial):  # a failed write (a full disk) leaves no partial folder behind
        save_file(state, str(partial / WEIGHTS))
        shutil.copy(args.adapters[0] / CONFIG, partial / CONFIG)
        atomic_write_json(partial / META, meta)
        replace_folder(partial, args.output)
    print(f"{args.output}: mean of {len(args.adapters)} adapters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
