"""``unimae index`` (embed a corpus into a vector index) and ``unimae ask`` (RAG over it, same model)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from unimae.cli.arguments import add_command, add_model_arguments
from unimae.index import INDEX_KINDS


def add_index_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "index", "Build (or resume) a FAISS index of a corpus with [EOS] embeddings.", _index)
    add_model_arguments(parser)
    parser.add_argument(
        "--corpus",
        default="enwiki-gensim:heldout",
        help="enwiki-gensim[:train|:heldout], a .jsonl (id, text), .txt (one passage per line) or .parquet.",
    )
    parser.add_argument("--field", default="text", help="Text field of a .jsonl / .parquet corpus.")
    parser.add_argument("--id-field", default="id", help="Id field of a .jsonl corpus (else the line number).")
    parser.add_argument("--output-dir", default="runs/index", help="The index folder (resumed if it exists).")
    parser.add_argument(
        "--kind",
        default="flat",
        choices=INDEX_KINDS,
        help="flat = exact search; hnsw / ivf approximate; sq8 = int8 codes (1/4 the memory), binary = sign bits "
        "(1/32), rescored with the float query.",
    )
    parser.add_argument("--dimensions", type=int, help="Index the first k coordinates (Matryoshka adapters).")
    parser.add_argument("--shard-size", type=int, default=256, help="Passages per saved shard (the resume unit).")
    parser.add_argument("--batch-size", type=int, default=16, help="Passages per forward pass.")
    parser.add_argument("--max-length", type=int, default=512, help="Tokens per passage, EOS included.")
    parser.add_argument("--overwrite", action="store_true", help="Rebuild an index folder made from other data.")


def add_ask_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "ask", "Answer a question from an index with the same model (RAG).", _ask)
    parser.add_argument("question", help="The question to answer.")
    parser.add_argument("--index", required=True, help="Folder written by `unimae index`.")
    add_model_arguments(parser, from_index=True)
    parser.add_argument("-k", type=int, default=3, help="Passages to retrieve.")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="Tokens of the answer at most.")
    parser.add_argument("--no-kv-reuse", action="store_true", help="Prefill the whole prompt (no query-cache reuse).")
    parser.add_argument(
        "--json", action="store_true", help="Print the answer as JSON (the rag.answer object POST /v1/rag returns)."
    )


def _index(args: argparse.Namespace) -> int:
    from unimae.adapter import adapter_revision, model_revision
    from unimae.corpus import load_passages
    from unimae.encoder import Encoder
    from unimae.index import IndexConfig, VectorIndex

    config = IndexConfig(
        kind=args.kind, shard_size=args.shard_size, batch_size=args.batch_size, dimensions=args.dimensions
    )
    passages = load_passages(args.corpus, field=args.field, id_field=args.id_field)
    print(f"{len(passages)} passages from {args.corpus}")
    encoder = Encoder.from_pretrained(
        args.model, adapter=args.adapter, max_length=args.max_length, precision=args.precision
    )
    source = {
        "model": args.model,
        "model_revision": model_revision(args.model),  # a local folder's weights: a rebuilt folder is not resumed
        "adapter": str(Path(args.adapter).resolve()) if args.adapter else None,
        "adapter_revision": adapter_revision(args.adapter),
        "corpus": args.corpus,
        "merged": encoder.adapter_merged,  # queries must be embedded the same way (rag.load_index_and_encoder)
    }
    index = VectorIndex.build(encoder, passages, args.output_dir, config, source=source, overwrite=args.overwrite)
    print(f"wrote a {config.kind} index of {len(index)} passages to {args.output_dir}")
    return 0


def _ask(args: argparse.Namespace) -> int:
    from unimae.generation import GenerationParams
    from unimae.rag import RAG, RAGAnswer, RAGConfig, load_index_and_encoder

    encoder, index = load_index_and_encoder(args.index, args.model, args.adapter, precision=args.precision)
    rag = RAG(encoder, index, RAGConfig(k=args.k, reuse_kv=not args.no_kv_reuse))
    answer = None
    for item in rag.stream(args.question, params=GenerationParams(max_new_tokens=args.max_new_tokens)):
        if isinstance(item, RAGAnswer):
            answer = item
        elif args.json:
            continue
        elif isinstance(item, list):
            for hit in item:
                print(f"[{hit.id}] ({hit.score:.3f}) {hit.text[:100]}{'...' if len(hit.text) > 100 else ''}")
            print()
        else:
            print(item, end="", flush=True)
    if args.json:
        print(json.dumps(answer.to_json(args.model or index.manifest.get("model", "unimae")), indent=2))
    else:
        print(f"\n\n({answer.prompt_tokens} prompt tokens, {answer.cached_tokens} from the query's embedding cache)")
    return 0
