"""Tiny random Llama / Gemma3 / Qwen2 models and tokenizers, built in-process (no download)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ARCHITECTURES = ["llama", "gemma3", "qwen2"]
SHARED_DATA = Path(os.environ.get("UNIMAE_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
# The user's model cache, where the integration tests find (or build once) the dequantized offline models.
REAL_CACHE = os.environ.get("UNIMAE_CACHE_REAL", str(Path.home() / ".cache" / "unimae"))

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
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>", "<mask>" if with_mask else "<extra_0>", "<extra_1>", "<extra_2>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    from tokenizers import decoders

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
        raise ValueError(arch)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """{arch: directory with a tiny random model and tokenizer}, saved once per session."""
    dirs = {}
    for arch in ARCHITECTURES:
        tokenizer = build_tokenizer(add_bos=arch != "qwen2", with_mask=arch != "qwen2")
        model = build_model(arch, len(tokenizer))
        directory = tmp_path_factory.mktemp(f"tiny-{arch}")
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        dirs[arch] = directory
    return dirs


@pytest.fixture(params=ARCHITECTURES)
def arch(request) -> str:
    return request.param


@pytest.fixture
def tiny_dir(tiny_model_dirs, arch) -> Path:
    return tiny_model_dirs[arch]


@pytest.fixture
def corpus_file(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(SENTENCES) + "\n")
    return path


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UNIMAE_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_encoder():
    """The real SmolLM2-135M (eos pooling), loaded once per session from the user's model cache.

    ``UNIMAE_CACHE`` points at that cache only while the model loads; every test still runs with its
    own empty cache (``_isolated_cache``), and the variable is restored even if loading fails.
    """
    from unimae.encoder import Encoder

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UNIMAE_CACHE", REAL_CACHE)
        return Encoder.from_pretrained("smollm2-135m", pooling="eos", max_length=128)


def tiny_train_config(tiny_dir, data, out, **overrides):
    """A TrainConfig for a few fast fp32 steps on a tiny model (one batch of 4 texts per step).

    p_mar is the paper's 0.5 (not the CPU recipe's 0) so that the tests exercise MAR masking too."""
    from unimae.training.config import TrainConfig

    values = dict(
        model=str(tiny_dir), data=str(data), output_dir=str(out), steps=12, batch_size=4, micro_batch_size=4,
        max_length=24, save_every=0, precision="fp32", lora_r=8, lora_alpha=16, lr=5e-3, seed=0, p_mar=0.5,
    )  # fmt: skip
    values.update(overrides)
    return TrainConfig.from_dict(values)  # flag-named: the options of another method (p_mar) are dropped


def read_log(out) -> list[dict]:
    """The per-step records of a run's log.jsonl."""
    import json

    return [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]


def post_embeddings(encoder, bodies: list[dict]) -> list:
    """POST each body to /v1/embeddings of an in-process server over ``encoder``; the responses."""
    import asyncio

    import httpx

    from unimae.serving.app import create_app
    from unimae.serving.config import ServerConfig

    app = create_app(encoder, ServerConfig(model_name="tiny"))
    state = app.state.server

    async def run():
        state.batcher.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            responses = [await http.post("/v1/embeddings", json=body) for body in bodies]
        await state.batcher.stop()
        return responses

    return asyncio.run(run())
