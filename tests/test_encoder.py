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


@pytest.mark.parametrize("pooling", ["eos", "mean", "wmean", "echo"])
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


def test_wmean_weights_the_ith_of_n_states_by_i(tiny_dir):
    """SGPT's position-weighted mean: sum_i i * h_i / sum_i i over the text's tokens, not the plain mean."""
    from unimae.embedding.pooling import build_inputs, last_hidden

    model, tokenizer, _ = load_model(str(tiny_dir))
    text = SENTENCES[0]
    (built,) = build_inputs("wmean", tokenizer, [text], 64)
    n = len(built.ids)
    assert built.pool == list(range(1, n + 1)) and built.ids == build_inputs("mean", tokenizer, [text], 64)[0].ids
    enc = Encoder(model, tokenizer, pooling="wmean", precision="fp32", device="cpu")
    ids = torch.tensor([built.ids])
    with torch.no_grad():
        hidden = last_hidden(model.eval(), ids, torch.ones_like(ids), torch.ones_like(ids))[0]  # (n, D)
    weights = torch.arange(1, n + 1, dtype=torch.float32)[:, None]
    expected = ((hidden * weights).sum(0) / weights.sum()).numpy()
    mean = Encoder(model, tokenizer, pooling="mean", precision="fp32", device="cpu").encode([text])
    got = enc.encode([text])
    assert _cos(got, expected[None])[0] >= 0.99999
    assert _cos(got, mean)[0] < 0.9999  # it is not the plain mean


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


# sentence-transformers' SentenceTransformer API on an Encoder (the export-side parity: tests/test_export.py)


def _st_encoder(tiny_model_dirs, **kwargs) -> Encoder:
    from unimae.embedding.spec import EmbeddingSpec

    model, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]), dtype=torch.float32)
    spec = EmbeddingSpec(prompts={"query": "q: ", "document": "d: "}, matryoshka_dims=(8,))
    kwargs = {"precision": "fp32", "device": "cpu", "max_length": 32, **kwargs}
    return Encoder(model, tokenizer, spec=spec, **kwargs)


def test_sentence_transformers_encode_keywords_map_to_the_encoders_own(tiny_model_dirs):
    """Before: each was a TypeError naming unimae's spelling."""
    enc = _st_encoder(tiny_model_dirs)
    texts = SENTENCES[:3]
    same = np.testing.assert_array_equal
    same(enc.encode(texts, normalize_embeddings=True), enc.encode(texts, normalize=True))
    same(enc.encode(texts, truncate_dim=8), enc.encode(texts, dimensions=8))
    same(enc.encode(sentences=texts), enc.encode(texts))  # sentence-transformers <= 5 names the texts so
    same(enc.encode(inputs=texts), enc.encode(texts))  # ... and 6.x so
    same(enc.encode(texts, show_progress_bar=False, output_value="sentence_embedding"), enc.encode(texts))
    both = enc.encode(texts, convert_to_numpy=True, normalize=True, normalize_embeddings=True)  # the same value
    same(both, enc.encode(texts, normalize=True))
    same(enc.encode(texts, 2, normalize_embeddings=None), enc.encode(texts))  # None: not given, as there
    same(enc.encode_query(texts, normalize_embeddings=True), enc.encode(texts, prompt="q: ", normalize=True))


def test_both_spellings_with_different_values_and_unknown_options_are_refused(tiny_model_dirs):
    enc = _st_encoder(tiny_model_dirs)
    with pytest.raises(TypeError, match="got normalize and normalize_embeddings"):
        enc.encode(["x"], normalize=False, normalize_embeddings=True)
    with pytest.raises(TypeError, match="got dimensions and truncate_dim"):
        enc.encode(["x"], dimensions=8, truncate_dim=16)
    with pytest.raises(TypeError, match="got texts and sentences"):
        enc.encode(["x"], sentences=["y"])
    with pytest.raises(TypeError, match="needs the texts"):
        enc.encode(normalize=True)
    with pytest.raises(ValueError, match="returns sentence embeddings only"):
        enc.encode(["x"], output_value="token_embeddings")
    with pytest.raises(TypeError, match=r"device \(use Encoder.from_pretrained\(device=...\)\), pool"):
        enc.encode(["x"], device="cpu", pool={})
    with pytest.raises(TypeError, match="pass prompt_name=... by keyword"):  # sentence-transformers' 2nd parameter
        enc.encode(["x"], "query")


