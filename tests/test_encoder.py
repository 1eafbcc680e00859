"""Embedding invariances and adapter-off generation."""

import numpy as np
import pytest
import torch
from conftest import SENTENCES

from unimae.embedding.tokenization import encode_with_eos, last_token_index, pad_batch
from unimae.encoder import Encoder
from unimae.generation.sampling import GenerationParams
from unimae.models import load_model

TEXTS = SENTENCES[:7] + ["", "   ", "short", "the"]


def _cos(a, b):
    a = a / np.linalg.norm(a, axis=-1, keepdims=True)
    b = b / np.linalg.norm(b, axis=-1, keepdims=True)
    return (a * b).sum(-1)


def test_last_token_index_both_sides():
    _, right = pad_batch([[5, 6, 7], [5]], 0, "right")
    _, left = pad_batch([[5, 6, 7], [5]], 0, "left")
    assert last_token_index(right).tolist() == [2, 0]
    assert last_token_index(left).tolist() == [2, 2]


@pytest.mark.parametrize("pooling", ["eos", "mean", "echo"])
def test_embeddings_invariant_to_batching_and_padding_side(tiny_dir, pooling):
    model, tokenizer, _ = load_model(str(tiny_dir))
    enc = Encoder(model, tokenizer, pooling=pooling, precision="fp32", device="cpu")
    reference = np.stack([enc.encode([t])[0] for t in TEXTS])  # one text per batch: no padding at all
    for batch_size in (2, 5, len(TEXTS)):
        for side in ("left", "right"):
            enc.padding_side = side
            got = enc.encode(TEXTS, batch_size=batch_size)
            assert got.dtype == np.float32 and got.shape == (len(TEXTS), model.config.hidden_size)
            assert _cos(got, reference).min() >= 0.9999, (batch_size, side)
    shuffled = enc.encode(TEXTS[::-1], batch_size=3)[::-1]
    assert _cos(shuffled, reference).min() >= 0.9999


def test_eos_is_appended_after_truncation(tiny_dir):
    _, tokenizer, _ = load_model(str(tiny_dir))
    with pytest.warns(UserWarning, match="truncated"):
        ids = encode_with_eos(tokenizer, [" ".join(SENTENCES)], max_length=8)[0]
    assert len(ids) == 8 and ids[-1] == tokenizer.eos_token_id
    assert encode_with_eos(tokenizer, [""], 8)[0][-1] == tokenizer.eos_token_id


def test_outer_whitespace_does_not_change_an_embedding(tiny_dir):
    """A text embeds as training saw it, without outer whitespace (the pair files have none): a trailing space
    or newline is not a token before [EOS]; the prompt still comes first and keeps its own spacing."""
    from unimae.embedding.spec import with_prompt

    model, tokenizer, _ = load_model(str(tiny_dir))
    enc = Encoder(model, tokenizer, precision="fp32", device="cpu")
    plain = enc.encode(["the cat sat", "a dog"])
    padded = enc.encode(["the cat sat ", "\n a dog\t"])
    np.testing.assert_array_equal(padded, plain)
    assert not np.array_equal(enc.encode("the cat sat."), plain[0])  # inner text still counts
    assert with_prompt([" the cat ", "x"], "query: ") == ["query: the cat", "query: x"]
    np.testing.assert_array_equal(enc.encode(" a dog ", prompt="q: "), enc.encode("a dog", prompt="q: "))


def test_normalize_and_single_string(tiny_dir):
    model, tokenizer, _ = load_model(str(tiny_dir))
    enc = Encoder(model, tokenizer, precision="fp32", device="cpu")
    vec = enc.encode("the cat", normalize=True)
    assert vec.shape == (model.config.hidden_size,)
    assert abs(np.linalg.norm(vec) - 1) < 1e-5
    assert enc.encode([]).shape == (0, model.config.hidden_size)


def test_generation_with_adapter_disabled_equals_base(tiny_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    base, tokenizer, _ = load_model(str(tiny_dir))
    base_text = Encoder(base, tokenizer, precision="fp32", device="cpu").generate("the cat", max_new_tokens=8)
    model, _, _ = load_model(str(tiny_dir))
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    enc = Encoder(peft_model, tokenizer, precision="fp32", device="cpu")
    with torch.no_grad():
        adapted = enc.generate("the cat", max_new_tokens=8)
    with enc.adapter_disabled():
        disabled = enc.generate("the cat", max_new_tokens=8)
    assert disabled == base_text
    assert adapted != base_text, "a random non-zero adapter should change greedy output"
    with torch.no_grad():  # GenerationParams in max_new_tokens's place is taken as params
        assert enc.generate("the cat", GenerationParams(max_new_tokens=8)) == adapted


def test_unmerged_bf16_adapter_skips_peft_upcast_with_identical_embeddings(tiny_model_dirs, corpus_file, tmp_path):
    """Encoder (bf16, unmerged LoRA) turns off peft's per-layer fp32 input cast: bit-identical embeddings."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from unimae.training.config import TrainConfig
    from unimae.training.trainer import train

    tiny = tiny_model_dirs["llama"]
    config = TrainConfig(
        model=str(tiny), data=str(corpus_file), output_dir=str(tmp_path / "run"), steps=2, batch_size=4,
        micro_batch_size=4, max_length=24, save_every=0, precision="fp32", lora_r=4, lora_alpha=8, lr=5e-2,
    )  # fmt: skip
    adapter = str(train(config).adapter_dir)
    enc = Encoder.from_pretrained(str(tiny), adapter=adapter, precision="bf16", merge=False)
    lora = [m for m in enc.model.modules() if isinstance(m, BaseTunerLayer)]
    assert lora and not any(m.cast_input_dtype_enabled for m in lora)
    skipped = enc.encode(SENTENCES[:6])
    for module in lora:
        module.cast_input_dtype_enabled = True
    assert np.array_equal(skipped, enc.encode(SENTENCES[:6]))
    base = Encoder.from_pretrained(str(tiny), precision="bf16").encode(SENTENCES[:6])
    assert not np.allclose(skipped, base, atol=1e-3)  # the adapter is really applied
