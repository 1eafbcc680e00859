"""Query/document prompts, Matryoshka dimensions and quantized vectors on tiny random models: the input ids a
prompt gives, training with prompts per source, the Matryoshka loss, truncation, int8/binary round trips,
and continuing an adapter's training where its checkpoints are gone."""

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import post_embeddings, read_log
from test_contrastive import _config, _method, _records, _write

from unimae.adapter import adapter_meta, adapter_revision, embedding_spec
from unimae.embedding.spec import EmbeddingSpec
from unimae.embedding.vectors import finish_embeddings
from unimae.encoder import Encoder
from unimae.losses.info_nce import info_nce
from unimae.losses.supervised_contrastive import ContrastiveObjective
from unimae.models import load_model
from unimae.training.methods.base import pooled_batch
from unimae.training.methods.contrastive import parse_dims
from unimae.training.trainer import train

QUERY = "Instruct: find the passage\nQuery: "


def _encoder(tiny_dir, **spec) -> Encoder:
    model, tokenizer, _ = load_model(str(tiny_dir), dtype=torch.float32)
    return Encoder(model, tokenizer, precision="fp32", max_length=32, spec=EmbeddingSpec(**spec))


def test_a_prompt_is_a_text_prefix_that_truncation_keeps(tiny_model_dirs):
    enc = _encoder(tiny_model_dirs["llama"], prompts={"query": QUERY, "document": ""})
    text = "a cat sat on the mat"
    plain = enc.spec.build_inputs(enc.tokenizer, [text], 32)[0].ids
    prompted = enc.spec.build_inputs(enc.tokenizer, [text], 32, prompt=QUERY)[0].ids
    assert prompted == enc.spec.build_inputs(enc.tokenizer, [QUERY + text], 32)[0].ids
    assert len(prompted) > len(plain) and prompted[-1] == plain[-1] == enc.tokenizer.eos_token_id
    short = enc.spec.build_inputs(enc.tokenizer, [text * 20], 12, prompt=QUERY)[0].ids  # the text's end is cut
    prefix = enc.tokenizer(QUERY, add_special_tokens=True)["input_ids"]
    assert short[: min(len(prefix), 11)] == prefix[:11] and len(short) == 12
    np.testing.assert_array_equal(enc.encode_query([text]), enc.encode([QUERY + text]))
    np.testing.assert_array_equal(enc.encode_document([text]), enc.encode([text]))  # document prompt ''
    np.testing.assert_array_equal(enc.encode([text], prompt="x: "), enc.encode(["x: " + text]))
    with pytest.raises(ValueError, match="unknown prompt 'passage'.*'document', 'query'"):
        enc.encode([text], prompt_name="passage")


def test_prompts_and_dimensions_travel_in_the_spec_and_old_specs_read_the_same():
    spec = EmbeddingSpec(prompts={"query": QUERY}, matryoshka_dims=(128, 64, 64))
    assert spec.matryoshka_dims == (64, 128) and spec.prompt("query") == QUERY and spec.prompt(None) == ""
    assert EmbeddingSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert EmbeddingSpec().to_dict() == {"attention": "causal", "pooling": "eos", "pooling_options": {}}
    assert "prompts" in spec.describe() or "query" in spec.describe()


def test_dimensions_truncate_then_renormalise(tiny_model_dirs):
    enc = _encoder(tiny_model_dirs["llama"], matryoshka_dims=(8,))
    full = enc.encode(["one text", "another text"])
    cut = enc.encode(["one text", "another text"], dimensions=8, normalize=True)
    assert cut.shape == (2, 8)
    np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(cut, full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True), rtol=1e-5)
    for bad in (0, enc.embedding_dim + 1, 2.5):
        with pytest.raises(ValueError, match="dimensions must be an integer"):
            enc.encode(["x"], dimensions=bad)


