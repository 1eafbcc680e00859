"""mteb end to end on tiny models and small slices of the real data; cache; summary; bad input."""

import json
from pathlib import Path

import pytest
from conftest import SHARED_DATA

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


@needs_data
def test_each_task_type_runs_through_mteb_with_scores_in_range(tiny_model_dirs, tiny_encoder, data_slice, tmp_path):
    from unimae.evaluation.embeddings import evaluate_embeddings

    run = evaluate_embeddings(
        str(tiny_model_dirs["llama"]), SLICE_TASKS, tmp_path, data_dir=data_slice, label="tiny", encoder=tiny_encoder
    )
    assert not run.errors, run.errors
    assert set(run.scores) == set(SLICE_TASKS)
    for task, score in run.scores.items():
        assert -1.0 <= score <= 1.0, (task, score)
        saved = json.loads((tmp_path / "tiny" / f"{task}.json").read_text())
        assert saved["task_name"] == task and "scores" in saved and "mteb_version" in saved
    meta = json.loads((tmp_path / "tiny" / "run.json").read_text())
    assert meta["pooling"] == "eos" and set(meta["tasks"]) == set(SLICE_TASKS)


@needs_data
def test_cache_returns_identical_embeddings_and_scores(tiny_model_dirs, tiny_encoder, data_slice, tmp_path):
    import numpy as np

    from unimae.evaluation.embedding_cache import EmbeddingCache
    from unimae.evaluation.embeddings import evaluate_embeddings

    first = evaluate_embeddings(
        str(tiny_model_dirs["llama"]), ["STSBenchmark"], tmp_path, data_dir=data_slice, label="a", encoder=tiny_encoder
    )
    second = evaluate_embeddings(
        str(tiny_model_dirs["llama"]),
        ["STSBenchmark"],
        tmp_path,
        data_dir=data_slice,
        label="a",
        encoder=tiny_encoder,
        rerun=True,
    )
    assert (
        first.cache_misses > 0
        and second.cache_misses == 0
        and second.cache_hits == first.cache_hits + first.cache_misses
    )
    assert first.scores == second.scores
    resumed = evaluate_embeddings(  # the task's JSON exists for this model: not run again
        str(tiny_model_dirs["llama"]), ["STSBenchmark"], tmp_path, data_dir=data_slice, label="a", encoder=tiny_encoder
    )
    assert resumed.cache_hits == resumed.cache_misses == 0
    assert resumed.scores == pytest.approx(first.scores, abs=1e-6)
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


@needs_data
def test_generation_suite_runs_through_lm_eval(tiny_model_dirs, tmp_path):
    from unimae.evaluation.generation import GENERATION_TASKS, HEADLINE_METRIC, evaluate_generation

    summary = evaluate_generation(
        str(tiny_model_dirs["llama"]),
        None,
        tmp_path,
        SHARED_DATA,
        limit=3,
        batch_size=4,
        max_length=128,
        precision="fp32",
    )
    assert set(summary["results"]) == set(GENERATION_TASKS)
    for task, metrics in summary["results"].items():
        value = metrics[HEADLINE_METRIC[task]]
        if "perplexity" in HEADLINE_METRIC[task]:
            assert value > 1.0
        else:
            assert 0.0 <= value <= 1.0
    assert json.loads((tmp_path / "generation.json").read_text())["limit"] == 3


def test_generation_without_data_dir_is_a_clear_error(tiny_model_dirs, tmp_path):
    from unimae.evaluation.generation import evaluate_generation

    with pytest.raises(FileNotFoundError, match="needs --data-dir"):
        evaluate_generation(str(tiny_model_dirs["llama"]), None, tmp_path, None, tasks=["piqa"], limit=2)
    with pytest.raises(ValueError, match="unknown generation task"):
        evaluate_generation(str(tiny_model_dirs["llama"]), None, tmp_path, None, tasks=["mmlu"], limit=2)


@needs_data
def test_compare_writes_both_tables_and_figures(tiny_model_dirs, corpus_file, data_slice, tmp_path):
    from unimae.config import TrainConfig
    from unimae.evaluation.compare import CompareConfig, run_compare
    from unimae.trainer import train

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
    # Separate cache entries: the bidirectional run embedded its texts instead of reusing the causal ones.
    assert runs["bidirectional"].cache_misses > 0
    assert runs["causal"].scores["STSBenchmark"] != runs["bidirectional"].scores["STSBenchmark"]
