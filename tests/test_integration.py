"""Integration tests on the real offline SmolLM2-135M (dequantized from its PyPI GGUF once).

Marked ``integration``; `make test` (and CI) runs them. They use the user's model cache
(``~/.cache/unimae`` or ``$UNIMAE_CACHE_REAL``), so only the first run pays the dequantization.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import REAL_CACHE

pytestmark = pytest.mark.integration


@pytest.fixture
def real_cache(monkeypatch):
    monkeypatch.setenv("UNIMAE_CACHE", REAL_CACHE)


def test_train_a_few_steps_of_real_smollm2(real_cache, tmp_path):
    from unimae.encoder import Encoder
    from unimae.training.config import TrainConfig
    from unimae.training.trainer import train

    config = TrainConfig(
        output_dir=str(tmp_path / "run"), steps=2, batch_size=4, micro_batch_size=2, max_length=48, save_every=1
    )
    result = train(config)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2]
    assert all(np.isfinite(r["loss"]) and 0 < r["mar"] < 20 and 0 < r["mrc"] < 20 for r in log)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["mask_token"] not in ("<|im_start|>", "<|im_end|>")
    enc = Encoder.from_pretrained("smollm2-135m", adapter=str(result.adapter_dir), merge=False, max_length=64)
    assert enc.encode(["a sentence"]).shape == (1, 576)
    with enc.adapter_disabled():
        base_text = enc.generate("The capital of France is", max_new_tokens=6)
    plain = Encoder.from_pretrained("smollm2-135m").generate("The capital of France is", max_new_tokens=6)
    assert base_text == plain

    from sentence_transformers import SentenceTransformer

    from unimae.export import export

    texts = ["A man is playing a guitar.", "Stocks fell sharply on Monday."]
    st_dir = export("smollm2-135m", str(result.adapter_dir), tmp_path / "st", fmt="sentence-transformers")
    theirs = SentenceTransformer(str(st_dir), device="cpu").encode(texts, normalize_embeddings=True)
    ours = Encoder.from_pretrained("smollm2-135m", adapter=str(result.adapter_dir), precision="fp32").encode(
        texts, normalize=True
    )
    assert (ours * theirs).sum(1).min() >= 0.9999


def test_real_model_embeddings_batch_and_padding_invariant(smollm2_encoder):
    texts = [
        "A man is playing a guitar.",
        "Two dogs run through a snowy field near the old farm house.",
        "",
        "Stocks fell.",
        "The cat sat on the mat while the children played outside in the rain.",
    ]
    ref = np.stack([smollm2_encoder.encode([t])[0] for t in texts])
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    try:
        for side in ("left", "right"):
            smollm2_encoder.padding_side = side
            got = smollm2_encoder.encode(texts, batch_size=3, normalize=True)
            assert (got * ref).sum(1).min() >= 0.999, side
    finally:  # the session's encoder, shared with the later tests
        smollm2_encoder.padding_side = "right"


def test_real_model_generates_sensible_text(smollm2_encoder):
    text = smollm2_encoder.generate("What is the capital of France?", max_new_tokens=12, chat=True)
    assert "Paris" in text


def test_corrupt_gguf_cache_is_rebuilt(tmp_path, monkeypatch):
    from unimae.models import load_model, resolve_model_path

    monkeypatch.setenv("UNIMAE_CACHE", str(tmp_path / "cache"))
    first = resolve_model_path("smollm2-135m")
    weights = first / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as handle:
        handle.truncate(size // 2)  # a half-written cache entry
    model, _, path = load_model("smollm2-135m")
    assert path == first and weights.stat().st_size == size
    assert model.config.hidden_size == 576


def test_real_model_rag_reuses_the_query_cache_without_changing_the_answer(smollm2_encoder, tmp_path):
    from unimae.data.corpus import load_passages
    from unimae.generation.sampling import GenerationParams
    from unimae.retrieval.index import VectorIndex
    from unimae.retrieval.rag import RAG

    passages = load_passages("enwiki-gensim:heldout")[:40]
    rag = RAG(smollm2_encoder, VectorIndex.build(smollm2_encoder, passages, tmp_path / "index"))
    question = " ".join(passages[7][1].split()[:12])
    params = GenerationParams(max_new_tokens=24)
    cached = rag.answer(question, params=params)
    plain = rag.answer(question, params=params, reuse_kv=False)
    assert [h.id for h in cached.hits] == [h.id for h in plain.hits] and len(cached.hits) == 3
    assert cached.cached_tokens > 5 and cached.prompt_tokens > 200
    assert cached.text == plain.text and cached.text.strip()


def _releases() -> list:
    from unimae.release import REPOSITORY_RELEASES

    found = sorted(p.parent.name for p in REPOSITORY_RELEASES.glob("*/unimae.json"))
    return found or [pytest.param(None, marks=pytest.mark.skip(reason="no release in releases/ yet"))]


@pytest.mark.parametrize("name", _releases())
def test_a_release_reproduces_its_cards_sts17(real_cache, name, tmp_path):
    """Each released adapter loads by name on its real base model and scores STS17 within 0.05 of its card
    (the card's number is its fp32 adapter's; the release stores bf16 weights: the bound checks both)."""
    from conftest import SHARED_DATA

    from unimae.evaluation.embeddings import evaluate_embeddings
    from unimae.release import card_scores, release_meta, resolve_adapter

    if not (SHARED_DATA / "sts").is_dir():
        pytest.skip(f"evaluation data not found at {SHARED_DATA} (set UNIMAE_DATA)")
    folder = resolve_adapter(name)
    card = card_scores((Path(folder) / "README.md").read_text())
    assert "STS17" in card, "the card has no STS17 score to check"
    model = release_meta(folder).base_model
    run = evaluate_embeddings(model, ["STS17"], tmp_path, adapter=name, data_dir=SHARED_DATA, use_cache=False)
    assert abs(run.scores["STS17"] * 100 - card["STS17"]) <= 0.05 + 0.005  # the card rounds to 2 decimals
