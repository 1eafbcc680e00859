"""``unimae compare``: the paper's two tables for one base model, in one command.

Embeddings (mteb): base ``mean``, ``eos`` and ``echo``, each trained adapter with the pooling it was trained
for (row ``<run>-<pooling>``: ``eos`` for UniMAE, ``mean`` for MNTP, ...), and the
dedicated-encoder reference all-MiniLM-L6-v2. Generation (lm-eval): the base model and each
adapter. Figures: t-SNE of a clustering set (base eos vs each adapter) and category bars.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from unimae.encoder import Encoder
from unimae.evaluation.embeddings import adapter_label, evaluate_embeddings, evaluate_model_on_tasks, expand_tasks
from unimae.evaluation.figures import CLUSTERING_TASK, category_bars, clustering_sample, tsne_figure
from unimae.evaluation.generation import (
    GENERATION_TASKS,
    HEADLINE_METRIC,
    check_generation_data,
    evaluate_generation,
)
from unimae.evaluation.reference import MINILM_LABEL, load_minilm
from unimae.evaluation.summary import write_summary


@dataclass
class CompareConfig:
    model: str
    adapters: list[str] = field(default_factory=list)
    data_dir: Path | None = None
    output_dir: Path = Path("results/compare")
    tasks: list[str] = field(default_factory=lambda: ["dev"])
    base_poolings: tuple[str, ...] = ("mean", "eos", "echo")
    reference: bool = True
    generation: bool = True
    generation_limit: int | None = None
    batch_size: int = 32
    max_length: int = 512


def generation_table(rows: dict[str, dict]) -> str:
    tasks = list(next(iter(rows.values()))["results"]) if rows else []
    header = "| model | " + " | ".join(f"{t} ({HEADLINE_METRIC[t].split(',')[0]})" for t in tasks) + " |"
    lines = [header, "|" + "---|" * (len(tasks) + 1)]
    for label, summary in rows.items():
        values = [summary["results"][t][HEADLINE_METRIC[t]] for t in tasks]
        lines.append(f"| {label} | " + " | ".join(f"{v * 100:.2f}" if v <= 1 else f"{v:.2f}" for v in values) + " |")
    return "\n".join(lines)


def run_compare(config: CompareConfig) -> dict[str, str]:
    """Evaluate every row; write summary.md/csv, generation.md and figures; return the tables.

    Everything that can be checked without a model is checked first (row names, the generation data), so a
    mistake fails before hours of embedding evaluation. One adapter's model is in memory at a time.
    """
    names = _row_names(config)
    if config.generation:
        check_generation_data(config.data_dir, GENERATION_TASKS)
    out = Path(config.output_dir)
    emb_dir = out / "embeddings"
    tasks = expand_tasks(config.tasks)
    sample = _clustering_sample(config.data_dir)
    labels, panels = _embedding_rows(config, names, tasks, emb_dir, sample and sample[0])
    _, _, embedding_md = write_summary(emb_dir, labels, tasks)
    tables = {"embeddings": embedding_md}
    if sample:
        tsne_figure(panels, sample[1], out / "tsne.png", "TwentyNewsgroups: 6 largest classes")
    category_bars(emb_dir / "summary.json", out / "categories.png")
    if config.generation:
        rows = {name: _generation_row(config, adapter, out / "generation" / name) for name, adapter in names.items()}
        tables["generation"] = generation_table(rows)
        (out / "generation.md").write_text(tables["generation"] + "\n")
    (out / "tables.json").write_text(json.dumps(tables, indent=2))
    return tables


def _row_names(config: CompareConfig) -> dict[str, str | None]:
    """{row name: adapter (None for the base)}; ValueError if two rows would share a name."""
    names = ["base"] + [adapter_label(a) for a in config.adapters]
    if len(set(names)) < len(names):
        raise ValueError(
            f"adapters {config.adapters} would share a row name with each other or the base ({names[1:]}); "
            "use distinct run folders not named 'base'"
        )
    return dict(zip(names, [None, *config.adapters], strict=True))


def _clustering_sample(data_dir: Path | None) -> tuple[list[str], list[str]] | None:
    """The t-SNE figure's texts and classes, or None when the data has no TwentyNewsgroups clustering set."""
    if data_dir is None or not (Path(data_dir) / "clustering" / CLUSTERING_TASK / "test.jsonl").is_file():
        return None
    return clustering_sample(Path(data_dir))


def _embedding_rows(
    config: CompareConfig, names: dict[str, str | None], tasks: list[str], emb_dir: Path, texts: list[str] | None
) -> tuple[list[str], dict]:
    """Evaluate the base poolings, each adapter with its own pooling and the reference; (row labels, t-SNE
    panels: the base's eos and each adapter's embeddings of ``texts``)."""
    labels, panels = [], {}
    for name, adapter in names.items():
        encoder = Encoder.from_pretrained(config.model, adapter=adapter, max_length=config.max_length)
        poolings = config.base_poolings if adapter is None else (encoder.pooling,)  # an adapter: its own pooling
        for pooling in poolings:
            label = f"{name}-{pooling}"
            evaluate_embeddings(
                config.model,
                tasks,
                emb_dir,
                adapter=adapter,
                pooling=pooling,
                data_dir=config.data_dir,
                label=label,
                batch_size=config.batch_size,
                encoder=encoder.with_pooling(pooling) if adapter is None else encoder,
            )
            labels.append(label)
        if texts:  # the base in its eos view, an adapter as it embeds
            panel = encoder.with_pooling("eos") if adapter is None else encoder
            panels["base eos" if adapter is None else f"{name}-{encoder.pooling}"] = panel.encode(texts)
        del encoder  # one model in memory at a time
    if config.reference:
        evaluate_model_on_tasks(
            load_minilm(), tasks, emb_dir, MINILM_LABEL, {"model": MINILM_LABEL}, config.data_dir, config.batch_size
        )
        labels.append(MINILM_LABEL)
    return labels, panels


def _generation_row(config: CompareConfig, adapter: str | None, out: Path) -> dict:
    return evaluate_generation(config.model, adapter, out, config.data_dir, limit=config.generation_limit)
