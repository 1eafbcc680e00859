"""Matryoshka prefixes by rotation (unimae.embedding.rotation, `unimae rotation`) on tiny random models: the fit is
an ordered orthogonal basis, the full-size vector is untouched, a prefix is the leading principal coordinates, and
the rotation travels with the adapter into releases and the sentence-transformers export."""

import numpy as np
import pytest
import torch
from conftest import post_embeddings
from test_contrastive import _config, _records, _write

from unimae.adapter import embedding_spec
from unimae.cli import main
from unimae.embedding.rotation import ROTATION_FILE, fit_rotation, load_rotation
from unimae.embedding.vectors import finish_embeddings
from unimae.encoder import Encoder
from unimae.training.trainer import train


def test_the_fit_is_an_orthogonal_basis_by_falling_variance_and_reproducible():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 8)) * np.array([1, 5, 0.1, 3, 0.5, 2, 0.2, 4])  # (N, D) one large axis: 2nd
    r = fit_rotation(x)
    assert np.allclose(r @ r.T, np.eye(8), atol=1e-5)
    variance = ((x - x.mean(0)) @ r.T).var(0)  # (D,)
    assert np.all(np.diff(variance) <= 1e-6) and abs(r[0, 1]) > 0.99
    assert np.array_equal(r, fit_rotation(x))
    with pytest.raises(ValueError, match="at least 8 embeddings"):
        fit_rotation(x[:7])


def test_a_prefix_is_the_leading_rotated_coordinates_and_the_full_size_is_untouched():
    z = np.random.default_rng(1).normal(size=(20, 8)).astype(np.float32)  # (N, D)
    r = fit_rotation(z)
    for full in (None, 8):
        assert np.array_equal(finish_embeddings(z, full, True, rotation=r), finish_embeddings(z, full, True))
    got = finish_embeddings(z, 3, True, rotation=r)  # (N, 3)
    want = z @ r[:3].T
    assert np.allclose(got, want / np.linalg.norm(want, axis=1, keepdims=True), atol=1e-6)


@pytest.fixture
def rotated_adapter(tiny_model_dirs, tmp_path):
    """A tiny contrastive adapter (Matryoshka dims 4, 8) with `unimae rotation` fitted on 80 texts of its data."""
    data = _write(tmp_path / "pairs.jsonl", _records(40))
    out = tmp_path / "run"
    train(_config(tiny_model_dirs["llama"], data, out, matryoshka_dims="4,8", steps=2))
    adapter = out / "adapter"
    before = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), adapter=str(adapter), precision="fp32")
    args = ["rotation", "--model", str(tiny_model_dirs["llama"]), "--adapter", str(adapter), "--max-length", "32"]
    assert main([*args, "--precision", "fp32", "--pairs-per-source", "40"]) == 0
    return adapter, before


def test_unimae_rotation_fits_the_adapters_prefixes_and_encode_uses_it(tiny_model_dirs, rotated_adapter):
    adapter, before = rotated_adapter
    spec = embedding_spec(adapter)
    assert spec.rotation and (adapter / ROTATION_FILE).is_file() and spec.matryoshka_dims == (4, 8)
    after = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), adapter=str(adapter), precision="fp32")
    texts = ["the cat sat on the mat", "a dog runs", "stocks fell today"]
    full = before.encode(texts, normalize=True)
    assert np.array_equal(after.encode(texts, normalize=True), full)  # the full size is h_eos, as before
    r = load_rotation(adapter, spec.rotation)
    want = full @ r[:4].T
    assert np.allclose(after.encode(texts, normalize=True, dimensions=4), want / np.linalg.norm(want, axis=1)[:, None])
    assert not np.allclose(after.encode(texts, normalize=True, dimensions=4), before.encode(texts, True, dimensions=4))


def test_a_refit_that_fails_keeps_the_rotation_the_adapter_had(tiny_model_dirs, rotated_adapter):
    adapter, _ = rotated_adapter
    had = embedding_spec(adapter).rotation
    args = ["rotation", "--adapter", str(adapter), "--max-length", "32", "--precision", "fp32"]
    assert main([*args, "--pairs-per-source", "10"]) == 2  # 20 texts cannot fit 64 coordinates
    assert embedding_spec(adapter).rotation == had and load_rotation(adapter, had).shape == (64, 64)


def test_a_missing_or_other_rotation_is_a_clear_error(tiny_model_dirs, rotated_adapter):
    adapter, _ = rotated_adapter
    path = adapter / ROTATION_FILE
    data = path.read_bytes()
    path.write_bytes(data[:100])
    with pytest.raises(ValueError, match="no readable rotation.*unimae rotation"):
        Encoder.from_pretrained(str(tiny_model_dirs["llama"]), adapter=str(adapter), precision="fp32")
    path.unlink()
    with pytest.raises(FileNotFoundError, match="metadata holds one; restore.*fit it again"):
        Encoder.from_pretrained(str(tiny_model_dirs["llama"]), adapter=str(adapter), precision="fp32")
    # ... and the command the errors name fits it again (the spec's stale fingerprint does not stand in its way)
    args = ["rotation", "--adapter", str(adapter), "--max-length", "32", "--precision", "fp32"]
    assert main([*args, "--pairs-per-source", "40"]) == 0  # --model from its unimae.json
    assert load_rotation(adapter, embedding_spec(adapter).rotation).shape == (64, 64)


