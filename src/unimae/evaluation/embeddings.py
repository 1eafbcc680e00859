"""Embedding evaluation on the official ``mteb`` evaluators (2.x), with local data when offline.

``evaluate_embeddings`` runs each task separately through ``mteb.evaluate``; a task that fails
(unknown name, missing file, malformed line, Hub-only while offline) is recorded in
``<task>.error.json`` and the others still run. Each successful task writes mteb's own result
JSON (``TaskResult.to_disk``) atomically, so no partial JSON ever looks complete; ``run.json``
beside them records model, adapter, pooling, revision, versions and each task's runtime.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from unimae.adapter import adapter_revision, model_revision
from unimae.encoder import Encoder
from unimae.evaluation.embedding_cache import EmbeddingCache, namespace_key
from unimae.evaluation.local_data import LOADERS, LocalDataError, task_folder
from unimae.files import atomic_write, atomic_write_json
from unimae.release import resolve_adapter
from unimae.runtime.memory import cpu_model

logger = logging.getLogger(__name__)

# The 9 dev tasks of the local evaluation data (5 MTEB categories).
DEV_TASKS = [
    "STSBenchmark",
    "SICK-R",
    "STS17",
    "Banking77Classification",
    "EmotionClassification",
    "MassiveIntentClassification",
    "TwentyNewsgroupsClustering",
    "SciFact",
    "TwitterURLCorpus",
]
# The UniMAE paper's MTEB-15 subset (Appendix A, Table 3), the same as LLM2Vec's.
MTEB15_TASKS = [
    "SciFact",
    "ArguAna",
    "NFCorpus",
    "StackOverflowDupQuestions",
    "SciDocsRR",
    "BiorxivClusteringS2S",
    "MedrxivClusteringS2S",
    "TwentyNewsgroupsClustering",
    "SprintDuplicateQuestions",
    "Banking77Classification",
    "EmotionClassification",
    "MassiveIntentClassification",
    "STS17",
    "SICK-R",
    "STSBenchmark",
]
TASK_GROUPS = {"dev": DEV_TASKS, "mteb15": MTEB15_TASKS}


def expand_tasks(names: list[str]) -> list[str]:
    """Task groups ('dev', 'mteb15') expand to their tasks; other names pass through, deduplicated."""
    out: list[str] = []
    for name in names:
        out.extend(TASK_GROUPS.get(name, [name]))
    return list(dict.fromkeys(out))


def unknown_tasks(names: list[str]) -> list[str]:
    """mteb's message for each name (after :func:`expand_tasks`) its registry does not hold ([] when all are known),
    so a command can refuse a typo before it loads a model or writes a result."""
    import mteb

    unknown = []
    for name in expand_tasks(names):
        try:
            mteb.get_task(name)
        except KeyError as err:
            unknown.append(str(err.args[0]).removeprefix("KeyError: ") if err.args else name)
    return unknown


def english_task(name: str):
    """An mteb task restricted to English subsets and the MTEB English splits (test)."""
    import mteb

    task = mteb.get_task(name)
    if task.metadata.is_multilingual:
        english = [
            subset
            for subset, langs in task.metadata.eval_langs.items()
            if all(lang.startswith("eng") for lang in langs)
        ]
        if not english:
            raise ValueError(f"{name} has no English-only subset")
        task = mteb.get_task(name, hf_subsets=english, eval_splits=["test"] if "test" in task.eval_splits else None)
    return task


def inject_local_data(task, data_dir: Path) -> None:
    """Load the task's files from ``data_dir`` into the shapes mteb's evaluator reads.

    A multilingual task (e.g. MTOPIntentClassification, restricted to its English subsets by
    :func:`english_task`) reads each subset from ``<folder>/<subset>/`` when that folder exists, else
    from ``<folder>`` itself (one flat set of files).
    """
    task_type = task.metadata.type
    folder = task_folder(data_dir, task.metadata.name, task_type)
    if task.metadata.is_multilingual:
        task.dataset = {subset: _local_split_data(task, subset_folder(folder, subset)) for subset in task.hf_subsets}
    elif task_type == "Retrieval":  # mteb reads retrieval data per subset ('default') even for one language
        task.dataset = {subset: _local_split_data(task, folder) for subset in task.hf_subsets}
    else:
        task.dataset = _local_split_data(task, folder)
    task.data_loaded = True


def subset_folder(folder: Path, subset: str) -> Path:
    """``folder/subset`` if the data ships per subset, else ``folder`` (a flat layout)."""
    if (folder / subset).is_dir():
        return folder / subset
    subfolders = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name != "qrels")
    if subfolders:
        raise LocalDataError(f"{folder} has subset folders {subfolders} but not {subset!r}; add {folder / subset}")
    return folder


def _local_split_data(task, folder: Path):
    """One subset's data: {split: {corpus, queries, relevant_docs}} for retrieval, else a DatasetDict."""
    from datasets import Dataset, DatasetDict

    task_type = task.metadata.type
    columns = LOADERS[task_type](folder, task.metadata.name, list(task.eval_splits))
    if task_type == "Retrieval":
        return {
            split: {
                "corpus": Dataset.from_dict(d["corpus"]),
                "queries": Dataset.from_dict(d["queries"]),
                "relevant_docs": d["relevant_docs"],
                "top_ranked": None,
            }
            for split, d in columns.items()
        }
    return DatasetDict({split: Dataset.from_dict(cols) for split, cols in columns.items()})


