"""Exports load offline in sentence-transformers / transformers and give unimae's embeddings."""

import json

import numpy as np
import pytest
import torch
from conftest import SENTENCES

TEXTS = SENTENCES[:5] + ["", "a"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sentence_transformers_export_matches_unimae(tiny_model_dirs, arch, tmp_path):
    from sentence_transformers import SentenceTransformer

    from unimae.encoder import Encoder
    from unimae.export import export

    tiny = str(tiny_model_dirs[arch])
    out = export(tiny, None, tmp_path / "st", fmt="sentence-transformers", max_length=16)
    st = SentenceTransformer(str(out), device="cpu")
    ours = Encoder.from_pretrained(tiny, precision="fp32", max_length=16).encode(TEXTS, normalize=True)
    theirs = st.encode(TEXTS, normalize_embeddings=True, batch_size=3)
    assert theirs.shape == ours.shape
    assert (ours * theirs).sum(1).min() >= 0.9999
    assert "Pooling" in (out / "README.md").read_text() or "pooling" in (out / "README.md").read_text().lower()
    # last-token pooling in both formats: "pooling_mode" (sentence-transformers >= 5.4) and the old flags
    # that older readers (vLLM's pooler detection among them) look for; the folder above loaded with both
    (pooling_config,) = out.glob("*_Pooling/config.json")
    config = json.loads(pooling_config.read_text())
    assert config.get("pooling_mode", "lasttoken") == "lasttoken" and config["pooling_mode_lasttoken"] is True
    assert config["pooling_mode_mean_tokens"] is False


def test_hf_export_loads_in_transformers_and_refuses_overwrite(tiny_model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    from unimae.export import export

    out = export(str(tiny_model_dirs["llama"]), None, tmp_path / "hf", fmt="hf")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.hidden_size == 64 and "EOS" in (out / "README.md").read_text()
    with pytest.raises(FileExistsError):
        export(str(tiny_model_dirs["llama"]), None, out, fmt="hf")


def test_an_export_that_fails_part_way_leaves_nothing_and_can_be_rerun(tiny_model_dirs, tmp_path, monkeypatch):
    from unimae.export import export, hf

    def fail_after_writing(model, adapter, out, spec, max_length, rotation):
        (out / "_transformer").mkdir()
        raise KeyboardInterrupt  # stopped mid-write

    saved = hf._save_sentence_transformers
    monkeypatch.setattr(hf, "_save_sentence_transformers", fail_after_writing)
    target = tmp_path / "st"
    with pytest.raises(KeyboardInterrupt):
        export(str(tiny_model_dirs["llama"]), None, target, fmt="sentence-transformers")
    assert not target.exists()
    monkeypatch.setattr(hf, "_save_sentence_transformers", saved)
    out = export(str(tiny_model_dirs["llama"]), None, target, fmt="sentence-transformers")
    assert (out / "modules.json").is_file() and not (out / "_transformer").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["st"]  # no partial folder left beside it


def _adapter_with_spec(tiny_dir, directory, spec):
    """A real (fresh) LoRA adapter of ``tiny_dir`` whose unimae.json records ``spec``."""
    from peft import LoraConfig, get_peft_model

    from unimae.adapter import AdapterMeta, base_fingerprint, write_adapter_meta
    from unimae.models import load_model

    model, _, _ = load_model(str(tiny_dir))
    fingerprint = base_fingerprint(model)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    lora.save_pretrained(directory)
    write_adapter_meta(directory, AdapterMeta(str(tiny_dir), fingerprint, spec))
    return str(directory)


@pytest.mark.parametrize(
    "spec",
    [
        {"attention": "bidirectional", "pooling": "mean"},
        {"attention": "gem", "pooling": "summary", "summary_ids": (5,)},
        {"attention": "causal", "pooling": "echo"},
    ],
    ids=["mntp", "gem", "echo"],
)
def test_sentence_transformers_export_refuses_what_it_cannot_express(tiny_model_dirs, tmp_path, spec):
    from unimae.embedding.spec import EmbeddingSpec
    from unimae.export import export

    adapter = _adapter_with_spec(tiny_model_dirs["llama"], tmp_path / "adapter", EmbeddingSpec(**spec))
    with pytest.raises(ValueError, match=f"embeds with {spec['attention']} attention, {spec['pooling']} pooling"):
        export(str(tiny_model_dirs["llama"]), adapter, tmp_path / "st", fmt="sentence-transformers")
    assert not (tmp_path / "st").exists(), "nothing written"


@pytest.mark.parametrize("fmt", ["hf", "sentence-transformers"])
def test_a_missing_rotation_is_refused_before_the_merge(tiny_model_dirs, tmp_path, monkeypatch, fmt):
    """Before: the rotation the adapter's unimae.json names was read only after the float32 merge was written."""
    from unimae.embedding.spec import EmbeddingSpec
    from unimae.export import export, hf

    spec = EmbeddingSpec(matryoshka_dims=(4,), rotation="0123456789ab")  # fitted, but its file was not copied
    adapter = _adapter_with_spec(tiny_model_dirs["llama"], tmp_path / "adapter", spec)

    def merge(*args, **kwargs):
        pytest.fail("merged before the missing rotation was refused")

    monkeypatch.setattr(hf, "save_merged", merge)
    monkeypatch.setattr(hf, "merged_model", merge)
    with pytest.raises(FileNotFoundError, match="names a Matryoshka rotation but neither"):
        export(str(tiny_model_dirs["llama"]), adapter, tmp_path / "out", fmt=fmt)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


def test_mean_adapter_exports_mean_pooling_and_hf_card_states_the_spec(tiny_model_dirs, tmp_path):
    from sentence_transformers import SentenceTransformer

    from unimae.adapter import embedding_spec
    from unimae.embedding.spec import EmbeddingSpec
    from unimae.encoder import Encoder
    from unimae.export import export

    tiny = str(tiny_model_dirs["llama"])
    mntp = _adapter_with_spec(tiny, tmp_path / "mntp", EmbeddingSpec("bidirectional", "mean"))
    hf = export(tiny, mntp, tmp_path / "hf", fmt="hf")
    assert "bidirectional attention, mean pooling" in (hf / "README.md").read_text()
    assert embedding_spec(hf) == EmbeddingSpec("bidirectional", "mean"), "the export keeps the spec in unimae.json"
    texts = SENTENCES[:4]
    for pooling, mode in (("mean", "mean"), ("wmean", "weightedmean")):  # unimae's and sentence-transformers' name
        causal = _adapter_with_spec(tiny, tmp_path / pooling, EmbeddingSpec("causal", pooling))
        out = export(tiny, causal, tmp_path / f"st-{pooling}", fmt="sentence-transformers", max_length=16)
        ours = Encoder.from_pretrained(tiny, adapter=causal, precision="fp32", max_length=16)
        assert ours.spec == EmbeddingSpec("causal", pooling)
        config = json.loads((out / "1_Pooling" / "config.json").read_text())
        assert config["pooling_mode"] == mode and config[f"pooling_mode_{mode}_tokens"] is True
        theirs = SentenceTransformer(str(out), device="cpu").encode(texts, normalize_embeddings=True)
        assert (ours.encode(texts, normalize=True) * theirs).sum(1).min() >= 0.9999, pooling


def test_sentence_transformers_export_carries_prompts_and_loads_with_truncate_dim(tiny_model_dirs, tmp_path):
    """The export's ``config_sentence_transformers.json`` holds the adapter's prompts (no default prompt), and a
    user who loads it as sentence-transformers users do (``truncate_dim`` at load, ``encode_query``, their
    keywords, ``similarity``) gets what the Encoder gives for the same calls."""
    from sentence_transformers import SentenceTransformer

    from unimae.embedding.spec import EmbeddingSpec
    from unimae.encoder import Encoder
    from unimae.export import export

    tiny = str(tiny_model_dirs["llama"])
    prompts = {"query": "Instruct: find the passage\nQuery: ", "document": ""}
    spec = EmbeddingSpec(prompts=prompts, matryoshka_dims=(8, 16))
    adapter = _adapter_with_spec(tiny_model_dirs["llama"], tmp_path / "adapter", spec)
    out = export(tiny, adapter, tmp_path / "st", fmt="sentence-transformers", max_length=32)
    config = json.loads((out / "config_sentence_transformers.json").read_text())
    assert config["prompts"] == prompts and config["default_prompt_name"] is None
    assert config["similarity_fn_name"] == "cosine"
    assert "truncate_dim=k" in (out / "README.md").read_text()
    texts, docs = SENTENCES[:3], SENTENCES[3:5]
    ours = Encoder.from_pretrained(tiny, adapter=adapter, precision="fp32", max_length=32)
    assert ours.max_seq_length == 32 and dict(ours.prompts) == prompts
    for truncate_dim in (None, 8):  # at load there, per call here
        st = SentenceTransformer(str(out), device="cpu", truncate_dim=truncate_dim)
        assert st.get_embedding_dimension() == (truncate_dim or ours.get_sentence_embedding_dimension())
        assert ours.max_seq_length == st.max_seq_length
        assert {k: v for k, v in st.prompts.items() if v} == {k: v for k, v in ours.prompts.items() if v}
        for kwargs in ({}, {"normalize_embeddings": True}, {"convert_to_tensor": True}, {"prompt": "x: "}):
            theirs = st.encode_query(texts, **kwargs)
            mine = ours.encode_query(texts, truncate_dim=truncate_dim, **kwargs)
            assert type(theirs) is type(mine) and theirs.shape == mine.shape, kwargs
            np.testing.assert_allclose(np.asarray(mine), np.asarray(theirs), rtol=1e-4, atol=1e-5)
        theirs, mine = st.encode_document(docs), ours.encode_document(docs, truncate_dim=truncate_dim)
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-5)
        q, d = (
            ours.encode_query(texts, truncate_dim=truncate_dim),
            ours.encode_document(docs, truncate_dim=truncate_dim),
        )
        torch.testing.assert_close(ours.similarity(q, d), st.similarity(q, d))
    prefix = st.encode_query(texts, truncate_dim=16, normalize_embeddings=True)  # a call's size wins there too
    np.testing.assert_allclose(ours.encode_query(texts, truncate_dim=16, normalize_embeddings=True), prefix, atol=1e-5)
