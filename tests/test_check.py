"""The before/after check on a slice of the real STSBenchmark data (skips without ../shared/data)."""

import math

import pytest
from conftest import SHARED_DATA

STSB = SHARED_DATA / "sts" / "STSBenchmark" / "test.jsonl"
needs_data = pytest.mark.skipif(
    not STSB.is_file(), reason=f"evaluation data not found at {STSB} (set UNIMAE_DATA to the shared/data folder)"
)


@needs_data
def test_sts_spearman_on_a_slice_is_a_valid_correlation(tiny_model_dirs):
    from unimae.check import load_sts_pairs, sts_spearman
    from unimae.encoder import Encoder

    s1, s2, gold = load_sts_pairs(STSB)
    assert len(s1) == 1379 and gold.min() >= 0 and gold.max() <= 5
    enc = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), precision="fp32")
    score = sts_spearman(enc, s1[:64], s2[:64], gold[:64])
    assert -100 <= score <= 100 and not math.isnan(score)


@needs_data
def test_find_data_dir_locates_shared_data(monkeypatch):
    from unimae.check import find_data_dir

    monkeypatch.setenv("UNIMAE_DATA", str(SHARED_DATA))
    assert find_data_dir() == SHARED_DATA


def test_malformed_sts_file_names_the_line(tmp_path):
    from unimae.check import load_sts_pairs

    path = tmp_path / "sts.jsonl"
    path.write_text('{"sentence1": "a", "sentence2": "b", "score": 1}\n{"sentence1": "a"}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_sts_pairs(path)
