"""The model card (``README.md``) of a released adapter, generated from its ``unimae.json`` and result files.

Nothing in a card is typed by hand: the ``model-index`` block and the tables come from the evaluation's own
JSON (mteb task results, ``unimae evaluate generation``'s ``generation.json``, the RAG benchmark, the
greedy-repetition check, the per-dimension and per-index-kind tables), and the training command, data, wall
time and machine from the adapter's training config and its runs' logs. A result that is not there yet is
left out and the card says so.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from unimae.adapter import AdapterMeta, TrainingTime
from unimae.evaluation.generation import average_accuracy
from unimae.evaluation.reference import reference_label
from unimae.evaluation.summary import markdown_table, read_row, summary_table, task_type
from unimae.files import read_json
from unimae.models import OFFLINE_MODELS
from unimae.training.config import TrainConfig, flag_defaults, flat_values


@dataclass(frozen=True)
class CardBase:
    """What a card says of a base model: its Hub id and licence (metadata id, words) and its hidden size."""

    hub_id: str
    licence_id: str = "other"
    licence: str = "the base model's"
    hidden_size: int | None = None


# The base models of the offline short names.
BASE_MODELS = {
    "smollm2-135m": CardBase("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0", "Apache-2.0", 576),
    "gemma3-270m": CardBase(
        "google/gemma-3-270m",
        "gemma",
        "the Gemma Terms of Use (https://ai.google.dev/gemma/terms), including the Gemma Prohibited Use Policy "
        "(https://ai.google.dev/gemma/prohibited_use_policy)",
        640,
    ),
}
# The licences of the supervised pairs (the data folder's README), by source file name.
DATA_LICENCES = {
    "snli_subset_cat": "SNLI: CC BY-SA 4.0",
    "snli_counterfactual_cad": "Apache-2.0 (SNLI: CC BY-SA 4.0)",
    "medical_question_entailment_rqe": "CC BY 4.0",
    "medquad_qa": "CC BY 4.0",
    "parasci_paraphrase": "derived from ACL Anthology and S2ORC (CC BY-NC): research use only",
    "mrpc_train_paraphrase": "Microsoft Research licence (research use)",
    "trecqa_answer_selection": "research data, no explicit licence",
    "debian_package_descriptions": "each package's own (Debian main: DFSG-free)",
    "wiki_ict": "Wikipedia text: CC BY-SA 4.0 (inverse-cloze pairs built by recipes/make_pairs_wiki.py)",
}
# The licences of the distillation teachers (`--distill-teacher`; sentence-transformers' model cards), by name.
TEACHER_LICENCES = {"all-mpnet-base-v2": "Apache-2.0", "all-MiniLM-L6-v2": "Apache-2.0"}
# The training text of the first stage recipes/retrieval.sh trains (`unimae train --method unimae`, its default).
FIRST_STAGE_TEXT = "`enwiki-gensim` (paragraphs of 206 Wikipedia articles shipped in the gensim wheel; CC BY-SA 4.0)"


@dataclass
class CardInputs:
    """Where a card's numbers come from (paths that do not exist are skipped)."""

    name: str
    release: Path
    dev_results: Path  # folder of the mteb task JSONs of the released adapter (a label folder)
    summary: Path | None = None  # `unimae evaluate summary` JSON with reference rows
    generation: Path | None = None
    base_generation: Path | None = None
    rag: Path | None = None
    repetition: list[Path] = field(default_factory=list)  # greedy_repetition.py JSONs (one per prompt set)
    extra_tables: list[Path] = field(default_factory=list)  # summary JSONs (dimensions, index kinds) to show
    train_logs: list[Path] = field(default_factory=list)  # log.jsonl of each sitting of the training run
    command: str = ""  # the recipe command that trained it
    source_dtype: str = ""  # how the adapter it is made from stores its LoRA weights ("": fp32, not recorded)


_NO_CPU = "CPU not recorded"
_CARD_WALL_TIME = re.compile(r"wall time (?P<hours>\d+(?:\.\d+)?) h of\s+training steps \((?P<cpus>[^;]*); ")

Revision = str | tuple[str, ...] | None  # one adapter revision, several that are one model, or None: any


