"""Training-step benchmark of the default CPU recipe: seconds/step, tokens/s, peak RSS, FLOP/s.

Each model runs in its own (spawned) process, so peak RSS is per model. The process builds what
``unimae.trainer.train`` builds (``load_model``, the trainer's ``_build_llm`` LoRA wrapping,
``UniMAEObjective``, AdamW, ``UniMAECollator`` over ``encode_with_eos`` of the trainer's data
order) and runs ``--warmup`` untimed plus ``--steps`` timed optimizer steps of the same shape as
the trainer's: gradient accumulation over micro-batches under the resolved autocast precision,
gradient clipping, ``optimizer.step``. Accelerate and logging are left out (single process).

FLOPs per step (model FLOPs, MFU convention: real tokens only, no padding; one multiply-add = 2).
Per micro-batch with real lengths n_i, N = sum_i n_i tokens, width D, vocabulary V:

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
  only (the head is frozen in MAR and detached in MRC): another ``2 * V * D`` per row. The chunked
  CE recomputes each chunk's logits in backward (activation checkpointing): ``2 * V * D`` more per
  row, counted separately as ``ce_recompute`` and excluded from the model-FLOP total.
- MRC tiny decoder (one layer, every weight trained; per example n queries, n + 1 keys,
  MLP width I): forward ``2 * D^2 * (2n + 2(n + 1)) + 6 * D * I * n + 4 * D * n * (n + 1)``;
  backward 2x forward.
- Softmax, norms, activations, AdamW and clipping are elementwise and not counted.

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
import math
import multiprocessing
import os
import platform
import resource
import subprocess
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Shape:
    """The dimensions the FLOP formula needs, read from the model before and after LoRA."""

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
    """FLOP counts by component, summed over micro-batches."""

    parts: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.parts[name] = self.parts.get(name, 0.0) + value

    @property
    def model_total(self) -> float:
        return sum(v for k, v in self.parts.items() if k != "ce_recompute")


def micro_batch_flops(shape: Shape, lengths: list[int], flops: Flops) -> None:
    """Add the FLOPs of one micro-batch of real lengths ``lengths`` (formula in the module docstring)."""
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
    ce_rows = (n_tok - len(lengths)) + n_tok  # MAR next-token rows + MRC token rows
    flops.add("ce_heads_fwd", head * ce_rows)
    flops.add("ce_heads_bwd_input_grad", head * ce_rows)
    flops.add("ce_recompute", head * ce_rows)
    d, i = shape.hidden, shape.tiny_intermediate
    tiny = sum(2 * d * d * (2 * n + 2 * (n + 1)) + 6 * d * i * n + 4 * d * n * (n + 1) for n in lengths)
    flops.add("tiny_decoder_fwd", tiny)
    flops.add("tiny_decoder_bwd", 2 * tiny)


def model_shape(p_lin: int, llm, objective) -> Shape:
    """The FLOP formula's dimensions: P_lin (counted before LoRA), P_lora, attention and heads."""
    config = llm.config
    heads = config.num_attention_heads
    return Shape(
        linear_params=p_lin, lora_params=sum(p.numel() for n, p in llm.named_parameters() if "lora_" in n),
        layers=config.num_hidden_layers, heads=heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        hidden=config.hidden_size, vocab=llm.get_output_embeddings().weight.shape[0],
        tiny_intermediate=objective.mrc.decoder.gate_proj.out_features,
    )


def linear_params(model) -> int:
    """Weights of the decoder's nn.Linear layers; call before LoRA wraps them."""
    import torch

    return sum(m.weight.numel() for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear))


