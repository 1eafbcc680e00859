"""``unimae index`` (embed a corpus into a vector index) and ``unimae ask`` (RAG over it, same model)."""

from __future__ import annotations

import argparse
import json

from unimae.cli.arguments import add_command, add_model_arguments
from unimae.cli.embed import utf8_argument
from unimae.retrieval.index import INDEX_KINDS, RESCORERS

STORES = ("memory", "disk")
ENGINES = ("local", "ray")


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
        "(1/32 in RAM), candidates rescored with the float query (--rescore).",
    )
    parser.add_argument(
        "--rescore",
        choices=RESCORERS,
        help="--kind binary: rescore the Hamming candidates with the float query against int8 codes kept on disk "
        "(int8, the default: D more bytes a vector on disk, near-float quality) or against their sign bits (bits).",
    )
    parser.add_argument("--dimensions", type=int, help="Index the first k coordinates (Matryoshka adapters).")
    parser.add_argument("--shard-size", type=int, default=256, help="Passages per saved shard (the resume unit).")
    parser.add_argument("--batch-size", type=int, default=16, help="Passages per forward pass.")
    parser.add_argument("--max-length", type=int, default=512, help="Tokens per passage, EOS included.")
    parser.add_argument("--overwrite", action="store_true", help="Rebuild an index folder made from other data.")
    add_store_arguments(parser)
    add_engine_arguments(parser)


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        default="memory",
        choices=STORES,
        help="memory = the FAISS index (--kind) in RAM; disk = IVF-PQ codes in RAM, exact rerank from vectors on "
        "disk (a corpus larger than RAM, from a .jsonl file; `ask` and `serve` read it the same way).",
    )
    parser.add_argument("--nlist", type=int, help="--store disk: IVF cells (default about 4*sqrt(N)).")
    parser.add_argument("--nprobe", type=int, help="--store disk: cells searched per query, at least (default 16).")
    parser.add_argument(
        "--target-recall", type=float, help="--store disk: raise nprobe at build until recall@10 reaches it (0.95)."
    )
    parser.add_argument("--pq-m", type=int, help="--store disk: PQ code bytes per vector (default: near D/12).")
    parser.add_argument("--rerank", type=int, help="--store disk: candidates re-scored exactly (default 200).")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        default="local",
        choices=ENGINES,
        help="local = embed in this process; ray = a Ray Data pool of encoders (pip install 'unimae[ray]').",
    )
    parser.add_argument("--address", help="--engine ray: the Ray cluster to join (default: start a local Ray).")
    parser.add_argument("--workers", type=int, default=2, help="--engine ray: encoder actors, one model each.")
    parser.add_argument("--num-gpus-per-worker", type=float, default=0, help="--engine ray: GPUs per actor.")
    parser.add_argument("--num-cpus-per-worker", type=float, default=1, help="--engine ray: CPUs per actor.")
    parser.add_argument(
        "--passages-per-job",
        type=int,
        default=100_000,
        help="--engine ray: missing passages per Ray Data job (the texts the driver holds at a time; each job "
        "loads the workers' encoders again).",
    )


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
    from unimae.adapter import load_record
    from unimae.data.corpus import load_passages
    from unimae.data.passage_file import open_passages

    config = _index_config(args)
    # a disk store reads a .jsonl corpus on demand (its texts never all in RAM); the memory store holds them anyway
    load = open_passages if args.store == "disk" else load_passages
    passages = load(args.corpus, field=args.field, id_field=args.id_field)
    print(f"{len(passages)} passages from {args.corpus}")
    source = {**load_record(args.model, args.adapter), "corpus": args.corpus}
    # the build adds whether the LoRA was merged: queries must be embedded the same way (load_index_and_encoder)
    build = _build_on_ray if args.engine == "ray" else _build_here
    index = build(args, passages, config, source)
    print(f"wrote a {index.kind} index of {len(index)} passages to {args.output_dir}")
    return 0


def _index_config(args: argparse.Namespace):
    """The IndexConfig (--store memory) or DiskIndexConfig (--store disk) the flags ask for."""
    from unimae.retrieval.disk_index import DiskIndexConfig
    from unimae.retrieval.index import IndexConfig

    common = {"shard_size": args.shard_size, "batch_size": args.batch_size, "dimensions": args.dimensions}
    names = ("nlist", "nprobe", "pq_m", "rerank", "target_recall")
    disk = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.store == "memory":
        if disk:
            raise ValueError(f"--{', --'.join(disk).replace('_', '-')} set the disk store: add --store disk")
        if args.rescore and args.kind != "binary":
            raise ValueError(
                f"--rescore picks how a binary index rescores; --kind {args.kind} has no sign bits to rescore"
            )
        return IndexConfig(kind=args.kind, **({"rescore": args.rescore} if args.rescore else {}), **common)
    if args.kind != "flat" or args.rescore:
        raise ValueError("--kind picks the FAISS index of --store memory; --store disk is IVF-PQ with exact rerank")
    return DiskIndexConfig(**common, **disk)


def _build_here(args: argparse.Namespace, passages: list, config, source: dict):
    from unimae.encoder import Encoder
    from unimae.retrieval.disk_index import DiskIndex, DiskIndexConfig
    from unimae.retrieval.index import VectorIndex

    encoder = Encoder.from_pretrained(
        args.model, adapter=args.adapter, max_length=args.max_length, precision=args.precision, device=args.device
    )
    store = DiskIndex if isinstance(config, DiskIndexConfig) else VectorIndex
    return store.build(encoder, passages, args.output_dir, config, source=source, overwrite=args.overwrite)


def _build_on_ray(args: argparse.Namespace, passages: list, config, source: dict):
    from unimae.retrieval.ray_index import EncoderLoad, RayConfig, build_on_ray

    load = EncoderLoad(
        args.model, adapter=args.adapter, max_length=args.max_length, precision=args.precision, device=args.device
    )
    ray_config = RayConfig(
        address=args.address,
        workers=args.workers,
        num_gpus_per_worker=args.num_gpus_per_worker,
        num_cpus_per_worker=args.num_cpus_per_worker,
        passages_per_job=args.passages_per_job,
    )
    return build_on_ray(load, passages, args.output_dir, config, source, args.overwrite, ray_config)


def _ask(args: argparse.Namespace) -> int:
    from unimae.generation.sampling import GenerationParams
    from unimae.retrieval.rag import RAG, RAGAnswer, RAGConfig, load_index_and_encoder

    question = utf8_argument(args.question, "the question")
    encoder, index = load_index_and_encoder(
        args.index, args.model, args.adapter, precision=args.precision, device=args.device
    )
    rag = RAG(encoder, index, RAGConfig(k=args.k, reuse_kv=not args.no_kv_reuse))
    answer = None
    for item in rag.stream(question, params=GenerationParams(max_new_tokens=args.max_new_tokens)):
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
