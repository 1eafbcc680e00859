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

from unimae.evaluation.embeddings import adapter_label, evaluate_embeddings, evaluate_model_on_tasks, expand_tasks
from unimae.evaluation.generation import HEADLINE_METRIC, evaluate_generation
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
    """Evaluate every row; write summary.md/csv, generation.md and figures; return the tables."""
    from unimae.encoder import Encoder
    from unimae.evaluation.figures import category_bars, clustering_sample, tsne_figure

    out = Path(config.output_dir)
    emb_dir = out / "embeddings"
    tasks = expand_tasks(config.tasks)
    names = [adapter_label(a) for a in config.adapters]
    if len(set(names)) < len(names):
        raise ValueError(f"adapters {config.adapters} would share a row name ({names}); use distinct run folders")
    base = Encoder.from_pretrained(config.model, max_length=config.max_length)
    encoders = [Encoder.from_pretrained(config.model, adapter=a, max_length=config.max_length) for a in config.adapters]
    trained = {f"{name}-{enc.pooling}": enc for name, enc in zip(names, encoders, strict=True)}  # its own pooling
    rows = [(f"base-{p}", None, p, base.with_pooling(p)) for p in config.base_poolings]
    rows += [(label, a, enc.pooling, enc) for (label, enc), a in zip(trained.items(), config.adapters, strict=True)]
    labels = []
    for label, adapter, pooling, encoder in rows:
        evaluate_embeddings(
            config.model,
            tasks,
            emb_dir,
            adapter=adapter,
            pooling=pooling,
            data_dir=config.data_dir,
            label=label,
            batch_size=config.batch_size,
            encoder=encoder,
        )
        labels.append(label)
    if config.reference:
        from unimae.evaluation.reference import MINILM_LABEL, load_minilm

        evaluate_model_on_tasks(
            load_minilm(), tasks, emb_dir, MINILM_LABEL, {"model": MINILM_LABEL}, config.data_dir, config.batch_size
        )
        labels.append(MINILM_LABEL)
    _, _, embedding_md = write_summary(emb_dir, labels, tasks)
    tables = {"embeddings": embedding_md}

    if config.data_dir is not None and (Path(config.data_dir) / "clustering").is_dir():
        texts, classes = clustering_sample(config.data_dir)
        panels = {"base eos": base.with_pooling("eos").encode(texts)}
        panels.update({label: enc.encode(texts) for label, enc in trained.items()})
        tsne_figure(panels, classes, out / "tsne.png", "TwentyNewsgroups: 6 largest classes")
    category_bars(emb_dir / "summary.json", out / "categories.png")

    if config.generation:
        rows = {
            "base": evaluate_generation(
                config.model, None, out / "generation" / "base", config.data_dir, limit=config.generation_limit
            )
        }
        for adapter in config.adapters:
            rows[adapter_label(adapter)] = evaluate_generation(
                config.model,
                adapter,
                out / "generation" / adapter_label(adapter),
                config.data_dir,
                limit=config.generation_limit,
            )
        tables["generation"] = generation_table(rows)
        (out / "generation.md").write_text(tables["generation"] + "\n")
    (out / "tables.json").write_text(json.dumps(tables, indent=2))
    return tables
