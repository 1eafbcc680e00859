"""The training loop: LoRA (or full) training of an objective with checkpoints, resume and DDP.

Distributed: the loop runs unchanged under ``torchrun`` or ``accelerate launch`` with DDP;
``accelerate`` wraps the model and averages gradients (tested: two processes match one). FSDP and
DeepSpeed are not supported: checkpoints and the adapter are read from the main process's module, and
gradient clipping takes accelerate's generic path. Each global batch of ``batch_size`` texts is split
deterministically into contiguous per-process shards and then into micro-batches. For the per-example
losses (UniMAE, MNTP) every loss is a mean over examples, so the update is the same for any number of
processes and micro-batches; the in-batch contrastive methods (simcse, contrastive, gem) contrast each
text with its own micro-batch, so there the micro-batch size is part of the recipe (``--grad-cache-chunk``
keeps one large micro-batch affordable)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from unimae.adapter import (
    INIT_ADAPTER,
    AdapterMeta,
    TrainingTime,
    adapter_meta,
    adapter_revision,
    attach_adapter,
    base_fingerprint,
    check_finite,
    embedding_spec,
    quiet_peft,
    save_merged,
    skip_input_upcast,
    trained_token_rows,
    write_adapter_meta,
)
from unimae.data.fingerprint import check_same_examples, examples_fingerprint
from unimae.data.order import DataOrder
from unimae.embedding.attention import set_attention_dropout
from unimae.embedding.spec import EmbeddingSpec
from unimae.embedding.tokenization import choose_mask_token
from unimae.files import (
    atomic_write_json,
    atomic_write_text,
    read_json,
    read_log_lines,
    remove,
    replace_folder,
    writing,
)
from unimae.models import load_model
from unimae.runtime.memory import cpu_model, release_if_above, resident_bytes, tune_allocator
from unimae.runtime.precision import autocast, resolve_device, resolve_precision, weight_dtype
from unimae.training.checkpoint import (
    DIVERGED,
    checkpoint_dir,
    checkpoint_folders,
    load_latest_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from unimae.training.config import TrainConfig, flag_defaults, flat_values, lora_targets
from unimae.training.methods import Context, Method, get_method

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What ``train`` returns."""

    output_dir: Path
    adapter_dir: Path
    steps: int  # optimizer steps done in all, resumed ones included
    interrupted: bool  # stopped by a signal before config.steps
    seconds: float  # this call's loop and saving (not model loading, not earlier sittings of a resumed run)
    already_finished: bool = False  # resumed a run that had nothing left to do (nothing was loaded or written)


