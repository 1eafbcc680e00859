"""``unimae`` command line: train, mine, embed, generate, check, evaluate, compare, export, index, ask, serve, release,
rotation.

``unimae models`` lists the offline models and the releases.

One module per group of subcommands; each adds its parsers (``add_*_parser(sub)``) and handlers that
only turn arguments into one library call and print the result.
"""

from __future__ import annotations

import argparse
import logging
import sys

from unimae.cli.arguments import fill_model_default
from unimae.cli.embed import add_embed_parser, add_generate_parser
from unimae.cli.evaluate import add_check_parser, add_compare_parser, add_evaluate_parser
from unimae.cli.export import add_export_parser
from unimae.cli.index import add_ask_parser, add_index_parser
from unimae.cli.mine import add_mine_parser
from unimae.cli.models import add_models_parser
from unimae.cli.release import add_release_parser
from unimae.cli.rotation import add_rotation_parser
from unimae.cli.serve import add_serve_parser
from unimae.cli.train import add_train_parser
from unimae.generation.sampling import NonFiniteLogitsError

SUBCOMMANDS = (
    add_train_parser,
    add_mine_parser,
    add_embed_parser,
    add_generate_parser,
    add_check_parser,
    add_evaluate_parser,
    add_compare_parser,
    add_export_parser,
    add_index_parser,
    add_ask_parser,
    add_serve_parser,
    add_models_parser,
    add_release_parser,
    add_rotation_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unimae", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="Debug logging.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser in SUBCOMMANDS:
        add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        fill_model_default(args)
        return args.func(args)
    except (FileNotFoundError, FileExistsError, ValueError, ImportError, OSError, NonFiniteLogitsError) as err:
        print(f"unimae {args.command}: error: {err}", file=sys.stderr)
        return 2