def versions() -> dict[str, str]:
    import importlib.metadata as md

    names = ("unimae", "mteb", "torch", "transformers", "peft", "sentence-transformers")
    out = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return out


@dataclass
class EmbeddingRun:
    """What was evaluated and how each task went."""

    label: str
    output_dir: Path
    scores: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    runtimes: dict[str, float] = field(default_factory=dict)
    cache_hits: int = 0
    cache_misses: int = 0


def evaluate_model_on_tasks(
    model,
    tasks: list[str],
    output_dir: Path,
    label: str,
    meta: dict,
    data_dir: Path | None = None,
    batch_size: int = 32,
    rerun: bool = False,
) -> EmbeddingRun:
    """Evaluate an mteb-compatible ``model`` (ours or a SentenceTransformer) on ``tasks``.

    A task whose result JSON already exists under ``output_dir/label`` from a run of the same model
    (same ``meta``) is not run again unless ``rerun``: an interrupted suite resumes where it stopped.
    Results that the folder holds from another model (another adapter revision, pooling, ...) are moved
    to ``superseded-<time>/`` first (see :func:`set_aside_other_model`), so one row never mixes two models.
    """
    from mteb.results import TaskResult

    out = Path(output_dir) / label
    out.mkdir(parents=True, exist_ok=True)
    run = EmbeddingRun(label, out)
    previous = json.loads((out / "run.json").read_text()) if (out / "run.json").is_file() else {}
    meta = {**meta, "data_dir": str(data_dir) if data_dir else None}  # local files and the Hub's differ
    same_model = bool(previous) and same_run(previous, meta)
    unrecorded = not previous and any(out.glob("*.json"))  # results no run.json names: of an unknown model
    if (previous and not same_model) or unrecorded:
        set_aside_other_model(out)
        previous = {}
    for name in expand_tasks(tasks):
        done = out / f"{name}.json"
        if done.is_file() and same_model and not rerun:
            run.scores[name] = float(TaskResult.from_disk(done).get_score())
            logger.info("%s: already evaluated for this model (%s); pass --rerun to redo it", name, done)
            continue
        (out / f"{name}.error.json").unlink(missing_ok=True)
        start = time.perf_counter()
        try:
            run.scores[name] = _evaluate_task(model, name, data_dir, batch_size, done)
        except (KeyError, ValueError, LocalDataError, FileNotFoundError, OSError, ConnectionError) as err:
            run.errors[name] = _record_task_error(name, err, data_dir, done)
        run.runtimes[name] = round(time.perf_counter() - start, 2)
        write_run_record(out, meta, previous, run)  # after every task: a stopped suite resumes
    if not run.runtimes:
        write_run_record(out, meta, previous, run)
    return run


def _evaluate_task(model, name: str, data_dir: Path | None, batch_size: int, result_path: Path) -> float:
    """Run mteb task ``name`` (local files from ``data_dir`` if given) on ``model``; write its result JSON
    to ``result_path`` -> the task's main score."""
    import mteb

    task = english_task(name)
    if data_dir is not None:
        inject_local_data(task, data_dir)
    result = mteb.evaluate(
        model,
        task,
        cache=None,
        co2_tracker=False,
        raise_error=True,
        # the encoder's own bar: a sentence-transformers reference shows its encoding progress (SciFact's 5k
        # abstracts take hours on one thread); unimae's encoder draws its own bar past 2,000 texts
        encode_kwargs={"batch_size": batch_size, "show_progress_bar": True},
        show_progress_bar=False,
    )
    task_result = result.task_results[0]
    atomic_write(result_path, task_result.to_disk)
    return float(task_result.get_score())