def build_card(inputs: CardInputs, meta: AdapterMeta, revision: Revision = None) -> str:
    """The whole card: YAML front matter, then the sections. ``revision``: the released adapter's (its fp32
    weights' content hash, and its bf16 weights' once the release exists: :func:`unimae.release.release_revisions`);
    the dev results must be that adapter's, or the card would describe another model."""
    check_results_belong(inputs.dev_results, revision)
    tasks = _dev_scores(inputs.dev_results)
    sections = [
        _front_matter(inputs.name, meta, tasks, inputs.dev_results),
        _intro(inputs.name, meta),
        _usage(inputs.name, meta),
        _results(inputs, tasks, revision),
        _training(inputs, meta),
        _limits(meta),
    ]
    return "\n".join(s for s in sections if s)


def accepts(revision: Revision, scored: str | None) -> bool:
    """Whether a result measured for adapter revision ``scored`` describes the adapter of ``revision``."""
    return revision is None or scored in ((revision,) if isinstance(revision, str) else revision)


def _run_record(folder: Path) -> dict:
    """The ``run.json`` an evaluation wrote into ``folder`` ({} if there is none)."""
    run = Path(folder) / "run.json"
    return read_json(run, "run record") if run.is_file() else {}


def check_results_belong(folder: Path, revision: Revision) -> None:
    """ValueError unless the dev-suite folder was evaluated for the adapter of ``revision`` (its run.json)."""
    scored = _run_record(folder).get("revision")
    if not accepts(revision, scored):
        raise ValueError(
            f"{folder} holds the results of adapter revision {scored}, not of the adapter released ({revision}); "
            "evaluate the adapter into its own folder first"
        )


def _dev_scores(folder: Path) -> dict[str, dict]:
    """{task: mteb result JSON} of the released adapter's dev-suite run."""
    out = {}
    for path in sorted(Path(folder).glob("*.json")):
        if path.name == "run.json" or path.name.endswith(".error.json"):
            continue
        data = read_json(path, "result file")
        if "task_name" in data:
            out[data["task_name"]] = data
    return out


def _scored_split(scores: dict) -> str:
    """The split an mteb result is quoted on: ``test`` where it has one, else its first."""
    return "test" if "test" in scores else next(iter(scores))


def _main_score(result: dict) -> float:
    try:
        scores = result["scores"]
        return float(scores[_scored_split(scores)][0]["main_score"]) * 100
    except (KeyError, IndexError, StopIteration, TypeError, ValueError) as err:
        raise ValueError(f"the mteb result of {result.get('task_name')!r} holds no main score ({err!r})") from err


def _front_matter(name: str, meta: AdapterMeta, tasks: dict[str, dict], folder: Path) -> str:
    import yaml

    base = _base(meta.base_model)
    results = [
        {
            "task": {"type": task_type(task)},
            "dataset": {"type": f"mteb/{task}", "name": f"MTEB {task}", **_dataset_fields(data)},
            "metrics": [{"type": "main_score", "value": round(_main_score(data), 2)}],
        }
        for task, data in tasks.items()
    ]
    front = {
        "base_model": base.hub_id,
        "library_name": "peft",
        "license": base.licence_id,
        "pipeline_tag": "feature-extraction",
        "tags": ["unimae", "sentence-embeddings", "text-generation", "lora", "mteb", "rag"],
        "model-index": [{"name": name, "results": results}],
    }
    return "---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n"


def _base(model: str) -> CardBase:
    return BASE_MODELS.get(model, CardBase(model))


def _dataset_fields(result: dict) -> dict:
    """The model-index ``dataset`` fields of an mteb result: its revision, and the split and subset scored."""
    fields = {"revision": result.get("dataset_revision")}
    scores = result.get("scores") or {}
    if not scores:
        return fields
    fields["split"] = split = _scored_split(scores)
    subsets = {s.get("hf_subset") for s in scores[split] if isinstance(s, dict)}
    if len(subsets) == 1 and None not in subsets:
        fields["config"] = subsets.pop()
    return fields


def _base_line(model: str) -> str:
    """Which weights the adapter belongs to: an offline model is a dequantized GGUF, not the Hub's weights."""
    if model not in OFFLINE_MODELS:
        return f"- Base: `{model}`; the adapter loads only onto it (its fingerprint is in `unimae.json`)."
    return (
        f"- Base: the offline `{model}`, {OFFLINE_MODELS[model].description}, dequantized to float: the adapter\n"
        f"  was trained and scored on it and loads only onto it (its fingerprint is in `unimae.json`), not onto\n"
        f"  the full-precision Hub weights of `{_base(model).hub_id}`, on which it was not measured."
    )