def test_an_untrained_size_warns_once_and_an_index_warns_before_its_progress_bar(tiny_model_dirs, tmp_path):
    """Before: every shard's encode call warned again, each time inside the progress bar's line."""
    from unimae.embedding import vectors
    from unimae.retrieval.index import IndexConfig, VectorIndex

    vectors._warn_untrained.cache_clear()
    enc = _encoder(tiny_model_dirs["llama"], matryoshka_dims=(8,))
    events = []
    real_encode = enc.encode_document
    enc.encode_document = lambda *args, **kwargs: events.append("shard") or real_encode(*args, **kwargs)

    class Record(logging.Handler):  # the warnings, in order with the shards
        def emit(self, record):
            events.append(record.getMessage())

    handler = Record(logging.WARNING)
    vectors.logger.addHandler(handler)
    try:
        passages = [(f"p{i}", f"passage number {i}") for i in range(9)]
        VectorIndex.build(enc, passages, tmp_path / "idx", IndexConfig(dimensions=6, shard_size=3))
        warning = "dimensions=6: this adapter was not trained to embed with 6 dimensions (Matryoshka dimensions: [8])"
        assert events == [warning, "shard", "shard", "shard"]
        enc.encode(["again"], dimensions=6)
        enc.encode(["trained"], dimensions=8)
        assert events.count(warning) == 1 and len(events) == 4
    finally:
        vectors.logger.removeHandler(handler)


def test_int8_and_binary_vectors_round_trip():
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((50, 64)).astype(np.float32)
    ranges = np.stack([vectors.min(0), vectors.max(0)])
    q = finish_embeddings(vectors, None, False, "int8", ranges=ranges)
    assert q.dtype == np.int8 and q.shape == (50, 64)
    steps = (ranges[1] - ranges[0]) / 255
    back = (q.astype(np.float32) + 128) * steps + ranges[0]
    assert np.abs(back - vectors).max() <= steps.max() + 1e-5
    bits = finish_embeddings(vectors, None, False, "ubinary")
    assert bits.dtype == np.uint8 and bits.shape == (50, 8)
    np.testing.assert_array_equal(np.unpackbits(bits, axis=1).astype(bool), vectors > 0)
    with pytest.raises(ValueError, match="precision must be one of"):
        finish_embeddings(vectors, None, False, "int4")


def test_matryoshka_loss_is_the_sum_over_normalised_prefixes(tiny_model_dirs):
    model, _, _ = load_model(str(tiny_model_dirs["llama"]), dtype=torch.float32)
    dims = model.config.hidden_size
    objective = ContrastiveObjective(model, matryoshka_dims=(4, 8))
    z = torch.randn(10, dims)
    batch = {"num_queries": 5}
    expected = sum(info_nce(z[:5, :m], z[5:, :m], 0.05) for m in (4, 8, dims))
    torch.testing.assert_close(objective.loss(z, batch), expected)
    torch.testing.assert_close(ContrastiveObjective(model).loss(z, batch), info_nce(z[:5], z[5:], 0.05))
    with pytest.raises(ValueError, match="at most the model's size"):
        ContrastiveObjective(model, matryoshka_dims=(dims + 1,))
    assert parse_dims("256, 64,128") == (64, 128, 256) and parse_dims("") == ()
    with pytest.raises(ValueError, match="comma-separated integers"):
        parse_dims("64,big")


def test_collate_prompts_asymmetric_sources_only(tiny_model_dirs, tmp_path):
    _, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]), dtype=torch.float32)
    qa = _write(tmp_path / "qa.jsonl", _records(6, negatives=False))
    para = _write(tmp_path / "para.jsonl", _records(6, start=10, negatives=False))
    data = f"{qa},{para}"
    method = _method(tokenizer, data=data, query_prompt=QUERY, document_prompt="D: ", symmetric_sources="para")
    pairs = method.load_data()
    by_source = {s: [p for p in pairs if p["source"] == s] for s in ("qa", "para")}
    for source, prompted in (("qa", True), ("para", False)):
        rows = by_source[source]
        got = method.collate(rows, list(range(len(rows))))["input_ids"]
        texts = [(QUERY if prompted else "") + r["query"] for r in rows]
        texts += [("D: " if prompted else "") + r["positive"] for r in rows]
        want = pooled_batch(tokenizer, texts, 24, EmbeddingSpec())["input_ids"]
        assert torch.equal(got, want)
    assert method.embedding_spec().prompt_map == {"query": QUERY, "document": "D: "}
    with pytest.raises(ValueError, match="not among the --data sources"):
        _method(tokenizer, data=data, symmetric_sources="nli").load_data()


