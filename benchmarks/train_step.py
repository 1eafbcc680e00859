"""Training-step benchmark of the real trainer: seconds/step, tokens/s, peak RSS, FLOP/s.

For each model, a fresh (spawned) process calls ``unimae.training.trainer.train`` with
``TrainConfig(model=..., output_dir=<temporary directory>, steps=warmup + steps, save_every=0)``
plus the ``--batch-size/--micro-batch-size/--max-length/--precision/--threads`` overrides (every
other field is the ``TrainConfig`` default, i.e. the CPU recipe on ``enwiki-gensim``). Nothing of
the training loop is re-implemented here: the numbers come from the run's own ``log.jsonl`` (one
record per optimizer step: ``step, loss, mar, mrc, grad_norm, lr, tokens, seconds, tokens_per_s,
elapsed``) and ``run.json`` (``resolved_precision``, ``world_size``, ...). The first ``--warmup``
steps are dropped; seconds/step (mean, min) and tokens/s use the remaining records' ``seconds``
and ``tokens`` (real, non-pad tokens). Only the per-step ``seconds`` are timed, so the model load
before the loop and the final checkpoint and adapter save after it (``train`` always does both)
are excluded; they are reported separately as ``setup_seconds`` and ``finish_seconds``. Peak RSS
is ``ru_maxrss`` of that process read after ``train`` returns (the process does nothing else
before), so it is per model; psutil's current RSS at that point is added when psutil is installed.

The FLOP formula's dimensions come from the run itself: the final checkpoint's trainable weights
(P_lora: the ``lora_`` tensors; I: the tiny decoder's ``gate_proj``) and the base model's config,
instantiated on the meta device (no weights) to count P_lin.

FLOPs per step (model FLOPs, MFU convention: real tokens only, no padding; one multiply-add = 2).
For a batch of examples with real lengths n_i, N = sum_i n_i tokens, width D, vocabulary V:

- LLM forward: ``2 * P_lin * N + 2 * P_lora * N + L * 4 * H * d_head * sum_i n_i (n_i + 1) / 2``.
  P_lin = weights of the decoder's nn.Linear layers (attention and MLP projections; embeddings,
  norms and the output head excluded), P_lora = LoRA A and B weights, L layers, H query heads of
  width d_head; the last term is QK^T and AV over the causal triangle (max_length is below any
  sliding window, so the window never shortens a context).
- LLM backward. ASSUMPTION: the base weights are frozen, so autograd computes only the gradient
  with respect to their inputs (one matmul per frozen linear, ``2 * P_lin * N`` = 1x its
  forward); their weight gradients are never formed. LoRA weights are trained (input and weight
  gradients: 2x their forward); attention has no weights but two activation operands (2x its
  forward). The first layer's input gradient is counted although the embedding needs none (<4%).
- Output-head cross-entropies (MAR over the sum_i (n_i - 1) next-token rows, MRC over the N token
  rows): forward ``2 * V * D`` per row each; backward = gradient with respect to the hidden state
  only (the head is frozen in MAR and detached in MRC): another ``2 * V * D`` per row. Where a loss's
  fp32 log-probabilities of one micro-batch exceed ``cross_entropy.RECOMPUTE_ABOVE_MB`` (more than
  1,024 rows on Gemma's 262k vocabulary; never at the default lengths), the chunked CE recomputes each chunk's logits in
  backward (activation checkpointing): ``2 * V * D`` more per row, counted separately as ``ce_recompute``
  and excluded from the model-FLOP total.
- MRC tiny decoder (one layer, every weight trained; per example n queries, n + 1 keys,
  MLP width I): forward ``2 * D^2 * (2n + 2(n + 1)) + 6 * D * I * n + 4 * D * n * (n + 1)``;
  backward 2x forward.
- Softmax, norms, activations, AdamW and clipping are elementwise and not counted.

Every term is a sum over examples, so a step's FLOPs are those of its whole global batch
(``batch_size`` examples, however it is split into micro-batches). APPROXIMATION: the log gives
only each step's total real tokens N (``tokens``), not the per-example lengths. The terms linear
in n_i are exact (they depend on N and the example count only); the quadratic ones (attention's
causal triangle and the tiny decoder's ``n (n + 1)`` term) use every example at the average
length ``N / batch_size``, which undercounts them when lengths vary (sum n_i^2 >= N^2 / B).

Peak FLOP/s of the CPU (an upper bound, printed with its derivation): physical cores (lscpu
cores/socket x sockets, else ``os.cpu_count()``) x clock (``cpu MHz`` of /proc/cpuinfo, else lscpu
BogoMIPS / 2) x FLOP/cycle/core:
- fp32: 2 FMA units x 16 fp32 lanes (AVX-512; 8 with AVX2 only) x 2 FLOP per FMA = 64.
- bf16 with AMX (``amx_bf16`` flag): 1024 = 512 BF16 FMAs/cycle/core of the AMX TMUL unit
  (Intel Architecture Instruction Set Extensions / Optimization Reference Manual, AMX chapter).
- bf16 with ``avx512_bf16`` only: 2x fp32 (VDPBF16PS does two bf16 products per fp32 lane).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import resource
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Shape:
    """The dimensions the FLOP formula needs, read from the run's checkpoint and base-model config."""

    linear_params: int  # P_lin
    lora_params: int  # P_lora
    layers: int
    heads: int
    head_dim: int
    hidden: int  # D
    vocab: int  # V
    tiny_intermediate: int  # I