def _intro(name: str, meta: AdapterMeta) -> str:
    spec, base = meta.embedding, _base(meta.base_model)
    prompts = "".join(f"- prompt `{k}`: `{v!r}`\n" for k, v in spec.prompts) or "- no prompts\n"
    size = f"{base.hidden_size} dimensions" if base.hidden_size else "the base model's hidden size"
    return f"""# {name}

A LoRA adapter for `{meta.base_model}` that makes the one model a retriever and keeps it a generator: the same weights
embed queries and passages (the last-layer state at an appended EOS token) and generate the answer, so a RAG
system needs one model instead of an encoder and an LLM. Trained with unimae (UniMAE, ACL 2025, and a supervised
contrastive stage with a next-token term); weights stored in bf16.

- Embedding: {spec.describe()}; cosine similarity; {size} at full size.
{prompts}{_base_line(meta.base_model)}
- Licence: the adapter follows its base model, {base.licence}; see the training data's licences below.
"""


def _usage(name: str, meta: AdapterMeta) -> str:
    model = meta.base_model or "MODEL"
    return f"""## Use

```python
from unimae import Encoder

enc = Encoder.from_pretrained("{model}", adapter="{name}")   # a release name resolves from any directory
q = enc.encode_query(["Who directed the film Solaris?"], normalize=True)
d = enc.encode_document(["Solaris is a 1972 film directed by Andrei Tarkovsky."], normalize=True)
print(q @ d.T, enc.generate("The capital of France is", max_new_tokens=8))
```

```bash
unimae index --model {model} --adapter {name} --corpus passages.jsonl --output-dir runs/index
unimae ask "Who directed the film Solaris?" --index runs/index
unimae serve --model {model} --adapter {name} --index runs/index   # /v1/embeddings (input_type, dimensions), /v1/rag
```
"""


def _results(inputs: CardInputs, tasks: dict[str, dict], revision: Revision) -> str:
    parts = ["## Results\n"]
    if not tasks:
        return "## Results\n\nNot evaluated yet.\n"
    parts.append(_dev_table(inputs, list(tasks)))
    parts.append(_scored_weights_line(inputs, revision))
    for path in inputs.extra_tables:
        if Path(path).is_file():
            parts.append(_summary_json_table(Path(path), caption=True))
    parts.append(_generation_lines(inputs, revision))
    parts.append(_rag_lines(inputs, revision))
    return "\n".join(p for p in parts if p)


def _dev_table(inputs: CardInputs, tasks: list[str]) -> str:
    rows = [read_row(Path(inputs.dev_results), tasks, label=inputs.name)]
    length = _run_record(inputs.dev_results).get("max_length")
    text = f"Dev suite ({len(tasks)} MTEB tasks, official mteb evaluators, main score x 100, "
    text += f"texts up to {length} tokens):\n\n"
    if inputs.summary is not None and Path(inputs.summary).is_file():
        own = Path(inputs.dev_results).name  # the summary's row of these results: shown once, as the release's
        return text + _summary_json_table(Path(inputs.summary), first=(inputs.name, rows[0]), drop=own)
    header, cells = summary_table(rows)
    return text + markdown_table(header, cells) + "\n"


def _summary_json_table(path: Path, first=None, drop: str | None = None, caption: bool = False) -> str:
    """A table of averages (and tasks) from an `unimae evaluate summary` JSON; ``first`` (label, row) leads, in
    place of the row ``drop`` (the same results under the summary's label). A row with missing tasks shows its
    scores but no average (it would not be the suite's). ``caption``: name the text length the rows were scored
    at (their folders' ``run.json`` beside the JSON) and what a blank cell means."""
    data = read_json(path, "result file")
    tasks = sorted({t for entry in data.values() for t in entry.get("tasks", {})})
    lines = ["| model | average | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 2) + "|"]
    entries = list(data.items())
    if first is not None:
        label, row = first
        others = [e for e in entries if e[0] not in (label, drop)]
        entries = [(label, {"tasks": row.task_scores, "average": row.average}), *others]
    for label, entry in entries:
        scores = entry.get("tasks", {})
        cells = [_fmt(scores.get(t)) for t in tasks]
        average = None if entry.get("missing") else entry.get("average")
        lines.append(f"| {label} | {_fmt(average)} | " + " | ".join(cells) + " |")
    note = _table_caption(path, [label for label, _ in entries], data) if caption else ""
    return f"{path.stem}{note}:\n\n" + "\n".join(lines) + "\n"


def _table_caption(path: Path, labels: list[str], data: dict) -> str:
    """`` (texts up to N tokens; ...)`` for the rows of a summary JSON whose folders sit beside it."""
    records = [_run_record(path.parent / label) for label in labels]
    lengths = {record.get("max_length") for record in records if record}  # rows without a run.json: not counted
    words = []
    if len(lengths) == 1 and None not in lengths:
        words.append(f"texts up to {lengths.pop()} tokens")
    if any(entry.get("missing") for entry in data.values()):
        words.append("a blank cell: the task was not scored for that row")
    return f" ({'; '.join(words)})" if words else ""


def _fmt(value) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}"


