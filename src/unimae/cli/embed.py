"""``unimae embed`` and ``unimae generate``: the two jobs of one model.

Text from the command line or standard input must be UTF-8: anything else is one sentence naming the argument
or line and the byte, not a tokenizer traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from unimae.cli.arguments import add_command, add_model_arguments, add_pooling_argument, inference_precisions
from unimae.files import atomic_write, check_writable


def add_embed_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "embed", "Embed texts (arguments, a file, or stdin; one per line).", _embed)
    add_model_arguments(parser)
    inference_precisions(parser)
    parser.add_argument("texts", nargs="*", help="Texts to embed; if none, read --input or stdin.")
    parser.add_argument(
        "--input",
        help="A .txt (one text per line), .jsonl (--field of each line) or .parquet file, or '-' for stdin "
        "(one text per line). Every text is one output row, empty ones too (embedded as BOS/EOS).",
    )
    parser.add_argument("--field", default="text", help="Text field of a .jsonl / .parquet --input.")
    parser.add_argument(
        "--output", help="Write a .npy array to this file (folders created) instead of printing JSON lines."
    )
    add_pooling_argument(parser)
    parser.add_argument("--batch-size", type=int, default=32, help="Texts per forward pass.")
    parser.add_argument("--max-length", type=int, default=512, help="Tokens per text, EOS included.")
    parser.add_argument("--normalize", action="store_true", help="L2-normalize the embeddings.")
    parser.add_argument(
        "--prompt-name",
        help="Embed with the adapter's prompt of this name: 'query' for search queries, 'document' for passages.",
    )
    parser.add_argument("--prompt", help="Embed after this text prefix (wins over --prompt-name).")
    parser.add_argument("--dimensions", type=int, help="Keep the first k coordinates (Matryoshka).")
    parser.add_argument(
        "--quantize",
        choices=("int8", "uint8", "binary", "ubinary"),
        help="Quantize the vectors (sentence-transformers): int8/uint8 with per-dimension ranges from --calibration "
        "or these texts' own embeddings; binary/ubinary packs sign bits (D / 8 bytes).",
    )
    parser.add_argument(
        "--calibration",
        help="A .npy of float embeddings (e.g. `unimae embed --output` of a corpus sample, full size or as "
        "--dimensions/--normalize finish them) whose per-dimension ranges scale --quantize int8/uint8, so codes "
        "of separate runs compare.",
    )


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "generate", "Generate text with the same model (and adapter).", _generate)
    add_model_arguments(parser)
    inference_precisions(parser)
    parser.add_argument("prompt", help="Text to continue.")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="Tokens to generate at most.")
    parser.add_argument("--chat", action="store_true", help="Wrap the prompt in the tokenizer's chat template.")
    parser.add_argument("--no-adapter", action="store_true", help="Generate with the adapter disabled.")


def read_texts(texts: list[str], source: str | None, field: str = "text") -> list[str]:
    """The texts to embed: ``texts`` if any, else the file ``source`` (read by the corpus readers, whose
    errors name the file and line), else standard input, one text per line."""
    if texts:
        return [utf8_argument(text, f"text argument {i}") for i, text in enumerate(texts, 1)]
    if source and source != "-":
        from unimae.data.corpus import load_texts

        if not Path(source).is_file():
            raise FileNotFoundError(f"input file {source} does not exist")
        return load_texts(source, field, keep_empty=True)
    return stdin_lines()


def stdin_lines() -> list[str]:
    """Standard input, one text per line (``\\n``, ``\\r\\n`` or ``\\r``, as text mode splits it), decoded as UTF-8;
    a line that is not UTF-8 is a ValueError naming it and its first bad byte."""
    stream = getattr(sys.stdin, "buffer", None)  # a test's StringIO has none
    raw = stream.read() if stream is not None else sys.stdin.read().encode("utf-8", "surrogateescape")
    lines = []
    for number, line in enumerate(raw.splitlines(), 1):
        try:
            lines.append(line.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ValueError(
                f"line {number} of standard input is not UTF-8 text (byte 0x{line[err.start]:02x} at byte "
                f"{err.start}); convert it first, e.g. `iconv -f latin1 -t utf-8`"
            ) from None
    return lines


def utf8_argument(text: str, where: str) -> str:
    """``text``, a command-line argument, if it is valid UTF-8; else a ValueError naming ``where`` and the byte
    (Python hands bytes it cannot decode over as lone surrogates U+DC80..U+DCFF, which tokenizers refuse)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        bad = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise ValueError(
            f"{where} is not UTF-8 text ({bad} at character {err.start}); pass UTF-8 text "
            "(convert with `iconv -t utf-8`, or set a UTF-8 locale)"
        ) from None
    return text


def _embed(args: argparse.Namespace) -> int:

    from unimae.encoder import Encoder

    output = _output_path(args.output)
    texts = read_texts(args.texts, args.input, args.field)
    if not texts:
        raise ValueError("no texts to embed (standard input was empty): pass texts, --input FILE, or lines on stdin")
    prompt = utf8_argument(args.prompt, "--prompt") if args.prompt else args.prompt
    encoder = Encoder.from_pretrained(
        args.model,
        adapter=args.adapter,
        pooling=args.pooling,
        max_length=args.max_length,
        precision=args.precision,
        device=args.device,
    )
    vectors = encoder.encode(
        texts,
        batch_size=args.batch_size,
        normalize=args.normalize,
        prompt_name=args.prompt_name,
        prompt=prompt,
        dimensions=args.dimensions,
        precision=args.quantize or "float32",
        calibration_embeddings=_calibration(args),
    )
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(output, lambda tmp: _save_npy(tmp, vectors))
        print(f"wrote {vectors.shape[0]} x {vectors.shape[1]} {vectors.dtype} embeddings to {output}")
    else:
        for row in vectors:
            print(json.dumps(row.tolist() if args.quantize else [round(float(x), 6) for x in row]))
    return 0


def _output_path(output: str | None) -> Path | None:
    """``--output`` checked before the model loads: not a folder, in a folder that can be written (created if
    missing), so a bad path fails before the embedding, not after it."""
    if not output:
        return None
    path = Path(output)
    if path.is_dir():
        raise IsADirectoryError(f"--output {path} is a folder; pass a file name such as {path / 'vectors.npy'}")
    check_writable(path.parent)
    return path


def _save_npy(path: Path, vectors) -> None:
    """The .npy array at exactly ``path`` (``np.save`` given a name would add ``.npy`` to one without it)."""
    import numpy as np

    with open(path, "wb") as handle:
        np.save(handle, vectors)


def _calibration(args: argparse.Namespace):
    """The --calibration vectors (None without the flag); a flag without --quantize int8/uint8 is an error."""
    import numpy as np

    if not args.calibration:
        return None
    if args.quantize not in ("int8", "uint8"):
        raise ValueError("--calibration scales --quantize int8 or uint8; it does nothing otherwise")
    try:
        return np.load(args.calibration, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise ValueError(f"--calibration {args.calibration}: not a readable .npy array ({err})") from None


def _generate(args: argparse.Namespace) -> int:
    from unimae.encoder import Encoder

    prompt = utf8_argument(args.prompt, "the prompt")
    adapter = None if args.no_adapter else args.adapter
    encoder = Encoder.from_pretrained(args.model, adapter=adapter, precision=args.precision, device=args.device)
    print(encoder.generate(prompt, max_new_tokens=args.max_new_tokens, chat=args.chat))
    return 0