@dataclass
class Flops:
    """FLOP counts by component, summed over steps."""

    parts: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.parts[name] = self.parts.get(name, 0.0) + value

    @property
    def model_total(self) -> float:
        return sum(v for k, v in self.parts.items() if k != "ce_recompute")


def batch_flops(shape: Shape, lengths: list[float], flops: Flops) -> None:
    """Add the FLOPs of a batch of examples of real lengths ``lengths`` (formula in the module docstring).

    Every term but ``ce_recompute`` is a sum over examples; that one depends on a loss call's rows, so pass
    one micro-batch at a time.
    """
    from unimae.losses.cross_entropy import recomputes_logits

    n_tok = sum(lengths)
    causal_pairs = sum(n * (n + 1) / 2 for n in lengths)
    attn = shape.layers * 4 * shape.heads * shape.head_dim * causal_pairs
    flops.add("llm_linear_fwd", 2 * shape.linear_params * n_tok)
    flops.add("llm_linear_bwd_input_grad", 2 * shape.linear_params * n_tok)
    flops.add("lora_fwd", 2 * shape.lora_params * n_tok)
    flops.add("lora_bwd", 4 * shape.lora_params * n_tok)
    flops.add("attention_fwd", attn)
    flops.add("attention_bwd", 2 * attn)
    head = 2 * shape.vocab * shape.hidden
    for rows in (n_tok - len(lengths), n_tok):  # MAR next-token rows, MRC token rows
        flops.add("ce_heads_fwd", head * rows)
        flops.add("ce_heads_bwd_input_grad", head * rows)
        if recomputes_logits(rows, shape.vocab):  # as chunked_cross_entropy decides
            flops.add("ce_recompute", head * rows)
    d, i = shape.hidden, shape.tiny_intermediate
    tiny = sum(2 * d * d * (2 * n + 2 * (n + 1)) + 6 * d * i * n + 4 * d * n * (n + 1) for n in lengths)
    flops.add("tiny_decoder_fwd", tiny)
    flops.add("tiny_decoder_bwd", 2 * tiny)


def step_flops(shape: Shape, tokens: int, batch_size: int, micro_batch_size: int, flops: Flops) -> None:
    """Add one logged step's FLOPs: ``batch_size`` examples at the average length (docstring), in micro-batches."""
    for first in range(0, batch_size, micro_batch_size):
        batch_flops(shape, [tokens / batch_size] * min(micro_batch_size, batch_size - first), flops)


def linear_params(model) -> int:
    """Weights of the decoder's nn.Linear layers (of the base model, without LoRA)."""
    import torch

    return sum(m.weight.numel() for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear))