def test_convert_to_tensor_and_to_a_list_of_tensors(tiny_model_dirs):
    enc = _st_encoder(tiny_model_dirs)
    texts = SENTENCES[:3]
    vectors = enc.encode(texts, normalize=True)
    tensor = enc.encode(texts, normalize_embeddings=True, convert_to_tensor=True)
    assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and tensor.device == enc.device
    np.testing.assert_array_equal(tensor.numpy(), vectors)
    rows = enc.encode(texts, normalize=True, convert_to_numpy=False)
    assert isinstance(rows, list) and len(rows) == 3 and all(isinstance(r, torch.Tensor) for r in rows)
    np.testing.assert_array_equal(torch.stack(rows).numpy(), vectors)
    one = enc.encode("the cat", convert_to_tensor=True)
    assert isinstance(one, torch.Tensor) and one.shape == (enc.embedding_dim,)
    assert isinstance(enc.encode("the cat", convert_to_numpy=False), torch.Tensor)  # one text: one tensor
    bits = enc.encode(texts, precision="ubinary", convert_to_tensor=True)
    assert bits.dtype == torch.uint8 and bits.device.type == "cpu"
    np.testing.assert_array_equal(bits.numpy(), enc.encode(texts, precision="ubinary"))


def test_similarity_is_sentence_transformers_cosine(tiny_model_dirs):
    pytest.importorskip("sentence_transformers")
    from sentence_transformers.util import cos_sim, pairwise_cos_sim

    enc = _st_encoder(tiny_model_dirs)
    a, b = enc.encode(SENTENCES[:3]), enc.encode(SENTENCES[3:5])
    assert enc.similarity_fn_name == "cosine"
    scores = enc.similarity(a, b)
    assert isinstance(scores, torch.Tensor) and scores.shape == (3, 2)
    torch.testing.assert_close(scores, cos_sim(a, b))
    torch.testing.assert_close(enc.similarity(torch.from_numpy(a), list(b)), scores)  # tensors, lists of arrays
    torch.testing.assert_close(enc.similarity(a[0], b), scores[:1])  # a 1-D vector is one row
    torch.testing.assert_close(enc.similarity_pairwise(a[:2], b), pairwise_cos_sim(a[:2], b))
    assert torch.allclose(enc.similarity(a, a).diagonal(), torch.ones(3))


def test_truncate_dim_is_a_call_option_not_a_load_option(tiny_model_dirs):
    enc = _st_encoder(tiny_model_dirs)
    assert enc.get_sentence_embedding_dimension() == enc.get_embedding_dimension() == enc.embedding_dim
    with pytest.raises(TypeError, match="truncate_dim \\(pass truncate_dim= \\(or dimensions=\\) to encode"):
        Encoder.from_pretrained(str(tiny_model_dirs["llama"]), precision="fp32", truncate_dim=8)


def test_max_seq_length_prompts_and_default_prompt_name(tiny_model_dirs):
    enc = _st_encoder(tiny_model_dirs)
    assert enc.max_seq_length == enc.max_length == 32
    long = " ".join(SENTENCES)
    with pytest.warns(UserWarning, match="truncated"):
        whole = enc.encode(long)
        enc.max_seq_length = 4
        cut = enc.encode(long)
        np.testing.assert_array_equal(cut, _st_encoder(tiny_model_dirs, max_length=4).encode(long))
    assert enc.max_length == 4 and not np.array_equal(cut, whole)
    with pytest.raises(ValueError, match="max_seq_length must be a positive integer"):
        enc.max_seq_length = 0
    assert dict(enc.prompts) == {"query": "q: ", "document": "d: "} and enc.default_prompt_name is None
    with pytest.raises(TypeError):  # read-only: a changed copy would change nothing
        enc.prompts["query"] = "other: "


def test_encode_query_takes_a_prompt_name_or_prompt_as_sentence_transformers_does(tiny_model_dirs):
    """Before: ``encode_query(prompt_name=...)`` was a TypeError."""
    enc = _st_encoder(tiny_model_dirs)
    texts = SENTENCES[:2]
    np.testing.assert_array_equal(enc.encode_query(texts), enc.encode(texts, prompt="q: "))
    np.testing.assert_array_equal(enc.encode_document(texts), enc.encode(texts, prompt="d: "))
    np.testing.assert_array_equal(enc.encode_query(texts, prompt_name="document"), enc.encode_document(texts))
    np.testing.assert_array_equal(enc.encode_document(texts, prompt="x: "), enc.encode(texts, prompt="x: "))
    np.testing.assert_array_equal(enc.encode_query(sentences=texts), enc.encode_query(texts))


def test_load_options_an_encoder_would_ignore_are_refused(tiny_model_dirs):
    """Before: ``from_pretrained(model, prompts=...)`` (or any unknown keyword) was passed on as a pooling option
    and silently ignored, since the adapter's spec holds the pooling options."""
    from unimae.embedding.spec import EmbeddingSpec

    tiny = str(tiny_model_dirs["llama"])
    with pytest.raises(TypeError, match=r"prompts \(the adapter's own come from its unimae.json"):
        Encoder.from_pretrained(tiny, prompts={"query": "q: "})
    with pytest.raises(TypeError, match="unexpected keyword arguments: trust_remote_code"):
        Encoder.from_pretrained(tiny, trust_remote_code=True)
    model, tokenizer, _ = load_model(tiny, dtype=torch.float32)
    with pytest.raises(TypeError, match="similarity_fn_name"):
        Encoder(model, tokenizer, spec=EmbeddingSpec(), similarity_fn_name="dot")
