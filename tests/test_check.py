"""The before/after check: its two scores on hand-made inputs with known answers, the whole check on a
tiny model, and a slice of the real STSBenchmark data (skips without ../shared/data)."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import SENTENCES, SHARED_DATA
from scipy.stats import rankdata

from unimae.evaluation.check import halves_retrieval, load_sts_pairs, sts_spearman

STSB = SHARED_DATA / "sts" / "STSBenchmark" / "test.jsonl"
needs_data = pytest.mark.skipif(
    not STSB.is_file(), reason=f"evaluation data not found at {STSB} (set UNIMAE_DATA to the shared/data folder)"
)


class TableEncoder:
    """Stands in for ``Encoder``: a fixed vector per text; normalizes only when asked to."""

    def __init__(self, vectors: dict[str, list[float]]):
        self.vectors = vectors
        self.seen: list[str] = []

    def encode(self, texts, batch_size=32, normalize=False):
        self.seen += texts
        out = np.array([self.vectors[t] for t in texts], dtype=np.float64)
        return out / np.linalg.norm(out, axis=1, keepdims=True) if normalize else out


def _angle_pairs(cosines, norms):
    """s1[i] = (1, 0); s2[i] at cosine ``cosines[i]`` from it, with length ``norms[i]``."""
    vectors = {}
    for i, (c, r) in enumerate(zip(cosines, norms, strict=True)):
        vectors[f"a{i}"] = [1.0, 0.0]
        vectors[f"b{i}"] = [r * c, r * np.sqrt(1 - c * c)]
    n = len(cosines)
    return TableEncoder(vectors), [f"a{i}" for i in range(n)], [f"b{i}" for i in range(n)]


def test_sts_spearman_is_the_rank_correlation_of_cosines_times_100():
    # cosine ranks 1 3 2 5 4 against gold ranks 1 2 3 4 5: sum d^2 = 4, rho = 1 - 6 * 4 / (5 * 24) = 0.8
    # The norms reverse the order of the raw dot products, so a score from unnormalized vectors differs.
    encoder, s1, s2 = _angle_pairs([0.1, 0.5, 0.3, 0.9, 0.7], [10.0, 1.0, 1.0, 0.5, 0.2])
    gold = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    assert sts_spearman(encoder, s1, s2, gold) == pytest.approx(80.0)
    assert sts_spearman(encoder, s1, s2, gold[::-1].copy()) == pytest.approx(-80.0)
    assert sts_spearman(encoder, s1, s2, np.array([0.0, 2.0, 1.0, 4.0, 3.0])) == pytest.approx(100.0)
    assert encoder.seen == s1 + s2 + s1 + s2 + s1 + s2


def test_halves_retrieval_splits_at_the_middle_word_and_scores_top1():
    vocab = ["cat", "dog", "sun"]

    class BagOfWords(TableEncoder):
        def __init__(self):
            super().__init__({})

        def encode(self, texts, batch_size=32, normalize=False):
            for text in texts:
                words = text.split()
                self.vectors[text] = [words.count(w) for w in vocab] + [sum(w not in vocab for w in words)]
            return super().encode(texts, batch_size, normalize)

    paragraphs = [
        "cat sat cat ran off",  # 5 words: first half is 2 words
        "dog sat dog ran",
        "sun sat dog ran",  # "sun" is in no second half: top-1 is the first paragraph's, a miss
    ]
    encoder = BagOfWords()
    assert halves_retrieval(encoder, paragraphs) == pytest.approx(200 / 3)
    assert encoder.seen == ["cat sat", "dog sat", "sun sat", "cat ran off", "dog ran", "dog ran"]


def test_run_check_rows_are_the_scores_of_each_setting(tiny_model_dirs, tmp_path, monkeypatch):
    from unimae.encoder import Encoder
    from unimae.evaluation.check import run_check

    tiny = str(tiny_model_dirs["llama"])
    sts = tmp_path / "sts.jsonl"
    pairs = [(SENTENCES[i], SENTENCES[(i + 1) % 12], float(i % 5)) for i in range(12)]
    sts.write_text("".join(json.dumps({"sentence1": a, "sentence2": b, "score": g}) + "\n" for a, b, g in pairs))
    monkeypatch.setattr(
        "unimae.evaluation.check.enwiki_gensim_paragraphs", lambda split: SENTENCES if split == "heldout" else []
    )
    result = run_check(tiny, None, sts=str(sts), max_paragraphs=8)
    s1, s2, gold = load_sts_pairs(sts)
    expected = []
    for pooling in ("mean", "eos"):
        encoder = Encoder.from_pretrained(tiny, pooling=pooling, max_length=128)
        expected += [
            (f"base {pooling}", "STSBenchmark test Spearman", sts_spearman(encoder, s1, s2, gold)),
            (f"base {pooling}", "held-out halves acc@1 (n=8)", halves_retrieval(encoder, SENTENCES[:8])),
        ]
    assert [row[:2] for row in result.rows] == [row[:2] for row in expected]
    assert [row[2] for row in result.rows] == pytest.approx([row[2] for row in expected], abs=1e-3)
    plain = Encoder.from_pretrained(tiny).generate("The capital of France is", max_new_tokens=20)
    assert result.generation == {"base": plain}
    assert result.table().splitlines()[2] == f"| base mean | STSBenchmark test Spearman | {expected[0][2]:.2f} |"


@needs_data
def test_sts_spearman_on_a_slice_matches_an_independent_computation(tiny_model_dirs):
    from unimae.encoder import Encoder

    s1, s2, gold = load_sts_pairs(STSB)
    assert len(s1) == len(s2) == len(gold) == 1379 and gold.min() == 0 and gold.max() == 5
    s1, s2, gold = s1[:64], s2[:64], gold[:64]
    enc = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), precision="fp32")
    score = sts_spearman(enc, s1, s2, gold)
    a, b = enc.encode(s1), enc.encode(s2)
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    expected = np.corrcoef(rankdata(cosine), rankdata(gold))[0, 1] * 100  # Spearman = Pearson of the ranks
    assert score == pytest.approx(expected, abs=1e-3)
    assert sts_spearman(enc, s2, s1, gold) == pytest.approx(score, abs=1e-3)  # cosine is symmetric
    assert sts_spearman(enc, s1, s2, -gold) == pytest.approx(-score, abs=1e-3)


def test_find_data_dir_takes_unimae_data_then_a_shared_data_folder_beside(monkeypatch, tmp_path):
    import unimae.files
    from unimae.evaluation.check import find_data_dir

    (tmp_path / "mine").mkdir()
    monkeypatch.setenv("UNIMAE_DATA", str(tmp_path / "mine"))
    assert find_data_dir() == tmp_path / "mine"
    monkeypatch.delenv("UNIMAE_DATA")
    (tmp_path / "proj").mkdir()
    (tmp_path / "shared" / "data").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "proj")
    beside_source = Path(unimae.files.__file__).resolve().parents[3] / "shared" / "data"  # a checkout's first
    assert find_data_dir() == (beside_source if beside_source.is_dir() else tmp_path / "shared" / "data")


def test_malformed_sts_file_names_the_line(tmp_path):
    path = tmp_path / "sts.jsonl"
    path.write_text('{"sentence1": "a", "sentence2": "b", "score": 1}\n{"sentence1": "a"}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_sts_pairs(path)
