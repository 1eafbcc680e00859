"""Local mteb data shipped per subset (``classification/<Task>/<subset>/``), as multilingual tasks ship English."""

import json

import pytest

from unimae.evaluation.embeddings import english_task, inject_local_data
from unimae.evaluation.local_data import LocalDataError

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
