"""In-batch distillation from a teacher embedding model (--distill-teacher): the KL term and the similarity term
(--distill-loss), their batch targets, the gradient cache with them, their checks, and a training run with a tiny
sentence-transformers teacher."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import read_log
from test_contrastive import _config, _grads, _method, _records, _write

from unimae.losses.distillation import in_batch_distillation, similarity_distillation
from unimae.losses.info_nce import info_nce
from unimae.models import load_model
from unimae.training.teacher import Teacher, load_teacher
from unimae.training.trainer import train


def _hash_encode(texts: list[str]) -> torch.Tensor:
    """A stand-in teacher: 16-dimensional embeddings from each text's characters (fixed, no model)."""
    rows = []
    for text in texts:
        g = torch.Generator().manual_seed(sum(ord(ch) * (i + 1) for i, ch in enumerate(text)) % 2**31)
        rows.append(torch.randn(16, generator=g))
    return torch.stack(rows)


def _student_cosines(a, c):
    return F.normalize(a, dim=-1) @ F.normalize(c, dim=-1).T


def test_the_kl_is_zero_when_the_student_agrees_and_positive_otherwise():
    torch.manual_seed(0)
    a, c = torch.randn(4, 8), torch.randn(6, 8)
    same = in_batch_distillation(a, c, _student_cosines(a, c), 0.05, 0.05)
    assert float(same) == pytest.approx(0.0, abs=1e-6)
    other = in_batch_distillation(a, c, torch.rand(4, 6), 0.05, 0.05)
    assert float(other) > 1e-3
    expected = F.kl_div(
        F.log_softmax(_student_cosines(a, c) / 0.05, -1), F.log_softmax(torch.ones(4, 6) / 0.1, -1),
        log_target=True, reduction="batchmean",
    )  # fmt: skip
    assert float(in_batch_distillation(a, c, torch.ones(4, 6), 0.05, 0.1)) == pytest.approx(float(expected))


def test_excluded_candidates_leave_both_distributions():
    torch.manual_seed(1)
    a, c = torch.randn(3, 8), torch.randn(5, 8)
    teacher = torch.rand(3, 5)
    exclude = torch.zeros(3, 5, dtype=torch.bool)
    exclude[0, 2] = exclude[1, 1] = True  # [1, 1] is query 1's own positive: kept
    base = in_batch_distillation(a, c, teacher, exclude=exclude)
    changed = teacher.clone()
    changed[0, 2] = 0.99
    assert torch.isfinite(base)
    assert float(in_batch_distillation(a, c, changed, exclude=exclude)) == pytest.approx(float(base))
    changed[1, 1] = 0.99
    assert float(in_batch_distillation(a, c, changed, exclude=exclude)) != pytest.approx(float(base))


def test_teacher_scores_of_another_shape_are_refused():
    with pytest.raises(ValueError, match="teacher scores .* do not match"):
        in_batch_distillation(torch.randn(3, 4), torch.randn(5, 4), torch.rand(3, 4))


def test_the_similarity_term_is_the_mean_squared_gap_of_the_off_diagonal_cosines():
    torch.manual_seed(2)
    z = torch.randn(5, 8)
    own = _student_cosines(z, z)
    assert float(similarity_distillation(z, own)) == pytest.approx(0.0, abs=1e-10)
    teacher = own.clone()
    teacher.fill_diagonal_(0.3)  # the diagonal is left out
    assert float(similarity_distillation(z, teacher)) == pytest.approx(0.0, abs=1e-10)
    teacher[1, 3] = teacher[3, 1] = own[1, 3] + 0.5
    assert float(similarity_distillation(z, teacher)) == pytest.approx(2 * 0.25 / 20)  # 2 of the 5 x 4 entries
    with pytest.raises(ValueError, match="teacher similarities .* do not match"):
        similarity_distillation(z, torch.rand(5, 4))


def test_the_batch_carries_the_teachers_cosines_of_every_pair_for_the_similarity_term(tiny_model_dirs):
    _, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]), dtype=torch.float32)
    method = _method(tokenizer, distill_teacher="stand-in", distill_loss="similarity", query_prompt="Query: ")
    method.__dict__["teacher"] = Teacher(_hash_encode)
    records = _records(6)
    batch = method.collate(records, list(range(6)))
    texts = [r["query"] for r in records] + [r["positive"] for r in records]
    texts += [r["negative"] for r in records if r.get("negative")]  # the batch's row order, without prompts
    z = F.normalize(_hash_encode(texts), dim=-1)
    assert "teacher_scores" not in batch and batch["input_ids"].shape[0] == 15
    torch.testing.assert_close(batch["teacher_similarities"], z @ z.T)