class _StopFlag:
    """First Ctrl-C/SIGTERM: finish the step, save, stop. Second: stop at once."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        logger.warning("stop requested: finishing this step and saving a checkpoint (Ctrl-C again to abort)")


def _build_llm(config: TrainConfig, model, method: Method):
    """The model to train: all weights (``--full-params``) or LoRA (plus what the method adds to it)."""
    if config.full_params:
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=method.lora_dropout,
        target_modules=lora_targets(config.lora_target_modules),
        task_type="CAUSAL_LM",
        **method.lora_extra(),
    )
    with quiet_peft():
        return get_peft_model(model, lora)


def _trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    return {n: t.detach().cpu().clone() for n, t in module.state_dict().items() if n in trainable}


def _read_log(path: Path, upto_step: int) -> list[str]:
    """The log lines of steps up to ``upto_step``; a line cut off by a crash or a full disk is dropped."""
    return [line for line, r in read_log_lines(path) if r.get("step") is not None and r["step"] <= upto_step]


_STEP_FIELDS = {"step", "grad_norm", "lr", "tokens", "seconds", "tokens_per_s", "elapsed", "rss_gb"}  # rest: losses


@dataclass
class _Run:
    """Everything ``train`` sets up once: the objective to optimize, its optimizer and the data."""

    config: TrainConfig
    accelerator: object
    method: Method
    objective: torch.nn.Module  # wrapped by accelerate (DDP) for forward/backward
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: object
    examples: list
    order: DataOrder
    precision: str
    accum: int
    fingerprint: str
    tokenizer: object
    meta: dict  # mask token, resolved model path, world size ... (run.json)

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process


def _load_base(config: TrainConfig, precision: str):
    """(frozen base model, tokenizer, path, fingerprint); a stage-1 ``init_adapter`` merged in fp32 first."""
    frozen_dtype = torch.float32 if config.full_params else weight_dtype(precision)
    model, tokenizer, path = load_model(config.model, dtype=torch.float32 if config.init_adapter else frozen_dtype)
    fingerprint = base_fingerprint(model)
    if config.init_adapter:
        model = attach_adapter(model, config.init_adapter).merge_and_unload().to(frozen_dtype)
    return model, tokenizer, path, fingerprint


# Settings a resumed run may change without leaving the interrupted run's path: its length, checkpointing,
# threads and device, where the folder lives, the final export, and memory knobs that compute the same step.
# (``model``: the base's fingerprint is checked instead; ``recipe``: its numbers are already in the fields.)
_RESUME_MAY_CHANGE = {
    "steps", "save_every", "threads", "output_dir", "merge", "model", "recipe", "gradient_checkpointing",
    "ce_chunk_size", "device",
}  # fmt: skip
# ...and a run continued from an adapter (``--continue-adapter``): its optimizer starts afresh anyway, so its learning
# rate and the contrastive schedule may change too (e.g. a decay over the new steps), and so may a distillation
# teacher's term added to the loss of the new steps, the next-token term's weight and source (``--lm-data``), not
# how many texts it reads, and the sources' sampling weights (``--data-weights``: an annealing stage on another mix of
# the same files; the batch order then departs from the earlier run's).
_CONTINUE_MAY_CHANGE = _RESUME_MAY_CHANGE | {
    "continue_adapter", "init_adapter", "init_lora", "lr", "lr_schedule", "lr_decay_from",
    "distill_teacher", "distill_weight", "distill_temperature", "distill_loss", "lm_weight", "lm_data", "data_weights",
}  # fmt: skip


def _restore(state: dict, config: TrainConfig, objective: torch.nn.Module, fingerprint: str, fixed=()) -> None:
    """Check a checkpoint belongs to this base and configuration (``fixed``: settings the method's run depends
    on, which a resume may not change after all), then load its trainable weights."""
    out = config.output_dir
    if state["fingerprint"] != fingerprint:
        raise ValueError(
            f"the checkpoint in {out} was trained on another base model ({state['model']}); "
            f"pass --model {state['model']} to resume it"
        )
    ours = {n: p for n, p in objective.named_parameters() if p.requires_grad}
    unknown = sorted(set(state["trainable"]) - set(ours))
    absent = sorted(set(ours) - set(state["trainable"]))
    reshaped = sorted(k for k in set(ours) & set(state["trainable"]) if ours[k].shape != state["trainable"][k].shape)
    for problem, names in (("unknown weights", unknown), ("missing weights", absent), ("other shapes", reshaped)):
        if names:
            raise ValueError(
                f"checkpoint in {out} does not match this configuration ({problem} such as {names[:3]}); "
                "resume with the run's own config.json"
            )
    _check_resumed_settings(state, config, _RESUME_MAY_CHANGE - set(fixed))
    objective.load_state_dict(state["trainable"], strict=False)


def _check_resumed_settings(state: dict, config: TrainConfig, may_change: set[str]) -> None:
    """Refuse a ``--resume`` whose settings outside ``may_change`` differ from the checkpoint's run."""
    changed = _changed_settings(state.get("config", {}), config, may_change)
    if changed:
        free = may_change - {"model", "recipe", "output_dir"}
        flags = ", ".join(sorted("--" + k.replace("_", "-") for k in free))
        raise ValueError(
            f"--resume: these settings differ from the run in {config.output_dir} ({', '.join(changed)}), so it "
            f"would not continue the same run; drop those flags (a resumed run may change only {flags}), "
            "or train with them into another --output-dir"
        )


