"""Training methods: each is a loss (objective), a collator and an inference rule, plugged into ONE trainer.

=============  ======================================  ==================  ===============
method         objective                               data                embeds with
=============  ======================================  ==================  ===============
unimae         alpha * L_MAR + L_MRC (UniMAE Eq. 6)    text                causal, eos
mntp           masked NTP, bidirectional (LLM2Vec)     text                bidirectional, mean
simcse         InfoNCE of two dropout views            text                the init adapter's (or eos)
contrastive    InfoNCE, in-batch + hard negatives      (query, positive    the init adapter's (or eos)
                                                       [, negative]) JSONL
gem            (1 - a) NTP + a InfoNCE, summary tokens text                gem, summary
=============  ======================================  ==================  ===============

The trainer asks the method for its data, objective and collator; the adapter records how it embeds
(``embedding`` in unimae.json), so ``Encoder.from_pretrained(..., adapter)`` uses the right attention and
pooling. Add a method with ``@register_method``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from unimae.config import TrainConfig
from unimae.corpus import CorpusError, jsonl_records, load_texts
from unimae.masking import UniMAECollator, example_generator, mar_corrupt
from unimae.pooling import build_inputs
from unimae.tokenization import encode_with_eos, pad_batch, spare_special_tokens


class Batch(dict):
    """Named tensors of one micro-batch (plus plain numbers); ``to`` moves the tensors."""

    def to(self, device) -> Batch:
        return Batch({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.items()})

    @property
    def num_tokens(self) -> int:
        return int(self["attention_mask"].sum())


@dataclass
class Context:
    """What the trainer resolved for a run: special-token ids and the init adapter's embedding rule."""

    tokenizer: object
    mask_id: int
    summary_ids: list[int]
    init_embedding: dict  # {"attention", "pooling", "pooling_options"}


@dataclass
class Method:
    name: str
    objective: Callable[[TrainConfig, torch.nn.Module, Context], torch.nn.Module]
    collator: Callable[[TrainConfig, Context], Callable[[list, list[int]], object]]
    embedding: Callable[[TrainConfig, Context], dict]
    load_data: Callable[[TrainConfig], list] = lambda config: load_texts(config.data)
    lora_dropout: Callable[[TrainConfig], float] = lambda config: config.lora_dropout
    # Attention-probability dropout while training (0: leave the model's own): what makes SimCSE's two views
    # differ (a fresh LoRA has B = 0, so LoRA dropout alone leaves them identical at the start).
    attention_dropout: Callable[[TrainConfig], float] = lambda config: 0.0


# simcse and gem: the dropout that makes two views of a text differ acts where --dropout-on says.
VIEW_DROPOUT = {
    "lora_dropout": lambda c: c.dropout if c.dropout_on == "lora" else c.lora_dropout,
    "attention_dropout": lambda c: c.dropout if c.dropout_on == "attention" else 0.0,
}

METHOD_REGISTRY: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    METHOD_REGISTRY[method.name] = method
    return method


def get_method(name: str) -> Method:
    if name not in METHOD_REGISTRY:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHOD_REGISTRY)}")
    return METHOD_REGISTRY[name]


def _pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    return pad_batch(rows, pad_id, "right")  # (B, T) ids, (B, T) mask


def _pooled_batch(ctx: Context, texts: list[str], max_length: int, embedding: dict, **extra) -> Batch:
    """Texts tokenized for ``embedding``'s pooling -> Batch(input_ids, attention_mask, pool_mask)."""
    inputs = build_inputs(embedding["pooling"], ctx.tokenizer, texts, max_length, **embedding["pooling_options"])
    ids, mask = _pad([i.ids for i in inputs], ctx.tokenizer.pad_token_id)
    pool_mask, _ = _pad([i.pool for i in inputs], 0)
    return Batch(input_ids=ids, attention_mask=mask, pool_mask=pool_mask, **extra)


def _contrastive_embedding(config: TrainConfig, ctx: Context) -> dict:
    """simcse/contrastive train the init adapter's embedding (its attention; --pooling overrides pooling)."""
    settings = dict(ctx.init_embedding)
    if config.pooling != "auto":
        settings["pooling"] = config.pooling
        if config.pooling != ctx.init_embedding["pooling"]:
            settings["pooling_options"] = {}
    return settings


# --- unimae -------------------------------------------------------------------------------------


def _unimae_objective(config, llm, ctx):
    from unimae.losses import UniMAEObjective

    return UniMAEObjective(
        llm, config.alpha, config.max_length, config.ce_chunk_size, config.mrc_heads, config.mrc_intermediate_size
    )


def _unimae_collator(config, ctx):
    tok = ctx.tokenizer
    collate = UniMAECollator(tok.pad_token_id, ctx.mask_id, tok.bos_token_id, config.p_mar, config.p_mrc, config.seed)
    return lambda texts, indices: collate(encode_with_eos(tok, texts, config.max_length, warn=False), indices)


register_method(
    Method(
        "unimae",
        _unimae_objective,
        _unimae_collator,
        lambda config, ctx: {"attention": "causal", "pooling": "eos", "pooling_options": {}},
    )
)


# --- mntp ---------------------------------------------------------------------------------------


def _mntp_objective(config, llm, ctx):
    from unimae.losses.mntp import MNTPObjective

    return MNTPObjective(llm, config.ce_chunk_size)


