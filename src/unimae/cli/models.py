"""``unimae models``: the offline models that ship on PyPI."""

from __future__ import annotations

import argparse

from unimae.cli.arguments import add_command


def add_models_parser(sub: argparse._SubParsersAction) -> None:
    add_command(sub, "models", "List the offline models that ship on PyPI.", _models)


def _models(args: argparse.Namespace) -> int:
    from unimae.models import OFFLINE_MODELS

    for name, entry in OFFLINE_MODELS.items():
        print(f"{name:22s} {entry.description}  [online: {entry.hub_id}]")
    return 0
