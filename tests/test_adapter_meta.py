"""``unimae.json`` as a typed AdapterMeta: it round-trips, and the files of earlier versions still read."""

import json

import pytest

from unimae.adapter import ADAPTER_META, AdapterMeta, ReleaseInfo, adapter_meta, embedding_spec, write_adapter_meta
from unimae.embedding.spec import EmbeddingSpec

SPEC = EmbeddingSpec("causal", "eos", prompts=(("query", "q: "),), matryoshka_dims=(8, 16))


def test_adapter_meta_round_trips_through_unimae_json(tmp_path):
    meta = AdapterMeta(
        base_model="tiny",
        base_fingerprint="abc",
        embedding=SPEC,
        trained_steps=4,
        mask_token="<mask>",
        method="contrastive",
        init_adapter="init_adapter",
        training_config={"method": "contrastive", "options": {"temperature": 0.1}},
        continued_from_step=2,
        release=ReleaseInfo("r", "bfloat16", "0123456789ab"),
        extra={"written_by": "a later version"},
    )
    assert AdapterMeta.from_dict(meta.to_dict()) == meta
    write_adapter_meta(tmp_path, meta)
    assert adapter_meta(tmp_path) == meta and embedding_spec(tmp_path) == SPEC
    saved = json.loads((tmp_path / ADAPTER_META).read_text())
    assert saved["continued_from"] == {"step": 2} and saved["written_by"] == "a later version"
    lengthened = AdapterMeta(continued_from_step=231, distill_from_step=200)  # a distilled cooldown continued again
    assert lengthened.to_dict()["continued_from"] == {"step": 231, "distill_from": 200}
    assert AdapterMeta.from_dict(lengthened.to_dict()) == lengthened
    assert adapter_meta(tmp_path / "missing") == AdapterMeta() and adapter_meta(None).embedding == EmbeddingSpec()


def test_files_of_earlier_versions_read():
    """The first unimae.json named only a top-level pooling; later ones a flat training config and null fields.
    Keys this version does not know are kept, so a release made from such an adapter keeps them too."""
    first = AdapterMeta.from_dict({"base_model": "m", "base_fingerprint": "f", "pooling": "eos", "odd": [1]})
    assert first.embedding == EmbeddingSpec() and first.extra == {"odd": [1]} and first.trained_steps is None
    assert first.to_dict() == {"base_model": "m", "base_fingerprint": "f", "embedding": EmbeddingSpec().to_dict(),
                               "odd": [1]}  # fmt: skip
    flat = {
        "base_model": "m",
        "base_fingerprint": "f",
        "embedding": SPEC.to_dict(),
        "trained_steps": 3,
        "mask_token": "<mask>",
        "method": "gem",
        "init_adapter": None,
        "training_config": {"method": "gem", "temperature": 0.05, "p_mar": 0.0},
        "release": {"name": "r", "weights_dtype": "bfloat16", "source_revision": "abc", "later": 1},
    }
    meta = AdapterMeta.from_dict(flat)
    assert (meta.embedding, meta.trained_steps, meta.init_adapter, meta.release.name) == (SPEC, 3, None, "r")
    assert meta.training_config == flat["training_config"] and meta.extra == {}


@pytest.mark.parametrize("content", ['{"embedding": "eos"}', '{"training_config": [1]}', '"abc"', "[]"])
def test_a_malformed_unimae_json_is_an_error_naming_the_file(tmp_path, content):
    from unimae.adapter import adapter_meta

    (tmp_path / "unimae.json").write_text(content)
    with pytest.raises(ValueError, match=r"adapter metadata .*unimae\.json is malformed"):
        adapter_meta(tmp_path)
