"""``unimae train``: a TrainConfig from defaults < --recipe < --config FILE < flags, then the trainer."""

from __future__ import annotations

import argparse
from pathlib import Path

from unimae.cli.arguments import add_command
from unimae.training.config import TrainConfig, add_config_arguments, resolve_config


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "train", "Train a UniMAE adapter (see --help for every recipe number).", _train)
    add_config_arguments(parser)
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true", help="Continue from the newest checkpoint in --output-dir.")
    start.add_argument(
        "--overwrite",
        action="store_true",
        help="Start a new run in an --output-dir that holds another one (its checkpoints and adapter are deleted).",
    )


def _train(args: argparse.Namespace) -> int:
    from unimae.training.trainer import train

    if args.resume:
        saved = Path(getattr(args, "output_dir", TrainConfig.output_dir)) / "config.json"
        if saved.is_file() and not getattr(args, "config", None):
            args.config = str(saved)  # resume with the run's own config; explicit flags still win
    config = resolve_config(
        {k: v for k, v in vars(args).items() if k not in ("command", "resume", "overwrite", "func")}
    )
    result = train(config, resume=args.resume, overwrite=args.overwrite)
    state = "interrupted at" if result.interrupted else "already finished at" if result.already_finished else "finished"
    print(f"\n{state} step {result.steps}/{config.steps} in {result.seconds:.0f} s")
    print(f"adapter:    {result.adapter_dir}")
    print(f"log:        {result.output_dir / 'log.jsonl'}")
    if result.interrupted:
        print(f"resume with: unimae train --resume --output-dir {result.output_dir}")
        return 130
    return 0
