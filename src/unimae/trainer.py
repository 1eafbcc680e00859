"""The training loop: LoRA (or full) training of an objective with checkpoints, resume and DDP.

Distributed: the loop runs unchanged under ``torchrun`` or ``accelerate launch`` (DDP, FSDP or
DeepSpeed as configured there); ``accelerate`` wraps the model and averages gradients. Each global
batch of ``batch_size`` texts is split deterministically into contiguous per-process shards and
then into micro-batches, and every loss is a mean over examples, so the update is the same for
any number of processes and micro-batches.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from unimae.adapter import (
    INIT_ADAPTER,
    attach_adapter,
    base_fingerprint,
    embedding_settings,
    quiet_peft,
    write_adapter_meta,
)
from unimae.attention import set_attention_dropout
from unimae.checkpoint import load_latest_checkpoint, rng_state, save_checkpoint, set_rng_state
from unimae.config import TrainConfig
from unimae.methods import Context, get_method, summary_tokens
from unimae.models import load_model
from unimae.precision import autocast, resolve_precision, weight_dtype
from unimae.runtime import tune_allocator
from unimae.tokenization import choose_mask_token

logger = logging.getLogger(__name__)


class DataOrder:
    """Example order as a pure function of (seed, global example index): epochs reshuffle."""

    def __init__(self, num_texts: int, seed: int):
        self.num_texts = num_texts
        self.seed = seed
        self._perms: dict[int, list[int]] = {}

    def text_index(self, example: int) -> int:
        epoch, offset = divmod(example, self.num_texts)
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed + 7919 * epoch)
            self._perms[epoch] = torch.randperm(self.num_texts, generator=gen).tolist()
        return self._perms[epoch][offset]


@dataclass
class TrainResult:
    output_dir: Path
    adapter_dir: Path
    steps: int
    interrupted: bool
    seconds: float


class _StopFlag:
    """First Ctrl-C/SIGTERM: finish the step, save, stop. Second: stop at once."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        logger.warning("stop requested: finishing this step and saving a checkpoint (Ctrl-C again to abort)")


def _build_llm(config: TrainConfig, model, lora_dropout: float):
    if config.full_params:
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=config.lora_target_modules,
        task_type="CAUSAL_LM",
    )
    with quiet_peft():
        return get_peft_model(model, lora)


def _trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    return {n: t.detach().cpu().clone() for n, t in module.state_dict().items() if n in trainable}


def _read_log(path: Path, upto_step: int) -> list[str]:
    if not path.is_file():
        return []
    return [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= upto_step]


