"""Options shared by several subcommands. Choice lists come from the registries, never spelled out here."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from unimae.embedding.pooling import POOLINGS
from unimae.runtime.precision import DEVICE_HELP, INFERENCE_PRECISIONS, PRECISIONS, check_device_name

DEFAULT_MODEL = "smollm2-135m"
Handler = Callable[[argparse.Namespace], int]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default once: not where the help already states it (the dataclass flags of
    :func:`unimae.training.config.add_dataclass_arguments` do), nor for an unset (None) or off (False) default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default:" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


def add_command(
    sub: argparse._SubParsersAction, name: str, help: str, handler: Handler | None = None
) -> argparse.ArgumentParser:
    """A subcommand parser that runs ``handler(args)``."""
    parser = sub.add_parser(name, help=help, formatter_class=HelpFormatter)
    if handler is not None:
        parser.set_defaults(func=handler)
    return parser


def pooling_choices() -> list[str]:
    return ["auto", *POOLINGS]


def add_pooling_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pooling",
        default="auto",
        choices=pooling_choices(),
        help="auto = what the adapter was trained for (eos for UniMAE, mean for MNTP, summary for GEM; else eos).",
    )


def add_precision_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--precision", default="auto", choices=PRECISIONS, help="auto = bf16 where the CPU/GPU runs it natively."
    )


def inference_precisions(parser: argparse.ArgumentParser) -> None:
    """Let ``--precision`` take the inference precisions too (``bf16-decode``, ``f16-decode``, ``int8-decode``,
    ``int8``; see :mod:`unimae.runtime.precision`)."""
    action = parser._option_string_actions["--precision"]
    action.choices = INFERENCE_PRECISIONS
    action.help = (
        "auto = bf16 where the CPU/GPU runs it natively, else (x86 CPU) f16-decode: fp32 embeddings, fp16 weights "
        "in the decode steps (bf16-decode on other CPUs); int8-decode: int8 weights and activations in the decode "
        "steps (opt-in: rounds the generated text's distribution most); int8 = int8-decode and int8 embedding "
        "forwards too (opt-in: changes the embeddings)."
    )


def device_argument(value: str) -> str:
    """``--device``: auto, cpu, cuda or cuda:N (whether that GPU exists is checked when the model loads)."""
    try:
        return check_device_name(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def adapter_argument(value: str) -> str:
    """``--adapter``: a folder, or the name of a released adapter (``unimae.release``); anything else is passed on
    as given, and loading it names the problem."""
    from unimae.release import find_release

    return find_release(value) or value


ADAPTER_HELP = "Adapter folder written by `unimae train`, or a release name (see `unimae models`)."
MODEL_HELP = (
    f"Hub id, directory, .gguf or offline short name (default: the base model --adapter was trained on, as its "
    f"unimae.json records; without an adapter {DEFAULT_MODEL})."
)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """``--model``, defaulting to the adapter's base model (:func:`fill_model_default` sets it after parsing)."""
    parser.add_argument("--model", help=MODEL_HELP)
    parser.set_defaults(model_from_adapter=True)


def default_model(adapter: str | None) -> str:
    """The model ``adapter`` was trained on (its unimae.json's ``base_model``), else :data:`DEFAULT_MODEL`; an
    ``adapter`` that is no adapter folder is an error here, before any model loads."""
    from unimae.adapter import adapter_folder, adapter_meta

    return (adapter_meta(adapter_folder(adapter)).base_model if adapter else "") or DEFAULT_MODEL


def fill_model_default(args: argparse.Namespace) -> None:
    """Give ``args.model`` its default when the command's ``--model`` came from :func:`add_model_argument`."""
    if getattr(args, "model_from_adapter", False) and args.model is None:
        args.model = default_model(args.adapter)


def add_model_arguments(parser: argparse.ArgumentParser, from_index: bool = False) -> None:
    """``--model``, ``--adapter``, ``--precision``, ``--device``; ``from_index``: model and adapter default to the
    index's."""
    if from_index:
        parser.add_argument("--model", help="Default: the model the index was built with.")
        parser.add_argument("--adapter", type=adapter_argument, help="Default: the adapter the index was built with.")
    else:
        add_model_argument(parser)
        parser.add_argument("--adapter", type=adapter_argument, help=ADAPTER_HELP)
    add_precision_argument(parser)
    parser.add_argument("--device", default="auto", type=device_argument, help=DEVICE_HELP)


def add_data_dir_argument(parser: argparse.ArgumentParser, what: str, required: bool = False) -> None:
    """``--data-dir``: a local data folder in the evaluation data layout (docs/evaluation.md), by default
    ``$UNIMAE_DATA``; ``required``: needed unless that variable is set."""
    default = os.environ.get("UNIMAE_DATA") or None
    parser.add_argument(
        "--data-dir",
        default=default,
        required=required and default is None,
        help=f"{what} (default: $UNIMAE_DATA{', here ' + default if default else ', unset'}).",
    )