def _own(path: Path | None, revision: Revision) -> dict | None:
    """The JSON at ``path`` if it was measured for the adapter of ``revision`` (its ``revision`` field; any
    revision when None), else None: a card quotes only the released adapter's own measurements."""
    if path is None or not Path(path).is_file():
        return None
    data = read_json(path, "result file")
    return data if accepts(revision, data.get("revision")) else None


def _scored_weights_line(inputs: CardInputs, revision: Revision) -> str:
    """Which weights the dev table scored: the bf16 ones shipped here (the last of a release's revisions, or the
    adapter it was made from where that one stored them in bf16 already) or the fp32 adapter the release was made
    from; '' where no revision is known."""
    scored = _run_record(inputs.dev_results).get("revision")
    if not isinstance(revision, tuple) or not scored:
        return ""
    if len(revision) > 1 and scored == revision[-1]:
        return f"Scored on the bf16 weights shipped here (revision {scored}).\n"
    if inputs.source_dtype == "bfloat16":
        return (
            f"Scored on the adapter this release was made from (revision {scored}), which stores its LoRA weights in "
            "bf16: the values shipped here.\n"
        )
    return (
        f"Scored on the fp32 adapter this release was made from (revision {scored}); the weights shipped here are "
        "its LoRA weights rounded to bf16.\n"
    )


def _generation_lines(inputs: CardInputs, revision: Revision) -> str:
    lines = []
    for label, path, rev in (
        ("this adapter", inputs.generation, revision),
        ("base model", inputs.base_generation, None),
    ):
        data = _own(path, rev)
        if data is None and label == "this adapter":
            lines.append("- Generation suite: not measured for this adapter yet.")
        if data is not None:
            mean, stderr, n = average_accuracy(data["results"])
            spread = f" +- {stderr * 100:.2f}" if stderr is not None else ""
            lines.append(
                f"- Generation ({n} lm-eval tasks, every item, average accuracy), {label}: {mean * 100:.2f}{spread}"
            )
    lines += [line for path in inputs.repetition if (line := _repetition_line(Path(path), revision))]
    return "\n".join(lines) + ("\n" if lines else "")


def _repetition_line(path: Path, revision: Revision) -> str:
    """The released adapter's repeated word 3-grams in one greedy_repetition.py JSON beside the base model's, with
    the prompt set, the standard errors and the paired difference where the file records them ('' if it holds
    no row of this adapter)."""
    if not path.is_file():
        return ""
    rows = read_json(path, "repetition result")
    own = [r for r in rows.values() if isinstance(r, dict) and accepts(revision, r.get("revision"))]
    base = rows.get("base") if isinstance(rows.get("base"), dict) else None
    if not (own and base and "repeated_trigrams" in own[0]):
        return ""
    row = own[0]
    spread = lambda r: f" +- {r['repeated_trigrams_se']:.3f}" if "repeated_trigrams_se" in r else ""  # noqa: E731
    prompts = f"{row.get('prompts', 8)} {row.get('prompt_set', 'plain')} prompts"
    versus = row.get("vs_base") or {}
    paired = (
        f"; paired difference {versus['repeated_trigrams_diff']:+.3f} +- {versus['repeated_trigrams_diff_se']:.3f}"
        if "repeated_trigrams_diff" in versus
        else ""
    )
    return (
        f"- Greedy generation, repeated word 3-grams per continuation ({prompts}): {row['repeated_trigrams']:.3f}"
        f"{spread(row)} (base model {base['repeated_trigrams']:.3f}{spread(base)}{paired})"
    )