def _record_task_error(name: str, err: Exception, data_dir: Path | None, result_path: Path) -> str:
    """Log a failed task and write ``<name>.error.json`` beside ``result_path`` -> the message (an earlier
    result of the same model, at ``result_path``, is kept)."""
    message = str(err) if isinstance(err, LocalDataError) else f"{name}: {type(err).__name__}: {err}"
    if data_dir is None and not isinstance(err, (LocalDataError, KeyError)):  # KeyError: unknown name
        message += " (offline? pass --data-dir with the task's files)"
    logger.error("task failed: %s", message)
    atomic_write_json(result_path.with_name(f"{name}.error.json"), {"task": name, "error": message})
    if result_path.is_file():
        logger.warning("%s: kept this model's earlier result %s", name, result_path)
    return message


WRITTEN_WHEN_SET = ("dimensions", "rotation")  # run.json keys of a run's identity that a plain run leaves out


def same_run(previous: dict, meta: dict, defaults: dict | None = None) -> bool:
    """Whether a record (``run.json``, a generation task's) was written for the model of ``meta``: every key
    equal, except that an adapter is known by its content hash (``revision``), not the path it was given by.
    ``defaults``: the value of a key in records written before that key existed."""
    defaults = {"attention": "causal"} if defaults is None else defaults
    ignored = {"adapter"} if meta.get("revision", "base") != "base" else set()
    if any(previous.get(k) is not None and k not in meta for k in WRITTEN_WHEN_SET):
        return False  # e.g. a --dimensions 256 record is not a full-size run's
    return all(previous.get(k, defaults.get(k)) == v for k, v in meta.items() if k not in ignored)


def write_run_record(out: Path, meta: dict, previous: dict, run: EmbeddingRun) -> None:
    """``run.json``: the model's ``meta`` and the runtimes and errors of every task evaluated under the label.

    Runs of the same label on other tasks add to its record; a task run again replaces its entry. Each task
    keeps the CPU its runtime was measured on (``task_cpu_models``) and the packages its score came from
    (``task_versions``); ``versions`` are those of the latest run that evaluated a task (a run that only
    reused records leaves them as they were).
    """
    now = versions()
    runtimes = {**previous.get("tasks", {}), **run.runtimes}
    # runtimes are per machine
    cpus = {**previous.get("task_cpu_models", {}), **dict.fromkeys(run.runtimes, cpu_model())}
    task_versions = {**previous.get("task_versions", {}), **{name: now for name in run.runtimes}}
    errors = {k: v for k, v in {**previous.get("errors", {}), **run.errors}.items() if k not in run.scores}
    atomic_write_json(
        out / "run.json",
        {
            **meta,
            "label": run.label,
            "versions": now if run.runtimes else previous.get("versions", now),
            "tasks": runtimes,
            "task_cpu_models": cpus,
            "task_versions": task_versions,
            "errors": errors,
        },
    )


def set_aside_other_model(out: Path) -> Path:
    """Move the task results and ``run.json`` of the model that ``out`` held before into
    ``out/superseded-<UTC time>/`` (nothing is deleted) and return that folder.

    Without this, evaluating a new adapter task by task under an old label would leave the old adapter's
    other task JSONs in place, and once the new ``run.json`` was written they would pass for the new one's.
    """
    stamp = time.strftime("superseded-%Y%m%d-%H%M%S", time.gmtime())
    aside, n = out / stamp, 1
    while aside.exists():
        n += 1
        aside = out / f"{stamp}-{n}"
    aside.mkdir()
    moved = [path for path in out.glob("*.json") if path.is_file()]
    for path in moved:
        path.rename(aside / path.name)
    logger.warning("%s held another model's results; moved them (%d files, run.json too) to %s", out, len(moved), aside)
    return aside


def adapter_label(adapter: str) -> str:
    """A row name for an adapter folder: its run's name for ``RUN/adapter``, else the folder's own name
    (``adapters/a`` and ``adapters/b`` stay apart)."""
    path = Path(adapter)
    return path.parent.name if path.name == "adapter" else path.name


