"""mteb end to end on tiny models and small slices of the real data; cache; summary; which runs are the same model
(results reused); bad input."""

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_DATA, build_model, build_tokenizer

needs_data = pytest.mark.skipif(
    not (SHARED_DATA / "sts").is_dir(), reason=f"evaluation data not found at {SHARED_DATA} (set UNIMAE_DATA)"
)

SLICE_TASKS = [
    "STSBenchmark",
    "STS17",
    "Banking77Classification",
    "TwentyNewsgroupsClustering",
    "SciFact",
    "TwitterURLCorpus",
]


def _head(src: Path, dst: Path, n: int, keep=None) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with open(src) as handle:
        for line in handle:
            if keep is None or keep(json.loads(line)):
                rows.append(line)
            if len(rows) == n:
                break
    dst.write_text("".join(rows))


@pytest.fixture(scope="module")
def data_slice(tmp_path_factory) -> Path:
    """A few rows of each task type, in the shared/data layout."""
    out = tmp_path_factory.mktemp("data")
    for task in ("STSBenchmark", "STS17"):
        _head(SHARED_DATA / "sts" / task / "test.jsonl", out / "sts" / task / "test.jsonl", 40)
    for split in ("train", "test"):
        per_label: dict[str, int] = {}

        def ten_per_label(row, seen=per_label):
            seen[row["label"]] = seen.get(row["label"], 0) + 1
            return row["label"] in ("card_arrival", "card_linking", "exchange_rate") and seen[row["label"]] <= 10

        _head(
            SHARED_DATA / "classification/Banking77Classification" / f"{split}.jsonl",
            out / "classification/Banking77Classification" / f"{split}.jsonl",
            30,
            ten_per_label,
        )
    first_set = json.loads((SHARED_DATA / "clustering/TwentyNewsgroupsClustering/test.jsonl").open().readline())
    (out / "clustering/TwentyNewsgroupsClustering").mkdir(parents=True)
    (out / "clustering/TwentyNewsgroupsClustering/test.jsonl").write_text(
        json.dumps({"sentences": first_set["sentences"][:60], "labels": first_set["labels"][:60]}) + "\n"
    )
    _head(
        SHARED_DATA / "pair_classification/TwitterURLCorpus/test.jsonl",
        out / "pair_classification/TwitterURLCorpus/test.jsonl",
        40,
    )
    scifact = SHARED_DATA / "retrieval/SciFact"
    qrels = (scifact / "qrels/test.tsv").read_text().splitlines()[1:21]
    wanted = {line.split("\t")[1] for line in qrels}
    queries = {line.split("\t")[0] for line in qrels}
    target = out / "retrieval/SciFact"
    _head(scifact / "corpus.jsonl", target / "corpus.jsonl", 10_000, lambda r: r["_id"] in wanted)
    with open(target / "corpus.jsonl", "a") as handle:  # distractors
        for i, line in enumerate(open(scifact / "corpus.jsonl")):
            if i >= 30:
                break
            if json.loads(line)["_id"] not in wanted:
                handle.write(line)
    _head(scifact / "queries.jsonl", target / "queries.jsonl", 100, lambda r: r["_id"] in queries)
    (target / "qrels").mkdir()
    (target / "qrels/test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "\n".join(qrels) + "\n")
    return out


@pytest.fixture(scope="module")
def tiny_encoder(tiny_model_dirs):
    from unimae.encoder import Encoder

    return Encoder.from_pretrained(str(tiny_model_dirs["llama"]), pooling="eos", precision="fp32", max_length=64)


def _cosine(a, b):
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@needs_data
def test_each_task_type_runs_through_mteb_and_scores_match_an_independent_computation(
    tiny_model_dirs, tiny_encoder, data_slice, tmp_path
):
    from scipy.stats import spearmanr
    from sklearn.metrics import average_precision_score

    from unimae.evaluation.embeddings import evaluate_embeddings

    run = evaluate_embeddings(
        str(tiny_model_dirs["llama"]), SLICE_TASKS, tmp_path, data_dir=data_slice, label="tiny", encoder=tiny_encoder
    )
    assert not run.errors, run.errors
    assert set(run.scores) == set(SLICE_TASKS)
    saved = {}
    for task in SLICE_TASKS:
        saved[task] = json.loads((tmp_path / "tiny" / f"{task}.json").read_text())
        assert saved[task]["task_name"] == task and "mteb_version" in saved[task]
        assert run.scores[task] == pytest.approx(saved[task]["scores"]["test"][0]["main_score"], abs=1e-6)
    for task, folder in [("STSBenchmark", "sts"), ("STS17", "sts"), ("TwitterURLCorpus", "pair_classification")]:
        rows = [json.loads(line) for line in (data_slice / folder / task / "test.jsonl").open()]
        a = tiny_encoder.encode([r["sentence1"] for r in rows])
        b = tiny_encoder.encode([r["sentence2"] for r in rows])
        if folder == "sts":  # main score: Spearman of cosine similarity with the gold scores
            expected = spearmanr(_cosine(a, b), [r["score"] for r in rows]).statistic
            assert run.scores[task] == pytest.approx(expected, abs=1e-4), task
        else:
            expected = average_precision_score([r["label"] for r in rows], _cosine(a, b))
            assert saved[task]["scores"]["test"][0]["cosine_ap"] == pytest.approx(expected, abs=1e-4)
    meta = json.loads((tmp_path / "tiny" / "run.json").read_text())
    assert meta["pooling"] == "eos" and set(meta["tasks"]) == set(SLICE_TASKS)


def _oracle_data(root: Path) -> dict[str, np.ndarray]:
    """Hand-made data of each task type, in the shared/data layout, and an embedding per text that
    solves it exactly: cosine = gold score / 5 (STS), 1 or 0 (pairs), one direction per label
    (classification, clustering), queries orthogonal to all but their relevant documents (retrieval).
    Every score of a correct pipeline is then 1.0; a misaligned label or text lowers it."""
    vectors: dict[str, np.ndarray] = {}

    def directions(n: int) -> list[np.ndarray]:
        return list(np.eye(64)[:n])

    def write(path: Path, rows: list[dict]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    for task in ("STSBenchmark", "STS17"):
        rows, axes = [], directions(24)
        for i in range(12):
            gold = (7 * i) % 6  # 0..5, with ties
            rows.append({"sentence1": f"{task} first {i:02d}", "sentence2": f"{task} second {i:02d}", "score": gold})
            u, w = axes[2 * i], axes[2 * i + 1]
            vectors[rows[-1]["sentence1"]] = u
            vectors[rows[-1]["sentence2"]] = gold / 5 * u + np.sqrt(1 - (gold / 5) ** 2) * w
        write(root / "sts" / task / "test.jsonl", rows)
    rows, axes = [], directions(24)
    for i in range(12):
        rows.append({"sentence1": f"tweet {i:02d}", "sentence2": f"url title {i:02d}", "label": i % 3 == 0})
        vectors[rows[-1]["sentence1"]] = axes[2 * i]
        vectors[rows[-1]["sentence2"]] = axes[2 * i] if i % 3 == 0 else axes[2 * i + 1]
    for row in rows:
        row["label"] = int(row["label"])
    write(root / "pair_classification" / "TwitterURLCorpus" / "test.jsonl", rows)
    labels, axes = ["card_arrival", "card_linking", "exchange_rate"], directions(3)
    for split, n in (("train", 8), ("test", 4)):
        rows = [{"text": f"{label} {split} {i:02d}", "label": label} for label in labels for i in range(n)]
        vectors.update({r["text"]: axes[labels.index(r["label"])] for r in rows})
        write(root / "classification" / "Banking77Classification" / f"{split}.jsonl", rows)
    topics, axes = ["sci.space", "rec.autos", "sci.med", "misc.forsale"], directions(4)
    sentences = [f"{topic} post {i:02d}" for i in range(5) for topic in topics]
    vectors.update({s: axes[topics.index(s.split()[0])] for s in sentences})
    write(
        root / "clustering" / "TwentyNewsgroupsClustering" / "test.jsonl",
        [{"sentences": sentences, "labels": [s.split()[0] for s in sentences]}],
    )
    relevant = {"q0": ["d0", "d1"], "q1": ["d2"], "q2": ["d3"], "q3": ["d4"]}  # d5..d9: distractors
    axes = directions(14)
    queries = [{"_id": q, "text": f"claim {q}"} for q in relevant]
    corpus = [{"_id": f"d{i}", "title": f"Title d{i}", "text": f"abstract of d{i}"} for i in range(10)]
    for j, query in enumerate(queries):
        vectors[query["text"]] = axes[j]
    for i, doc in enumerate(corpus):
        about = [j for j, q in enumerate(relevant) if doc["_id"] in relevant[q]]
        vectors[f"{doc['title']} {doc['text']}"] = axes[4 + i] + sum((axes[j] for j in about), np.zeros(64))
    target = root / "retrieval" / "SciFact"
    write(target / "queries.jsonl", queries)
    write(target / "corpus.jsonl", corpus)
    qrels = [f"{q}\t{d}\t1" for q, docs in relevant.items() for d in docs]
    (target / "qrels").mkdir()
    (target / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "\n".join(qrels) + "\n")
    return vectors


def test_an_embedding_that_solves_each_task_scores_one_on_every_task_type(
    tiny_model_dirs, tiny_encoder, tmp_path, monkeypatch
):
    from unimae.evaluation.embeddings import evaluate_embeddings

    vectors = _oracle_data(tmp_path / "data")
    embedded = []

    def oracle(texts, batch_size=32, normalize=False, show_progress=None):
        embedded.extend(texts)
        return np.stack([vectors[t] for t in texts]).astype(np.float32)

    monkeypatch.setattr(tiny_encoder, "encode", oracle)
    run = evaluate_embeddings(
        str(tiny_model_dirs["llama"]),
        SLICE_TASKS,
        tmp_path / "out",
        data_dir=tmp_path / "data",
        label="oracle",
        encoder=tiny_encoder,
        use_cache=False,
    )
    assert not run.errors, run.errors
    assert run.scores == pytest.approx(dict.fromkeys(SLICE_TASKS, 1.0))
    assert set(embedded) == set(vectors)  # every text of every task went through the encoder


@needs_data
def test_cache_returns_identical_embeddings_and_scores(
    tiny_model_dirs, tiny_encoder, data_slice, tmp_path, monkeypatch
):
    from unimae.evaluation.embedding_cache import EmbeddingCache
    from unimae.evaluation.embeddings import evaluate_embeddings

    def evaluate(**options):  # STSBenchmark on the tiny model, label "a", in one output folder
        return evaluate_embeddings(
            str(tiny_model_dirs["llama"]),
            ["STSBenchmark"],
            tmp_path,
            data_dir=data_slice,
            label="a",
            encoder=tiny_encoder,
            **options,
        )

    first = evaluate()
    second = evaluate(rerun=True)
    assert (
        first.cache_misses > 0
        and second.cache_misses == 0
        and second.cache_hits == first.cache_hits + first.cache_misses
    )
    assert first.scores == second.scores
    resumed = evaluate()  # the task's JSON exists for this model: not run again
    assert resumed.cache_hits == resumed.cache_misses == 0
    assert resumed.scores == pytest.approx(first.scores, abs=1e-6)
    embedded, encode = [], tiny_encoder.encode

    def counted(texts, **options):
        embedded.extend(texts)
        return encode(texts, **options)

    monkeypatch.setattr(tiny_encoder, "encode", counted)
    bypassed = evaluate(rerun=True, use_cache=False)  # --no-cache: every text embedded again, though all are cached
    assert bypassed.cache_hits == bypassed.cache_misses == 0
    assert len(embedded) == first.cache_hits + first.cache_misses  # each text of each lookup
    assert bypassed.scores == pytest.approx(first.scores, abs=1e-6)  # batched otherwise: rounding may differ
    cache = EmbeddingCache(tmp_path / "c.sqlite", "ns")
    texts = ["a cat", "a dog", "a cat"]
    fresh = cache.get_or_compute(texts, lambda t: tiny_encoder.encode(t))
    again = cache.get_or_compute(texts, lambda t: pytest.fail("should be cached"))
    assert np.array_equal(fresh, again) and np.array_equal(fresh, tiny_encoder.encode(texts))


@needs_data
def test_summary_averages_come_from_the_task_jsons(tiny_model_dirs, tiny_encoder, data_slice, tmp_path):
    from mteb.results import TaskResult

    from unimae.evaluation.embeddings import evaluate_embeddings
    from unimae.evaluation.summary import write_summary

    tasks = ["STSBenchmark", "STS17", "TwitterURLCorpus"]
    evaluate_embeddings(
        str(tiny_model_dirs["llama"]), tasks, tmp_path, data_dir=data_slice, label="m", encoder=tiny_encoder
    )
    _, csv_path, markdown = write_summary(tmp_path, ["m"], tasks)
    scores = {t: TaskResult.from_disk(tmp_path / "m" / f"{t}.json").get_score() * 100 for t in tasks}
    summary = json.loads((tmp_path / "summary.json").read_text())["m"]
    assert summary["average"] == pytest.approx(sum(scores.values()) / 3)
    sts = (scores["STSBenchmark"] + scores["STS17"]) / 2
    header, row = [line.split(",") for line in csv_path.read_text().splitlines()]
    assert float(row[header.index("STS")]) == pytest.approx(sts, abs=0.006)
    assert f"{scores['TwitterURLCorpus']:.2f}" in markdown

    # A row kept in another results folder joins a table as LABEL=FOLDER, read where it is, not re-scored;
    # the table's own folder is created if missing.
    other = tmp_path / "other" / "new"
    write_summary(other, ["copy=" + str(tmp_path / "m")], tasks, name="borrowed")
    borrowed = json.loads((other / "borrowed.json").read_text())
    assert borrowed == {"copy": json.loads((tmp_path / "summary.json").read_text())["m"]}
    with pytest.raises(FileNotFoundError, match="no results folder"):
        write_summary(other, ["x=" + str(tmp_path / "nowhere")], tasks)
    with pytest.raises(ValueError, match="LABEL=FOLDER"):
        write_summary(other, ["=" + str(tmp_path / "m")], tasks)
    # A label with '=' in it (the ablations' p_mar=0.5, k=1) is a folder of the results dir, not LABEL=FOLDER.
    (tmp_path / "m").rename(tmp_path / "k=1")
    write_summary(tmp_path, ["k=1"], tasks, name="ablation")
    assert list(json.loads((tmp_path / "ablation.json").read_text())) == ["k=1"]


def test_summary_labels_and_unknown_tasks(tmp_path):
    from unimae.evaluation.summary import row_folder, task_type

    (tmp_path / "k=1").mkdir()
    assert row_folder(tmp_path, "k=1") == ("k=1", tmp_path / "k=1")
    elsewhere = tmp_path / "other" / "k=1"
    elsewhere.mkdir(parents=True)
    assert row_folder(tmp_path, f"k=5={elsewhere}") == ("k=5", elsewhere)  # a label holding '=' renames a folder
    assert row_folder(tmp_path, f"base={elsewhere}") == ("base", elsewhere)
    with pytest.raises(ValueError, match="expected LABEL or LABEL=FOLDER"):
        row_folder(tmp_path, "=nothing")
    with pytest.raises(FileNotFoundError, match="no results folder"):
        row_folder(tmp_path, "typo")
    assert task_type("STSBenchmrk") == "unknown"  # a failed task's row, not a KeyError


@needs_data
def test_a_label_evaluated_for_another_model_sets_the_old_results_aside(tiny_encoder, data_slice, tmp_path):
    """Task-by-task runs of a new model under an old label never reuse the old model's task JSONs."""
    from unimae.evaluation.embeddings import evaluate_embeddings

    def run(model, task):
        return evaluate_embeddings(model, [task], tmp_path, data_dir=data_slice, label="m", encoder=tiny_encoder)

    run("first", "STSBenchmark")
    run("first", "STS17")
    assert "STS17" not in run("first", "STS17").runtimes  # same model: resumed, not re-run
    run("second", "STSBenchmark")
    folder = tmp_path / "m"
    assert not (folder / "STS17.json").exists()
    (aside,) = folder.glob("superseded-*")
    assert (aside / "STS17.json").is_file() and json.loads((aside / "run.json").read_text())["model"] == "first"
    assert "STS17" in run("second", "STS17").runtimes  # evaluated for the new model
    record = json.loads((folder / "run.json").read_text())
    assert record["model"] == "second" and set(record["tasks"]) == {"STSBenchmark", "STS17"}
    (folder / "run.json").unlink()  # task results no run.json names: set aside, not claimed by the next run
    run("third", "STSBenchmark")
    assert not (folder / "STS17.json").exists() and len(list(folder.glob("superseded-*"))) == 2


def test_an_adapter_is_known_by_its_content_not_its_path():
    """What makes two evaluation runs "the same model", so that the first one's results are reused."""
    from unimae.evaluation.embeddings import same_run

    meta = {"model": "m", "adapter": "runs/x/adapter", "revision": "abc", "pooling": "eos", "data_dir": "d"}
    assert same_run({**meta, "adapter": "./runs/x/adapter"}, meta)
    assert not same_run({**meta, "revision": "def"}, meta)
    assert not same_run({**meta, "data_dir": None}, meta)  # local files and the Hub's are other data
    base = {**meta, "adapter": None, "revision": "base"}
    assert not same_run({**base, "adapter": "a"}, base)
    # before: a --dimensions 256 record passed for a full-size run's (only the new run's keys were compared)
    assert not same_run({**meta, "dimensions": 256, "rotation": None}, meta)
    assert same_run({**meta, "dimensions": 256}, {**meta, "dimensions": 256})


def test_a_model_folder_changes_revision_when_its_weights_are_rewritten(tmp_path):
    from unimae.adapter import model_revision

    (tmp_path / "model.safetensors").write_bytes(b"old")
    first = model_revision(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"new weights")
    assert model_revision(str(tmp_path)) != first
    assert model_revision("smollm2-135m") is None  # registry names and Hub ids name fixed weights


@needs_data
def test_a_suite_stopped_between_tasks_resumes_after_the_finished_ones(tiny_encoder, data_slice, tmp_path, monkeypatch):
    """run.json is written after every task, so Ctrl-C in the second task keeps the first one's result."""
    import mteb

    from unimae.evaluation.embeddings import evaluate_embeddings

    evaluate = mteb.evaluate
    calls = []

    def stop_on_second_task(model, task, **kwargs):
        calls.append(task.metadata.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return evaluate(model, task, **kwargs)

    monkeypatch.setattr(mteb, "evaluate", stop_on_second_task)
    tasks = ["STSBenchmark", "STS17"]
    with pytest.raises(KeyboardInterrupt):
        evaluate_embeddings("m", tasks, tmp_path, data_dir=data_slice, label="m", encoder=tiny_encoder)
    record = json.loads((tmp_path / "m" / "run.json").read_text())
    assert set(record["tasks"]) == set(record["task_cpu_models"]) == {"STSBenchmark"}  # each runtime's machine
    assert set(record["task_versions"]) == {"STSBenchmark"}
    resumed = evaluate_embeddings("m", tasks, tmp_path, data_dir=data_slice, label="m", encoder=tiny_encoder)
    assert set(resumed.runtimes) == {"STS17"} and set(resumed.scores) == set(tasks)
    # a later run that only reuses the records keeps the packages they came from
    monkeypatch.setattr("unimae.evaluation.embeddings.versions", lambda: {"transformers": "99.0"})
    reused = evaluate_embeddings("m", tasks, tmp_path, data_dir=data_slice, label="m", encoder=tiny_encoder)
    final = json.loads((tmp_path / "m" / "run.json").read_text())
    assert not reused.runtimes and final["versions"] == record["versions"] != {"transformers": "99.0"}
    assert set(final["task_versions"]) == set(tasks)


def test_every_task_asks_the_encoder_for_its_progress_bar(monkeypatch, tmp_path):
    """mteb hands encode_kwargs to the model's encode: a sentence-transformers reference (``--reference``) shows
    its own bar only when asked, and was silent for hours on SciFact."""
    import mteb

    from unimae.evaluation.embeddings import _evaluate_task

    seen = {}

    def record(model, task, **kwargs):
        seen.update(kwargs)
        raise KeyboardInterrupt  # stop before any encoding

    monkeypatch.setattr(mteb, "evaluate", record)
    with pytest.raises(KeyboardInterrupt):
        _evaluate_task("st-model", "STS17", None, 8, tmp_path / "STS17.json")
    assert seen["encode_kwargs"] == {"batch_size": 8, "show_progress_bar": True}
    assert seen["show_progress_bar"] is False  # mteb's own per-task bar stays off


def test_bad_tasks_fail_alone_with_clear_messages(tiny_model_dirs, tiny_encoder, tmp_path):
    from unimae.evaluation.embeddings import evaluate_embeddings
    from unimae.evaluation.summary import write_summary

    data = tmp_path / "data"
    (data / "sts/STSBenchmark").mkdir(parents=True)
    good = [{"sentence1": f"the cat {i}", "sentence2": f"a dog {i % 3}", "score": i % 5} for i in range(12)]
    (data / "sts/STSBenchmark/test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))
    (data / "sts/SICK-R").mkdir(parents=True)
    (data / "sts/SICK-R/test.jsonl").write_text(json.dumps(good[0]) + "\n{broken\n")
    run = evaluate_embeddings(
        str(tiny_model_dirs["llama"]),
        ["NoSuchTask", "STSBenchmark", "SICK-R", "STS17"],
        tmp_path / "out",
        data_dir=data,
        label="t",
        encoder=tiny_encoder,
    )
    assert set(run.scores) == {"STSBenchmark"}
    assert "NoSuchTask" in run.errors["NoSuchTask"]
    assert "test.jsonl, line 2" in run.errors["SICK-R"]
    assert "no folder" in run.errors["STS17"]
    out = tmp_path / "out" / "t"
    assert not (out / "SICK-R.json").exists() and (out / "SICK-R.error.json").exists()
    md_path, _, markdown = write_summary(tmp_path / "out", ["t"], ["STSBenchmark", "SICK-R"], name="table1")
    assert "failed" in markdown and "*" in markdown
    assert md_path.name == "table1.md" and (tmp_path / "out" / "table1.json").is_file()


@pytest.fixture(scope="module")
def uniform_lm_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 whose logits are all zero: every token has log-probability -ln(vocab size)."""
    import torch

    directory = tmp_path_factory.mktemp("uniform-qwen2")
    tokenizer = build_tokenizer(add_bos=False, with_mask=False)
    model = build_model("qwen2", len(tokenizer))
    torch.nn.init.zeros_(model.lm_head.weight)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _first_rows(task: str, n: int) -> list[dict]:
    path = next((SHARED_DATA / "generation" / task).glob("*.jsonl"))
    with open(path) as handle:
        return [json.loads(next(handle)) for _ in range(n)]


def _choice_scores(tokenizer, log_v: float, contexts: list[str], continuations: list[str]) -> np.ndarray:
    """Log-likelihoods under uniform logits: -ln(V) per continuation token, the continuation's tokens
    being those of context + continuation after the context's (lm-eval's convention)."""
    return np.array(
        [
            -(len(tokenizer.encode(c + k)) - len(tokenizer.encode(c))) * log_v
            for c, k in zip(contexts, continuations, strict=True)
        ]
    )


@needs_data
def test_generation_suite_matches_hand_computed_scores_of_a_uniform_model(uniform_lm_dir, tmp_path):
    """With uniform logits every metric is a function of token counts alone, computed here from the
    task files and the YAMLs' prompt formats, so each task's data, prompt, choices and gold label
    must reach lm-eval intact for the scores to match."""
    import math
    import re

    from transformers import AutoTokenizer

    from unimae.data.corpus import enwiki_gensim_paragraphs
    from unimae.evaluation.generation import GENERATION_TASKS, HEADLINE_METRIC, evaluate_generation

    limit = 3
    summary = evaluate_generation(
        str(uniform_lm_dir), None, tmp_path, SHARED_DATA, limit=limit, batch_size=4, max_length=128, precision="fp32"
    )
    assert set(summary["results"]) == set(GENERATION_TASKS)
    assert all(summary["n_samples"][t]["effective"] == limit for t in GENERATION_TASKS)
    assert json.loads((tmp_path / "generation.json").read_text())["limit"] == limit
    tokenizer = AutoTokenizer.from_pretrained(uniform_lm_dir)
    log_v = math.log(len(tokenizer))

    def multiple_choice(items) -> tuple[float, float]:
        """(acc, acc_norm) over (contexts, continuations, choices, gold); ties go to the first choice."""
        acc = acc_norm = 0
        for contexts, continuations, choices, gold in items:
            scores = _choice_scores(tokenizer, log_v, contexts, continuations)
            acc += int(np.argmax(scores)) == gold
            acc_norm += int(np.argmax(scores / np.array([len(c) for c in choices]))) == gold
        return acc / len(items), acc_norm / len(items)

    def same_context(context: str, choices: list[str], gold: int):
        return [context] * len(choices), [" " + c for c in choices], choices, gold

    def winogrande(doc):  # partial evaluation: the options fill the blank, the rest is the continuation
        blank = doc["sentence"].index("_")
        contexts = [doc["sentence"][:blank] + option for option in (doc["option1"], doc["option2"])]
        rest = " " + doc["sentence"][blank + 1 :].strip()
        return contexts, [rest, rest], contexts, int(doc["answer"]) - 1

    expected = {
        "piqa": multiple_choice(
            [
                same_context(f"Question: {d['goal']}\nAnswer:", [d["sol1"], d["sol2"]], d["label"])
                for d in _first_rows("piqa", limit)
            ]
        ),
        "arc_easy": multiple_choice(
            [
                same_context(
                    f"Question: {d['question']}\nAnswer:", d["choices"], d["choice_labels"].index(d["answerKey"])
                )
                for d in _first_rows("arc_easy", limit)
            ]
        ),
        "hellaswag": multiple_choice(
            [same_context(d["ctx"], d["endings"], int(d["label"])) for d in _first_rows("hellaswag", limit)]
        ),
        "winogrande": multiple_choice([winogrande(d) for d in _first_rows("winogrande", limit)]),
    }
    results = summary["results"]
    for task, (acc, acc_norm) in expected.items():
        assert results[task]["acc,none"] == pytest.approx(acc), task
        if task != "winogrande":
            assert results[task]["acc_norm,none"] == pytest.approx(acc_norm), task
    # LAMBADA: greedy decoding of uniform logits picks token 0 (<pad>), never the last word.
    lambada = [d["text"].rsplit(" ", 1) for d in _first_rows("lambada_openai", limit)]
    lambada_ll = _choice_scores(tokenizer, log_v, [c for c, _ in lambada], [" " + w for _, w in lambada])
    assert results["lambada_openai"]["acc,none"] == 0.0
    assert results["lambada_openai"]["perplexity,none"] == pytest.approx(math.exp(-lambada_ll.mean()), rel=1e-4)
    # Held-out perplexity: every token of each paragraph predicted once, at -ln(V).
    docs = enwiki_gensim_paragraphs("heldout")[:limit]
    nll = sum(len(tokenizer.encode(d)) for d in docs) * log_v
    words = sum(len(re.split(r"\s+", d)) for d in docs)
    wiki = results["wiki_heldout"]
    assert wiki[HEADLINE_METRIC["wiki_heldout"]] == pytest.approx(math.exp(nll / words), rel=1e-4)
    assert wiki["byte_perplexity,none"] == pytest.approx(math.exp(nll / sum(len(d.encode()) for d in docs)), rel=1e-4)


@needs_data
def test_a_generation_suite_resumes_after_its_finished_tasks(uniform_lm_dir, tmp_path, monkeypatch):
    """Each task's result is kept with what it was run on: the same model skips it, another limit redoes it."""
    from unimae.evaluation import generation

    def run(tasks, limit, data=SHARED_DATA):
        return generation.evaluate_generation(
            str(uniform_lm_dir), None, tmp_path, data, tasks=tasks, limit=limit, max_length=128, precision="fp32"
        )

    first = run(["piqa"], 2)
    ran = []
    run_tasks = generation._run_tasks

    def counting(meta, tasks, *args):
        ran.extend(tasks)
        return run_tasks(meta, tasks, *args)

    monkeypatch.setattr(generation, "_run_tasks", counting)
    both = run(["piqa", "arc_easy"], 2)
    assert ran == ["arc_easy"] and both["results"]["piqa"] == first["results"]["piqa"]
    summary = json.loads((tmp_path / "generation.json").read_text())
    assert set(summary["results"]) == {"piqa", "arc_easy"}
    cpus = {json.loads((tmp_path / "tasks" / f"{t}.json").read_text())["cpu_model"] for t in ("piqa", "arc_easy")}
    assert summary["cpu_models"] == sorted(c or "not recorded" for c in cpus)  # wall times are per machine
    run(["piqa"], 3)  # another limit: run again, record replaced
    assert ran == ["arc_easy", "piqa"]
    assert json.loads((tmp_path / "tasks" / "piqa.json").read_text())["n_samples"]["effective"] == 3
    weights = max((p for p in Path(uniform_lm_dir).iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # as if retrained into the same folder
    run(["piqa"], 3)
    assert ran == ["arc_easy", "piqa", "piqa"]
    (tmp_path / "other-data").symlink_to(Path(SHARED_DATA).resolve())
    run(["piqa"], 3, tmp_path / "other-data")  # another data folder: its task files may differ
    assert ran == ["arc_easy", "piqa", "piqa", "piqa"]


@needs_data
def test_a_task_stopped_part_way_resumes_after_its_answered_requests(uniform_lm_dir, tmp_path, monkeypatch):
    """lm-eval's request cache keeps what a stopped task answered; the rerun asks the model only for the rest."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from unimae.evaluation import generation

    def run():
        return generation.evaluate_generation(
            str(uniform_lm_dir), None, tmp_path, SHARED_DATA, tasks=["piqa"], limit=3, max_length=128, precision="fp32"
        )

    evaluate = lm_eval.simple_evaluate

    def stopped(*args, **kwargs):
        evaluate(*args, **kwargs)
        raise KeyboardInterrupt  # as if stopped after every request was answered, before the record

    monkeypatch.setattr(lm_eval, "simple_evaluate", stopped)
    with pytest.raises(KeyboardInterrupt):
        run()
    assert not (tmp_path / "tasks" / "piqa.json").exists()
    assert len(list((tmp_path / "tasks").glob(".requests-piqa-*"))) == 1
    monkeypatch.setattr(lm_eval, "simple_evaluate", evaluate)
    asked = []
    loglikelihood = HFLM.loglikelihood

    def counting(self, requests, *args, **kwargs):
        asked.extend(requests)
        return loglikelihood(self, requests, *args, **kwargs)

    monkeypatch.setattr(HFLM, "loglikelihood", counting)
    result = run()
    assert asked == [] and result["n_samples"]["piqa"]["effective"] == 3  # all 6 answers came from the cache
    assert not list((tmp_path / "tasks").glob(".requests-*"))  # removed with the record written


def test_generation_without_data_dir_is_a_clear_error(tiny_model_dirs, tmp_path):
    from unimae.evaluation.generation import evaluate_generation

    with pytest.raises(FileNotFoundError, match="needs --data-dir"):
        evaluate_generation(str(tiny_model_dirs["llama"]), None, tmp_path, None, tasks=["piqa"], limit=2)
    with pytest.raises(ValueError, match="unknown generation task"):  # mmlu & co. are lm-eval registry tasks
        evaluate_generation(str(tiny_model_dirs["llama"]), None, tmp_path, None, tasks=["not_a_task"], limit=2)


@needs_data
def test_compare_writes_both_tables_and_figures(tiny_model_dirs, corpus_file, data_slice, tmp_path):
    from unimae.evaluation.compare import CompareConfig, run_compare
    from unimae.training.config import TrainConfig
    from unimae.training.trainer import train

    tiny = tiny_model_dirs["llama"]
    adapter = train(
        TrainConfig(
            model=str(tiny),
            data=str(corpus_file),
            output_dir=str(tmp_path / "run"),
            steps=1,
            batch_size=2,
            micro_batch_size=2,
            max_length=24,
            precision="fp32",
        )
    ).adapter_dir
    config = CompareConfig(
        model=str(tiny),
        adapters=[str(adapter)],
        data_dir=data_slice,
        output_dir=tmp_path / "cmp",
        tasks=["STSBenchmark", "TwentyNewsgroupsClustering"],
        generation=False,
        max_length=64,
    )
    tables = run_compare(config)
    rows = [line.split(" | ")[0].strip("| ") for line in tables["embeddings"].splitlines()[2:]]
    assert rows == ["base-mean", "base-eos", "base-echo", "run-eos", "all-MiniLM-L6-v2"]
    assert (tmp_path / "cmp" / "categories.png").stat().st_size > 1000
    assert (tmp_path / "cmp" / "tsne.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="share a row name"):  # checked before any model loads
        run_compare(dataclasses.replace(config, adapters=[str(adapter), "elsewhere/run/adapter"]))


def test_compare_checks_row_names_and_generation_data_before_loading_a_model(monkeypatch, tmp_path):
    from unimae.encoder import Encoder
    from unimae.evaluation.compare import CompareConfig, run_compare

    monkeypatch.setattr(Encoder, "from_pretrained", lambda *args, **kwargs: pytest.fail("a model was loaded"))
    config = CompareConfig(model="m", adapters=["runs/base/adapter"], output_dir=tmp_path, generation=False)
    with pytest.raises(ValueError, match="share a row name"):  # "base" is the base model's rows
        run_compare(config)
    with pytest.raises(FileNotFoundError, match="needs --data-dir"):  # not after hours of embedding rows
        run_compare(dataclasses.replace(config, adapters=["runs/a/adapter"], generation=True))


def test_attention_override_is_recorded_and_changes_the_embeddings(tiny_model_dirs, tmp_path):
    from unimae.evaluation.embeddings import evaluate_embeddings

    data = tmp_path / "data"
    (data / "sts/STSBenchmark").mkdir(parents=True)
    rows = [{"sentence1": f"the cat {i} sat", "sentence2": f"a dog {i % 3} ran", "score": i % 5} for i in range(12)]
    (data / "sts/STSBenchmark/test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = {}
    for attention in ("causal", "bidirectional"):
        runs[attention] = evaluate_embeddings(
            str(tiny_model_dirs["llama"]),
            ["STSBenchmark"],
            tmp_path / "out",
            pooling="mean",
            precision="fp32",
            data_dir=data,
            label=attention,
            attention=attention,
        )
        meta = json.loads((tmp_path / "out" / attention / "run.json").read_text())
        assert meta["attention"] == attention
    # Separate cache entries: the bidirectional run embedded every text itself, exactly as the causal run did,
    # instead of reusing the causal embeddings.
    causal, bidirectional = runs["causal"], runs["bidirectional"]
    assert causal.cache_misses > 0
    assert (bidirectional.cache_hits, bidirectional.cache_misses) == (causal.cache_hits, causal.cache_misses)
    assert runs["causal"].scores["STSBenchmark"] != runs["bidirectional"].scores["STSBenchmark"]


def test_embedding_cache_recomputes_a_damaged_row_and_names_an_unreadable_file(tmp_path):
    import sqlite3

    from unimae.evaluation.embedding_cache import EmbeddingCache, EmbeddingCacheError

    cache = EmbeddingCache(tmp_path / "c.sqlite", "ns")
    first = cache.get_or_compute(["a", "b"], lambda t: np.ones((len(t), 3), dtype=np.float32))
    with sqlite3.connect(tmp_path / "c.sqlite") as db:  # one row's vector cut short
        db.execute("UPDATE emb SET vec = ? WHERE rowid = 1", (b"\0" * 4,))
    again = cache.get_or_compute(["a", "b"], lambda t: np.full((len(t), 3), 2, dtype=np.float32))
    assert first.shape == again.shape == (2, 3) and sorted(again.sum(axis=1)) == [3.0, 6.0]
    cache.close()
    (tmp_path / "bad.sqlite").write_bytes(b"not a database" * 100)
    with pytest.raises(EmbeddingCacheError, match="--no-cache"):
        EmbeddingCache(tmp_path / "bad.sqlite", "ns")


def test_a_new_vector_code_version_embeds_every_text_again(tmp_path, monkeypatch):
    """Vectors cached by other code are never read: the namespace holds VECTOR_CODE_VERSION, which a change that
    alters the vectors of the same inputs bumps, so the next evaluation (a --rerun) embeds every text again."""
    from types import SimpleNamespace

    from unimae.evaluation import embedding_cache
    from unimae.evaluation.embeddings import open_embedding_cache

    encoder = SimpleNamespace(  # what open_embedding_cache reads of an Encoder
        pooling="eos",
        max_length=64,
        embedding_precision="fp32",
        pooling_options={},
        adapter_merged=False,
        attention="causal",
    )

    def lookup(version: int, value: float) -> tuple[str, int, int, np.ndarray]:
        """Two texts through the cache of code ``version`` (computed as ``value``) -> namespace, hits, misses and
        the (2, 3) vectors."""
        monkeypatch.setattr(embedding_cache, "VECTOR_CODE_VERSION", version)
        cache = open_embedding_cache(tmp_path, encoder, "tiny", None, "base")
        try:
            vectors = cache.get_or_compute(["a", "b"], lambda t: np.full((len(t), 3), value, dtype=np.float32))
            return cache.namespace, cache.hits, cache.misses, vectors
        finally:
            cache.close()

    version = embedding_cache.VECTOR_CODE_VERSION
    old, _, misses, _ = lookup(version, 1.0)
    same, hits, _, vectors = lookup(version, 2.0)  # the same code: every vector from the cache
    assert misses == 2 and (same, hits) == (old, 2) and (vectors == 1).all()
    new, hits, misses, vectors = lookup(version + 1, 3.0)
    assert new != old and (hits, misses) == (0, 2) and (vectors == 3).all()


def test_default_labels_of_two_adapters_in_one_folder_differ():
    from unimae.evaluation.embeddings import default_label

    assert default_label("smollm2-135m", "runs/t1/unimae/adapter", "eos") == "smollm2-135m-unimae-eos"
    assert default_label("smollm2-135m", "adapters/a", "eos") != default_label("smollm2-135m", "adapters/b", "eos")
    assert default_label("org/model", None, "mean") == "org_model-base-mean"


@needs_data
def test_mteb_applies_the_adapters_prompts_by_its_own_rule_and_scores_prefixes(tiny_model_dirs, data_slice, tmp_path):
    from unimae.embedding.spec import EmbeddingSpec
    from unimae.encoder import Encoder
    from unimae.evaluation.embeddings import evaluate_embeddings

    base = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), pooling="eos", precision="fp32", max_length=64)
    spec = EmbeddingSpec(prompts={"query": "Q: ", "document": "D: "})
    prompted = base.with_spec(spec)
    seen = []
    original = Encoder.encode

    def spy(self, texts, *args, **kwargs):
        seen.extend(texts)
        return original(self, texts, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Encoder, "encode", spy)
        evaluate_embeddings(
            "tiny", ["SciFact", "STS17"], tmp_path, data_dir=data_slice, label="p", encoder=prompted, use_cache=False
        )
    queries = [json.loads(line)["text"] for line in open(data_slice / "retrieval/SciFact/queries.jsonl")]
    sentence = json.loads(open(data_slice / "sts/STS17/test.jsonl").readline())["sentence1"]
    assert all("Q: " + q in seen for q in queries)  # retrieval queries: the query prompt
    assert sum(t.startswith("D: ") for t in seen) >= 30  # the corpus: the document prompt
    assert sentence in seen and "Q: " + sentence not in seen  # STS: none
    full = evaluate_embeddings("tiny", ["STS17"], tmp_path, data_dir=data_slice, label="full", encoder=base)
    cut = evaluate_embeddings(
        "tiny", ["STS17"], tmp_path, data_dir=data_slice, label="d16", encoder=base, dimensions=16
    )
    assert cut.cache_misses == 0 and cut.cache_hits > 0  # the full vectors, cached by the first run
    assert cut.scores["STS17"] != full.scores["STS17"]
    assert json.loads((tmp_path / "d16" / "run.json").read_text())["dimensions"] == 16
