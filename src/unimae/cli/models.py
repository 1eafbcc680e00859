"""``unimae models``: the offline models that ship on PyPI, and the released adapters."""

from __future__ import annotations

import argparse

from unimae.cli.arguments import add_command


def add_models_parser(sub: argparse._SubParsersAction) -> None:
    add_command(sub, "models", "List the offline models that ship on PyPI, and the released adapters.", _models)


def _models(args: argparse.Namespace) -> int:
    from unimae.models import OFFLINE_MODELS
    from unimae.release import available_releases, release_meta, resolve_adapter

    for name, entry in OFFLINE_MODELS.items():
        print(f"{name:22s} {entry.description}  [online: {entry.hub_id}]")
    for name in available_releases():
        base = release_meta(resolve_adapter(name)).base_model
        print(f"{name:22s} released adapter for {base} (--adapter {name})")
    return 0