def run_shape(output_dir: Path, model_path: str) -> Shape:
    """The FLOP formula's dimensions of a finished run.

    P_lora and the tiny decoder's MLP width I are read from the trainable weights of the run's final
    checkpoint; P_lin, layers, heads, width and vocabulary from the base model built from its config on
    the meta device (shapes only, nothing allocated or read).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from unimae.training.checkpoint import load_latest_checkpoint

    trainable = load_latest_checkpoint(output_dir)["trainable"]
    lora = sum(t.numel() for n, t in trainable.items() if "lora_" in n)
    gate = [t for n, t in trainable.items() if n.endswith("decoder.gate_proj.weight")]
    if len(gate) != 1:
        raise RuntimeError(f"expected one tiny-decoder gate_proj in the checkpoint, found {len(gate)}")
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    config = model.config
    heads = config.num_attention_heads
    return Shape(
        linear_params=linear_params(model),
        lora_params=lora,
        layers=config.num_hidden_layers,
        heads=heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        hidden=config.hidden_size,
        vocab=model.get_output_embeddings().weight.shape[0],
        tiny_intermediate=gate[0].shape[0],
    )


def rss_mib() -> dict[str, float | None]:
    """Peak RSS of this process (ru_maxrss, KiB on Linux) and current RSS from psutil if installed."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    try:
        import psutil

        current = psutil.Process().memory_info().rss / 2**20
    except ImportError:
        current = None
    return {"ru_maxrss_mib": round(peak, 1), "psutil_rss_mib": None if current is None else round(current, 1)}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_model(name: str, args: argparse.Namespace) -> dict:
    """Train ``name`` with ``unimae.training.trainer.train`` and summarize its log (runs in a fresh process)."""
    import torch

    from unimae.training.config import TrainConfig
    from unimae.training.trainer import train

    with tempfile.TemporaryDirectory(prefix="unimae-train-step-") as tmp:
        out = Path(tmp) / "run"
        config = TrainConfig(
            model=name,
            output_dir=str(out),
            steps=args.warmup + args.steps,
            save_every=0,
            batch_size=args.batch_size,
            micro_batch_size=args.micro_batch_size,
            max_length=args.max_length,
            precision=args.precision,
            threads=args.threads,
        )
        tic = time.perf_counter()
        result = train(config)
        wall = time.perf_counter() - tic
        memory = rss_mib()  # first thing after train(): the process's peak is the run's
        records = read_jsonl(out / "log.jsonl")
        run = json.loads((out / "run.json").read_text())
        if result.interrupted or len(records) != config.steps:
            raise RuntimeError(f"{name}: the run logged {len(records)} of {config.steps} steps")
        shape = run_shape(out, run["resolved_model_path"])
    timed = [r for r in records if r["step"] > args.warmup]
    flops = Flops()
    for record in timed:
        step_flops(shape, record["tokens"], config.batch_size, config.micro_batch_size, flops)
    seconds = [r["seconds"] for r in timed]
    tokens = [r["tokens"] for r in timed]
    steps, total_s = len(timed), sum(seconds)
    return {
        "model": name,
        "resolved_model_path": run["resolved_model_path"],
        "precision": run["resolved_precision"],
        "world_size": run["world_size"],
        "grad_accum_steps": run["grad_accum_steps"],
        "torch_threads": torch.get_num_threads(),
        "batch_size": config.batch_size,
        "micro_batch_size": config.micro_batch_size,
        "max_length": config.max_length,
        "lora_r": config.lora_r,
        "warmup_steps": args.warmup,
        "timed_steps": steps,
        "setup_seconds": round(wall - result.seconds, 2),  # train() before its loop: load, LoRA, ...
        "finish_seconds": round(result.seconds - records[-1]["elapsed"], 2),  # final checkpoint + adapter
        "step_seconds": seconds,
        "step_tokens": tokens,
        "step_loss": [r["loss"] for r in timed],
        "step_seconds_mean": total_s / steps,
        "step_seconds_min": min(seconds),
        "tokens_per_step_mean": sum(tokens) / steps,
        "tokens_per_s": sum(tokens) / total_s,
        "shape": vars(shape),
        "flops_note": "quadratic terms at the average length tokens/batch_size (module docstring)",
        "flops_per_step": flops.model_total / steps,
        "flops_per_step_incl_recompute": sum(flops.parts.values()) / steps,
        "flops_by_component_per_step": {k: v / steps for k, v in flops.parts.items()},
        "achieved_flop_per_s": flops.model_total / total_s,
        "peak_rss_mib": memory["ru_maxrss_mib"],
        "psutil_rss_mib_after_train": memory["psutil_rss_mib"],
    }


