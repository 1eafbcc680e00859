"""Local mteb data (unimae.evaluation.local_data): a bad line or label is an error naming the file and line, and
data shipped per subset (``classification/<Task>/<subset>/``) is read as multilingual tasks ship English."""

import json
import os

import pytest

from unimae.evaluation.embeddings import english_task, inject_local_data
from unimae.evaluation.local_data import LocalDataError, load_pair_classification, load_retrieval, read_jsonl


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


ROWS = {
    "train": [{"text": f"set an alarm for {h} am", "label": "alarm"} for h in range(4)]
    + [{"text": f"play song number {n}", "label": "music"} for n in range(4)],
    "test": [{"text": "wake me at six", "label": "alarm"}, {"text": "put on some jazz", "label": "music"}],
}


def _write(folder, rows=ROWS):
    folder.mkdir(parents=True)
    for split, items in rows.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))


def test_multilingual_task_reads_its_english_subset_folder(tmp_path):
    _write(tmp_path / "classification" / "MTOPIntentClassification" / "en")
    task = english_task("MTOPIntentClassification")
    inject_local_data(task, tmp_path)
    assert set(task.dataset) == {"en"}
    data = task.dataset["en"]
    assert data["test"]["text"] == ["wake me at six", "put on some jazz"]
    assert data["train"].num_rows == 8 and sorted(set(data["train"]["label"])) == [0, 1]


def test_flat_layout_still_works_for_a_multilingual_task(tmp_path):
    _write(tmp_path / "classification" / "MTOPIntentClassification")
    task = english_task("MTOPIntentClassification")
    inject_local_data(task, tmp_path)
    assert task.dataset["en"]["test"].num_rows == 2


def test_other_subset_folders_without_english_are_a_clear_error(tmp_path):
    _write(tmp_path / "classification" / "MTOPIntentClassification" / "de")
    with pytest.raises(LocalDataError, match=r"subset folders \['de'\] but not 'en'"):
        inject_local_data(english_task("MTOPIntentClassification"), tmp_path)
