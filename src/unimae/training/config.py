"""Training configuration: :class:`TrainConfig`, every number of the paper recipe a field, with the run's method's
:class:`MethodOptions` nested in it.

Precedence when resolving a run's configuration (later wins):
defaults < ``--recipe`` < ``--config FILE`` (JSON or YAML) < explicit command-line flags.
The resolved configuration is saved as ``config.json`` next to every output, the method's options under ``options``
(as peft nests ``LoftQConfig`` in ``LoraConfig``); :meth:`TrainConfig.from_dict` also reads the flat files of earlier
versions, which named every method's options beside the rest.

This module names no method. Each one (``unimae.training.methods``) subclasses :class:`MethodOptions` with its fields,
its values under a recipe and its checks, and registers the class in :data:`METHOD_OPTIONS` when ``unimae`` is imported
(``unimae/__init__.py`` imports the trainer, which imports the methods).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from unimae.files import atomic_write_json, read_json
from unimae.runtime.precision import DEVICE_HELP, PRECISIONS, check_device_name

logger = logging.getLogger(__name__)

# Recipes override the defaults (which are the CPU recipe). The paper recipe is App. C of the UniMAE paper: global
# batch 32, max length 512, 100 steps, LoRA r=16/alpha=32, lr 1e-4 constant. A method's own numbers under a recipe
# are in its options' ``recipes``.
RECIPES: dict[str, dict[str, Any]] = {
    "cpu": {},
    "paper": {"batch_size": 32, "micro_batch_size": 8, "max_length": 512},
}


def choice_field(default: str, choices, help_text: str):
    """A dataclass field with one of ``choices`` (a tuple, or a callable returning the list) and help."""
    return field(default=default, metadata={"help": help_text, "choices": choices})


def check_choices(config) -> None:
    """ValueError for a field of the dataclass ``config`` whose value is not among its ``choices``."""
    for f in fields(config):
        choices = f.metadata.get("choices")
        if choices is not None:
            allowed = choices() if callable(choices) else choices
            if getattr(config, f.name) not in allowed:
                raise ValueError(f"{f.name} must be one of {list(allowed)}, got {getattr(config, f.name)!r}")


@dataclass
class MethodOptions:
    """Base of a training method's options, nested in :class:`TrainConfig` as ``options``.

    A method's subclass (in its module of ``unimae.training.methods``) holds its fields, each a ``--flag`` named after
    the field (a field that several methods' options share is one flag), its values under a ``--recipe`` and its
    checks (:meth:`check`, which :meth:`TrainConfig.validate` calls)."""

    recipes: ClassVar[dict[str, dict[str, Any]]] = {}  # --recipe name -> values of these fields
    full_batch_recipes: ClassVar[tuple[str, ...]] = ()  # recipes whose micro-batch is the whole batch (when not given)

    def check(self, config: TrainConfig, world_size: int) -> None:
        """ValueError naming the flag of a wrong value (``config``: the rest of the run, on ``world_size``
        processes); a warning for a poor one. Subclasses call ``super().check`` first."""
        check_choices(self)


METHOD_OPTIONS: dict[str, type[MethodOptions]] = {}  # --method name -> its options (filled by register_method)


def method_names() -> list[str]:
    """The registered training methods."""
    return sorted(METHOD_OPTIONS)


def options_class(method: str) -> type[MethodOptions]:
    """The options class of ``--method method``."""
    if method not in METHOD_OPTIONS:
        raise ValueError(f"unknown method {method!r}; choose one of {method_names()}")
    return METHOD_OPTIONS[method]


@dataclass
class TrainConfig:
    """Configuration of a training run: what every method shares, and the method's own ``options``.

    ``options`` is an instance of the method's :class:`MethodOptions` subclass, a dict of its fields, or None for
    its defaults; :meth:`from_dict` builds a config from flag-named values.
    """

    model: str = field(
        default="smollm2-135m",
        metadata={
            "help": "Hugging Face model id, local model directory, .gguf file, or an offline "
            "short name (smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b)."
        },
    )
    data: str = field(
        default="enwiki-gensim",
        metadata={
            "help": "Training text: 'enwiki-gensim' (default corpus), a .txt/.jsonl/.parquet file, "
            "or a Hugging Face datasets name (online)."
        },
    )
    output_dir: str = field(
        default="runs/unimae", metadata={"help": "Where the run writes adapter, logs, checkpoints."}
    )
    recipe: str = field(default="cpu", metadata={"help": "Preset: 'cpu' (default, ~18 min on 2 cores) or 'paper'."})
    method: str = choice_field(
        "unimae", lambda: method_names(), "Training method (unimae.training.methods; see the choices)."
    )
    init_adapter: str = field(
        default="",
        metadata={"help": "Start from this trained adapter (merged into the base): a second stage on top of a first."},
    )
    init_lora: str = field(
        default="",
        metadata={
            "help": "Start this run's LoRA from this trained adapter's LoRA weights (same r, alpha and target "
            "modules; any method, from step 0), e.g. the UniMAE stage then --method contrastive: the two stages "
            "stay one LoRA (a release is one), and the first stage's update is kept exact rather than merged "
            "into bf16 weights as --init-adapter does."
        },
    )
    continue_adapter: str = field(
        default="",
        metadata={
            "help": "Train this adapter's own LoRA further, from the step it holds (its unimae.json's "
            "trained_steps) to --steps, with the same data order: a run continued where its checkpoints are "
            "gone (another machine, a release). The optimizer starts afresh (Adam's moments are not in an "
            "adapter), so --lr and the contrastive --lr-schedule may differ from its run; its init adapter, if "
            "any, is merged as in its own run. Needs a new --output-dir."
        },
    )

    steps: int = field(default=100, metadata={"help": "Optimizer steps (paper: 100)."})
    batch_size: int = field(default=16, metadata={"help": "Global batch size in texts (paper: 32)."})
    micro_batch_size: int = field(
        default=8, metadata={"help": "Texts per forward pass per process; the rest is gradient accumulation."}
    )
    max_length: int = field(default=128, metadata={"help": "Max tokens per text, EOS included (paper: 512)."})
    lr: float = field(
        default=1e-4,
        metadata={"help": "AdamW learning rate (paper: 1e-4), constant unless the method's options schedule it."},
    )
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (paper: not stated)."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm; 0 turns it off."})

    mask_token: str = field(
        default="auto",
        metadata={
            "help": "Mask token of the methods that mask input tokens: 'auto' = the tokenizer's mask token, else "
            "its last special token that is not BOS/EOS/PAD/UNK and not used by the chat template."
        },
    )

    lora_r: int = field(default=16, metadata={"help": "LoRA rank (paper: 16)."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (paper: 32)."})
    lora_dropout: float = field(
        default=0.0, metadata={"help": "LoRA dropout (paper: not stated; 0 makes a CPU step faster)."}
    )
    lora_target_modules: str = field(
        default="all-linear",
        metadata={
            "help": "Modules that get LoRA: 'all-linear' (attention and MLP projections) or comma-separated module "
            "names (q_proj,v_proj: each matches modules whose name ends with it, as peft's list form)."
        },
    )
    full_params: bool = field(default=False, metadata={"help": "Train all parameters instead of LoRA."})

    precision: str = choice_field(
        "auto",
        PRECISIONS,
        "'auto' (bf16 autocast where the CPU/GPU supports it), 'bf16' or 'fp32'.",
    )
    ce_chunk_size: int = field(
        default=1024, metadata={"help": "Rows per output-head cross-entropy chunk (no full BxTxV logits)."}
    )
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations (long texts)."})
    threads: int = field(default=0, metadata={"help": "torch threads per process (0: torch's default)."})
    device: str = field(
        default="auto",
        metadata={"help": DEVICE_HELP + " Under torchrun / accelerate launch each process takes its local GPU."},
    )

    seed: int = field(default=0, metadata={"help": "Seed for data order, masks, init."})
    save_every: int = field(default=25, metadata={"help": "Checkpoint every N steps (0: only at the end)."})
    merge: bool = field(default=False, metadata={"help": "Also export a merged Hugging Face model directory."})

    options: MethodOptions | None = field(
        default=None,
        metadata={
            "help": "The --method's own options: its MethodOptions (unimae.training.methods), a dict of their fields, "
            "or None for their defaults.",
            "nested": True,
        },
    )

    def __post_init__(self):
        kind = options_class(self.method)
        if self.options is None:
            self.options = kind()
        elif isinstance(self.options, Mapping):
            unknown = sorted(set(self.options) - {f.name for f in fields(kind)})
            if unknown:
                raise ValueError(f"--method {self.method} has no options {unknown}")
            self.options = kind(**self.options)
        elif not isinstance(self.options, kind):
            raise ValueError(f"--method {self.method} takes {kind.__name__}, got {type(self.options).__name__}")

    def validate(self, world_size: int = 1) -> int:
        """Check the numbers (the method's options check theirs) and return the gradient-accumulation steps per
        process."""
        if self.recipe not in RECIPES:
            raise ValueError(f"unknown recipe {self.recipe!r}; choose one of {sorted(RECIPES)}")
        check_choices(self)
        check_device_name(self.device)
        if self.max_length < 4:
            raise ValueError(f"max_length must be at least 4 tokens, got {self.max_length}")
        least = {"steps": 1, "save_every": 0, "threads": 0, "ce_chunk_size": 1, "batch_size": 1, "micro_batch_size": 1}
        for name, value in least.items():
            if getattr(self, name) < value:
                raise ValueError(f"{name} must be >= {value}, got {getattr(self, name)}")
        if self.init_adapter and self.init_lora:
            raise ValueError("--init-adapter and --init-lora are two ways to start from a stage: pass one")
        if self.full_params and (self.init_lora or self.continue_adapter):
            raise ValueError("--init-lora and --continue-adapter load LoRA weights; --full-params trains no LoRA")
        if not self.full_params and not lora_targets(self.lora_target_modules):
            raise ValueError("--lora-target-modules names no module: pass 'all-linear' or names like q_proj,v_proj")
        out = Path(self.output_dir).resolve()
        for flag, path in (
            ("--init-adapter", self.init_adapter),
            ("--init-lora", self.init_lora),
            ("--continue-adapter", self.continue_adapter),
        ):
            if path and Path(path).resolve().is_relative_to(out):
                raise ValueError(
                    f"{flag} {path} is inside --output-dir {self.output_dir}, which this run overwrites (and reads "
                    "again when it saves); give the new stage its own --output-dir"
                )
        self.options.check(self, world_size)  # first: a method's own reason to refuse the split is the clearer one
        per_step = self.micro_batch_size * world_size
        if self.batch_size % per_step:
            raise ValueError(
                f"batch_size {self.batch_size} is not a multiple of micro_batch_size x processes "
                f"({self.micro_batch_size} x {world_size}); change --batch-size or --micro-batch-size"
            )
        return self.batch_size // per_step

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``config.json``, ``training_config`` in ``unimae.json``): ``options`` nested."""
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Every value by its flag's name (the options beside the rest)."""
        return flat_values(self.to_dict())

    def save(self, path: str | Path) -> None:
        """Write the config as JSON, atomically (a crash leaves the old file or the new one, never half)."""
        atomic_write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainConfig:
        """A config from :meth:`to_dict`'s form or from flag-named values: the CLI's, and the ``config.json`` of
        earlier versions, which named every method's options beside the rest (the other methods' are dropped).
        Keys that are no field of any method are an error."""
        flat = flat_values(values)
        kind = options_class(flat.get("method", cls.method))
        unknown = sorted(set(flat) - set(flag_fields()))
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known keys: {sorted(flag_fields())}")
        ours = {f.name for f in fields(kind)}
        options = kind(**{k: v for k, v in flat.items() if k in ours})
        return cls(**{k: v for k, v in flat.items() if k in _own_fields()}, options=options)


def flat_values(data: Mapping[str, Any]) -> dict[str, Any]:
    """A saved config's values by flag name: its nested ``options`` merged into the rest (the files of earlier
    versions name them there already)."""
    return {**{k: v for k, v in data.items() if k != "options"}, **(data.get("options") or {})}


def _own_fields() -> dict[str, Field]:
    """TrainConfig's own fields by name (the options aside): what every method shares."""
    return {f.name: f for f in fields(TrainConfig) if not f.metadata.get("nested")}


def flag_fields() -> dict[str, Field]:
    """The field of every flag by name: TrainConfig's own, then every method's options."""
    return {**_own_fields(), **option_fields()}


def option_fields() -> dict[str, Field]:
    """Every registered method's option fields by name (a name several methods share: the first's field)."""
    found: dict[str, Field] = {}
    for name in method_names():
        for f in fields(METHOD_OPTIONS[name]):
            found.setdefault(f.name, f)
    return found


def flag_defaults(method: str) -> dict[str, Any]:
    """The defaults of a ``--method method`` run by flag name (``method`` itself: TrainConfig's default)."""
    own = {name: f.default for name, f in _own_fields().items()}
    return {**own, **dataclasses.asdict(options_class(method)())}


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON or YAML config file -> its values by flag name (an ``options`` mapping merged in); unknown keys
    are an error, values take their field's type."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            raise ValueError(f"config file {path} is not valid YAML: {err}") from err
    else:
        values = read_json(path, "config file")
    if not isinstance(values, dict) or not isinstance(values.get("options") or {}, dict):
        raise ValueError(f"config file {path} must hold a mapping of TrainConfig fields (options: a mapping too)")
    known = flag_fields()
    values = flat_values(values)
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"config file {path} has unknown keys {unknown}; known keys: {sorted(known)}")
    return {key: _as_field_type(known[key], value, path) for key, value in values.items()}


def _as_field_type(f, value, path: Path):
    """``value`` read from a config file, as the type of field ``f``'s default.

    YAML reads ``1e-4`` as a string (YAML 1.1 floats need a dot), JSON has no int/float distinction: both
    are converted here so that a wrong value fails now, naming its key, not inside the optimizer.
    """
    kind = type(f.default)
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif isinstance(value, str):
        return value
    raise ValueError(f"config file {path}: {f.name} must be a {kind.__name__}, got {value!r}")


def add_dataclass_arguments(parser, cls, suppress_defaults: bool = False) -> None:
    """Add one ``--flag`` per field of the dataclass ``cls`` (a nested dataclass field aside), with its help text
    and default, to ``parser`` (an ArgumentParser or one of its argument groups).

    ``suppress_defaults``: leave unset flags out of the namespace (so a config file can fill them).
    """
    for f in fields(cls):
        if not f.metadata.get("nested"):
            add_field_argument(parser, f, suppress_defaults)


def add_field_argument(parser, f: Field, suppress_defaults: bool = False) -> None:
    """Add the ``--flag`` of the dataclass field ``f`` to ``parser`` (see :func:`add_dataclass_arguments`)."""
    flag = "--" + f.name.replace("_", "-")
    default = f.default
    help_text = f"{f.metadata.get('help', '')} (default: {default})".replace("%", "%%")  # argparse formats help
    kwargs = {"dest": f.name, "help": help_text, "default": argparse.SUPPRESS if suppress_defaults else default}
    if "choices" in f.metadata:
        choices = f.metadata["choices"]
        kwargs["choices"] = choices() if callable(choices) else choices
    if isinstance(default, bool):
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
    else:
        parser.add_argument(flag, type=str if default is None else type(default), **kwargs)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per TrainConfig field, then per method option under a heading naming the methods that
    take it, defaulting to 'not given' so precedence works."""
    parser.add_argument("--config", help="JSON or YAML file with TrainConfig fields.")
    add_dataclass_arguments(parser, TrainConfig, suppress_defaults=True)
    for methods, group in option_groups().items():
        section = parser.add_argument_group(f"{' / '.join(methods)} options")
        for f in group:
            add_field_argument(section, f, suppress_defaults=True)


def option_groups() -> dict[tuple[str, ...], list[Field]]:
    """Every method option once, grouped by the methods that take it (in the order the methods list them)."""
    takers: dict[str, list[str]] = {}
    for name in method_names():
        for f in fields(METHOD_OPTIONS[name]):
            takers.setdefault(f.name, []).append(name)
    groups: dict[tuple[str, ...], list[Field]] = {}
    known = option_fields()
    for option, methods in takers.items():
        groups.setdefault(tuple(methods), []).append(known[option])
    return groups


def resolve_config(args: argparse.Namespace | dict[str, Any]) -> TrainConfig:
    """Resolve defaults < recipe (TrainConfig's numbers, then the method's) < config file < explicit flags into one
    TrainConfig. A flag of another method's options is ignored, with a warning."""
    given = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    flags = {k: v for k, v in given.items() if k in flag_fields()}
    from_file = load_config_file(given["config"]) if given.get("config") else {}
    recipe = flags.get("recipe", from_file.get("recipe", "cpu"))
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {sorted(RECIPES)}")
    method = flags.get("method", from_file.get("method", TrainConfig.method))
    kind = options_class(method)
    _warn_ignored(flags, method)
    values = {**RECIPES[recipe], **kind.recipes.get(recipe, {}), **from_file, **flags, "recipe": recipe}
    chosen = "micro_batch_size" in from_file or flags.get("micro_batch_size") is not None
    if recipe in kind.full_batch_recipes and not chosen:
        values["micro_batch_size"] = values.get("batch_size", TrainConfig.batch_size)
    return TrainConfig.from_dict(values)


def _warn_ignored(flags: dict[str, Any], method: str) -> None:
    """A warning naming the given flags that are options of other methods than ``method`` only."""
    ignored = sorted(set(flags) - set(_own_fields()) - {f.name for f in fields(options_class(method))})
    if ignored:
        names = ", ".join("--" + k.replace("_", "-") for k in ignored)
        logger.warning("%s: not options of --method %s, ignored", names, method)


def lora_targets(value: str) -> str | list[str]:
    """peft's ``target_modules`` for ``--lora-target-modules``: 'all-linear' as it is, else the comma-separated
    names as a list (a plain string would be a regex matched against whole module paths: 'q_proj' matches none)."""
    if value.strip() == "all-linear":
        return "all-linear"
    return [name.strip() for name in value.split(",") if name.strip()]