def _lscpu() -> dict[str, str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def _cpuinfo() -> tuple[str | None, float | None, set[str]]:
    """(model name, cpu MHz, flags) of the first processor in /proc/cpuinfo."""
    name, mhz, flags = None, None, set()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return name, mhz, flags
    for line in lines:
        key, _, value = (s.strip() for s in line.partition(":"))
        if key == "model name" and name is None:
            name = value
        elif key == "cpu MHz" and mhz is None:
            mhz = float(value)
        elif key == "flags" and not flags:
            flags = set(value.split())
    return name, mhz, flags


def cpu_peak() -> dict:
    """Peak fp32 and bf16 FLOP/s of this CPU with the derivation (see the module docstring)."""
    lscpu = _lscpu()
    name, mhz, flags = _cpuinfo()
    try:
        cores = int(lscpu["Core(s) per socket"]) * int(lscpu["Socket(s)"])
        cores_source = "lscpu cores/socket x sockets"
    except (KeyError, ValueError):
        cores, cores_source = os.cpu_count() or 1, "os.cpu_count()"
    clock_source = "/proc/cpuinfo cpu MHz"
    if mhz is None and "BogoMIPS" in lscpu:
        mhz, clock_source = float(lscpu["BogoMIPS"]) / 2, "lscpu BogoMIPS / 2"
    hz = (mhz or 0.0) * 1e6
    lanes = 16 if "avx512f" in flags else 8
    fp32_per_cycle = 2 * lanes * 2
    if "amx_bf16" in flags:
        bf16_per_cycle, bf16_source = 1024, "AMX TMUL: 512 BF16 FMAs/cycle/core = 1024 FLOP/cycle/core"
    elif "avx512_bf16" in flags:
        bf16_per_cycle, bf16_source = 2 * fp32_per_cycle, "avx512_bf16 (VDPBF16PS): 2x fp32"
    else:
        bf16_per_cycle, bf16_source = None, "no native bf16 instructions (amx_bf16/avx512_bf16 absent)"
    return {
        "cpu_model": name or lscpu.get("Model name") or platform.processor(),
        "cores": cores,
        "cores_source": cores_source,
        "logical_cpus": os.cpu_count(),
        "clock_ghz": hz / 1e9,
        "clock_source": clock_source,
        "fp32_flop_per_cycle_per_core": fp32_per_cycle,
        "fp32_derivation": f"2 FMA units x {lanes} fp32 lanes ({'AVX-512' if lanes == 16 else 'AVX2'}) x 2",
        "bf16_flop_per_cycle_per_core": bf16_per_cycle,
        "bf16_derivation": bf16_source,
        "peak_fp32_flop_per_s": cores * hz * fp32_per_cycle,
        "peak_bf16_flop_per_s": cores * hz * bf16_per_cycle if bf16_per_cycle else None,
    }


def add_utilization(result: dict, peak: dict) -> None:
    """Achieved FLOP/s as a share of the fp32 and bf16 peaks."""
    for kind in ("fp32", "bf16"):
        top = peak[f"peak_{kind}_flop_per_s"]
        result[f"share_of_{kind}_peak"] = result["achieved_flop_per_s"] / top if top else None


def print_peak(peak: dict) -> None:
    print(
        f"CPU: {peak['cpu_model']}  cores={peak['cores']} ({peak['cores_source']})  "
        f"clock={peak['clock_ghz']:.2f} GHz ({peak['clock_source']})"
    )
    print(
        f"  fp32 peak = {peak['cores']} x {peak['clock_ghz']:.2f} GHz x "
        f"{peak['fp32_flop_per_cycle_per_core']} [{peak['fp32_derivation']}] = "
        f"{peak['peak_fp32_flop_per_s'] / 1e9:.1f} GFLOP/s"
    )
    if peak["peak_bf16_flop_per_s"]:
        print(
            f"  bf16 peak = {peak['cores']} x {peak['clock_ghz']:.2f} GHz x "
            f"{peak['bf16_flop_per_cycle_per_core']} [{peak['bf16_derivation']}] = "
            f"{peak['peak_bf16_flop_per_s'] / 1e9:.1f} GFLOP/s"
        )
    else:
        print(f"  bf16 peak: n/a ({peak['bf16_derivation']})")


def print_result(r: dict) -> None:
    share = " ".join(
        f"{k}={r[f'share_of_{k}_peak']:.2%}" for k in ("fp32", "bf16") if r[f"share_of_{k}_peak"] is not None
    )
    print(
        f"\n{r['model']}  precision={r['precision']}  threads={r['torch_threads']}  "
        f"processes={r['world_size']}  batch={r['batch_size']}/{r['micro_batch_size']}  "
        f"max_length={r['max_length']}  steps={r['timed_steps']} (+{r['warmup_steps']} warm-up)"
    )
    print(
        f"  s/step mean={r['step_seconds_mean']:.2f} min={r['step_seconds_min']:.2f}  "
        f"tokens/s={r['tokens_per_s']:.0f} ({r['tokens_per_step_mean']:.0f} tokens/step)"
    )
    print(
        f"  FLOP/step={r['flops_per_step'] / 1e9:.2f} G (incl. CE recompute "
        f"{r['flops_per_step_incl_recompute'] / 1e9:.2f} G)  "
        f"achieved={r['achieved_flop_per_s'] / 1e9:.1f} GFLOP/s  share of peak: {share}"
    )
    print(
        f"  peak RSS={r['peak_rss_mib']:.0f} MiB (ru_maxrss)  psutil RSS after train="
        f"{r['psutil_rss_mib_after_train']} MiB  setup={r['setup_seconds']:.1f} s  "
        f"final save={r['finish_seconds']:.1f} s"
    )


def parse_args() -> argparse.Namespace:
    from unimae.training.config import TrainConfig

    d = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        nargs="+",
        default=["smollm2-135m", "gemma3-270m"],
        help="Anything TrainConfig.model accepts: short names, Hub ids, local model directories.",
    )
    parser.add_argument("--warmup", type=int, default=1, help="Logged steps dropped before the statistics.")
    parser.add_argument("--steps", type=int, default=3, help="Steps measured after the warm-up.")
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size)
    parser.add_argument("--max-length", type=int, default=d.max_length)
    parser.add_argument("--precision", default=d.precision, choices=["auto", "bf16", "fp32"])
    parser.add_argument("--threads", type=int, default=d.threads, help="torch threads (0: torch's default).")
    parser.add_argument("--output", type=Path, default=RESULTS / "train_step.json")
    parser.add_argument(
        "--speed-json",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "results" / "speed.json",
        help="Also merge s/step and tokens/s per model into this file's \"train\" key ('' to skip).",
    )
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    # A local directory is passed as an absolute path: the run happens in another process.
    args.models = [str(Path(m).resolve()) if Path(m).exists() else m for m in args.models]
    return args


def main() -> None:
    args = parse_args()
    peak = cpu_peak()
    print_peak(peak)
    results = []
    spawn = multiprocessing.get_context("spawn")
    for name in args.models:
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:  # fresh process: own peak RSS
            result = pool.submit(run_model, name, args).result()
        add_utilization(result, peak)
        print_result(result)
        results.append(result)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report = {"settings": settings, "cpu": peak, "results": results}
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.output}")
    if str(args.speed_json):
        record_speed(args.speed_json, results, peak)


def record_speed(path: Path, results: list[dict], peak: dict) -> None:
    """Merge each model's s/step and tokens/s into ``path`` under ``"train"`` (other keys kept)."""
    from unimae.files import update_json

    train = {}
    for r in results:
        train[r["model"]] = {
            "s_per_step": r["step_seconds_mean"],
            "tokens_per_s": r["tokens_per_s"],
            "precision": r["precision"],
            "batch_size": r["batch_size"],
            "max_length": r["max_length"],
            "timed_steps": r["timed_steps"],
            "cpu_model": peak["cpu_model"],
        }
    update_json(path, train, under="train")
    print(f'merged into {path} ("train")')


if __name__ == "__main__":
    main()