def _changed_settings(saved_config: dict, config: TrainConfig, free: set[str]) -> list[str]:
    """'name old -> new' for each setting outside ``free`` where ``config`` differs from a run's saved config (older
    runs saved it flat); a setting the run predates counts as its default there (a new option left at its default
    continues the run, set otherwise it would change it)."""
    saved, ours = flat_values(saved_config), config.flat()
    saved = {**{k: v for k, v in flag_defaults(config.method).items() if k not in saved and saved}, **saved}
    return [
        f"{k} {saved[k]!r} -> {ours[k]!r}" for k in sorted((saved.keys() & ours.keys()) - free) if saved[k] != ours[k]
    ]


def _setup(config: TrainConfig, state: dict | None) -> _Run:
    """Load the model, build the method's objective and the optimizer, restore ``state`` if resuming."""
    accelerator = _accelerator(config.device)
    accum = config.validate(accelerator.num_processes)
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    precision = resolve_precision(config.precision, accelerator.device)
    model, tokenizer, model_path, fingerprint = _load_base(config, precision)
    mask_token, mask_id = choose_mask_token(tokenizer, config.mask_token)
    method = get_method(config.method)(config, Context(tokenizer, mask_id, _start_spec(config)))
    examples = method.load_data()
    data = examples_fingerprint(examples)
    if state is not None:
        check_same_examples(state.get("data"), data, config.output_dir)
    objective = method.build_objective(_trainable_llm(config, method.prepare_model(model), method, precision))
    objective.train()
    if state is not None:
        _restore(state, config, objective, fingerprint, method.fixed_on_resume(state["step"]))
    if config.init_lora and state is None and not config.continue_adapter:
        _load_init_lora(config, objective, fingerprint)
    if config.continue_adapter and state is None:
        _load_continued(config, objective, fingerprint)
    params, optimizer, scheduler = _optimizer(config, method, objective)
    if config.continue_adapter and state is None:
        _move_schedule(scheduler, continued_step(config))
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        saved = state["rng"]  # one entry per process of the run that wrote it
        set_rng_state(saved[min(accelerator.process_index, len(saved) - 1)])
    wrapped, optimizer = accelerator.prepare(objective, optimizer)
    meta = {
        "mask_token": mask_token,
        "mask_token_id": mask_id,
        "resolved_model_path": str(model_path),
        "world_size": accelerator.num_processes,
        "grad_accum_steps": accum,
        "resolved_precision": precision,
        "continued_from": _continued_facts(config, resumed=state is not None),
        "data": data,
    }
    return _Run(
        config=config,
        accelerator=accelerator,
        method=method,
        objective=wrapped,
        params=params,
        optimizer=optimizer,
        scheduler=scheduler,
        examples=examples,
        order=method.example_order(len(examples), config.seed),  # DataOrder unless the method groups batches
        precision=precision,
        accum=accum,
        fingerprint=fingerprint,
        tokenizer=tokenizer,
        meta=meta,
    )


def _accelerator(device: str):
    """accelerate's Accelerator on ``device`` (``--device``). On the CPU, cpu=True also lets accelerate see torchrun's
    WORLD_SIZE and use gloo (MULTI_CPU); on GPUs each process of a launcher takes its local rank's GPU, so
    ``cuda:N`` names the GPU of a single process only."""
    from accelerate import Accelerator

    placed = resolve_device(device)
    accelerator = Accelerator(cpu=placed.type == "cpu")
    if placed.type == "cuda" and placed.index is not None:
        if accelerator.num_processes > 1:
            raise ValueError(
                f"--device {device} picks the GPU of one process; under torchrun / accelerate launch each process "
                "takes its local rank's GPU: pass --device cuda or auto (CUDA_VISIBLE_DEVICES picks which GPUs)"
            )
        torch.cuda.set_device(placed)  # the Accelerator's device is "cuda", the current one
    if accelerator.device.type != placed.type:  # accelerate's state is set once per process
        raise RuntimeError(
            f"--device {device}: accelerate was already set up on {accelerator.device} in this process; "
            "train on another device in a new process"
        )
    return accelerator


