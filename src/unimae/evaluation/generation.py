"""Generation evaluation on ``lm-eval`` (lm-evaluation-harness) with local task definitions.

The YAMLs in ``lm_tasks/`` mirror lm-eval's built-in arc_easy, piqa, hellaswag, winogrande and
lambada_openai (zero-shot, the same prompts, choices and acc/acc_norm), pointed at local files
in the ``generation/<task>/`` layout of ``--data-dir``. ``unimae_wiki_heldout`` is the perplexity
of held-out Wikipedia paragraphs: every 10th article of the default corpus, never trained on.
Any other name is looked up in lm-eval's own task registry (e.g. the paper's mmlu, sciq, arc_challenge,
logiqa, nq_open), which downloads its data from the Hugging Face Hub: for online users.
The model is evaluated live (``HFLM(pretrained=<model object>)``), the adapter applied unmerged. The
default scorer, :class:`~unimae.evaluation.lm_eval_model.ScoredLM`, is HFLM with the output head applied at
the scored positions only (the same numbers up to the log-softmax's rounding; ``scorer="hf"`` runs HFLM).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import torch

from unimae.adapter import adapter_revision, load_with_adapter, model_revision
from unimae.data.corpus import enwiki_gensim_paragraphs
from unimae.evaluation.embeddings import same_run, versions
from unimae.files import atomic_write_json, read_json
from unimae.release import resolve_adapter
from unimae.runtime.memory import cpu_model
from unimae.runtime.precision import resolve_device, resolve_precision, weight_dtype

logger = logging.getLogger(__name__)

LM_TASKS_DIR = Path(__file__).parent / "lm_tasks"
GENERATION_TASKS = ["arc_easy", "piqa", "hellaswag", "winogrande", "lambada_openai", "wiki_heldout"]
SCORERS = {
    "unimae": "HFLM with the output head at the scored positions only (fast; fp32 log-softmax)",
    "hf": "lm-eval's HFLM as it is (head and bf16/fp32 log-softmax at every position)",
}
HEADLINE_METRIC = {
    "arc_easy": "acc_norm,none",
    "piqa": "acc_norm,none",
    "hellaswag": "acc_norm,none",
    "winogrande": "acc,none",
    "lambada_openai": "acc,none",
    "wiki_heldout": "word_perplexity,none",
}


def check_generation_data(data_dir: Path | None, tasks: list[str]) -> None:
    """FileNotFoundError unless every local task but ``wiki_heldout`` has its .jsonl files under ``data_dir``."""
    for name in tasks:
        if name != "wiki_heldout":
            if data_dir is None:
                raise FileNotFoundError(f"generation task {name} needs --data-dir (generation/{name}/ files)")
            if not list((Path(data_dir) / "generation" / name).glob("*.jsonl")):
                raise FileNotFoundError(f"generation task {name}: no .jsonl in {Path(data_dir) / 'generation' / name}")


def write_task_configs(target: Path, data_dir: Path | None, tasks: list[str]) -> Path:
    """Render the task YAMLs with absolute data paths into ``target`` (an lm-eval include_path)."""
    target.mkdir(parents=True, exist_ok=True)
    heldout = target / "wiki_heldout.jsonl"
    if "wiki_heldout" in tasks:
        heldout.write_text("".join(json.dumps({"text": p}) + "\n" for p in enwiki_gensim_paragraphs("heldout")))
    check_generation_data(data_dir, tasks)
    for name in tasks:
        template = (LM_TASKS_DIR / f"unimae_{name}.yaml").read_text()
        rendered = template.replace("@DATA_DIR@", str(Path(data_dir or ".").resolve() / "generation"))
        rendered = rendered.replace("@HELDOUT_FILE@", str(heldout.resolve()))
        (target / f"unimae_{name}.yaml").write_text(rendered)
    (target / "winogrande_utils.py").write_text((LM_TASKS_DIR / "winogrande_utils.py").read_text())
    return target


def lm_eval_name(task: str) -> str:
    """Our local tasks are registered as ``unimae_<name>``; any other name is lm-eval's own."""
    return f"unimae_{task}" if task in GENERATION_TASKS else task


def check_registry_tasks(names: list[str], manager) -> None:
    """ValueError naming the tasks that are neither local nor in lm-eval's registry."""
    tags = sorted(set(names) & set(manager.all_tags))
    if tags:  # a tag runs its tasks but reports no score under its own name
        raise ValueError(f"{tags}: lm-eval tag(s), not tasks; name the tasks themselves (e.g. ai2_arc -> arc_easy)")
    unknown = sorted(set(names) - set(manager.all_tasks))
    if unknown:
        raise ValueError(
            f"unknown generation task(s) {unknown}: not one of the local tasks {GENERATION_TASKS} and not in "
            "lm-eval's registry (`lm_eval --tasks list` lists it)"
        )