def test_query_prompt_dropout_leaves_a_seeded_share_of_queries_unprompted(tiny_model_dirs, tmp_path):
    _, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]), dtype=torch.float32)
    data = _write(tmp_path / "qa.jsonl", _records(6, negatives=False))
    data = str(data)
    method = _method(tokenizer, data=data, query_prompt=QUERY, query_prompt_dropout=0.5)
    prefixes = [method._query_prefix(QUERY, i) for i in range(400)]
    assert 150 < prefixes.count("") < 250 and set(prefixes) == {"", QUERY}  # about half, no other text
    again = _method(tokenizer, data=data, query_prompt=QUERY, query_prompt_dropout=0.5)
    assert [again._query_prefix(QUERY, i) for i in range(400)] == prefixes  # a function of (seed, index)
    rows = method.load_data()
    batch = method.collate(rows, list(range(len(rows))))["input_ids"]
    texts = [prefixes[i] + r["query"] for i, r in enumerate(rows)] + [r["positive"] for r in rows]
    assert torch.equal(batch, pooled_batch(tokenizer, texts, 24, EmbeddingSpec())["input_ids"])
    plain = _method(tokenizer, data=data, query_prompt=QUERY)
    assert all(plain._query_prefix(QUERY, i) == QUERY for i in range(50))  # the default: every query prompted
    with pytest.raises(ValueError, match=r"query-prompt-dropout must be in \[0, 1\]"):
        _method(tokenizer, data=data, query_prompt=QUERY, query_prompt_dropout=1.5)


def test_trained_adapter_carries_prompts_and_dimensions(tiny_model_dirs, tmp_path):
    data = _write(tmp_path / "pairs.jsonl", _records(12))
    out = tmp_path / "run"
    train(_config(tiny_model_dirs["llama"], data, out, query_prompt=QUERY, matryoshka_dims="4,8", steps=2))
    adapter = out / "adapter"
    spec = embedding_spec(adapter)
    assert spec.prompt_map == {"query": QUERY, "document": ""} and spec.matryoshka_dims == (4, 8)
    # the sentence-transformers export carries the prompts: its encode_query is unimae's encode_query
    from sentence_transformers import SentenceTransformer

    from unimae.export import export

    tiny = str(tiny_model_dirs["llama"])
    exported = export(tiny, str(adapter), tmp_path / "st", fmt="sentence-transformers", max_length=32)
    st = SentenceTransformer(str(exported))
    ours = Encoder.from_pretrained(tiny, adapter=str(adapter), precision="fp32", max_length=32)
    texts = ["the cat sat on the mat", "a dog"]
    theirs = st.encode_query(texts, normalize_embeddings=True)
    assert (theirs * ours.encode_query(texts, normalize=True)).sum(1).min() >= 0.9999
    assert (theirs * ours.encode(texts, normalize=True)).sum(1).min() < 0.9999  # the prompt changed them
    assert "Prompt `query`" in (tmp_path / "st" / "README.md").read_text()


