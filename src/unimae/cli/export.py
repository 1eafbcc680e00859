"""``unimae export``: merged weights as a Hugging Face or sentence-transformers model, or a llama.cpp GGUF;
or the adapter alone as a llama.cpp LoRA-adapter GGUF (``gguf-lora``) for a base GGUF."""

from __future__ import annotations

import argparse

from unimae.cli.arguments import ADAPTER_HELP, adapter_argument, add_command, add_model_argument
from unimae.export.base import FORMATS
from unimae.export.gguf import GGUF_TYPES


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub,
        "export",
        "Export merged weights as a Hugging Face, sentence-transformers or GGUF model, or the adapter as a "
        "llama.cpp LoRA GGUF.",
        _export,
    )
    add_model_argument(parser)
    parser.add_argument("--adapter", type=adapter_argument, help=ADAPTER_HELP)
    parser.add_argument(
        "--format",
        default="hf",
        choices=FORMATS,
        help="What to write (see unimae.export; gguf-lora: the adapter alone, for llama.cpp's --lora).",
    )
    parser.add_argument("--output", required=True, help="A new (or empty) directory; a new FILE.gguf for gguf*.")
    parser.add_argument(
        "--max-length", type=int, help="max_seq_length of the sentence-transformers export (default: 512)."
    )
    parser.add_argument(
        "--type",
        choices=GGUF_TYPES,
        help="Weight type of the gguf export (1-D tensors stay f32); f32 or f16 for gguf-lora (default: f16).",
    )


def _export(args: argparse.Namespace) -> int:
    from unimae.export import export

    gguf, st = args.format.startswith("gguf"), args.format == "sentence-transformers"
    for flag, value, used in (("--type", args.type, gguf), ("--max-length", args.max_length, st)):
        if value is not None and not used:
            raise ValueError(f"{flag} does nothing for --format {args.format}")
    args.type, args.max_length = args.type or "f16", args.max_length or 512
    options = {"gguf_type": args.type} if gguf else {}
    out = export(args.model, args.adapter, args.output, fmt=args.format, max_length=args.max_length, **options)
    if args.format == "gguf-lora":
        print(f"wrote gguf-lora ({args.type}) adapter to {out}; load it on a GGUF of {args.model}: --lora {out}")
    else:
        kind = f"gguf ({args.type})" if args.format == "gguf" else args.format
        print(f"wrote {kind} export to {out}")
    return 0
