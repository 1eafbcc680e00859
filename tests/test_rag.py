"""Vector index (build, resume, damage) and one-model RAG with KV-cache reuse, on tiny models."""

import copy
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import SENTENCES

from unimae.data.corpus import CorpusError, load_passages
from unimae.encoder import Encoder
from unimae.generation.sampling import GenerationParams
from unimae.retrieval.index import IndexConfig, VectorIndex, VectorIndexError
from unimae.retrieval.rag import RAG

PASSAGES = [(f"p{i}", text) for i, text in enumerate(SENTENCES)]


@pytest.fixture
def encoder(tiny_dir):
    return Encoder.from_pretrained(str(tiny_dir), precision="fp32", max_length=64)


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf"])
def test_index_finds_each_passage_by_its_own_text(tiny_model_dirs, tmp_path, kind):
    enc = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), precision="fp32", max_length=64)
    index = VectorIndex.build(enc, PASSAGES, tmp_path / "idx", IndexConfig(kind=kind, shard_size=5))
    loaded = VectorIndex.load(tmp_path / "idx")
    hits = loaded.search(enc.encode([t for _, t in PASSAGES], normalize=True), k=2)
    assert [h[0].id for h in hits] == [pid for pid, _ in PASSAGES]
    assert all(abs(h[0].score - 1) < 1e-4 for h in hits)
    assert len(index) == len(loaded) == len(PASSAGES)


def test_index_resumes_and_redoes_a_damaged_shard(encoder, tmp_path, monkeypatch):
    config = IndexConfig(shard_size=4)
    VectorIndex.build(encoder, PASSAGES, tmp_path / "idx", config)
    shards = sorted((tmp_path / "idx" / "shards").glob("*.npy"))
    assert len(shards) == 3
    reference = np.load(shards[1])
    shards[1].write_bytes(b"not a numpy file")
    shards[2].unlink()
    stale = [tmp_path / "idx" / ".index.faiss.tmp4242", tmp_path / "idx" / "shards" / ".00000008.npy.tmp4242"]
    for path in stale:  # what a build killed mid-write leaves (a vectors file's as large as the index)
        path.write_bytes(b"partial")
    calls = []
    original = encoder.encode
    monkeypatch.setattr(encoder, "encode", lambda texts, **kw: calls.append(len(texts)) or original(texts, **kw))
    VectorIndex.build(encoder, PASSAGES, tmp_path / "idx", config)
    assert calls == [4, 4], "only the damaged and the missing shard are embedded again"
    assert not any(path.exists() for path in stale)
    np.testing.assert_allclose(np.load(shards[1]), reference, atol=1e-6)


def test_index_refuses_other_passages_and_incomplete_folders(encoder, tmp_path):
    VectorIndex.build(encoder, PASSAGES, tmp_path / "idx", IndexConfig(shard_size=4))
    with pytest.raises(VectorIndexError, match="--overwrite"):
        VectorIndex.build(encoder, PASSAGES[:5], tmp_path / "idx", IndexConfig(shard_size=4))
    assert len(VectorIndex.build(encoder, PASSAGES[:5], tmp_path / "idx", overwrite=True)) == 5
    record = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    record["precision"] = "fp32" if record["precision"] == "bf16" else "bf16"  # as if built at the other one
    (tmp_path / "idx" / "manifest.json").write_text(json.dumps(record))
    with pytest.raises(VectorIndexError, match="precision"):  # resuming would mix shards of two precisions
        VectorIndex.build(encoder, PASSAGES[:5], tmp_path / "idx")
    (tmp_path / "idx" / "manifest.json").write_text(json.dumps({**record, "adapter_revision": "0123456789ab"}))
    with pytest.raises(VectorIndexError, match=r"other adapter_revision.*the adapter's weights changed.*--overwrite"):
        VectorIndex.build(encoder, PASSAGES[:5], tmp_path / "idx")  # a newer release's weights, say
    (tmp_path / "idx" / "manifest.json").write_text(json.dumps(record))
    manifest = tmp_path / "idx" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "complete": False}))
    with pytest.raises(VectorIndexError, match="resume"):
        VectorIndex.load(tmp_path / "idx")
    with pytest.raises(VectorIndexError, match="no manifest"):
        VectorIndex.load(tmp_path / "nothing")