def test_the_similarity_term_is_weighted_into_the_loss_and_the_grad_cache_keeps_its_gradient(tiny_model_dirs):
    model, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]), dtype=torch.float32)
    model.train()
    options = dict(distill_teacher="stand-in", distill_weight=20.0, distill_loss="similarity")
    method = _method(tokenizer, **options)
    method.__dict__["teacher"] = Teacher(_hash_encode)
    batch = method.collate(_records(6), list(range(6)))
    plain = method.build_objective(model)
    with torch.no_grad():
        z = plain.embed(batch)
    sim = similarity_distillation(z, batch["teacher_similarities"])
    losses = plain(batch)
    assert float(sim) > 0
    nce = info_nce(z[:6], z[6:], 0.05, exclude=batch.get("false_negatives"))
    assert float(losses["loss"].detach()) == pytest.approx(float(nce + 20.0 * sim), rel=1e-5)
    assert float(losses["distill"]) == pytest.approx(float(sim), rel=1e-5)
    losses["loss"].backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    cached = _method(tokenizer, grad_cache_chunk=4, **options).build_objective(model)
    cached(batch)["loss"].backward()
    got = _grads(model)
    assert got.keys() == expected.keys() and len(got) > 0
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()), msg=name)
    with pytest.raises(KeyError, match="teacher_similarities"):
        plain({k: v for k, v in batch.items() if k != "teacher_similarities"})


def test_the_batch_carries_the_teachers_cosines_of_the_raw_texts(tiny_model_dirs):
    _, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]), dtype=torch.float32)
    method = _method(tokenizer, distill_teacher="stand-in", query_prompt="Query: ")
    method.__dict__["teacher"] = Teacher(_hash_encode)
    records = _records(6)
    batch = method.collate(records, list(range(6)))
    documents = [r["positive"] for r in records] + [r["negative"] for r in records if r.get("negative")]
    z = F.normalize(_hash_encode([r["query"] for r in records] + documents), dim=-1)
    assert batch["teacher_scores"].shape == (6, 9)
    torch.testing.assert_close(batch["teacher_scores"], z[:6] @ z[6:].T)  # no "Query: " on the teacher's side


def test_the_objective_adds_the_weighted_term_and_the_grad_cache_keeps_the_gradient(tiny_model_dirs):
    model, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]), dtype=torch.float32)
    model.train()
    records = _records(6)
    records[4]["query"] = records[1]["query"]  # a false negative, masked in both terms
    options = dict(distill_teacher="stand-in", distill_weight=0.5, distill_temperature=0.1)
    method = _method(tokenizer, **options)
    method.__dict__["teacher"] = Teacher(_hash_encode)
    batch = method.collate(records, list(range(6)))

    plain = method.build_objective(model)
    with torch.no_grad():
        z = plain.embed(batch)
    exclude = batch["false_negatives"]
    nce = info_nce(z[:6], z[6:], 0.05, exclude=exclude)
    kd = in_batch_distillation(z[:6], z[6:], batch["teacher_scores"], 0.05, 0.1, exclude=exclude)
    losses = plain(batch)
    assert float(kd) > 0
    assert float(losses["loss"].detach()) == pytest.approx(float(nce + 0.5 * kd), rel=1e-5)
    assert float(losses["distill"]) == pytest.approx(float(kd), rel=1e-5)  # the log's own, unweighted term
    losses["loss"].backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)

    cached = _method(tokenizer, grad_cache_chunk=4, **options).build_objective(model)
    out = cached(batch)
    out["loss"].backward()
    assert float(out["loss"]) == pytest.approx(float(losses["loss"]), rel=1e-5)
    assert float(out["distill"]) == pytest.approx(float(kd), rel=1e-5)
    got = _grads(model)
    assert got.keys() == expected.keys() and len(got) > 0
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()), msg=name)


def test_a_batch_without_teacher_scores_is_an_error(tiny_model_dirs):
    model, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]), dtype=torch.float32)
    objective = _method(tokenizer, distill_teacher="stand-in").build_objective(model)
    batch = _method(tokenizer).collate(_records(6), list(range(6)))
    with pytest.raises(KeyError, match="teacher_scores"):
        objective(batch)


