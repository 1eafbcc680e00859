"""Exports load offline in sentence-transformers / transformers and give unimae's embeddings."""

import pytest
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


def test_hf_export_loads_in_transformers_and_refuses_overwrite(tiny_model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    from unimae.export import export

    out = export(str(tiny_model_dirs["llama"]), None, tmp_path / "hf", fmt="hf")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.hidden_size == 64 and "EOS" in (out / "README.md").read_text()
    with pytest.raises(FileExistsError):
        export(str(tiny_model_dirs["llama"]), None, out, fmt="hf")
