"""Tiny random Llama / Gemma3 / Qwen2 models and a byte-level BPE tokenizer, built in-process (no download).

The tests' models (tests/conftest.py) and ``benchmarks/gpu_check.py``'s: each family's own config flags (tied or
untied head, Gemma3's sliding window and head size) at 64 dimensions and 2 layers, with a vocabulary of 400 tokens
trained on :data:`SENTENCES`. Random weights: the numbers mean nothing, but every code path of a real model of the
family runs (:func:`save_tiny_model` writes one as a model folder ``--model`` takes).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

ARCHITECTURES = ("llama", "gemma3", "qwen2")

SENTENCES = [
    "the cat sat on the mat and looked at the door",
    "a dog ran across the green field to find the ball",
    "rain fell over the old city while people walked home",
    "the river flows north through the quiet valley",
    "she wrote a letter to her brother about the summer",
    "stock markets rose after the bank cut interest rates",
    "the team won the final match in the last minute",
    "scientists found water ice near the south pole of the moon",
    "he cooked rice and beans for dinner with his friends",
    "the museum opened a new hall for ancient coins",
    "children played football in the park after school",
    "the train to the coast leaves every hour from the station",
]


CHAT_TEMPLATE = (
    "{% for m in messages %}<extra_1>{{ m['role'] }}: {{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<extra_1>assistant:{% endif %}"
)


def build_tokenizer(add_bos: bool, with_mask: bool, with_pad: bool = True):
    """A byte-level BPE over ``SENTENCES``; ``<pad>`` is always in the vocabulary (same ids either way),
    but only declared the pad token when ``with_pad``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>", "<mask>" if with_mask else "<extra_0>", "<extra_1>", "<extra_2>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    tok.decoder = decoders.ByteLevel()
    if add_bos:
        bos_id = tok.token_to_id("<bos>")
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos_id)]
        )
    extra = ["<extra_1>", "<extra_2>"] if with_mask else ["<extra_0>", "<extra_1>", "<extra_2>"]
    kwargs = {"additional_special_tokens": extra, **({"mask_token": "<mask>"} if with_mask else {})}
    if with_pad:
        kwargs["pad_token"] = "<pad>"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", **kwargs
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(arch: str, vocab_size: int, seed: int = 0):
    """A random ``arch`` (one of :data:`ARCHITECTURES`) model in eval mode, its weights drawn from ``seed``."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=True)
    elif arch == "gemma3":
        config = Gemma3TextConfig(**common, head_dim=16, sliding_window=8, query_pre_attn_scalar=16)
    elif arch == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=False)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHITECTURES}")
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def save_tiny_model(arch: str, directory: str | Path, seed: int = 0) -> Path:
    """Write a tiny random ``arch`` model and its tokenizer to ``directory`` (Qwen2's tokenizer, like Qwen's, has no
    BOS and no mask token); returns the directory."""
    tokenizer = build_tokenizer(add_bos=arch != "qwen2", with_mask=arch != "qwen2")
    model = build_model(arch, len(tokenizer), seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return Path(directory)


@contextlib.contextmanager
def one_query_attention_in_fp32():
    """transformers' SDPA attention computing one-query steps in fp32 (autocast off), as unimae's decode step does
    (:func:`unimae.generation.kv_cache.one_query_attention`); longer queries (prefill) unchanged."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attention(module, query, key, value, *args, **kwargs):
        if query.shape[2] != 1 or query.dtype == torch.float32:
            return sdpa(module, query, key, value, *args, **kwargs)
        with torch.autocast(query.device.type, enabled=False):
            out, weights = sdpa(module, query.float(), key.float(), value.float(), *args, **kwargs)
        return out.to(query.dtype), weights

    ALL_ATTENTION_FUNCTIONS["sdpa"] = attention
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
