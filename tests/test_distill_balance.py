"""benchmarks/distill_balance.py: each distillation term's gradient norm on a batch's embeddings, and the weight that
makes the similarity term pull as hard as another."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from unimae.training.teacher import Teacher


@pytest.fixture
def bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "distill_balance.py"
    spec = importlib.util.spec_from_file_location("distill_balance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_teacher_that_agrees_with_the_student_leaves_only_info_nce_pulling(bench):
    torch.manual_seed(0)
    z = torch.randn(10, 8)  # 4 queries, 4 positives, 2 negatives
    texts = [f"t{i}" for i in range(10)]
    lookup = dict(zip(texts, z, strict=True))
    agreeing = Teacher(lambda batch: torch.stack([lookup[t] for t in batch]))
    norms = bench.gradient_norms(z, 4, agreeing, texts, [4, 8])
    assert norms["similarity"] == pytest.approx(0.0, abs=1e-6) and norms["similarity_value"] == pytest.approx(
        0, abs=1e-9
    )
    assert norms["info_nce"] > 0 and norms["listwise"] == pytest.approx(0.0, abs=1e-5)
    other = Teacher(lambda batch: F.normalize(torch.randn(len(batch), 8), dim=-1))
    assert bench.gradient_norms(z, 4, other, texts, [8])["similarity"] > 0


def test_batch_texts_draws_one_files_pairs_with_their_negatives(bench, tmp_path):
    rows = [{"query": f"q{i}", "positive": f"p{i}", **({"negative": f"n{i}"} if i % 2 else {})} for i in range(9)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    queries, positives, negatives = bench.batch_texts(path, 4, seed=0)
    assert len(queries) == len(positives) == 4 and [q[1:] for q in queries] == [p[1:] for p in positives]
    assert {n[1:] for n in negatives} == {q[1:] for q in queries if int(q[1:]) % 2}
    assert bench.batch_texts(path, 4, seed=0) == (queries, positives, negatives)  # seeded