def test_damaged_index_files_and_empty_builds_are_clear_errors(encoder, tmp_path):
    from unimae.retrieval.rag import load_index_and_encoder

    with pytest.raises(VectorIndexError, match="no passages"):
        VectorIndex.build(encoder, [], tmp_path / "empty")
    VectorIndex.build(encoder, PASSAGES, tmp_path / "named")  # from_pretrained's encoder names its model
    assert load_index_and_encoder(tmp_path / "named")[1].manifest["model"] == encoder.source["model"]
    anonymous = copy.copy(encoder)
    anonymous.source = {}  # an Encoder built by hand around a model object
    VectorIndex.build(anonymous, PASSAGES, tmp_path / "idx")
    with pytest.raises(VectorIndexError, match="records no model"):
        load_index_and_encoder(tmp_path / "idx")
    passages = tmp_path / "idx" / "passages.jsonl"
    passages.write_text(passages.read_text()[:-20] + "\n")  # the last record cut short
    with pytest.raises(VectorIndexError, match=rf"line {len(PASSAGES)}, is damaged"):
        VectorIndex.load(tmp_path / "idx")
    passages.unlink()
    with pytest.raises(VectorIndexError, match="passages.jsonl is missing"):
        VectorIndex.load(tmp_path / "idx")
    (tmp_path / "idx" / "manifest.json").write_text("[]")
    with pytest.raises(VectorIndexError, match="not a JSON object"):
        VectorIndex.load(tmp_path / "idx")
    (tmp_path / "idx" / "manifest.json").write_bytes(b"\xff{")
    with pytest.raises(VectorIndexError, match="damaged"):  # also when resuming a build into it
        VectorIndex.build(encoder, PASSAGES, tmp_path / "idx")


def test_load_passages_ids_and_errors(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"id": "a", "text": "first"}\n{"text": "second"}\n\n{"id": "c", "text": "  "}\n')
    assert load_passages(str(path)) == [("a", "first"), ("2", "second")]
    path.write_text('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n')
    with pytest.raises(CorpusError, match="twice"):
        load_passages(str(path))
    path.write_text('{"id": "a", "text": "ok"}\n{"id": "b", "text": "x \\ud800 y"}\n')
    with pytest.raises(CorpusError, match="line 2: 'text' holds a lone surrogate"):
        load_passages(str(path))


def test_rag_kv_reuse_gives_the_same_answer(encoder, tmp_path):
    rag = RAG(encoder, VectorIndex.build(encoder, PASSAGES, tmp_path / "idx"))
    params = GenerationParams(max_new_tokens=12)
    cached = rag.answer("where did the cat sit", params=params)
    plain = rag.answer("where did the cat sit", params=params, reuse_kv=False)
    assert cached.text == plain.text and cached.completion_tokens == plain.completion_tokens
    assert cached.cached_tokens > 0 and plain.cached_tokens == 0
    assert [h.id for h in cached.hits] == [h.id for h in plain.hits] and len(cached.hits) == 3
    query_ids = encoder.encode_with_cache("where did the cat sit")[1]
    prompt = query_ids + rag.prompt_tail("where did the cat sit", cached.hits)
    assert cached.prompt_tokens == len(prompt)


