"""What makes two evaluation runs "the same model" (so results are reused), and bad labels and data lines."""

import json
import os

import pytest

from unimae.adapter import model_revision
from unimae.evaluation.embeddings import same_run
from unimae.evaluation.local_data import LocalDataError, load_pair_classification, load_retrieval, read_jsonl
from unimae.evaluation.summary import row_folder, task_type

META = {"model": "m", "adapter": "runs/x/adapter", "revision": "abc", "pooling": "eos", "data_dir": "d"}


def test_an_adapter_is_known_by_its_content_not_its_path():
    assert same_run({**META, "adapter": "./runs/x/adapter"}, META)
    assert not same_run({**META, "revision": "def"}, META)
    assert not same_run({**META, "data_dir": None}, META)  # local files and the Hub's are other data
    base = {**META, "adapter": None, "revision": "base"}
    assert not same_run({**base, "adapter": "a"}, base)


def test_a_model_folder_changes_revision_when_its_weights_are_rewritten(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"old")
    first = model_revision(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"new weights")
    assert model_revision(str(tmp_path)) != first
    assert model_revision("smollm2-135m") is None  # registry names and Hub ids name fixed weights


def test_summary_labels_and_unknown_tasks(tmp_path):
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


def test_local_data_lines_that_are_not_objects_or_have_bad_labels(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text('{"text": "a"}\n42\n')
    with pytest.raises(LocalDataError, match="line 2: not a JSON object"):
        list(read_jsonl(path, ("text",), "T"))
    folder = tmp_path / "pairs"
    folder.mkdir()
    good = '{"sentence1": "a", "sentence2": "b", "label": 1}' + os.linesep
    for label in ("yes", 0.9, 2):  # 0.9 was truncated to 0, 2 accepted
        (folder / "test.jsonl").write_text(good + json.dumps({"sentence1": "a", "sentence2": "b", "label": label}))
        with pytest.raises(LocalDataError, match=r"test.jsonl, line 2: label must be 0 or 1, got"):
            load_pair_classification(folder, "T", ["test"])
    (folder / "test.jsonl").write_text(good + '{"sentence1": "c", "sentence2": "d", "label": "0"}')
    assert load_pair_classification(folder, "T", ["test"])["test"]["labels"] == [1, 0]


def test_retrieval_qrels_skip_blank_lines_and_keep_quotes_in_ids(tmp_path):
    for name, rows in {"corpus": [("d1", "x"), ('d"2', "y")], "queries": [("q1", "z")]}.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"_id": i, "text": t}) + "\n" for i, t in rows))
    (tmp_path / "qrels").mkdir()
    (tmp_path / "qrels" / "test.tsv").write_text('query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td"2\t1\n\n')
    assert load_retrieval(tmp_path, "T", ["test"])["test"]["relevant_docs"] == {"q1": {"d1": 1, 'd"2': 1}}