def test_the_server_and_a_rag_index_use_the_rotation_and_full_size_indexes_ignore_it(
    tiny_model_dirs, rotated_adapter, tmp_path
):
    from test_rag import PASSAGES

    from unimae.retrieval.index import IndexConfig, VectorIndex
    from unimae.retrieval.rag import RAG

    adapter, before = rotated_adapter
    enc = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), adapter=str(adapter), precision="fp32")
    texts = ["the cat sat", "a dog ran"]
    (cut, odd) = post_embeddings(enc, [{"input": texts, "dimensions": 4}, {"input": texts, "dimensions": 5}])
    vectors = np.array([d["embedding"] for d in cut.json()["data"]])
    np.testing.assert_allclose(vectors, enc.encode(texts, dimensions=4, normalize=True), atol=1e-5)
    assert odd.status_code == 200  # with a rotation every k is a principal prefix
    full = VectorIndex.build(before, PASSAGES, tmp_path / "full", IndexConfig())  # built before the rotation
    query = "where did the cat sit"  # a full-size index: the rotation plays no part (z, not R z)
    assert [h.id for h in RAG(enc, full).retrieve(query, k=3)] == [h.id for h in RAG(before, full).retrieve(query, k=3)]
    prefix = VectorIndex.build(enc, PASSAGES, tmp_path / "d4", IndexConfig(dimensions=4))
    assert prefix.spec.rotation == enc.spec.rotation
    with pytest.raises(ValueError, match="the index was built with"):
        RAG(before, prefix)  # raw prefixes against rotated ones


def test_a_run_started_from_a_rotated_adapter_names_no_rotation(tiny_model_dirs, rotated_adapter, tmp_path):
    adapter, _ = rotated_adapter
    data = _write(tmp_path / "more.jsonl", _records(12))
    out = tmp_path / "next"
    train(_config(tiny_model_dirs["llama"], data, out, init_lora=str(adapter), steps=1))
    assert embedding_spec(adapter).rotation and not embedding_spec(out / "adapter").rotation


def test_the_rotation_travels_into_a_release_and_the_sentence_transformers_export(
    tiny_model_dirs, rotated_adapter, tmp_path
):
    from sentence_transformers import SentenceTransformer

    from unimae.export import export
    from unimae.release import make_release

    adapter, _ = rotated_adapter
    released = make_release(adapter, "tiny-release", root=tmp_path / "releases", card="card")
    spec = embedding_spec(adapter)
    assert not (released / ROTATION_FILE).exists()  # a release is its four files: R rides in the weights' metadata
    assert np.array_equal(load_rotation(released, spec.rotation), load_rotation(adapter, spec.rotation))
    again = make_release(released, "tiny-release", root=tmp_path / "again", card="card")  # a release made again
    assert np.array_equal(load_rotation(again, spec.rotation), load_rotation(adapter, spec.rotation))
    weights = (released / "adapter_model.safetensors").read_bytes()
    for _ in range(3):  # the same weights released again keep their bytes (safetensors orders metadata keys freely)
        make_release(adapter, "tiny-release", root=tmp_path / "releases", card="card")
        assert (released / "adapter_model.safetensors").read_bytes() == weights
    tiny = str(tiny_model_dirs["llama"])
    ours = Encoder.from_pretrained(tiny, adapter=str(adapter), precision="fp32", max_length=32)
    exported = export(tiny, str(adapter), tmp_path / "st", fmt="sentence-transformers", max_length=32)
    texts = ["the cat sat on the mat", "a dog runs"]
    st = SentenceTransformer(str(exported), truncate_dim=4)
    theirs = st.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
    assert (theirs * ours.encode(texts, normalize=True, dimensions=4)).sum(1).min() >= 0.9999
    assert "PCA rotation" in (tmp_path / "st" / "README.md").read_text()


def test_a_gguf_does_not_claim_raw_prefixes_of_a_rotated_adapter(tiny_model_dirs):
    """llama.cpp returns h_eos: with a rotation its raw prefixes are not the adapter's, so the GGUF names no
    Matryoshka sizes and a server on it refuses `dimensions`."""
    from unimae.embedding.spec import EmbeddingSpec
    from unimae.export.gguf import unimae_keys
    from unimae.models import load_model

    _, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]), dtype=torch.float32)
    keys = lambda spec: {name.rsplit(".", 1)[-1] for name, _, _ in unimae_keys(tokenizer, spec, {})}  # noqa: E731
    assert "matryoshka_dims" in keys(EmbeddingSpec(matryoshka_dims=(4, 8)))
    assert "matryoshka_dims" not in keys(EmbeddingSpec(matryoshka_dims=(4, 8), rotation="abc"))