def test_a_mean_pooled_query_leaves_the_prompt_tokenizer_untouched(tiny_dir, tmp_path):
    """A fast tokenizer switched to truncation while another thread tokenizes a prompt fails: a query embedded
    with truncation (mean pooling) must not switch the encoder's own tokenizer, which prompts use."""
    enc = Encoder.from_pretrained(str(tiny_dir), precision="fp32", max_length=64, pooling="mean")
    rag = RAG(enc, VectorIndex.build(enc, PASSAGES, tmp_path / "idx"))
    answer = rag.answer("where did the cat sit", params=GenerationParams(max_new_tokens=4))
    enc.tokenizer("a prompt")  # as prompts are tokenized: no truncation
    hits = rag.retrieve("where did the cat sit")
    assert enc.tokenizer.backend_tokenizer.truncation is None, "the query's truncation switched the shared tokenizer"
    assert [h.id for h in hits] == [h.id for h in answer.hits] and answer.cached_tokens == 0


def test_encode_with_cache_matches_encode(encoder):
    vector, ids, cache = encoder.encode_with_cache("the river flows north")
    np.testing.assert_allclose(vector, encoder.encode(["the river flows north"])[0], atol=1e-5)
    assert ids[-1] == encoder.tokenizer.eos_token_id and cache.get_seq_length() == len(ids)


def test_rag_refuses_a_prompt_over_the_context(encoder, tmp_path):
    rag = RAG(encoder, VectorIndex.build(encoder, PASSAGES, tmp_path / "idx"))
    with pytest.raises(ValueError, match="context"):
        rag.answer("the cat " * 150, params=GenerationParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="empty"):
        rag.answer("   ")