def _rag_lines(inputs: CardInputs, revision: Revision) -> str:
    data = _own(inputs.rag, revision)  # benchmarks/load_test.py's JSON
    if data is None:
        return ""
    lines = []
    for entry in data.get("rag", []):
        if isinstance(entry, dict) and "retrieval_acc_at_1" in entry:
            lines.append(
                f"- RAG benchmark, {_setup(entry.get('mode'))} ({entry.get('models')}): retrieval acc@1 "
                f"{entry['retrieval_acc_at_1']:.2f} over {entry.get('questions')} questions" + _every_paragraph(entry)
            )
    return "\n".join(lines) + ("\n" if lines else "")


def _setup(mode) -> str:
    return {"one": "one model", "two": "two models"}.get(mode, f"{mode} model(s)")


def _every_paragraph(entry: dict) -> str:
    """The RAG entry's acc@1 over every held-out paragraph's question (benchmarks since 2026-11-27), if any."""
    if "all_paragraphs_acc_at_1" not in entry:
        return ""
    return (
        f"; {entry['all_paragraphs_acc_at_1']:.3f} +- {entry.get('all_paragraphs_acc_at_1_se', 0):.3f} over all "
        f"{entry.get('all_paragraphs')} paragraphs' questions (retrieval only)"
    )


def training_time(inputs: CardInputs, meta: AdapterMeta) -> TrainingTime | None:
    """The wall time of the optimizer steps the released adapter holds, and their CPUs: from its sittings' logs
    that are on this machine (``inputs.train_logs``; in the last one only the steps the adapter holds), plus what
    a release it was continued from recorded; for a release, or a copy of one (a run's adapter restored from it, whose
    run's log may hold other steps), what the release records (``unimae.json``); for a release made before releases
    recorded it, what its card says (to 0.1 h). None: not known."""
    if meta.release is not None and meta.release.training is not None:
        return meta.release.training
    logs = [Path(p) for p in inputs.train_logs if Path(p).is_file()]
    if logs:
        last = len(logs) - 1  # the release's own run: only the steps its adapter holds
        times = [TrainingTime.from_log(p, meta.trained_steps if i == last else None) for i, p in enumerate(logs)]
        return sum(times[1:], times[0]) + meta.continued_from_training
    if meta.release is None:  # a run's adapter without its logs
        return None
    return meta.release.training or card_training_time(Path(inputs.release) / "README.md")


def card_training_time(card: Path) -> TrainingTime | None:
    """The training wall time a card states (``_training``'s own sentence), for releases made before
    ``unimae.json`` recorded it; None without a card or that sentence."""
    found = _CARD_WALL_TIME.search(card.read_text(encoding="utf-8")) if card.is_file() else None
    if not found:
        return None
    cpus = () if found["cpus"] == _NO_CPU else tuple(found["cpus"].split(", "))
    return TrainingTime(float(found["hours"]) * 3600, cpus)


def _wall_time(time: TrainingTime | None, meta: AdapterMeta) -> str:
    """The card's wall-time words: hours and CPUs, or why they are missing."""
    if time is None:
        return "wall time not recorded"
    cpus = ", ".join(time.cpu_models) or _NO_CPU
    text = f"wall time {time.seconds / 3600:.1f} h of\n  training steps ({cpus}; 2 CPU cores)"
    if meta.continued_from_step and meta.continued_from_training is None:
        text += f", the steps after {meta.continued_from_step} only (the adapter it continued recorded none)"
    return text


def _training(inputs: CardInputs, meta: AdapterMeta) -> str:
    config = flat_values(meta.training_config)
    wall_time = _wall_time(training_time(inputs, meta), meta)
    sources = [Path(p).name.removesuffix(".jsonl") for p in str(config.get("data", "")).split(",") if p]
    data_rows = "".join(f"| {s} | {DATA_LICENCES.get(s, 'see its source')} |\n" for s in sources)
    weights = config.get("data_weights") or "size"
    notes = _distillation(config, meta) + _averaging(meta)
    return f"""## Training

```bash
{inputs.command or train_command(config)}
```

- Steps: {meta.trained_steps}, each a batch of {config.get("batch_size")} pairs; {wall_time}.
{notes}- Data (query -> positive pairs; one source per batch, `{weights}` weights):

| source | licence |
|---|---|
{data_rows}{_first_stage(inputs, meta)}"""