def test_continue_adapter_picks_up_its_weights_step_and_data_order(tiny_model_dirs, tmp_path):
    data = _write(tmp_path / "pairs.jsonl", _records(24))
    tiny = tiny_model_dirs["llama"]
    train(_config(tiny, data, tmp_path / "a", steps=2))
    whole = tmp_path / "whole"
    train(_config(tiny, data, whole, steps=4))
    # the loss of a step is computed before its update: step 3 of the continued run sees the weights and the
    # batch that step 3 of the uninterrupted run saw
    cont = tmp_path / "b"
    train(_config(tiny, data, cont, steps=4, continue_adapter=str(tmp_path / "a" / "adapter")))
    log, reference = read_log(cont), read_log(whole)
    assert [r["step"] for r in log] == [3, 4]
    assert [r["tokens"] for r in log] == [r["tokens"] for r in reference[2:]]
    assert log[0]["loss"] == pytest.approx(reference[2]["loss"], rel=1e-5)
    assert adapter_meta(cont / "adapter").trained_steps == 4
    with pytest.raises(ValueError, match="already holds 2 steps"):
        train(_config(tiny, data, tmp_path / "c", steps=2, continue_adapter=str(tmp_path / "a" / "adapter")))
    with pytest.raises(ValueError, match="differ from its run"):
        train(
            _config(
                tiny,
                data,
                tmp_path / "d",
                steps=4,
                temperature=0.1,
                continue_adapter=str(Path(tmp_path / "a" / "adapter")),
            )
        )
    # another mix of the same sources (an annealing stage) continues; another file would not
    mix = f"{data},{_write(tmp_path / 'more.jsonl', _records(24))}"
    train(_config(tiny, mix, tmp_path / "m1", steps=2, data_weights="1,1"))
    annealed = tmp_path / "m2"
    train(_config(tiny, mix, annealed, steps=3, data_weights="0,1", continue_adapter=str(tmp_path / "m1/adapter")))
    assert adapter_meta(annealed / "adapter").training_config["options"]["data_weights"] == "0,1"
    assert [r["step"] for r in read_log(annealed)] == [3]
    with pytest.raises(ValueError, match="differ from its run.*data"):
        train(_config(tiny, data, tmp_path / "m3", steps=3, continue_adapter=str(tmp_path / "m1/adapter")))
    source = str(tmp_path / "a" / "adapter")  # trained on the base alone, its LoRA started fresh
    with pytest.raises(ValueError, match="is not the stage --continue-adapter"):
        train(
            _config(tiny, data, tmp_path / "e", steps=4, continue_adapter=source, init_adapter=str(whole / "adapter"))
        )
    with pytest.raises(ValueError, match="is not the LoRA --continue-adapter"):
        train(_config(tiny, data, tmp_path / "f", steps=4, continue_adapter=source, init_lora=str(whole / "adapter")))


def test_server_input_type_and_dimensions(tiny_model_dirs):
    trained = _encoder(tiny_model_dirs["llama"], prompts={"query": QUERY}, matryoshka_dims=(8,))
    full = trained.embedding_dim
    texts = ["the cat sat", "a dog ran"]
    query, document, cut, whole, wide, zero = post_embeddings(
        trained,
        [
            {"input": texts, "input_type": "query"},
            {"input": texts, "input_type": "document"},
            {"input": texts, "dimensions": 8},
            {"input": texts, "dimensions": full},
            {"input": texts, "dimensions": full + 1},
            {"input": texts, "dimensions": 0},
        ],
    )
    vectors = lambda r: np.array([d["embedding"] for d in r.json()["data"]])  # noqa: E731
    np.testing.assert_allclose(vectors(query), trained.encode_query(texts, normalize=True), atol=1e-5)
    np.testing.assert_allclose(vectors(document), trained.encode(texts, normalize=True), atol=1e-5)  # no such prompt
    np.testing.assert_allclose(vectors(cut), trained.encode(texts, dimensions=8, normalize=True), atol=1e-5)
    assert vectors(whole).shape == (2, full)
    for refused in (wide, zero):
        assert refused.status_code == 400 and "dimensions must be from 1 to" in refused.json()["error"]["message"]
    plain = _encoder(tiny_model_dirs["llama"])
    (untrained, bad_type) = post_embeddings(
        plain, [{"input": texts, "dimensions": 8}, {"input": texts, "input_type": "x"}]
    )
    assert untrained.status_code == 400 and "not trained for shorter ones" in untrained.json()["error"]["message"]
    assert bad_type.status_code == 400