@pytest.mark.parametrize(("overrides", "world_size"), [({"micro_batch_size": 3}, 1), ({}, 2)])
def test_distillation_needs_the_whole_batch_on_one_process(tiny_model_dirs, overrides, world_size):
    _, tokenizer, _ = load_model(str(tiny_model_dirs["llama"]), dtype=torch.float32)
    with pytest.raises(ValueError, match="--distill-teacher scores each query against the whole batch"):
        _method(tokenizer, world_size, distill_teacher="t", **overrides)


def test_a_missing_teacher_names_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--distill-teacher .*not a sentence-transformers model"):
        load_teacher(str(tmp_path / "no-such-teacher"), 32)


def _tiny_sentence_transformer(model_dir, out):
    """A sentence-transformers model over the tiny random LLM (mean pooling), saved in ``out``."""
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers import models

    body = models.Transformer(str(model_dir), max_seq_length=32)
    pooling = models.Pooling(body.get_word_embedding_dimension(), pooling_mode="mean")
    st.SentenceTransformer(modules=[body, pooling], device="cpu").save(str(out))
    return out


def test_training_with_a_sentence_transformers_teacher(tiny_model_dirs, tmp_path):
    tiny = tiny_model_dirs["llama"]
    teacher = _tiny_sentence_transformer(tiny, tmp_path / "teacher")
    loaded = load_teacher(str(teacher), max_length=16)
    scores = loaded.scores(["a query", "another"], ["a passage", "a second", "a third"])
    assert scores.shape == (2, 3) and bool(((scores >= -1 - 1e-5) & (scores <= 1 + 1e-5)).all())
    data = _write(tmp_path / "pairs.jsonl", _records(12))
    common = dict(batch_size=4, micro_batch_size=4, steps=3)
    train(_config(tiny, data, tmp_path / "plain", **common))
    train(_config(tiny, data, tmp_path / "kd", distill_teacher=str(teacher), distill_weight=2.0, **common))
    plain, kd = read_log(tmp_path / "plain"), read_log(tmp_path / "kd")
    assert len(kd) == 3 and all(math.isfinite(r["loss"]) for r in kd)
    assert kd[0]["contrastive"] > plain[0]["contrastive"]  # same first batch and weights: InfoNCE + 2 x KL > InfoNCE
    assert "distill" not in plain[0] and kd[0]["distill"] > 0
    assert kd[0]["contrastive"] == pytest.approx(plain[0]["contrastive"] + 2.0 * kd[0]["distill"], rel=1e-4)


def test_a_distilled_cooldown_continued_again_records_where_its_distillation_began(tiny_model_dirs, tmp_path):
    """A plain run (2 steps), distilled from step 2 (to 3), then lengthened from that adapter with the same teacher and
    weight (to 4): the last records distill_from 2, so a recipe reading it back knows the cooldown began at step 2;
    the same teacher fetched into another folder (another machine's home) counts as the same; another weight is a new
    distillation (none recorded)."""
    import dataclasses
    import shutil

    from unimae.adapter import adapter_meta

    tiny = tiny_model_dirs["llama"]
    teacher = str(_tiny_sentence_transformer(tiny, tmp_path / "teacher"))
    data = _write(tmp_path / "pairs.jsonl", _records(12))
    plain = _config(tiny, data, tmp_path / "plain", batch_size=4, micro_batch_size=4, steps=2)
    train(plain)
    distill = dict(distill_teacher=teacher, distill_weight=2.0)
    first = _config(tiny, data, tmp_path / "kd", batch_size=4, micro_batch_size=4, steps=3, **distill)
    train(dataclasses.replace(first, continue_adapter=str(tmp_path / "plain" / "adapter")))
    cooled = adapter_meta(tmp_path / "kd" / "adapter")
    assert cooled.continued_from_step == 2 and cooled.distill_from_step is None  # it began here
    moved = shutil.copytree(teacher, tmp_path / "other-home" / "teacher")
    cases = ((2.0, teacher, "longer", 2), (2.0, moved, "moved", 2), (3.0, teacher, "other", None))
    for weight, where, out, expected in cases:
        again = _config(tiny, data, tmp_path / out, batch_size=4, micro_batch_size=4, steps=4, **distill)
        again.options.distill_weight, again.options.distill_teacher = weight, str(where)
        train(dataclasses.replace(again, continue_adapter=str(tmp_path / "kd" / "adapter")))
        meta = adapter_meta(tmp_path / out / "adapter")
        assert meta.continued_from_step == 3 and meta.distill_from_step == expected