def train(config: TrainConfig, resume: bool = False) -> TrainResult:
    """Run (or resume) training as configured; returns where the adapter was written."""
    from accelerate import Accelerator

    # Without a GPU, cpu=True lets accelerate see torchrun's WORLD_SIZE and use gloo (MULTI_CPU).
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    tune_allocator()
    world = accelerator.num_processes
    accum = config.validate(world)
    if config.threads:
        torch.set_num_threads(config.threads)
    out = Path(config.output_dir)
    main = accelerator.is_main_process
    if main:
        out.mkdir(parents=True, exist_ok=True)

    state = load_latest_checkpoint(out) if resume else None
    torch.manual_seed(config.seed)
    method = get_method(config.method)
    texts = method.load_data(config)
    precision = resolve_precision(config.precision, accelerator.device)
    frozen_dtype = torch.float32 if config.full_params else weight_dtype(precision)
    model, tokenizer, model_path = load_model(
        config.model, dtype=torch.float32 if config.init_adapter else frozen_dtype
    )
    fingerprint = base_fingerprint(model)
    if config.init_adapter:  # stage 2 (e.g. SimCSE after UniMAE/MNTP): the first adapter merged into the base
        model = attach_adapter(model, config.init_adapter).merge_and_unload().to(frozen_dtype)
    if state is not None and state["fingerprint"] != fingerprint:
        raise ValueError(
            f"the checkpoint in {out} was trained on another base model ({state['model']}); "
            f"pass --model {state['model']} to resume it"
        )
    mask_token, mask_id = choose_mask_token(tokenizer, config.mask_token)
    ctx = Context(
        tokenizer,
        mask_id,
        summary_tokens(tokenizer, config.num_summary_tokens) if config.method == "gem" else [],
        embedding_settings(config.init_adapter or None),
    )
    llm = _build_llm(config, model, method.lora_dropout(config))
    if view_dropout := method.attention_dropout(config):  # else the model keeps its own config's rate
        set_attention_dropout(llm, view_dropout)
    if config.gradient_checkpointing:
        llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        llm.enable_input_require_grads()
    objective = method.objective(config, llm, ctx)
    objective.train()
    if state is not None:
        missing = set(state["trainable"]) - set(objective.state_dict())
        if missing:
            raise ValueError(
                f"checkpoint in {out} does not match this configuration (unknown weights such as "
                f"{sorted(missing)[:3]}); resume with the run's own config.json"
            )
        objective.load_state_dict(state["trainable"], strict=False)
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)  # constant (paper App. C)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    wrapped, optimizer = accelerator.prepare(objective, optimizer)

    start = state["step"] if state is not None else 0
    if state is not None:
        saved = state["rng"]  # one entry per process of the run that wrote it
        set_rng_state(saved[min(accelerator.process_index, len(saved) - 1)])
    extra = {
        "mask_token": mask_token,
        "mask_token_id": mask_id,
        "resolved_model_path": str(model_path),
        "world_size": world,
        "grad_accum_steps": accum,
        "resolved_precision": precision,
    }
    if main:
        config.save(out / "config.json")
        (out / "run.json").write_text(json.dumps(extra, indent=2) + "\n")
    log_path = out / "log.jsonl"
    kept_log = _read_log(log_path, start) if main else []
    if main:
        log_path.write_text("".join(line + "\n" for line in kept_log))

    order = DataOrder(len(texts), config.seed)
    collate = method.collator(config, ctx)
    shard = config.batch_size // world
    stop = _StopFlag()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    bar = tqdm(total=config.steps, initial=start, desc="unimae train", disable=not main, unit="step")
    t0 = time.perf_counter()
    step = start

    def checkpoint(step_done: int) -> None:
        rngs = accelerator.gather_for_metrics([rng_state()], use_gather_object=True) if world > 1 else [rng_state()]
        if main:
            trainable = _trainable_state(accelerator.unwrap_model(wrapped))
            save_checkpoint(
                out,
                step_done,
                {
                    "trainable": trainable,
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": rngs,
                    "fingerprint": fingerprint,
                    "model": config.model,
                    "config": config.to_dict(),
                },
            )

    try:
        while step < config.steps and not stop.requested:
            tic = time.perf_counter()
            first = step * config.batch_size + accelerator.process_index * shard
            examples = list(range(first, first + shard))  # global example indices of this process
            totals: dict[str, float] = {}
            tokens = 0
            if hasattr(objective, "step"):
                objective.step = step  # for schedules over steps (GEM's 0 -> 1 switch)
            for micro in range(accum):
                chosen = examples[micro * config.micro_batch_size : (micro + 1) * config.micro_batch_size]
                batch = collate([texts[order.text_index(i)] for i in chosen], chosen).to(accelerator.device)
                tokens += batch.num_tokens
                sync = contextlib.nullcontext() if micro == accum - 1 else accelerator.no_sync(wrapped)
                with sync:
                    with autocast(precision, accelerator.device):
                        losses = wrapped(batch)
                    accelerator.backward(losses["loss"] / accum)
                for key, value in losses.items():
                    totals[key] = totals.get(key, 0.0) + value.item() / accum
            max_norm = config.max_grad_norm if config.max_grad_norm > 0 else math.inf
            grad_norm = float(accelerator.clip_grad_norm_(params, max_norm))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            keys = sorted(totals)
            stats = torch.tensor([totals[k] for k in keys] + [tokens], dtype=torch.float64, device=accelerator.device)
            stats = accelerator.reduce(stats, reduction="sum") if world > 1 else stats
            seconds = time.perf_counter() - tic
            record = {"step": step, **{k: stats[i].item() / world for i, k in enumerate(keys)}}
            record.update(
                grad_norm=grad_norm,
                lr=scheduler.get_last_lr()[0],
                tokens=int(stats[-1].item()),
                seconds=round(seconds, 4),
                tokens_per_s=round(stats[-1].item() / seconds, 1),
                elapsed=round(time.perf_counter() - t0, 2),
            )
            if main:
                with open(log_path, "a") as log:
                    log.write(json.dumps(record) + "\n")
                bar.set_postfix({**{k: f"{record[k]:.3f}" for k in keys}, "tok_s": f"{record['tokens_per_s']:.0f}"})
                bar.update(1)
            if config.save_every and step % config.save_every == 0 and step < config.steps:
                checkpoint(step)
    finally:
        bar.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    checkpoint(step)
    interrupted = step < config.steps
    adapter_dir = out / ("model" if config.full_params else "adapter")
    if main:
        unwrapped = accelerator.unwrap_model(wrapped)
        unwrapped.llm.save_pretrained(adapter_dir)
        tokenizer.save_pretrained(adapter_dir)
        if config.init_adapter and not config.full_params:
            shutil.copytree(config.init_adapter, adapter_dir / INIT_ADAPTER, dirs_exist_ok=True)
        write_adapter_meta(
            adapter_dir,
            fingerprint,
            config.model,
            trained_steps=step,
            mask_token=mask_token,
            method=config.method,
            embedding=method.embedding(config, ctx),
            init_adapter=INIT_ADAPTER if config.init_adapter else None,
            training_config=config.to_dict(),
        )
        if config.merge and not config.full_params:
            export_merged(config.model, adapter_dir, out / "merged")
    accelerator.wait_for_everyone()
    return TrainResult(out, adapter_dir, step, interrupted, time.perf_counter() - t0)


def export_merged(model: str, adapter_dir: str | Path, directory: str | Path) -> Path:
    """Write a plain Hugging Face model directory: the float32 base with the LoRA weights merged in."""
    from unimae.adapter import attach_adapter

    base, tokenizer, _ = load_model(model, dtype=torch.float32)
    merged = attach_adapter(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return Path(directory)