def _distillation(config: dict, meta: AdapterMeta) -> str:
    """The card's line on the teacher the training distilled from (``--distill-teacher``, its weight, temperature
    and licence), '' for a run without one. A local folder is named by its folder, a Hub id by its last part."""
    teacher, weight = config.get("distill_teacher"), float(config.get("distill_weight") or 0)
    if not teacher or not weight:
        return ""
    name = reference_label(str(teacher))
    start = meta.distill_start
    steps = f"the {meta.trained_steps - start} steps after step {start}" if start else "every step"
    if config.get("distill_loss") == "similarity":
        detail, flags = (
            "cosines of every pair of a batch's texts",
            f"`--distill-loss similarity --distill-weight {weight:g}`",
        )
    else:
        detail, flags = (
            "in-batch similarities",
            f"`--distill-weight {weight:g}`, temperature {config.get('distill_temperature')}",
        )
    return (
        f"- Distillation: {steps} also matched the {detail} of the sentence-transformers model `{name}` ({flags}; "
        f"licence: {TEACHER_LICENCES.get(name, 'see its model card')}), so part of the scores comes from that teacher "
        "and the data it was trained on.\n"
    )


def _averaging(meta: AdapterMeta) -> str:
    """The card's line on a LoRA that is a weighted mean of adapters (``recipes/average_adapters.py``, its
    ``averaged_from``: WiSE-FT or a checkpoint soup), '' for a trained one. The steps, data and distillation the card
    lists are those of the first input, whose record the mean carries."""
    inputs = meta.extra.get("averaged_from") or []
    if not inputs:
        return ""
    parts = [
        f"`{entry.get('adapter')}` (revision {entry.get('revision')}, share {entry.get('weight', 1 / len(inputs)):.2f})"
        for entry in inputs
    ]
    return (
        f"- Weight averaging: the LoRA weights are the mean of {len(inputs)} adapters on one training path "
        f"(WiSE-FT, arXiv:2109.01903, for a start and a model trained further from it): {', '.join(parts)}; the "
        "steps and data here are the first's.\n"
    )


def _first_stage(inputs: CardInputs, meta: AdapterMeta) -> str:
    """The stage this LoRA continued (``--init-lora``), which the release holds too, and its training text."""
    if meta.init_lora_revision is None:
        return ""
    text = (
        f"\nThe LoRA also holds the first stage it continued (`--init-lora`, revision {meta.init_lora_revision}), "
        "whose training text the release does not record"
    )
    if "recipes/retrieval.sh" in inputs.command:
        text += f": the recipe trains it with `unimae train --method unimae` on its default corpus, {FIRST_STAGE_TEXT}"
    return text + ".\n"


def train_command(config: dict) -> str:
    """``unimae train`` with the flags of ``config`` (a saved TrainConfig: nested, or flat as older runs saved it)
    that differ from the defaults of its method (the other methods' options of a flat one are left out)."""
    config = flat_values(config)
    defaults = flag_defaults(config.get("method", TrainConfig.method))
    flags = []
    for key, value in config.items():
        if key in defaults and value != defaults[key] and key not in ("output_dir", "threads", "device"):
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                flags.append(flag if value else f"--no-{key.replace('_', '-')}")
            else:
                flags.append(f"{flag} {shell_word(value) if isinstance(value, str) else value}")
    return "unimae train " + " \\\n  ".join(flags)


def shell_word(text: str) -> str:
    """``text`` as one bash word: bare when safe, ``$'...'`` when it holds a newline, else single-quoted."""
    if "\n" in text:
        return "$'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"
    return shlex.quote(text)


def _limits(meta: AdapterMeta) -> str:
    return """## Intended use and limits

- English retrieval and sentence similarity for RAG and search, from a small model that also answers; trained
  and evaluated on 2 CPU cores, one seed. Scores on tasks unlike the training pairs may be lower.
- Generation is the base model's, nudged by the training (see the generation figures above); answers of a
  small model are often wrong even with the right passage retrieved.
- The prompts matter: embed queries with `encode_query` (or `input_type: query`) and passages with
  `encode_document`; llama.cpp users prepend the query prompt themselves.
- Some training sources are for research use only (table above): check them before commercial use.
"""
