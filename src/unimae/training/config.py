"""Training configuration: :class:`TrainConfig` (with its option groups), every number of the paper recipe a field.

Precedence when resolving a run's configuration (later wins):
defaults < ``--recipe`` < ``--config FILE`` (JSON or YAML) < explicit command-line flags.
The resolved configuration is saved as ``config.json`` next to every output.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from unimae.embedding.pooling import POOLINGS
from unimae.files import atomic_write_json, read_json
from unimae.runtime.precision import DEVICE_HELP, PRECISIONS, check_device_name

logger = logging.getLogger(__name__)

DROPOUT_PLACES = ("attention", "lora")

# Recipes override the defaults (which are the CPU recipe). The paper recipe is App. C of the
# UniMAE paper: global batch 32, max length 512, 100 steps, LoRA r=16/alpha=32, lr 1e-4 constant,
# p_mar 0.5. The CPU recipe leaves the input unmasked (p_mar 0): on the default model, SmolLM2-135M,
# masking half the input costs 13 dev points because MRC then trains h_eos on corrupted text only
# (docs/results.md, "Tiny-decoder and p_mar diagnostics"). Likewise GEM's contrastive phase keeps --lr on the
# CPU recipe (the GEM paper's 1e-5 is for full fine-tuning; with LoRA it leaves GEM below Echo pooling:
# docs/results.md, "GEM as its paper describes it"); --recipe paper uses the paper's 1e-5.
RECIPES: dict[str, dict[str, Any]] = {
    "cpu": {},
    "paper": {
        "batch_size": 32,
        "micro_batch_size": 8,
        "max_length": 512,
        "p_mar": 0.5,
        "gem_contrastive_lr_scale": 0.1,  # GEM's paper: 1e-5 after 1e-4 (full fine-tuning)
    },
}


# Methods whose InfoNCE negatives are the other texts of the micro-batch. The papers contrast each text with
# the rest of the whole batch (GEM: 31 negatives in a batch of 32), so --recipe paper gives these methods one
# micro-batch per step (micro_batch_size = batch_size); `contrastive` gets a large batch from its gradient cache.
IN_BATCH_NEGATIVES = ("simcse", "contrastive", "gem")
FULL_BATCH_IN_RECIPE = {"paper": ("simcse", "gem")}


def choice_field(default: str, choices, help_text: str):
    """A dataclass field with one of ``choices`` (a tuple, or a callable returning the list) and help."""
    return field(default=default, metadata={"help": help_text, "choices": choices})


@dataclass
class MNTPOptions:
    """``--method mntp`` (LLM2Vec step 1): bidirectional attention, masked next-token prediction."""

    mntp_p_mask: float = field(default=0.2, metadata={"help": "mntp: share of input tokens masked (LLM2Vec: 0.2)."})


@dataclass
class ContrastiveOptions:
    """``--method simcse`` / ``contrastive`` (and GEM's contrastive term): InfoNCE on pooled embeddings."""

    temperature: float = field(default=0.05, metadata={"help": "simcse/contrastive/gem: InfoNCE temperature."})
    dropout: float = field(
        default=0.1, metadata={"help": "simcse/gem: dropout rate that makes the two views of a text differ."}
    )
    dropout_on: str = choice_field(
        "attention",
        DROPOUT_PLACES,
        "simcse/gem: where that dropout acts: 'attention' (attention probabilities, as LLM2Vec) or "
        "'lora' (LoRA inputs; a fresh LoRA has B = 0, so the views only start to differ after the first step).",
    )
    pooling: str = choice_field(
        "auto",
        lambda: ["auto", *POOLINGS],
        "simcse/contrastive: pooling to train; auto = the --init-adapter's (eos without one).",
    )
    data_weights: str = field(
        default="",
        metadata={
            "help": "contrastive: --data may list several JSONL files (comma-separated) or be a .yaml/.json "
            "mixture file ([{path, weight}, ...]); every batch is drawn from one of them with these sampling "
            "weights: one number per file (comma-separated), 'size' (proportional to its pairs), 'sqrt', or "
            "empty (the mixture file's weights, else 'size')."
        },
    )
    symmetric_loss: bool = field(
        default=False,
        metadata={"help": "contrastive: symmetric InfoNCE, the mean of query -> positives and positive -> queries."},
    )
    mask_false_negatives: bool = field(
        default=True,
        metadata={
            "help": "contrastive: leave a batch's known false negatives out of the softmax (rows sharing a query "
            "or a positive, reversed paraphrase pairs)."
        },
    )
    lm_weight: float = field(
        default=0.0,
        metadata={
            "help": "contrastive: add this weight x the next-token loss of the pairs' positives to InfoNCE "
            "(GritLM's joint objective, on the positives' own text), so the adapter keeps generating; 0: off. "
            "Costs an output-head pass over the positives' tokens."
        },
    )
    lm_texts: int = field(
        default=0,
        metadata={
            "help": "contrastive with --lm-weight: the next-token loss on the first N positives of each batch only "
            "(0: all); the output head over a 262k vocabulary makes scoring all 256 of a batch costly "
            "(docs/methods.md)."
        },
    )
    query_prompt: str = field(
        default="",
        metadata={
            "help": "contrastive: text prefix of the queries of asymmetric sources (all sources but "
            "--symmetric-sources), saved as the adapter's 'query' prompt (Encoder.encode_query, mteb's query "
            "prompt, the server's input_type=query); empty: no prompts."
        },
    )
    document_prompt: str = field(
        default="",
        metadata={
            "help": "contrastive: text prefix of the positives and negatives of asymmetric sources, saved as the "
            "adapter's 'document' prompt; empty: documents embed as they are."
        },
    )
    symmetric_sources: str = field(
        default="",
        metadata={
            "help": "contrastive: --data sources (file names without .jsonl, comma-separated) whose pairs are "
            "symmetric (paraphrase, NLI): neither side gets a prompt, as texts embed outside retrieval."
        },
    )
    matryoshka_dims: str = field(
        default="",
        metadata={
            "help": "contrastive: also train these prefix sizes of the embedding to stand alone (comma-separated, "
            "e.g. 64,128,256): InfoNCE summed over the full vector and each truncated, re-normalised prefix "
            "(sentence-transformers' MatryoshkaLoss, weights 1); empty: off."
        },
    )
    grad_cache_chunk: int = field(
        default=0,
        metadata={
            "help": "contrastive: gradient cache, embedding the batch in chunks of N texts (0: off), so a large "
            "batch needs one chunk's memory; needs --micro-batch-size equal to --batch-size (in-batch negatives "
            "span the whole batch) and one process."
        },
    )


@dataclass
class GEMOptions:
    """``--method gem``: summary tokens + attention-mask rule, (1 - a) NTP + a contrastive (docs/methods.md, "GEM").

    The paper's recipe is the default; ``[open]`` marks the choices the paper leaves to us.
    """

    num_summary_tokens: int = field(
        default=1, metadata={"help": "gem: summary tokens per text, k (paper: 1; ablation 1, 2, 5, 10)."}
    )
    gem_plain_share: float = field(
        default=0.8, metadata={"help": "gem: share of NTP rows without the summary block, p (paper: 0.8)."}
    )
    gem_switch_step: int = field(
        default=100, metadata={"help": "gem: steps of NTP before the loss switches to contrastive (paper: 100)."}
    )
    gem_summary_tokens: str = choice_field(
        "new",
        ("new", "spare"),
        "gem: 'new' (k new special tokens <|summary_i|> added to the tokenizer, embedding rows grown, "
        "as the paper) or 'spare' (the tokenizer's k highest spare special tokens, no resize).",
    )
    gem_summary_init: str = choice_field(
        "mean",
        ("mean", "eos"),
        "gem [open]: initial input-embedding rows of new summary tokens: 'mean' (mean of the "
        "vocabulary's rows; with a tied head their logit starts at the average token's) or 'eos' (a copy of "
        "EOS's row, so the untrained summary state is h_eos; with a tied head their logit starts at EOS's).",
    )
    gem_train_summary_rows: bool = field(
        default=True,
        metadata={
            "help": "gem: train the summary tokens' embedding rows (peft trainable_token_indices; only those rows "
            "are saved); --no-gem-train-summary-rows with --gem-summary-tokens spare is the earlier behaviour."
        },
    )
    gem_block_position: str = choice_field(
        "uniform",
        ("uniform", "inner"),
        "gem [open]: where the block goes in an NTP row: 'uniform' over the gaps with >= 1 text token "
        "before it and >= 1 token after it (the final EOS counts), or 'inner' (>= 1 text token after it too).",
    )
    gem_positives: str = choice_field(
        "prefix",
        ("prefix", "dropout"),
        "gem: the contrastive positive of a text: 'prefix' (the same row with --gem-prefix-dropout of "
        "its text tokens dropped, as the paper; no model dropout) or 'dropout' (a second pass with --dropout "
        "on --dropout-on, SimCSE style; the earlier behaviour).",
    )
    gem_prefix_dropout: float = field(
        default=0.5,
        metadata={
            "help": "gem [open]: share of a text's tokens (BOS kept) dropped to make its positive: round(share x n) "
            "tokens, at least 1 and at most n - 1. 0.5: harder positives; on SmolLM2 (300 steps, 7 dev tasks) "
            "58.89 against 55.09 at 0.2."
        },
    )
    gem_learn_logit_scale: bool = field(
        default=True,
        metadata={
            "help": "gem: learn the InfoNCE logit scale (CLIP style, starting at 1 / --temperature = 20); "
            "--no-gem-learn-logit-scale keeps 1 / --temperature fixed."
        },
    )
    gem_max_logit_scale: float = field(
        default=100.0, metadata={"help": "gem: upper clamp of the learnable logit scale (paper, CLIP: 100)."}
    )
    gem_contrastive_lr_scale: float = field(
        default=1.0,
        metadata={
            "help": "gem [decision]: learning rate of the contrastive phase as a multiple of --lr, which the NTP "
            "phase uses. 1: LoRA at the paper's 1e-5 (0.1, --recipe paper) barely moves: on SmolLM2 300 steps "
            "score 44.88 on the dev suite at 0.1 and 53.32 at 1 (Echo pooling 45.82)."
        },
    )
    gem_lr_schedule: str = choice_field(
        "cosine",
        ("cosine", "constant"),
        "gem: contrastive-phase schedule: 'cosine' (from --lr x --gem-contrastive-lr-scale to 0 at "
        "--steps) or 'constant'. The NTP phase is constant at --lr.",
    )


@dataclass
class TrainConfig(MNTPOptions, ContrastiveOptions, GEMOptions):
    """Configuration of a training run: UniMAE (Eq. 1-6 of the paper; docs/methods.md, "The UniMAE objective") or
    a relative.

    Method-specific options live in their own dataclasses (MNTPOptions, ContrastiveOptions, GEMOptions);
    ``--full-params --p-mar 0 --alpha 1`` with ``--method unimae`` is the paper's domain post-training mode
    (plain next-token training of all weights plus MRC).
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
    recipe: str = field(default="cpu", metadata={"help": "Preset: 'cpu' (default, ~15 min on 2 cores) or 'paper'."})
    method: str = choice_field("unimae", lambda: method_names(), "Training method (unimae.methods; see the choices).")
    init_adapter: str = field(
        default="",
        metadata={"help": "Start from this trained adapter (merged into the base), e.g. UniMAE then --method simcse."},
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
            "adapter); its init adapter, if any, is merged as in its own run. Needs a new --output-dir."
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
        metadata={"help": "AdamW learning rate, constant schedule (paper: 1e-4); gem: see --gem-lr-schedule."},
    )
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (paper: not stated)."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm; 0 turns it off."})

    alpha: float = field(default=0.1, metadata={"help": "Weight of L_MAR in L = alpha*L_MAR + L_MRC (Eq. 6)."})
    p_mar: float = field(
        default=0.0,
        metadata={
            "help": "Share of input tokens replaced by the mask token (Eq. 1). Default 0: measured best on "
            "SmolLM2-135M (docs/results.md); the paper, and --recipe paper, use 0.5."
        },
    )
    p_mar_sampling: str = choice_field(
        "fixed",
        ("fixed", "uniform"),
        "MAR rate per text: 'fixed' (p_mar for every text, Eq. 1) or 'uniform' (each text's rate drawn "
        "from U(0, p_mar), so training also sees nearly clean text, as at inference).",
    )
    p_mrc: float = field(default=0.5, metadata={"help": "Share of token keys hidden from the tiny decoder (Eq. 4)."})
    train_mask_token: bool = field(
        default=False,
        metadata={
            "help": "Train the MAR mask token's embedding row (peft trainable_token_indices); the offline models "
            "have no mask token, so the default mask is an untrained spare special token."
        },
    )
    mask_token: str = field(
        default="auto",
        metadata={
            "help": "Mask token for MAR: 'auto' = the tokenizer's mask token, else its last special "
            "token that is not BOS/EOS/PAD/UNK and not used by the chat template."
        },
    )

    lora_r: int = field(default=16, metadata={"help": "LoRA rank (paper: 16)."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (paper: 32)."})
    lora_dropout: float = field(
        default=0.0, metadata={"help": "LoRA dropout (paper: not stated; 0 makes a CPU step faster)."}
    )
    lora_target_modules: str = field(
        default="all-linear", metadata={"help": "peft target_modules: attention and MLP projections."}
    )
    full_params: bool = field(default=False, metadata={"help": "Train all parameters instead of LoRA."})

    mrc_heads: int = field(default=0, metadata={"help": "Tiny decoder attention heads (0: the LLM's)."})
    mrc_intermediate_size: int = field(default=0, metadata={"help": "Tiny decoder MLP width (0: the LLM's)."})
    mrc_input: str = choice_field(
        "corrupted",
        ("corrupted", "clean"),
        "Text h_eos is computed from for MRC: 'corrupted' (Eq. 2: the one MAR pass) or 'clean' (a second pass over "
        "the uncorrupted text; a diagnostic for the train/inference mismatch, a second forward pass per step).",
    )
    mrc_positions: str = choice_field(
        "scaled",
        ("scaled", "legacy"),
        "Tiny decoder positions (Eq. 3): 'scaled' (h_eos and token embeddings RMS-normalised, p_i ~ N(0, 1), "
        "so queries differ by position) or 'legacy' (raw h_eos + p_i ~ N(0, 0.02), earlier results).",
    )

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

    def validate(self, world_size: int = 1) -> int:
        """Check the numbers and return the gradient-accumulation steps per process."""
        if self.recipe not in RECIPES:
            raise ValueError(f"unknown recipe {self.recipe!r}; choose one of {sorted(RECIPES)}")
        if self.method not in method_names():
            raise ValueError(f"unknown method {self.method!r}; choose one of {method_names()}")
        for name in ("p_mar", "p_mrc"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if not 0.0 < self.mntp_p_mask < 1.0:
            raise ValueError(f"mntp_p_mask must be in (0, 1), got {self.mntp_p_mask}")
        if self.method in IN_BATCH_NEGATIVES and self.micro_batch_size < 2:
            raise ValueError(
                f"--method {self.method} contrasts each text with the others in its micro-batch; "
                f"micro_batch_size must be >= 2, got {self.micro_batch_size}"
            )
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and f.name != "method":  # method: checked above, with its registry
                allowed = choices() if callable(choices) else choices
                if getattr(self, f.name) not in allowed:
                    raise ValueError(f"{f.name} must be one of {list(allowed)}, got {getattr(self, f.name)!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        check_device_name(self.device)
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.num_summary_tokens < 1:
            raise ValueError(f"num_summary_tokens must be >= 1, got {self.num_summary_tokens}")
        if self.max_length < 4:
            raise ValueError(f"max_length must be at least 4 tokens, got {self.max_length}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        for name, least in (
            ("save_every", 0),
            ("threads", 0),
            ("ce_chunk_size", 1),
            ("alpha", 0),
            ("lm_weight", 0),
            ("lm_texts", 0),
        ):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if self.init_adapter and self.init_lora:
            raise ValueError("--init-adapter and --init-lora are two ways to start from a stage: pass one")
        if self.init_adapter and Path(self.init_adapter).resolve().parent == Path(self.output_dir).resolve():
            raise ValueError(
                f"--init-adapter {self.init_adapter} is inside --output-dir {self.output_dir}, which this run "
                "overwrites; give the new stage its own --output-dir"
            )
        for name in ("batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        per_step = self.micro_batch_size * world_size
        if self.batch_size % per_step:
            raise ValueError(
                f"batch_size {self.batch_size} is not a multiple of micro_batch_size x processes "
                f"({self.micro_batch_size} x {world_size}); change --batch-size or --micro-batch-size"
            )
        cached = self.method == "contrastive" and self.grad_cache_chunk > 0
        if self.method in IN_BATCH_NEGATIVES and self.micro_batch_size < self.batch_size and not cached:
            logger.warning(
                "--method %s contrasts each text with the others in its micro-batch: %d negatives per text, not "
                "the %d of the whole batch; --micro-batch-size %d gives the papers' in-batch negatives (more memory)",
                self.method,
                self.micro_batch_size - 1,
                self.batch_size - 1,
                self.batch_size,
            )
        return self.batch_size // per_step

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        """Write the config as JSON, atomically (a crash leaves the old file or the new one, never half)."""
        atomic_write_json(path, self.to_dict())


def method_names() -> list[str]:
    """The registered training methods."""
    from unimae.methods import METHOD_REGISTRY  # imported here: the methods' type hints name TrainConfig (a cycle)

    return sorted(METHOD_REGISTRY)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON or YAML config file; unknown keys are an error."""
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
    if not isinstance(values, dict):
        raise ValueError(f"config file {path} must hold a mapping of TrainConfig fields, got {type(values).__name__}")
    known = {f.name: f for f in fields(TrainConfig)}
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


def add_dataclass_arguments(parser, cls, suppress_defaults: bool = False, skip: tuple = ()) -> None:
    """Add one ``--flag`` per field of the dataclass ``cls`` (but not those of the dataclasses in ``skip``),
    with its help text and default, to ``parser`` (an ArgumentParser or one of its argument groups).

    ``suppress_defaults``: leave unset flags out of the namespace (so a config file can fill them).
    """
    skipped = {f.name for base in skip for f in fields(base)}
    for f in (f for f in fields(cls) if f.name not in skipped):
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
    """Add one ``--flag`` per TrainConfig field, defaulting to 'not given' so precedence works."""
    parser.add_argument("--config", help="JSON or YAML file with TrainConfig fields.")
    groups = {  # the method-specific options, listed after the rest
        MNTPOptions: "mntp options",
        ContrastiveOptions: "simcse / contrastive options (also gem's contrastive term)",
        GEMOptions: "gem options",
    }
    add_dataclass_arguments(parser, TrainConfig, suppress_defaults=True, skip=tuple(groups))
    for cls, title in groups.items():
        add_dataclass_arguments(parser.add_argument_group(title), cls, suppress_defaults=True)


def resolve_config(args: argparse.Namespace | dict[str, Any]) -> TrainConfig:
    """Resolve defaults < recipe < config file < explicit flags into one TrainConfig."""
    given = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    known = {f.name for f in fields(TrainConfig)}
    from_file = load_config_file(given["config"]) if given.get("config") else {}
    recipe = given.get("recipe", from_file.get("recipe", "cpu"))
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {sorted(RECIPES)}")
    values: dict[str, Any] = {**RECIPES[recipe], **from_file}
    values.update({k: v for k, v in given.items() if k in known})
    values["recipe"] = recipe
    chosen = "micro_batch_size" in from_file or given.get("micro_batch_size") is not None
    if values.get("method", TrainConfig.method) in FULL_BATCH_IN_RECIPE.get(recipe, ()) and not chosen:
        values["micro_batch_size"] = values.get("batch_size", TrainConfig.batch_size)
    return TrainConfig(**values)