def headline_metric(task: str, metrics: dict) -> str:
    """The metric a table shows for ``task``: ours for the local tasks, else the first acc-like one."""
    if task in HEADLINE_METRIC:
        return HEADLINE_METRIC[task]
    for name in ("acc_norm,none", "acc,none", "exact_match,none", "word_perplexity,none"):
        if name in metrics:
            return name
    numeric = [k for k, v in metrics.items() if isinstance(v, (int, float)) and "stderr" not in k]
    if not numeric:
        raise ValueError(f"no score for generation task {task!r} (its result has no numeric metric)")
    return numeric[0]


def average_accuracy(results: dict[str, dict]) -> tuple[float, float | None, int]:
    """(mean, standard error, n) of the tasks' headline accuracies (perplexities left out).

    The tasks' items are disjoint, so their errors are independent: SE = sqrt(sum_i SE_i^2) / n, with
    lm-eval's per-task ``<metric>_stderr``. SE is None when a task lacks it (e.g. a hand-written JSON).
    """
    values, errors = [], []
    for task, metrics in results.items():
        key = headline_metric(task, metrics or {})
        if "perplexity" in key or key not in (metrics or {}):
            continue
        name, _, filter_name = key.partition(",")
        values.append(metrics[key])
        error = metrics.get(f"{name}_stderr,{filter_name}")  # lm-eval writes "N/A" where it has none
        errors.append(error if isinstance(error, (int, float)) else None)
    if not values:
        raise ValueError("no accuracy among the generation results")
    se = None if None in errors else sum(e * e for e in errors) ** 0.5 / len(errors)
    return sum(values) / len(values), se, len(values)