@pytest.mark.parametrize(("kind", "rescore"), [("sq8", "int8"), ("binary", "bits"), ("binary", "int8")])
def test_quantized_indexes_find_each_passage(tiny_model_dirs, tmp_path, kind, rescore):
    from test_rag import PASSAGES

    from unimae.retrieval.index import IndexConfig, VectorIndex

    enc = _encoder(tiny_model_dirs["llama"])
    VectorIndex.build(enc, PASSAGES, tmp_path / "idx", IndexConfig(kind=kind, shard_size=5, rescore=rescore))
    loaded = VectorIndex.load(tmp_path / "idx")
    hits = loaded.search(enc.encode([t for _, t in PASSAGES], normalize=True), k=3)
    assert [h[0].id for h in hits] == [pid for pid, _ in PASSAGES]
    # cosine scale, best first; a vector against its own sign vector: about sqrt(2 / pi) = 0.8 for binary's bits
    assert all(h[0].score > 0.7 and h[0].score >= h[1].score for h in hits)
    assert (tmp_path / "idx" / "rescore.npy").is_file() == (kind == "binary" and rescore == "int8")
    VectorIndex.build(enc, PASSAGES, tmp_path / "idx", IndexConfig(shard_size=5))  # the same shards, now flat
    assert not any((tmp_path / "idx" / name).exists() for name in ("rescore.npy", "rescore.faiss"))


def test_int8_rescored_binary_index_scores_like_the_float_one_and_checks_its_store(tiny_model_dirs, tmp_path):
    from test_rag import PASSAGES

    from unimae.retrieval.index import IndexConfig, VectorIndex, VectorIndexError, _int8_rescored_search

    enc = _encoder(tiny_model_dirs["llama"])
    flat = VectorIndex.build(enc, PASSAGES, tmp_path / "flat", IndexConfig(shard_size=5))
    binary = VectorIndex.build(enc, PASSAGES, tmp_path / "bin", IndexConfig(kind="binary", rescore_multiplier=99))
    assert np.load(tmp_path / "bin" / "rescore.npy", mmap_mode="r").shape == (len(PASSAGES), enc.embedding_dim)
    queries = enc.encode_query(["where did the cat sit", "stock markets"], normalize=True)
    # every passage is a candidate (99 x k > N): the order is the float index's, the scores its up to int8 rounding
    want, got = flat.search(queries, k=5), VectorIndex.load(tmp_path / "bin").search(queries, k=5)
    assert [[h.id for h in row] for row in binary.search(queries, k=5)] == [[h.id for h in row] for row in got]
    one_by_one = _int8_rescored_search(binary.index, binary.rescore_store, queries, 5, 99, chunk=1)
    np.testing.assert_array_equal(
        one_by_one[1], _int8_rescored_search(binary.index, binary.rescore_store, queries, 5, 99)[1]
    )
    assert [[h.id for h in row] for row in got] == [[h.id for h in row] for row in want]
    np.testing.assert_allclose([[h.score for h in r] for r in got], [[h.score for h in r] for r in want], atol=0.02)
    codes = tmp_path / "bin" / "rescore.npy"
    data = bytearray(codes.read_bytes())
    data[-1] ^= 0xFF  # one code changed in place
    codes.write_bytes(bytes(data))
    with pytest.raises(VectorIndexError, match=r"rescore\.npy does not match the SHA-256"):
        VectorIndex.load(tmp_path / "bin")
    codes.unlink()
    with pytest.raises(VectorIndexError, match=r"rescore\.npy is missing: .* rerun `unimae index`"):
        VectorIndex.load(tmp_path / "bin")
    with pytest.raises(ValueError, match="rescore must be one of"):
        IndexConfig(kind="binary", rescore="float")


def test_index_cli_takes_rescore_for_a_binary_index_only():
    import argparse

    from unimae.cli.index import _index_config

    def config(**given):
        flags = {"kind": "binary", "rescore": None, "store": "memory", "shard_size": 8, "batch_size": 4}
        flags |= {"dimensions": None, "nlist": None, "nprobe": None, "pq_m": None, "rerank": None}
        return _index_config(argparse.Namespace(**(flags | {"target_recall": None} | given)))

    assert config().rescore == "int8" and config(rescore="bits").rescore == "bits"
    for refused in ({"kind": "flat", "rescore": "bits"}, {"kind": "flat", "store": "disk", "rescore": "int8"}):
        with pytest.raises(ValueError, match="rescore|--kind"):
            config(**refused)


