"""``unimae release``: a trained adapter into ``releases/<name>/`` (bf16 weights, spec, generated model card)."""

from __future__ import annotations

import argparse
from pathlib import Path

from unimae.cli.arguments import add_command


def add_release_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub,
        "release",
        "Write a released adapter (bf16 LoRA, adapter_config.json, unimae.json, model card) into releases/<name>/.",
        _release,
    )
    parser.add_argument("--adapter", help="The adapter folder to release (not needed with --card-only).")
    parser.add_argument("--name", required=True, help="Release name, e.g. unimae-gemma3-270m-retriever.")
    parser.add_argument("--root", default=None, help="Folder of releases (default: the repository's releases/).")
    parser.add_argument("--dev-results", required=True, help="The released adapter's dev-suite folder (mteb JSONs).")
    parser.add_argument("--summary", help="`unimae evaluate summary` JSON with the reference rows.")
    parser.add_argument("--generation", help="generation.json of the adapter (unimae evaluate generation).")
    parser.add_argument("--base-generation", help="generation.json of the base model.")
    parser.add_argument("--rag", help="The RAG benchmark JSON.")
    parser.add_argument(
        "--repetition", action="append", default=[], help="A greedy-repetition JSON (repeat: one per prompt set)."
    )
    parser.add_argument("--table", action="append", default=[], help="More summary JSONs to show (repeat).")
    parser.add_argument("--train-log", action="append", default=[], help="log.jsonl of each training sitting.")
    parser.add_argument("--command", default="", help="The recipe command that trained it (for the card).")
    parser.add_argument("--card-only", action="store_true", help="Only regenerate the card of an existing release.")


def _release(args: argparse.Namespace) -> int:
    from unimae.files import atomic_write_text
    from unimae.release import (
        REPOSITORY_RELEASES,
        check_release_name,
        make_release,
        record_training,
        release_meta,
        release_revisions,
        source_dtype,
    )
    from unimae.release_card import CardInputs, build_card, training_time

    check_release_name(args.name)
    root = Path(args.root) if args.root else REPOSITORY_RELEASES
    optional = lambda value: Path(value) if value else None  # noqa: E731
    inputs = CardInputs(
        name=args.name,
        release=root / args.name,
        dev_results=Path(args.dev_results),
        summary=optional(args.summary),
        generation=optional(args.generation),
        base_generation=optional(args.base_generation),
        rag=optional(args.rag),
        repetition=[Path(r) for r in args.repetition],
        extra_tables=[Path(t) for t in args.table],
        train_logs=[Path(t) for t in args.train_log],
        command=args.command,
    )
    if args.card_only:
        meta = release_meta(inputs.release)
        inputs.source_dtype = source_dtype(inputs.release)
        card = build_card(inputs, meta, release_revisions(inputs.release))
        atomic_write_text(inputs.release / "README.md", card)
        record_training(inputs.release, training_time(inputs, meta))  # known now: later cards need no logs
        print(f"wrote the model card of {inputs.release}")
        return 0
    if not args.adapter:
        raise ValueError("--adapter is needed to write a release (or pass --card-only)")
    from unimae.adapter import adapter_meta

    meta = adapter_meta(args.adapter)
    inputs.source_dtype = source_dtype(args.adapter)
    card = build_card(inputs, meta, release_revisions(args.adapter))
    out = make_release(args.adapter, args.name, root, card=card, training=training_time(inputs, meta))
    print(f"wrote release {out}")
    return 0