def rss_mib() -> dict[str, float | None]:
    """Peak RSS of this process (ru_maxrss, KiB on Linux) and current RSS from psutil if installed."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    try:
        import psutil

        current = psutil.Process().memory_info().rss / 2**20
    except ImportError:
        current = None
    return {"ru_maxrss_mib": round(peak, 1), "psutil_rss_mib": None if current is None else round(current, 1)}


@dataclass
class Setup:
    """Everything one training step needs, built as ``unimae.trainer.train`` builds it."""

    config: object  # unimae.config.TrainConfig
    precision: str
    texts: list[str]
    tokenizer: object
    objective: object  # unimae.losses.UniMAEObjective around the LoRA-wrapped LLM
    params: list
    optimizer: object
    collate: object  # unimae.masking.UniMAECollator
    order: object  # unimae.trainer.DataOrder
    shape: Shape


def build(config) -> Setup:
    """Texts, model, LoRA (the trainer's ``_build_llm``), objective, AdamW and collator."""
    import torch

    from unimae.corpus import load_texts
    from unimae.losses import UniMAEObjective
    from unimae.masking import UniMAECollator
    from unimae.models import load_model
    from unimae.precision import resolve_precision
    from unimae.tokenization import choose_mask_token
    from unimae.trainer import DataOrder, _build_llm

    torch.manual_seed(config.seed)
    texts = load_texts(config.data)
    model, tokenizer, _ = load_model(config.model)
    _, mask_id = choose_mask_token(tokenizer, config.mask_token)
    p_lin = linear_params(model)
    llm = _build_llm(config, model)
    objective = UniMAEObjective(llm, config.alpha, config.max_length, config.ce_chunk_size,
                                config.mrc_heads, config.mrc_intermediate_size)
    objective.train()
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    collate = UniMAECollator(tokenizer.pad_token_id, mask_id, tokenizer.bos_token_id,
                             config.p_mar, config.p_mrc, config.seed)
    return Setup(config, resolve_precision(config.precision, torch.device("cpu")), texts, tokenizer,
                 objective, params, optimizer, collate, DataOrder(len(texts), config.seed),
                 model_shape(p_lin, llm, objective))


def train_step(setup: Setup, step: int, flops: Flops | None) -> int:
    """Optimizer step ``step`` as the trainer runs it (one process); returns its real token count."""
    import torch

    from unimae.precision import autocast
    from unimae.tokenization import encode_with_eos

    config = setup.config
    accum = config.validate(1)
    examples = list(range(step * config.batch_size, (step + 1) * config.batch_size))
    tokens = 0
    for micro in range(accum):
        chosen = examples[micro * config.micro_batch_size:(micro + 1) * config.micro_batch_size]
        texts = [setup.texts[setup.order.text_index(i)] for i in chosen]
        ids = encode_with_eos(setup.tokenizer, texts, config.max_length)
        batch = setup.collate(ids, chosen)
        tokens += batch.num_tokens
        if flops is not None:
            micro_batch_flops(setup.shape, [len(s) for s in ids], flops)
        with autocast(setup.precision, torch.device("cpu")):
            losses = setup.objective(batch)
        (losses["loss"] / accum).backward()
    max_norm = config.max_grad_norm if config.max_grad_norm > 0 else math.inf
    torch.nn.utils.clip_grad_norm_(setup.params, max_norm)
    setup.optimizer.step()
    setup.optimizer.zero_grad(set_to_none=True)
    return tokens


def run_model(name: str, args: argparse.Namespace) -> dict:
    """Build one model's training setup and time its steps (runs in a fresh process)."""
    import warnings

    import torch

    from unimae.config import TrainConfig
    from unimae.tokenization import TextTooLongWarning

    warnings.simplefilter("ignore", TextTooLongWarning)  # truncation to max_length is the recipe
    if args.threads:
        torch.set_num_threads(args.threads)
    config = TrainConfig(model=name, batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
                         max_length=args.max_length, precision=args.precision)
    config.validate(1)
    t0 = time.perf_counter()
    setup = build(config)
    load_s = time.perf_counter() - t0
    for step in range(args.warmup):
        train_step(setup, step, None)
    flops, seconds, tokens, rss_samples = Flops(), [], [], []
    for step in range(args.warmup, args.warmup + args.steps):
        tic = time.perf_counter()
        tokens.append(train_step(setup, step, flops))
        seconds.append(time.perf_counter() - tic)
        rss_samples.append(rss_mib()["psutil_rss_mib"])
    return summarize(setup, flops, seconds, tokens, rss_samples, load_s)


def summarize(setup: Setup, flops: Flops, seconds: list[float], tokens: list[int],
              rss_samples: list[float | None], load_s: float) -> dict:
    """Per-model numbers: step times, tokens/s, FLOPs by component, memory."""
    import torch

    config, steps, total_s = setup.config, len(seconds), sum(seconds)
    psutil_peak = max((r for r in rss_samples if r is not None), default=None)
    return {
        "model": config.model, "precision": setup.precision, "torch_threads": torch.get_num_threads(),
        "batch_size": config.batch_size, "micro_batch_size": config.micro_batch_size,
        "max_length": config.max_length, "lora_r": config.lora_r, "timed_steps": steps,
        "load_seconds": round(load_s, 2),
        "step_seconds": [round(s, 3) for s in seconds],
        "step_seconds_mean": total_s / steps, "step_seconds_min": min(seconds),
        "tokens_per_step_mean": sum(tokens) / steps, "tokens_per_s": sum(tokens) / total_s,
        "shape": vars(setup.shape),
        "flops_per_step": flops.model_total / steps,
        "flops_per_step_incl_recompute": sum(flops.parts.values()) / steps,
        "flops_by_component_per_step": {k: v / steps for k, v in flops.parts.items()},
        "achieved_flop_per_s": flops.model_total / total_s,
        "peak_rss_mib": rss_mib()["ru_maxrss_mib"], "psutil_rss_mib_max_after_step": psutil_peak,
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
        "cores": cores, "cores_source": cores_source, "logical_cpus": os.cpu_count(),
        "clock_ghz": hz / 1e9, "clock_source": clock_source,
        "fp32_flop_per_cycle_per_core": fp32_per_cycle,
        "fp32_derivation": f"2 FMA units x {lanes} fp32 lanes ({'AVX-512' if lanes == 16 else 'AVX2'}) x 2",
        "bf16_flop_per_cycle_per_core": bf16_per_cycle, "bf16_derivation": bf16_source,
        "peak_fp32_flop_per_s": cores * hz * fp32_per_cycle,
        "peak_bf16_flop_per_s": cores * hz * bf16_per_cycle if bf16_per_cycle else None,
    }


def add_utilization(result: dict, peak: dict) -> None:
    """Achieved FLOP/s as a share of the fp32 and bf16 peaks."""
    for kind in ("fp32", "bf16"):
        top = peak[f"peak_{kind}_flop_per_s"]
        result[f"share_of_{kind}_peak"] = result["achieved_flop_per_s"] / top if top else None


def print_peak(peak: dict) -> None:
    print(f"CPU: {peak['cpu_model']}  cores={peak['cores']} ({peak['cores_source']})  "
          f"clock={peak['clock_ghz']:.2f} GHz ({peak['clock_source']})")
    print(f"  fp32 peak = {peak['cores']} x {peak['clock_ghz']:.2f} GHz x "
          f"{peak['fp32_flop_per_cycle_per_core']} [{peak['fp32_derivation']}] = "
          f"{peak['peak_fp32_flop_per_s'] / 1e9:.1f} GFLOP/s")
    if peak["peak_bf16_flop_per_s"]:
        print(f"  bf16 peak = {peak['cores']} x {peak['clock_ghz']:.2f} GHz x "
              f"{peak['bf16_flop_per_cycle_per_core']} [{peak['bf16_derivation']}] = "
              f"{peak['peak_bf16_flop_per_s'] / 1e9:.1f} GFLOP/s")
    else:
        print(f"  bf16 peak: n/a ({peak['bf16_derivation']})")


def print_result(r: dict) -> None:
    share = " ".join(f"{k}={r[f'share_of_{k}_peak']:.2%}" for k in ("fp32", "bf16")
                     if r[f"share_of_{k}_peak"] is not None)
    print(f"\n{r['model']}  precision={r['precision']}  threads={r['torch_threads']}  "
          f"batch={r['batch_size']}/{r['micro_batch_size']}  max_length={r['max_length']}  "
          f"steps={r['timed_steps']}")
    print(f"  s/step mean={r['step_seconds_mean']:.2f} min={r['step_seconds_min']:.2f}  "
          f"tokens/s={r['tokens_per_s']:.0f} ({r['tokens_per_step_mean']:.0f} tokens/step)")
    print(f"  FLOP/step={r['flops_per_step'] / 1e12:.3f} T (incl. CE recompute "
          f"{r['flops_per_step_incl_recompute'] / 1e12:.3f} T)  "
          f"achieved={r['achieved_flop_per_s'] / 1e9:.1f} GFLOP/s  share of peak: {share}")
    print(f"  peak RSS={r['peak_rss_mib']:.0f} MiB (ru_maxrss)  psutil RSS max after a step="
          f"{r['psutil_rss_mib_max_after_step']} MiB  load={r['load_seconds']:.1f} s")


def parse_args() -> argparse.Namespace:
    from unimae.config import TrainConfig

    d = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--warmup", type=int, default=1, help="Untimed optimizer steps first.")
    parser.add_argument("--steps", type=int, default=3, help="Timed optimizer steps.")
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size)
    parser.add_argument("--max-length", type=int, default=d.max_length)
    parser.add_argument("--precision", default=d.precision, choices=["auto", "bf16", "fp32"])
    parser.add_argument("--threads", type=int, default=d.threads, help="torch threads (0: torch's default).")
    parser.add_argument("--output", type=Path, default=RESULTS / "train_step.json")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
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


if __name__ == "__main__":
    main()