def continued_step(config: TrainConfig) -> int:
    """The step ``--continue-adapter``'s adapter holds (0 without one)."""
    if not config.continue_adapter:
        return 0
    steps = adapter_meta(config.continue_adapter).trained_steps
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--continue-adapter {config.continue_adapter}: its unimae.json names no trained_steps")
    return steps


def _with_continued_init(config: TrainConfig) -> TrainConfig:
    """``--continue-adapter``: check it holds fewer steps than ``--steps``; its own init adapter (the stage it was
    trained on top of, kept inside it) becomes this run's ``--init-adapter``, so the base is merged as before."""
    if not config.continue_adapter:
        return config
    source = Path(config.continue_adapter)
    if not (source / "adapter_model.safetensors").is_file():
        raise FileNotFoundError(f"--continue-adapter {source} is not an adapter folder (no adapter_model.safetensors)")
    held = continued_step(config)
    if held >= config.steps:
        raise ValueError(f"--continue-adapter {source} already holds {held} steps; pass --steps above {held}")
    inner = source / INIT_ADAPTER
    if config.init_adapter and not (
        inner.is_dir() and adapter_revision(str(inner)) == adapter_revision(config.init_adapter)
    ):
        raise ValueError(
            f"--init-adapter {config.init_adapter} is not the stage --continue-adapter {source} was trained on "
            f"({'its ' + INIT_ADAPTER + '/' if inner.is_dir() else 'the base model alone'}); drop --init-adapter"
        )
    recorded = adapter_meta(source).init_lora_revision
    if config.init_lora and Path(config.init_lora).is_dir() and adapter_revision(config.init_lora) != recorded:
        raise ValueError(
            f"--init-lora {config.init_lora} is not the LoRA --continue-adapter {source} started from; drop --init-lora"
        )
    return dataclasses.replace(config, init_adapter=str(inner)) if inner.is_dir() else config


def _start_spec(config: TrainConfig) -> EmbeddingSpec:
    """The embedding spec a run starts from: its first stage's (``--init-adapter`` / ``--init-lora``; the base's
    without one), without a rotation (it fits its own weights only). A first stage gone from disk (a resumed or
    continued run on another machine) is read from ``--continue-adapter``, trained from it; with none, an error:
    the default spec would silently change the attention and pooling of a chain such as MNTP -> SimCSE."""
    first = config.init_adapter or config.init_lora or None
    if first and not Path(first).is_dir():
        if not config.continue_adapter:
            raise FileNotFoundError(
                f"{first}, this run's first stage, does not exist: its embedding spec (attention, pooling) is the "
                "run's starting point; restore the folder"
            )
        first = config.continue_adapter
    return dataclasses.replace(embedding_spec(first), rotation="")


def _load_continued(config: TrainConfig, objective: torch.nn.Module, fingerprint: str) -> None:
    """Load ``--continue-adapter``'s LoRA weights into the fresh LoRA of this run, after checking that the adapter
    was trained on this base with this configuration (the settings a ``--resume`` may not change, but for the
    learning rate and its schedule: the optimizer starts afresh)."""
    source = Path(config.continue_adapter)
    meta = adapter_meta(source)
    if meta.base_fingerprint != fingerprint:
        raise ValueError(f"--continue-adapter {source} was trained on another base model ({meta.base_model})")
    changed = _changed_settings(meta.training_config, config, _CONTINUE_MAY_CHANGE)
    if changed:
        raise ValueError(f"--continue-adapter {source}: these settings differ from its run ({', '.join(changed)})")
    _load_lora_weights(objective.llm, source, "--continue-adapter")
    fresh = [n for n, p in objective.named_parameters() if p.requires_grad and not n.startswith("llm.")]
    if fresh:  # UniMAE's MRC decoder, GEM's logit scale: the adapter keeps no copy of them
        logger.warning(
            "--continue-adapter restores the LoRA weights only: %d trainable tensors of the objective outside the "
            "model (%s) start afresh, so the loss curve departs from the uninterrupted run's",
            len(fresh),
            ", ".join(fresh[:3]),
        )