def test_rag_embeds_queries_with_the_query_prompt_at_the_index_dimensions(tiny_model_dirs, tmp_path):
    from test_rag import PASSAGES

    from unimae.generation.sampling import GenerationParams
    from unimae.retrieval.index import IndexConfig, VectorIndex
    from unimae.retrieval.rag import RAG

    enc = _encoder(tiny_model_dirs["llama"], prompts={"query": QUERY, "document": "passage: "}, matryoshka_dims=(8,))
    index = VectorIndex.build(enc, PASSAGES, tmp_path / "idx", IndexConfig(dimensions=8))
    assert index.dim == 8 and np.load(tmp_path / "idx" / "shards" / "00000000.npy").shape[1] == 8
    docs = enc.encode([t for _, t in PASSAGES], prompt_name="document", dimensions=8, normalize=True)
    np.testing.assert_allclose(index.index.reconstruct_n(0, len(PASSAGES)), docs, atol=1e-5)
    rag = RAG(enc, index)
    question = "where did the cat sit"
    want = index.search(enc.encode_query([question], dimensions=8, normalize=True), k=3)[0]
    assert [h.id for h in rag.retrieve(question, k=3)] == [h.id for h in want]
    params = GenerationParams(max_new_tokens=6)
    cached, plain = rag.answer(question, params=params), rag.answer(question, params=params, reuse_kv=False)
    assert cached.text == plain.text and cached.cached_tokens > 0
    prompt_ids = enc.tokenizer(QUERY + question, add_special_tokens=True)["input_ids"]
    assert cached.prompt_tokens >= len(prompt_ids) + 1  # the reused prefix holds the query prompt


