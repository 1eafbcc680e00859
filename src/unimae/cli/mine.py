"""``unimae mine``: hard negatives for supervised pairs, mined with the model itself (:mod:`unimae.data.mining`)."""

from __future__ import annotations

import argparse
import dataclasses

from unimae.cli.arguments import add_command, add_model_arguments
from unimae.data.mining import MiningConfig
from unimae.training.config import add_dataclass_arguments


def add_mine_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(
        sub,
        "mine",
        "Add a hard negative to each (query, positive) pair, mined by the model from its source's positives.",
        _mine,
    )
    add_model_arguments(parser)
    parser.add_argument("--data", required=True, help="Pairs as `unimae train --method contrastive --data` takes.")
    parser.add_argument("--output-dir", required=True, help="Where the mined <source>.jsonl files and mining.json go.")
    parser.add_argument(
        "--symmetric-sources", default="", help="Sources (file names without .jsonl) embedded without prompts."
    )
    parser.add_argument("--max-length", type=int, default=128, help="Tokens per text, as the training cuts them.")
    parser.add_argument("--batch-size", type=int, default=32, help="Texts per forward pass.")
    parser.add_argument(
        "--steps",
        type=int,
        default=0,
        help="Mine only the pairs the first N training batches draw (with --train-batch-size, --data-weights, "
        "--seed as `unimae train`); 0: every pair.",
    )
    parser.add_argument("--train-batch-size", type=int, default=256, help="With --steps: the training's --batch-size.")
    parser.add_argument("--data-weights", default="sqrt", help="With --steps: the training's --data-weights.")
    add_dataclass_arguments(parser, MiningConfig)


def _mine(args: argparse.Namespace) -> int:
    from unimae.data.mining import mine_pairs
    from unimae.encoder import Encoder

    config = MiningConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(MiningConfig)})
    encoder = Encoder.from_pretrained(
        args.model, adapter=args.adapter, max_length=args.max_length, precision=args.precision, device=args.device
    )
    symmetric = [s for s in args.symmetric_sources.split(",") if s.strip()]
    record = mine_pairs(
        args.data,
        args.output_dir,
        encoder,
        config,
        symmetric_sources=symmetric,
        steps=args.steps,
        batch_size=args.train_batch_size,
        weights=args.data_weights,
        embed_batch_size=args.batch_size,
        identity={"model": args.model, "adapter": args.adapter},
    )
    for name, stats in record["sources"].items():
        print(
            f"{name}: {stats['mined']} mined of {stats['asked']} asked ({stats['kept_given']} kept their own, "
            f"{stats['none_found']} found none), pool {stats['pool']}, {stats['seconds']} s"
        )
    return 0