def test_index_and_ask_commands(tiny_model_dirs, tmp_path, capsys):
    from unimae.cli import main

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"id": pid, "text": text}) + "\n" for pid, text in PASSAGES))
    tiny = str(tiny_model_dirs["llama"])
    out = str(tmp_path / "idx")
    assert main(["index", "--model", tiny, "--corpus", str(corpus), "--output-dir", out, "--precision", "fp32"]) == 0
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["count"] == len(PASSAGES) and manifest["model"] == tiny
    capsys.readouterr()
    assert main(["ask", SENTENCES[2], "--index", out, "--json", "--max-new-tokens", "4", "--precision", "fp32"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["object"] == "rag.answer" and answer["model"] == tiny  # the layout POST /v1/rag returns
    assert answer["passages"][0]["id"] == "p2" and answer["usage"]["cached_prompt_tokens"] > 0
    assert main(["ask", "x", "--index", str(tmp_path / "missing")]) == 2
    model = tmp_path / "model"  # a local model folder rebuilt in place is not resumed into the old shards
    shutil.copytree(tiny, model)
    build = ["index", "--model", str(model), "--corpus", str(corpus), "--output-dir", str(tmp_path / "idx2")]
    assert main([*build, "--precision", "fp32"]) == 0
    os.utime(model / "config.json", ns=(0, 0))
    capsys.readouterr()
    assert main([*build, "--precision", "fp32"]) == 2 and "model_revision" in capsys.readouterr().err


def _replace_index_faiss(directory, dim: int) -> None:
    """Overwrite index.faiss with a flat index of random unit vectors (as many as the passages, ``dim`` wide)."""
    import faiss

    vectors = np.random.default_rng(0).standard_normal((len(PASSAGES), dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = faiss.IndexFlatIP(dim)
    index.add(vectors)
    faiss.write_index(index, str(directory / "index.faiss"))


def test_an_index_faiss_replaced_by_other_vectors_is_refused(encoder, tmp_path):
    """Before: random vectors of the right shape loaded silently (top scores 0.07 instead of 0.96)."""
    built = VectorIndex.build(encoder, PASSAGES, tmp_path / "idx", IndexConfig(shard_size=5))
    _replace_index_faiss(tmp_path / "idx", built.dim)
    with pytest.raises(VectorIndexError, match="index.faiss does not match the SHA-256 in manifest.json"):
        VectorIndex.load(tmp_path / "idx")
    recorded = json.loads((tmp_path / "idx" / "manifest.json").read_text())["sha256"]
    assert sorted(recorded["shards"]) == ["00000000.npy", "00000005.npy", "00000010.npy"]
    VectorIndex.build(encoder, PASSAGES, tmp_path / "idx", IndexConfig(shard_size=5))  # as the message says
    assert len(VectorIndex.load(tmp_path / "idx")) == len(PASSAGES)


def _as_before_hashes(directory) -> None:
    """Drop the hashes from a manifest, as unimae wrote it before it recorded them."""
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest.pop("sha256", None)
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_an_index_without_recorded_hashes_loads_with_a_warning(encoder, tmp_path, caplog):
    VectorIndex.build(encoder, PASSAGES, tmp_path / "idx")
    _as_before_hashes(tmp_path / "idx")
    with caplog.at_level("WARNING", logger="unimae.retrieval.index"):
        assert len(VectorIndex.load(tmp_path / "idx")) == len(PASSAGES)
    assert "index.faiss is not verified" in caplog.text


def test_an_index_of_another_dimension_is_a_clear_error(encoder, tmp_path):
    """Before: a bare AssertionError from FAISS at the first search (here without recorded hashes, which would
    catch the swap first)."""
    built = VectorIndex.build(encoder, PASSAGES, tmp_path / "idx")
    _as_before_hashes(tmp_path / "idx")
    _replace_index_faiss(tmp_path / "idx", built.dim + 8)
    with pytest.raises(VectorIndexError, match=rf"holds {built.dim + 8}-dimensional vectors.*says {built.dim}"):
        VectorIndex.load(tmp_path / "idx")


def test_a_shard_overwritten_in_place_is_embedded_again(encoder, tmp_path, monkeypatch):
    """Before: a shard of the same size with other bytes (here NaN) was reused, and the index built with NaN rows."""
    config = IndexConfig(shard_size=4)
    VectorIndex.build(encoder, PASSAGES, tmp_path / "idx", config)
    shard = tmp_path / "idx" / "shards" / "00000004.npy"
    reference, size = np.load(shard), shard.stat().st_size
    np.save(shard, np.full_like(reference, np.nan))
    assert shard.stat().st_size == size
    calls = []
    original = encoder.encode
    monkeypatch.setattr(encoder, "encode", lambda texts, **kw: calls.append(len(texts)) or original(texts, **kw))
    rebuilt = VectorIndex.build(encoder, PASSAGES, tmp_path / "idx", config)
    assert calls == [4], "only the damaged shard is embedded again"
    np.testing.assert_allclose(np.load(shard), reference, atol=1e-6)
    hits = rebuilt.search(encoder.encode([PASSAGES[5][1]], normalize=True), k=1)
    assert hits[0][0].id == PASSAGES[5][0]


def test_a_resumed_build_hashes_each_shard_once_until_it_is_rewritten(tmp_path, monkeypatch):
    """Before: a Ray build read every existing shard's bytes three times (before its job, for it, after it)."""
    from unimae.retrieval import index as index_module

    hashed = []
    real = index_module.file_sha256
    monkeypatch.setattr(index_module, "file_sha256", lambda path: hashed.append(Path(path).name) or real(path))
    shards = tmp_path / "shards"
    shards.mkdir()
    index_module.write_shard(shards, 0, np.ones((4, 8), dtype=np.float32))
    for _ in range(3):
        assert index_module._shard_ok(shards, 0, 4, 10, 8)
    assert hashed == ["00000000.npy"]
    index_module.write_shard(shards, 0, np.full((4, 8), 2.0, dtype=np.float32))  # a new file at the path
    assert index_module._shard_ok(shards, 0, 4, 10, 8) and hashed == ["00000000.npy"] * 2


def test_a_passages_file_swapped_for_another_is_refused(encoder, tmp_path):
    VectorIndex.build(encoder, PASSAGES, tmp_path / "idx")
    path = tmp_path / "idx" / "passages.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join([lines[1], lines[0], *lines[2:]]))  # valid JSON, every text labelled wrong
    with pytest.raises(VectorIndexError, match="passages.jsonl is not the file this index was built from"):
        VectorIndex.load(tmp_path / "idx")


def test_the_rag_benchmark_pairs_both_setups_over_every_paragraph(monkeypatch):
    """benchmarks/load_test.py: acc@1 over every paragraph's question, its standard error, and the discordant
    pairs of the one- and two-model setups (the per-paragraph lists leave the recorded entries)."""
    import importlib.util

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("load_test", bench / "load_test.py")
    load_test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load_test)

    passages = [("a", "alpha " * 20), ("b", "beta words here"), ("c", "gamma " * 3)]
    assert load_test.question_of(passages[0][1]) == " ".join(["alpha"] * 12)
    found = load_test.all_paragraph_hits(passages, lambda qs: ["a", "x", "c"][: len(qs)])
    assert found == [1, 0, 1]
    one = {"mode": "one", **load_test.all_paragraphs_summary(found)}
    assert one["all_paragraphs"] == 3 and one["all_paragraphs_acc_at_1"] == round(2 / 3, 4)
    assert one["all_paragraphs_acc_at_1_se"] == round((2 / 3 * 1 / 3 / 3) ** 0.5, 4)
    two = {"mode": "two", **load_test.all_paragraphs_summary([0, 1, 1])}
    assert load_test.paired([one, two]) == {"paragraphs": 3, "one_only": 1, "two_only": 1, "mcnemar_p": 1.0}
    assert load_test.mcnemar_p(0, 0) == 1.0 and load_test.mcnemar_p(0, 5) == round(2 / 32, 6)
    assert "all_paragraph_hits" not in one and "all_paragraph_hits" not in two


def test_an_index_built_with_a_release_finds_it_again_after_the_project_moved(tiny_model_dirs, tmp_path, monkeypatch):
    """The manifest records the release's folder; once that path is gone (the clone moved), the release of that
    name found here is used, and its revision still has to match."""
    import torch
    from peft import LoraConfig, get_peft_model

    from unimae.adapter import AdapterMeta, adapter_revision, base_fingerprint, quiet_peft, write_adapter_meta
    from unimae.embedding.spec import EmbeddingSpec
    from unimae.models import load_model
    from unimae.release import RELEASES_ENV
    from unimae.retrieval.rag import load_index_and_encoder

    tiny = str(tiny_model_dirs["llama"])
    old, new = tmp_path / "old" / "rel-a", tmp_path / "releases" / "rel-a"
    model, _, _ = load_model(tiny)
    torch.manual_seed(3)
    with quiet_peft():
        lora = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        )
    lora.save_pretrained(old)
    write_adapter_meta(old, AdapterMeta(tiny, base_fingerprint(model), EmbeddingSpec()))
    encoder = Encoder.from_pretrained(tiny, adapter=str(old), precision="fp32", max_length=32)
    source = {"model": tiny, "adapter": str(old), "adapter_revision": adapter_revision(str(old))}
    VectorIndex.build(encoder, [(f"p{i}", t) for i, t in enumerate(SENTENCES)], tmp_path / "idx", source=source)
    shutil.copytree(old, new)
    shutil.rmtree(old)
    monkeypatch.setenv(RELEASES_ENV, str(new.parent))
    loaded, index = load_index_and_encoder(tmp_path / "idx", precision="fp32")
    assert index.search(loaded.encode([SENTENCES[2]], normalize=True), k=1)[0][0].id == "p2"
    (new / "adapter_model.safetensors").write_bytes((new / "adapter_model.safetensors").read_bytes()[:-8] + bytes(8))
    with pytest.raises(VectorIndexError, match=r"built with adapter revision .*rel-a\), but .*another adapter"):
        load_index_and_encoder(tmp_path / "idx", precision="fp32")
