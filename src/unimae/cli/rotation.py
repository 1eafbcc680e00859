"""``unimae rotation``: fit an adapter's Matryoshka rotation (PCA of its embeddings; unimae.embedding.rotation)."""

from __future__ import annotations

import argparse

from unimae.cli.arguments import add_command, add_precision_argument


def add_rotation_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub,
        "rotation",
        "Fit the PCA rotation that makes an adapter's dimensions=k prefixes keep the most variance (written into "
        "the adapter folder; the full-size embedding is unchanged).",
        _rotation,
    )
    parser.add_argument("--model", help="The base model the adapter was trained on (default: its unimae.json's).")
    parser.add_argument("--adapter", required=True, help="The adapter folder (a release name is refused: copy it).")
    parser.add_argument(
        "--data",
        help="Pairs to embed (JSONL files, comma-separated, or a mixture file); default: the adapter's own training "
        "data (unimae.json).",
    )
    parser.add_argument("--pairs-per-source", type=int, default=350, help="Pairs drawn from each source (both texts).")
    parser.add_argument("--max-length", type=int, default=256, help="Tokens per text.")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    add_precision_argument(parser)  # of the embedding forward that the fit reads


def _rotation(args: argparse.Namespace) -> int:
    from pathlib import Path

    from unimae.adapter import adapter_meta, fit_adapter_rotation, forget_rotation, write_adapter_meta
    from unimae.data.pairs import sample_pair_texts
    from unimae.encoder import Encoder
    from unimae.release import find_release

    folder = Path(args.adapter)
    if not folder.is_dir():
        release = find_release(args.adapter)
        if release:  # a name resolves elsewhere; this command writes into the folder it is given
            raise FileNotFoundError(
                f"--adapter {args.adapter} is a release ({release}), which carries its rotation already; "
                f"`unimae rotation` writes into the adapter folder, so to fit another, copy it first: "
                f"cp -r {release} my-adapter && unimae rotation --adapter my-adapter"
            )
        raise FileNotFoundError(f"--adapter {args.adapter}: no such adapter folder")
    meta = adapter_meta(folder)
    data, model = args.data or meta.training_config.get("data"), args.model or meta.base_model
    if not data:
        raise ValueError(f"{folder}'s unimae.json records no training data: pass --data FILE.jsonl[,...]")
    if not model:
        raise ValueError(f"{folder}'s unimae.json names no base model: pass --model")
    texts = sample_pair_texts(data, args.pairs_per_source, args.seed)
    forget_rotation(folder)  # refitted from the unrotated vectors (a missing or damaged file is no obstacle)
    try:
        encoder = Encoder.from_pretrained(
            model, adapter=str(folder), max_length=args.max_length, precision=args.precision
        )
        if len(texts) < encoder.embedding_dim:
            raise ValueError(
                f"{len(texts)} texts cannot fit a rotation of {encoder.embedding_dim} coordinates: "
                "raise --pairs-per-source"
            )
        key, kept = fit_adapter_rotation(encoder, folder, texts, args.batch_size)
    except BaseException:
        write_adapter_meta(folder, meta)  # a fit that did not finish: the adapter keeps the rotation it had
        raise
    shares = ", ".join(f"{k}: {kept[k - 1]:.1%}" for k in (64, 128, 256) if k < len(kept))
    print(
        f"wrote {folder}/matryoshka_rotation.safetensors (rotation {key}, {len(texts)} texts); variance kept by "
        f"the first k principal coordinates: {shares}"
    )
    return 0