def _load_init_lora(config: TrainConfig, objective: torch.nn.Module, fingerprint: str) -> None:
    """``--init-lora``: this run's LoRA starts from that adapter's LoRA weights (trained on this base)."""
    source = Path(config.init_lora)
    if not (source / "adapter_model.safetensors").is_file():
        raise FileNotFoundError(f"--init-lora {source} is not an adapter folder (no adapter_model.safetensors)")
    meta = adapter_meta(source)
    if meta.base_fingerprint != fingerprint:
        raise ValueError(f"--init-lora {source} was trained on another base model ({meta.base_model})")
    if meta.init_adapter or (source / INIT_ADAPTER).exists():
        raise ValueError(f"--init-lora {source} was trained on top of another adapter; start from one LoRA")
    if trained_token_rows(read_json(source / "adapter_config.json", "adapter config")):
        raise ValueError(
            f"--init-lora {source} also trains token embedding rows (GEM's summary tokens, a trained mask token), "
            "which a LoRA start would drop; start from it with --init-adapter (merged into the base) instead"
        )
    _load_lora_weights(objective.llm, source, "--init-lora")


def _load_lora_weights(llm: torch.nn.Module, source: Path, flag: str) -> None:
    """Copy ``source``'s LoRA weights into ``llm``'s (fp32); every LoRA weight must fit, or a clear error."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(source / "adapter_model.safetensors")
    result = set_peft_model_state_dict(llm, {k: v.float() for k, v in weights.items()})
    keys = [*getattr(result, "unexpected_keys", []), *getattr(result, "missing_keys", [])]
    unfit = [k for k in keys if "lora_" in k]
    if unfit or not weights:
        raise ValueError(f"{flag} {source}: its weights do not fit this run's LoRA ({unfit[:3]})")


def _move_schedule(scheduler, step: int) -> None:
    """Set a fresh ``LambdaLR`` to 0-based step ``step`` (the learning rate that step uses)."""
    scheduler.last_epoch = step
    for group, base, factor in zip(
        scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base * factor(step)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def _trainable_llm(config: TrainConfig, model, method: Method, precision: str):
    """The LLM as it trains: LoRA (or all weights), bf16 input handling, dropout, checkpointing."""
    llm = _build_llm(config, model, method)
    if precision == "bf16" and not config.full_params:
        skip_input_upcast(llm)
    if method.attention_dropout:  # else the model keeps its own config's rate
        set_attention_dropout(llm, method.attention_dropout)
    if config.gradient_checkpointing:
        llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        llm.enable_input_require_grads()
    return llm


def _optimizer(config: TrainConfig, method: Method, objective: torch.nn.Module):
    """(trainable parameters, AdamW over them, the learning-rate schedule)."""
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    # --lr x the method's multiplier per step (constant 1.0 by default, paper App. C; GEM: its two phases)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, method.lr_lambda)
    return params, optimizer, scheduler


def _forward_backward(run: _Run, batch) -> dict:
    """Loss and gradients of one micro-batch: forward through the (DDP-)wrapped objective, then backward (a
    gradient cache's per-chunk passes run inside it, as a hook on the loss). The returned values are final only
    after that backward (the gradient cache writes its LM term in the hook), so nothing reads them in between."""
    losses = run.objective(batch)
    run.accelerator.backward(losses["loss"] / run.accum)
    return losses


def _train_step(run: _Run, step: int, stop: _StopFlag) -> tuple[dict, bool]:
    """One optimizer step (micro-batches + accumulation) -> (its log record, losses averaged over processes;
    whether any process has been asked to stop, agreed by all of them in the same reduction)."""
    config, acc = run.config, run.accelerator
    world = acc.num_processes
    shard = config.batch_size // world
    tic = time.perf_counter()
    first = step * config.batch_size + acc.process_index * shard
    examples = list(range(first, first + shard))  # global example indices of this process
    totals: dict[str, float] = {}
    tokens = 0
    acc.unwrap_model(run.objective).set_step(step)
    for micro in range(run.accum):
        chosen = examples[micro * config.micro_batch_size : (micro + 1) * config.micro_batch_size]
        batch = run.method.collate([run.examples[run.order.text_index(i)] for i in chosen], chosen).to(acc.device)
        tokens += batch.num_tokens
        sync = contextlib.nullcontext() if micro == run.accum - 1 else acc.no_sync(run.objective)
        with sync:
            with autocast(run.precision, acc.device):
                losses = _forward_backward(run, batch)
        for key, value in losses.items():
            totals[key] = totals.get(key, 0.0) + value.item() / run.accum
    max_norm = config.max_grad_norm if config.max_grad_norm > 0 else math.inf
    grad_norm = float(acc.clip_grad_norm_(run.params, max_norm))
    lr = run.scheduler.get_last_lr()[0]  # the rate this step uses (read before the scheduler moves on)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    keys = sorted(totals)
    stats = [totals[k] for k in keys] + [tokens, float(stop.requested)]
    stats = torch.tensor(stats, dtype=torch.float64, device=acc.device)
    stats = acc.reduce(stats, reduction="sum") if world > 1 else stats
    seconds = time.perf_counter() - tic
    record = {"step": step + 1, **{k: stats[i].item() / world for i, k in enumerate(keys)}}
    record.update(
        grad_norm=grad_norm,
        lr=lr,
        tokens=int(stats[-2].item()),
        seconds=round(seconds, 4),
        tokens_per_s=round(stats[-2].item() / seconds, 1),
    )
    return record, bool(stats[-1].item() > 0)


def _save_checkpoint(run: _Run, step: int) -> None:
    """Gather every process's RNG state; the main process writes the checkpoint."""
    acc = run.accelerator
    rngs = acc.gather_for_metrics([rng_state()], use_gather_object=True) if acc.num_processes > 1 else [rng_state()]
    if run.main:
        state = {
            "trainable": _trainable_state(acc.unwrap_model(run.objective)),
            "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(),
            "rng": rngs,
            "fingerprint": run.fingerprint,
            "model": run.config.model,
            "config": run.config.to_dict(),
            "data": run.meta["data"],
        }
        save_checkpoint(run.config.output_dir, step, state)


def _save_adapter(run: _Run, step: int) -> Path:
    """Write the adapter (or full model), its unimae.json and, with ``--merge``, a merged HF folder."""
    config, continued = run.config, run.meta["continued_from"]
    adapter_dir = _adapter_dir(config)
    if not run.main:
        return adapter_dir
    llm = run.accelerator.unwrap_model(run.objective).llm
    trained = ((name, p) for name, p in llm.named_parameters() if p.requires_grad)
    check_finite(trained, f"adapter of step {step} not written", DIVERGED)
    # Trained token rows (GEM's summary tokens, --train-mask-token) are saved as peft trainable-token deltas;
    # the whole embedding matrices are not (every load grows the base the same way: unimae.adapter).
    # Filled beside the adapter and swapped in whole: an interruption or a full disk never leaves one step's
    # weights under another step's unimae.json.
    partial = adapter_dir.with_name(f".{adapter_dir.name}.partial")
    remove(partial)
    with writing(adapter_dir, partial=partial):  # a full disk: an error naming the adapter, not the library's
        llm.save_pretrained(partial, **({} if config.full_params else {"save_embedding_layers": False}))
        run.tokenizer.save_pretrained(partial)
        if config.init_adapter and not config.full_params:
            shutil.copytree(config.init_adapter, partial / INIT_ADAPTER)
    meta = AdapterMeta(
        base_model=config.model,
        base_fingerprint=run.fingerprint,
        embedding=run.method.embedding_spec(),
        trained_steps=step,
        mask_token=run.meta["mask_token"],
        method=config.method,
        init_adapter=INIT_ADAPTER if config.init_adapter else None,
        init_lora_revision=continued["init_lora_revision"] if continued else _init_lora_revision(config),
        training_config=config.to_dict(),
        continued_from_step=continued["step"] if continued else None,
        continued_from_training=TrainingTime.from_dict(continued["training"]) if continued else None,
        distill_from_step=continued.get("distill_from") if continued else None,
    )
    with writing(adapter_dir, partial=partial):
        write_adapter_meta(partial, meta)
        replace_folder(partial, adapter_dir)
    if config.merge and not config.full_params:
        save_merged(config.model, adapter_dir, Path(config.output_dir) / "merged")
    return adapter_dir


def _continued_facts(config: TrainConfig, resumed: bool) -> dict | None:
    """What ``--continue-adapter``'s adapter held when this run started from it (its steps, their wall time, the
    LoRA it started from): read at the first sitting and kept in run.json, which later sittings read back, since
    the folder may hold another adapter by then (the retrieval recipe releases each better point into the
    folder a fresh machine continues from). None without ``--continue-adapter``."""
    if not config.continue_adapter:
        return None
    record = Path(config.output_dir) / "run.json"
    kept = read_json(record, "run record").get("continued_from") if resumed and record.is_file() else None
    if kept:
        return kept
    training = _continued_training(config)
    return {
        "step": continued_step(config),
        "training": training.to_dict() if training else None,
        "init_lora_revision": _init_lora_revision(config),
        "distill_from": _distill_from(config),
    }


def _distill_from(config: TrainConfig) -> int | None:
    """A distilled run continued from an adapter distilled from the same teacher, weight and loss (a distilled
    cooldown lengthened where its checkpoints are gone): the step that distillation began at, which that adapter
    records, else the step it was continued from itself (0: it distilled from its first step). None otherwise: the
    distillation, if any, begins at this run's first step. The same teacher: the same folder or Hub id, or one of the
    same name (the teacher fetched into another home folder on another machine, or its Hub id)."""
    teacher = getattr(config.options, "distill_teacher", None)
    if not teacher:
        return None
    held = adapter_meta(config.continue_adapter)
    options = held.training_config.get("options") or {}
    names = {os.path.basename(os.path.normpath(str(t))) for t in (options.get("distill_teacher") or "", teacher)}
    same_term = (options.get("distill_weight"), options.get("distill_loss", "listwise")) == (
        config.options.distill_weight,
        config.options.distill_loss,
    )
    if len(names) != 1 or not same_term:
        return None
    return held.distill_start or 0


def _continued_training(config: TrainConfig) -> TrainingTime | None:
    """The wall time of the steps ``--continue-adapter``'s adapter held: what a release records (its sittings' logs
    stay on the machines that ran them), else the ``log.jsonl`` of the run folder that holds the adapter, up to its
    step, plus what that adapter carries from one it was continued from itself. None where nothing records it."""
    if not config.continue_adapter:
        return None
    meta = adapter_meta(config.continue_adapter)
    if meta.release:
        return meta.release.training
    log = Path(config.continue_adapter).parent / "log.jsonl"
    if not log.is_file():
        return meta.continued_from_training
    return TrainingTime.from_log(log, meta.trained_steps) + meta.continued_from_training


def _init_lora_revision(config: TrainConfig) -> str | None:
    """The revision of the LoRA this run's LoRA started from: a continued adapter's own record, else
    ``--init-lora``'s weights (None where that folder is gone: a later sitting on another machine)."""
    if config.continue_adapter:
        return adapter_meta(config.continue_adapter).init_lora_revision
    return adapter_revision(config.init_lora) if config.init_lora and Path(config.init_lora).is_dir() else None


def _start_log(run: _Run, start: int) -> Path:
    """Write config.json and run.json; keep the log lines up to ``start`` (a resumed run rewrites the rest)."""
    out = Path(run.config.output_dir)
    log_path = out / "log.jsonl"
    if run.main:
        run.config.save(out / "config.json")
        atomic_write_json(out / "run.json", {**run.meta, "cpu_models": _sitting_cpus(out / "run.json", start)})
        atomic_write_text(log_path, "".join(line + "\n" for line in _read_log(log_path, start)))
    return log_path


def _sitting_cpus(record: Path, start: int) -> list[str]:
    """The CPU models of every sitting of the run: those an earlier run.json lists (when resuming) and this one's
    (the release card names the machine of the training's wall time)."""
    earlier = read_json(record, "run record").get("cpu_models", []) if start > 0 and record.is_file() else []
    return sorted(set(earlier) | {cpu_model()})


_RUN_OUTPUTS = ("checkpoints", "adapter", "model", "merged")  # what a run writes besides its logs and configs


def _earlier_run(out: Path) -> Path | None:
    """The newest checkpoint, or the adapter (or full model), of a run already in ``out``; None if none."""
    found = [p for p in (out / "adapter" / "adapter_config.json", out / "model" / "config.json") if p.is_file()]
    found += checkpoint_folders(checkpoint_dir(out))
    return found[-1] if found else None


def _adapter_dir(config: TrainConfig) -> Path:
    return Path(config.output_dir) / ("model" if config.full_params else "adapter")


def _finished(out: Path, config: TrainConfig, step: int) -> bool:
    """Whether the run in ``out`` is done: its newest checkpoint is at ``config.steps`` or later and its adapter
    was saved at that step. (An interrupted run saves its adapter too, at the step it stopped, so an adapter
    alone does not mean the run finished: its ``unimae.json`` says how many steps it holds.)"""
    return step >= config.steps and adapter_meta(_adapter_dir(config)).trained_steps == step


def train(config: TrainConfig, resume: bool = False, overwrite: bool = False) -> TrainResult:
    """Run (or resume) training as configured; returns where the adapter was written.

    A new run refuses an ``output_dir`` that holds another run's checkpoints or adapter (its checkpoints would
    outrank the new run's, and its adapter be lost) unless ``overwrite``, which deletes them first."""
    tune_allocator()
    out = Path(config.output_dir)
    earlier = None if resume else _earlier_run(out)
    if earlier is not None and not overwrite:
        raise FileExistsError(
            f"--output-dir {out} already holds a training run ({earlier}); continue it with "
            f"`unimae train --resume --output-dir {out}`, start it over with --overwrite, or pass another --output-dir"
        )
    state = load_latest_checkpoint(out) if resume else None
    config = _with_continued_init(config) if state is None else config
    if state is not None and _finished(out, config, state["step"]):  # nothing left: no model to load
        _check_resumed_settings(state, config, _RESUME_MAY_CHANGE)  # a changed flag is refused here too
        if config.merge and not config.full_params and not (out / "merged").is_dir():  # --merge asked only now
            save_merged(config.model, _adapter_dir(config), out / "merged")
        return TrainResult(out, _adapter_dir(config), state["step"], False, 0.0, already_finished=True)
    run = _setup(config, state)
    if earlier is not None:
        for name in _RUN_OUTPUTS:
            shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    step = start = state["step"] if state is not None else continued_step(config)
    log_path = _start_log(run, start)
    stop = _StopFlag()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    bar = tqdm(total=config.steps, initial=start, desc="unimae train", disable=not run.main, unit="step")
    t0 = time.perf_counter()
    alone, stopping = run.accelerator.num_processes == 1, False
    try:
        # Several processes leave the loop on the stop flag they agreed on in the last step's reduction (a
        # signal seen by one rank alone between steps would otherwise send the ranks to different collectives).
        while step < config.steps and not (stopping or (alone and stop.requested)):
            record, stopping = _train_step(run, step, stop)
            step += 1
            record["elapsed"] = round(time.perf_counter() - t0, 2)
            release_if_above(0.25)  # a heap grown past a quarter of the machine: hand free pages back (memory.py)
            rss = resident_bytes()
            if rss is not None:
                record["rss_gb"] = round(rss / 1e9, 2)
            if run.main:
                with open(log_path, "a") as log:
                    log.write(json.dumps(record) + "\n")
                losses = {k: f"{v:.3f}" for k, v in record.items() if k not in _STEP_FIELDS}
                bar.set_postfix({**losses, "tok_s": f"{record['tokens_per_s']:.0f}"})
                bar.update(1)
            if config.save_every and step % config.save_every == 0 and step < config.steps:
                _save_checkpoint(run, step)
    finally:
        bar.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _save_checkpoint(run, step)
    adapter_dir = _save_adapter(run, step)
    run.accelerator.wait_for_everyone()
    return TrainResult(out, adapter_dir, step, step < config.steps, time.perf_counter() - t0)