def test_init_lora_starts_one_lora_where_the_merged_stage_would(tiny_model_dirs, tmp_path):
    data = _write(tmp_path / "pairs.jsonl", _records(24))
    tiny = tiny_model_dirs["llama"]
    train(_config(tiny, data, tmp_path / "first", steps=2, lr=1e-2))
    first = tmp_path / "first" / "adapter"
    train(_config(tiny, data, tmp_path / "merged", steps=2, init_adapter=str(first)))
    train(_config(tiny, data, tmp_path / "one", steps=2, init_lora=str(first)))
    merged, one = read_log(tmp_path / "merged"), read_log(tmp_path / "one")
    # step 1's loss is computed before any update: the same function, merged into fp32 weights or kept as LoRA
    assert one[0]["loss"] == pytest.approx(merged[0]["loss"], rel=1e-5)
    fresh = read_log(tmp_path / "first")
    assert abs(one[0]["loss"] - fresh[0]["loss"]) > 1e-4  # ...and not the base model's
    adapter = tmp_path / "one" / "adapter"
    assert not (adapter / "init_adapter").exists()
    assert adapter_meta(adapter).init_lora_revision == adapter_revision(str(first))
    with pytest.raises(ValueError, match="pass one"):
        train(_config(tiny, data, tmp_path / "both", init_lora=str(first), init_adapter=str(first)))
    with pytest.raises(FileNotFoundError, match="not an adapter folder"):
        train(_config(tiny, data, tmp_path / "none", init_lora=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="first stage, does not exist"):  # before: the default spec, silently
        train(_config(tiny, data, tmp_path / "gone", init_lora=str(tmp_path / "gone-stage" / "adapter")))
    tokens = tmp_path / "tokens"  # an adapter that also trains token rows (GEM's summary tokens)
    shutil.copytree(first, tokens)
    config = json.loads((tokens / "adapter_config.json").read_text())
    (tokens / "adapter_config.json").write_text(json.dumps({**config, "trainable_token_indices": [5]}))
    with pytest.raises(ValueError, match="trains token embedding rows"):
        train(_config(tiny, data, tmp_path / "rows", init_lora=str(tokens)))


def test_encode_takes_sentence_transformers_spellings_instead_of_ignoring_them(tiny_model_dirs):
    """Before: ``normalize_embeddings=True`` was swallowed by ``**quantize_options`` and the vectors came back
    unnormalised. Now sentence-transformers' spellings are taken (tests/test_encoder.py) and others refused."""
    enc = _encoder(tiny_model_dirs["llama"], prompts={"query": QUERY})
    normalized = enc.encode(["x", "a dog"], normalize_embeddings=True, truncate_dim=8)
    np.testing.assert_array_equal(normalized, enc.encode(["x", "a dog"], normalize=True, dimensions=8))
    with pytest.raises(TypeError, match=r"unexpected keyword arguments: normalise_embeddings"):  # a misspelling
        enc.encode(["x"], normalise_embeddings=True)
    full = enc.encode(["one text", "two"])
    np.testing.assert_array_equal(enc.encode(["one text", "two"], dimensions=np.int64(8)), full[:, :8])


def test_int8_codes_take_ranges_from_full_size_calibration_vectors_finished_alike(tiny_model_dirs):
    enc = _encoder(tiny_model_dirs["llama"], matryoshka_dims=(8,))
    calibration = enc.encode(["a cat", "a dog", "the rain", "an old river"])  # (4, D) full size, unnormalised
    finished = calibration[:, :8] / np.linalg.norm(calibration[:, :8], axis=1, keepdims=True)
    ranges = np.stack([finished.min(0), finished.max(0)])
    expected = enc.encode(["a bird"], dimensions=8, normalize=True, precision="int8", ranges=ranges)
    got = enc.encode(["a bird"], dimensions=8, normalize=True, precision="int8", calibration_embeddings=calibration)
    np.testing.assert_array_equal(got, expected)
    with pytest.raises(ValueError, match="of one vector needs per-dimension ranges"):
        enc.encode(["a bird"], precision="int8")
    with pytest.raises(ValueError, match="calibration_embeddings must be"):
        enc.encode(["a", "b"], precision="int8", calibration_embeddings=calibration[:, :5])
    with pytest.raises(ValueError, match=r"ranges must be \(2, 8\)"):
        enc.encode(["a", "b"], dimensions=8, precision="int8", ranges=ranges[:, :4])


def test_encode_tokenizes_a_large_list_block_by_block_with_the_same_vectors(tiny_model_dirs, monkeypatch):
    import unimae.encoder

    enc = _encoder(tiny_model_dirs["llama"])
    texts = ["a cat", "a much longer text about the weather today", "", "dogs", "the river flows to the sea"]
    whole = enc.encode(texts)
    seen, build = [], EmbeddingSpec.build_inputs

    def counted(spec, tokenizer, block, *args, **kwargs):
        seen.append(len(block))
        return build(spec, tokenizer, block, *args, **kwargs)

    monkeypatch.setattr(unimae.encoder, "ENCODE_BLOCK", 2)
    monkeypatch.setattr(EmbeddingSpec, "build_inputs", counted)
    np.testing.assert_allclose(enc.encode(texts), whole, rtol=1e-5, atol=1e-6)
    assert seen == [2, 2, 1]


def test_the_encode_bar_of_a_large_list_moves_with_every_batch(tiny_model_dirs, monkeypatch):
    import unimae.encoder

    updates = []

    class Bar(unimae.encoder.tqdm):
        def update(self, n=1):
            updates.append(n)
            return super().update(n)

    enc = _encoder(tiny_model_dirs["llama"])
    monkeypatch.setattr(unimae.encoder, "ENCODE_BLOCK", 2)
    monkeypatch.setattr(unimae.encoder, "tqdm", Bar)
    enc.encode(["a cat", "dogs", "the river", "", "a bird"], batch_size=1, show_progress=True)
    assert updates == [1] * 5  # one text a batch, not one block (4,096 texts) at a time