def default_label(model: str, adapter: str | None, pooling: str) -> str:
    base = Path(model).name if Path(model).exists() else model.replace("/", "_")
    return f"{base}-{adapter_label(adapter) if adapter else 'base'}-{pooling}"


def open_embedding_cache(output_dir: Path, encoder, model: str, weights: str | None, revision: str | None):
    """The embedding cache of ``output_dir``, under a namespace of everything that changes ``encoder``'s vectors:
    model (and a local folder's weights), adapter weights, pooling and its options, max length, precision,
    a merged adapter, a non-causal attention rule, and the code that computes them (``namespace_key`` adds
    :data:`~unimae.evaluation.embedding_cache.VECTOR_CODE_VERSION`)."""
    namespace = namespace_key(
        model=model,
        **({"model_revision": weights} if weights else {}),
        adapter=revision,
        pooling=encoder.pooling,
        max_length=encoder.max_length,
        precision=encoder.embedding_precision,
        options=encoder.pooling_options,
        **({"merged": True} if encoder.adapter_merged else {}),
        **({"attention": encoder.attention} if encoder.attention != "causal" else {}),
    )
    return EmbeddingCache(output_dir / "embedding_cache.sqlite", namespace)


def evaluate_embeddings(
    model: str,
    tasks: list[str],
    output_dir: Path,
    adapter: str | None = None,
    pooling: str = "auto",
    data_dir: Path | None = None,
    label: str | None = None,
    batch_size: int = 32,
    max_length: int = 512,
    precision: str = "auto",
    use_cache: bool = True,
    encoder=None,
    rerun: bool = False,
    attention: str | None = None,
    dimensions: int | None = None,
    device: str = "auto",
) -> EmbeddingRun:
    """Evaluate unimae's Encoder (``model`` + ``adapter``, ``pooling``) on mteb ``tasks``.

    ``attention`` overrides the attention rule (default: the adapter's, causal without one), e.g. the
    base model with bidirectional attention as a control for MNTP.

    Embeddings are cached under ``output_dir/embedding_cache.sqlite`` keyed by model, adapter
    weights, pooling, max length, precision, the vector code version and text (``rerun`` reuses them;
    ``use_cache=False`` embeds every text again); ``encoder`` reuses an already loaded one.
    ``dimensions``: score the first k coordinates (Matryoshka; cosine similarity, so no re-normalisation is
    needed); the cache holds the full vectors, so every size after the first costs only the scoring.
    ``device``: where a loaded encoder runs (auto, cpu, cuda, cuda:N; not part of the cache key).
    """
    from unimae.evaluation.mteb_model import MTEBEncoder  # imported here: that module imports mteb, an optional extra

    adapter = resolve_adapter(adapter)  # a release name -> its folder, so the revision hashes its weights
    encoder = encoder or Encoder.from_pretrained(
        model,
        adapter=adapter,
        pooling=pooling,
        max_length=max_length,
        precision=precision,
        attention=attention,
        device=device,
    )
    pooling = encoder.pooling  # 'auto' resolved from the adapter
    revision = adapter_revision(adapter)
    weights = model_revision(model)  # a local model folder: retrained weights are another model
    label = label or default_label(model, adapter, pooling)
    cache = open_embedding_cache(Path(output_dir), encoder, model, weights, revision) if use_cache else None
    wrapped = MTEBEncoder(
        encoder, name=f"unimae/{label}", revision=revision, cache=cache, batch_size=batch_size, dimensions=dimensions
    )
    meta = {
        "model": model,
        **({"model_revision": weights} if weights else {}),
        "adapter": adapter,
        "pooling": pooling,
        "attention": encoder.attention,
        "revision": revision,
        "max_length": encoder.max_length,
        "precision": encoder.embedding_precision,
        **({"dimensions": dimensions} if dimensions else {}),
        **({"rotation": encoder.spec.rotation or None} if dimensions else {}),  # whose prefixes (None: raw)
    }
    try:
        run = evaluate_model_on_tasks(wrapped, tasks, Path(output_dir), label, meta, data_dir, batch_size, rerun)
    finally:
        if cache is not None:
            hits, misses = cache.hits, cache.misses
            cache.close()
            logger.info("embedding cache: %d hits, %d misses", hits, misses)
    if cache is not None:
        run.cache_hits, run.cache_misses = hits, misses
    return run