def _mntp_collator(config, ctx):
    tok = ctx.tokenizer
    has_bos = tok.bos_token_id is not None

    def collate(texts, indices):
        rows = encode_with_eos(tok, texts, config.max_length, warn=False)
        corrupted = []
        for ids, index in zip(rows, indices, strict=True):
            has = has_bos and ids[0] == tok.bos_token_id
            corrupted.append(
                mar_corrupt(ids, config.mntp_p_mask, ctx.mask_id, has, example_generator(config.seed, index))
            )
        ids, mask = _pad(rows, tok.pad_token_id)
        noisy, _ = _pad(corrupted, tok.pad_token_id)
        return Batch(input_ids=ids, corrupted_ids=noisy, attention_mask=mask, targets=(noisy != ids) & mask.bool())

    return collate


register_method(
    Method(
        "mntp",
        _mntp_objective,
        _mntp_collator,
        lambda config, ctx: {"attention": "bidirectional", "pooling": "mean", "pooling_options": {}},
    )
)


# --- simcse -------------------------------------------------------------------------------------


def _simcse_objective(config, llm, ctx):
    from unimae.losses.simcse import SimCSEObjective

    return SimCSEObjective(llm, config.temperature, _contrastive_embedding(config, ctx)["attention"])


def _simcse_collator(config, ctx):
    embedding = _contrastive_embedding(config, ctx)
    return lambda texts, indices: _pooled_batch(ctx, texts, config.max_length, embedding)


register_method(Method("simcse", _simcse_objective, _simcse_collator, _contrastive_embedding, **VIEW_DROPOUT))


# --- supervised contrastive ---------------------------------------------------------------------


def load_pairs(path: str) -> list[dict]:
    """(query, positive[, negative]) records of a JSONL file; a clear error names a bad line."""
    file = Path(path)
    if file.suffix != ".jsonl" or not file.is_file():
        raise CorpusError(
            f"--method contrastive needs --data FILE.jsonl with query, positive and optional negative fields; "
            f"{path!r} is not such a file (recipes/make_pairs.py builds one from STSBenchmark train)"
        )
    records = []
    for number, record in jsonl_records(file, "query"):  # UTF-8, JSON and a string query, per line
        missing = [k for k in ("query", "positive") if not isinstance(record.get(k), str) or not record[k].strip()]
        if missing:
            raise CorpusError(f"{file}, line {number}: missing or empty field(s) {missing}")
        if "negative" in record and not isinstance(record["negative"], str):
            raise CorpusError(f"{file}, line {number}: 'negative' must be a string")
        records.append(record)
    if len(records) < 2:
        raise CorpusError(f"{file}: needs at least 2 pairs for in-batch negatives, found {len(records)}")
    return records


def _contrastive_objective(config, llm, ctx):
    from unimae.losses.simcse import ContrastiveObjective

    return ContrastiveObjective(llm, config.temperature, _contrastive_embedding(config, ctx)["attention"])


def _contrastive_collator(config, ctx):
    embedding = _contrastive_embedding(config, ctx)

    def collate(records, indices):
        texts = [r["query"] for r in records] + [r["positive"] for r in records]
        texts += [r["negative"] for r in records if r.get("negative")]
        return _pooled_batch(ctx, texts, config.max_length, embedding, num_queries=len(records))

    return collate


register_method(
    Method(
        "contrastive",
        _contrastive_objective,
        _contrastive_collator,
        _contrastive_embedding,
        load_data=lambda config: load_pairs(config.data),
    )
)


# --- gem ----------------------------------------------------------------------------------------


def summary_tokens(tokenizer, n: int) -> list[int]:
    """GEM's summary tokens: the ``n`` highest-id spare special tokens (never in plain text)."""
    spare = spare_special_tokens(tokenizer)
    if len(spare) < n:
        raise ValueError(f"the tokenizer has {len(spare)} spare special tokens; --num-summary-tokens {n} needs {n}")
    return [token_id for _, token_id in spare[:n]]


def _gem_objective(config, llm, ctx):
    from unimae.losses.gem import GEMObjective

    return GEMObjective(llm, config.gem_switch_step, config.temperature, config.ce_chunk_size)


def _gem_embedding(config, ctx):
    return {"attention": "gem", "pooling": "summary", "pooling_options": {"summary_ids": ctx.summary_ids}}


def _gem_collator(config, ctx):
    tok = ctx.tokenizer
    n = len(ctx.summary_ids)
    embedding = _gem_embedding(config, ctx)

    def collate(texts, indices):
        rows, flags = [], []
        for ids, index in zip(encode_with_eos(tok, texts, config.max_length - n, warn=False), indices, strict=True):
            gen = example_generator(config.seed, index)
            start = 1 if tok.bos_token_id is not None and ids[0] == tok.bos_token_id else 0
            if torch.rand(1, generator=gen).item() < config.gem_plain_share or len(ids) - start < 2:
                rows.append(ids)
                flags.append([0] * len(ids))
                continue
            at = int(torch.randint(start + 1, len(ids), (1,), generator=gen))  # at least one token before
            rows.append(ids[:at] + ctx.summary_ids + ids[at:])
            flags.append([0] * at + [1] * n + [0] * (len(ids) - at))
        ids, mask = _pad(rows, tok.pad_token_id)
        summary, _ = _pad(flags, 0)
        view = _pooled_batch(ctx, texts, config.max_length, embedding)
        return Batch(
            input_ids=ids,
            attention_mask=mask,
            summary=summary.bool(),
            view_ids=view["input_ids"],
            view_mask=view["attention_mask"],
            view_pool=view["pool_mask"],
        )

    return collate


register_method(Method("gem", _gem_objective, _gem_collator, _gem_embedding, **VIEW_DROPOUT))