def evaluate_generation(
    model_spec: str,
    adapter: str | None,
    output_dir: Path,
    data_dir: Path | None,
    tasks: list[str] | None = None,
    limit: int | None = None,
    batch_size: int = 16,
    max_length: int = 2048,
    precision: str = "auto",
    rerun: bool = False,
    scorer: str = "unimae",
    device: str = "auto",
) -> dict:
    """Run lm-eval on the live model (adapter applied, not merged); write ``generation.json``; return it.

    The adapter stays a separate LoRA (as in training): merging it into bf16 weights would round away
    part of its update, so "generation unchanged" could not be told from "adapter partly lost".
    Each task's result is kept in ``output_dir/tasks/<task>.json`` with what it was run on (model,
    adapter revision, limit, max length, precision): a suite stopped part-way (the full one takes
    hours on a CPU) resumes after its finished tasks; ``rerun`` redoes them. A task stopped part-way
    (HellaSwag alone is 40k requests, 75 min to 2 h for SmolLM2 on 2 cores) resumes after its answered
    requests: lm-eval's own request cache (``use_cache``), one per task and run identity, deleted
    once the task's record is written. ``scorer``: ``"unimae"`` (:class:`ScoredLM`) or ``"hf"`` (lm-eval's HFLM);
    it is part of the run's identity, so the two never share a record. ``device``: where the model runs (auto,
    cpu, cuda, cuda:N); 'auto' precision resolves for it.
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    if scorer not in SCORERS:
        raise ValueError(f"unknown scorer {scorer!r}; choose from {sorted(SCORERS)}")
    adapter = resolve_adapter(adapter)  # a release name -> its folder, so the revision hashes its weights
    tasks = tasks or GENERATION_TASKS
    local = [t for t in tasks if t in GENERATION_TASKS]
    output_dir = Path(output_dir)
    include = write_task_configs(output_dir / "lm_tasks", data_dir, local)
    manager = TaskManager(include_path=str(include))
    check_registry_tasks([t for t in tasks if t not in GENERATION_TASKS], manager)
    placed = resolve_device(device)
    resolved = resolve_precision(precision, placed)
    meta = {
        "model": model_spec,
        "model_revision": model_revision(model_spec),  # a model folder retrained in place is a new model
        "adapter": adapter,
        "revision": adapter_revision(adapter),
        "limit": limit,
        "max_length": max_length,
        "precision": resolved,
        "scorer": scorer,
        "data_dir": str(data_dir) if data_dir else None,  # the task files the local tasks read
    }
    done = {} if rerun else finished_tasks(output_dir / "tasks", tasks, meta)
    todo = [t for t in tasks if t not in done]
    if todo:
        done.update(_run_tasks(meta, todo, manager, output_dir / "tasks", batch_size, placed))
    summary = {
        **meta,
        "seconds": round(sum(done[t]["seconds"] for t in tasks), 1),
        "cpu_models": sorted({done[t].get("cpu_model") or "not recorded" for t in tasks}),  # tasks may be reused
        "versions": {**versions(), "lm_eval": lm_eval.__version__},
        "results": {t: done[t]["result"] for t in tasks},
        "n_samples": {t: done[t]["n_samples"] for t in tasks},
    }
    atomic_write_json(output_dir / "generation.json", summary)
    return summary


def finished_tasks(folder: Path, tasks: list[str], meta: dict) -> dict[str, dict]:
    """The task records in ``folder`` written for this ``meta`` (others are run again and replaced).

    As for embeddings (:func:`~unimae.evaluation.embeddings.same_run`), an adapter is matched by its content
    hash, not its path (``runs/a/adapter`` and ``./runs/a/adapter/`` are one run). Records written before
    ``model_revision`` existed were all run on registry names or Hub ids, whose revision is None; those written
    before ``data_dir`` existed count as of the data given now."""
    records = {}
    for task in tasks:
        path = folder / f"{task}.json"
        if path.is_file():
            record = read_json(path, "generation task record")
            defaults = {"model_revision": None, "data_dir": meta.get("data_dir")}  # records before data_dir
            if same_run(record.get("meta", {}), meta, defaults=defaults):
                records[task] = record
    if records:
        logger.info("generation: %s already evaluated for this model; pass --rerun to redo", sorted(records))
    return records


def _run_tasks(
    meta: dict, tasks: list[str], manager, folder: Path, batch_size: int, device: torch.device
) -> dict[str, dict]:
    """Evaluate ``tasks`` one by one on the model of ``meta`` on ``device``; write each task's record as it
    finishes."""
    import lm_eval

    # unmerged: peft casts inputs to the fp32 LoRA weights itself
    model, tokenizer, _ = load_with_adapter(meta["model"], meta["adapter"] or None, weight_dtype(meta["precision"]))
    model.to(device).eval()
    lm = build_scorer(meta["scorer"], model, tokenizer, batch_size, meta["max_length"])
    folder.mkdir(parents=True, exist_ok=True)
    records = {}
    for task in tasks:
        start = time.perf_counter()
        cache = request_cache(folder, task, meta)
        with torch.inference_mode():
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=[lm_eval_name(task)],
                task_manager=manager,
                num_fewshot=0,
                limit=meta["limit"],
                log_samples=False,
                bootstrap_iters=1000,
                use_cache=str(cache),
            )
        name = lm_eval_name(task)
        if name not in {**results.get("groups", {}), **results["results"]}:
            raise RuntimeError(f"lm-eval returned no score for {name!r}, only for {sorted(results['results'])}")
        records[task] = {
            "meta": meta,
            "seconds": round(time.perf_counter() - start, 1),
            "cpu_model": cpu_model(),  # wall times are per machine
            "result": {**results.get("groups", {}), **results["results"]}.get(name),
            "n_samples": results.get("n-samples", {}).get(name),
        }
        atomic_write_json(folder / f"{task}.json", records[task])
        for path in folder.glob(f"{cache.name}*"):
            path.unlink()
    return records


def build_scorer(name: str, model, tokenizer, batch_size: int, max_length: int):
    """The lm-eval model of scorer ``name`` (see :data:`SCORERS`) around the loaded ``model``.

    lm-eval's ``HFLM`` calls ``model.tie_weights()`` when it starts. transformers looks tied parameters up by
    name, and an adapter that trains token rows (peft ``trainable_token_indices``: GEM's summary tokens) has
    wrapped the embedding, so the lookup fails; the weights were tied when the model loaded (peft's wrapper
    keeps the tie), so the call is skipped while the scorer starts.
    """
    if name == "hf":
        from lm_eval.models.huggingface import HFLM as scorer_class
    else:
        from unimae.evaluation.lm_eval_model import ScoredLM as scorer_class  # imports lm-eval, an optional extra
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.tie_weights = lambda *args, **kwargs: None  # an instance attribute shadows the method
    try:
        return scorer_class(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    finally:
        del base.tie_weights


def request_cache(folder: Path, task: str, meta: dict) -> Path:
    """The path prefix of lm-eval's request cache for ``task`` run on ``meta`` (lm-eval adds ``_rank0.db``).

    lm-eval keys a cached answer by the request alone, so the run's identity is in the name: another
    model, adapter, limit or precision never reads this one's answers."""
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]
    return folder / f".requests-{task}-{digest}"
