"""``--method unimae`` (default): ``L = alpha * L_MAR + L_MRC`` (UniMAE Eq. 6); embeds with causal ``eos``."""

from __future__ import annotations

from dataclasses import dataclass, field

from unimae.data.masking import UniMAECollator
from unimae.embedding.spec import EmbeddingSpec
from unimae.embedding.tokenization import encode_with_eos
from unimae.losses import UniMAEObjective
from unimae.training.config import MethodOptions, TrainConfig, choice_field
from unimae.training.methods.base import Method
from unimae.training.methods.registry import register_method


@dataclass
class UniMAEOptions(MethodOptions):
    """MAR (Eq. 1-2) and MRC (Eq. 3-5) of the UniMAE paper (docs/methods.md, "The UniMAE objective").

    ``--full-params --p-mar 0 --alpha 1`` is the paper's domain post-training mode (plain next-token training of
    all weights plus MRC).
    """

    # --recipe paper masks half the input (the paper's p_mar). The CPU recipe leaves it unmasked: on the default
    # model, SmolLM2-135M, masking half the input costs 13 dev points because MRC then trains h_eos on corrupted
    # text only (docs/results.md, "Tiny-decoder and p_mar diagnostics").
    recipes = {"paper": {"p_mar": 0.5}}

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

    def check(self, config: TrainConfig, world_size: int) -> None:
        super().check(config, world_size)
        for name in ("p_mar", "p_mrc"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if self.alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")


@register_method
class UniMAE(Method):
    """Batches: :class:`~unimae.data.masking.UniMAECollator` (MAR-corrupted ids and the MRC key mask)."""

    name = "unimae"
    options_class = UniMAEOptions

    def __init__(self, config, ctx):
        super().__init__(config, ctx)
        tok, o = ctx.tokenizer, self.options
        self._collate = UniMAECollator(
            tok.pad_token_id, ctx.mask_id, tok.bos_token_id, o.p_mar, o.p_mrc, config.seed, o.p_mar_sampling
        )

    def lora_extra(self) -> dict:
        """``--train-mask-token``: the mask token's embedding row trains with the LoRA (peft TrainableTokens)."""
        return {"trainable_token_indices": [self.ctx.mask_id]} if self.options.train_mask_token else {}

    def build_objective(self, llm):
        c, o = self.config, self.options
        return UniMAEObjective(
            llm,
            o.alpha,
            c.max_length,
            c.ce_chunk_size,
            o.mrc_heads,
            o.mrc_intermediate_size,
            o.mrc_positions,
            o.mrc_input,
        )

    def collate(self, texts, indices):
        return self._collate(encode_with_eos(self.ctx.tokenizer, texts, self.config.max_length, warn=False), indices)

    def embedding_spec(self) -> EmbeddingSpec:
        return EmbeddingSpec(attention="causal", pooling="eos")
