"""Local evaluation data in the evaluation data layout (see docs/evaluation.md, "Evaluation data layout"),
converted to the dataset shapes the official ``mteb`` evaluators read.

One loader per task type, chosen by mteb's own task metadata (``task.metadata.type``), so any
MTEB English task whose folder follows the layout just works:

| type | folder | files |
|---|---|---|
| STS | ``sts/<Task>/`` | ``test.jsonl``: sentence1, sentence2, score |
| Classification | ``classification/<Task>/`` | ``train.jsonl``, ``test.jsonl``: text, label (str) |
| Clustering | ``clustering/<Task>/`` | ``test.jsonl``: one set per line, sentences[], labels[] |
| PairClassification | ``pair_classification/<Task>/`` | ``test.jsonl``: sentence1, sentence2, label 0/1 |
| Retrieval | ``retrieval/<Task>/`` | ``corpus.jsonl`` (_id, title, text), ``queries.jsonl`` (_id, text), |
| | | ``qrels/test.tsv`` (query-id, corpus-id, score) |

Every malformed line raises LocalDataError naming the file and line.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TYPE_FOLDERS = {
    "STS": "sts",
    "Classification": "classification",
    "Clustering": "clustering",
    "PairClassification": "pair_classification",
    "Retrieval": "retrieval",
}


class LocalDataError(ValueError):
    """Local task data is missing or malformed; the message names the task, file and line."""


def task_folder(data_dir: Path, task_name: str, task_type: str) -> Path:
    if task_type not in TYPE_FOLDERS:
        raise LocalDataError(
            f"{task_name}: task type {task_type!r} has no local-data loader (supported: {sorted(TYPE_FOLDERS)})"
        )
    folder = Path(data_dir) / TYPE_FOLDERS[task_type] / task_name
    if not folder.is_dir():
        raise LocalDataError(
            f"{task_name}: no folder {folder}; put the task's files there (docs/evaluation.md, "
            "'Evaluation data layout') or drop --data-dir to load it from the Hub"
        )
    return folder


def read_jsonl(path: Path, required: tuple[str, ...], task_name: str) -> Iterator[dict[str, Any]]:
    if not path.is_file():
        raise LocalDataError(f"{task_name}: missing file {path}")
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise LocalDataError(
                    f"{task_name}: {path}, line {number}: not a valid UTF-8 JSON object ({err})"
                ) from err
            if not isinstance(row, dict):
                raise LocalDataError(f"{task_name}: {path}, line {number}: not a JSON object ({raw[:40]!r})")
            missing = [key for key in required if key not in row]
            if missing:
                raise LocalDataError(f"{task_name}: {path}, line {number}: missing field(s) {missing}")
            yield row


def as_int(value, where: str) -> int:
    """``int(value)`` for a label or relevance score, or a :class:`LocalDataError` naming ``where``."""
    try:
        return int(value)
    except (TypeError, ValueError) as err:
        raise LocalDataError(f"{where}: expected an integer, got {value!r}") from err


def _binary_label(value, where: str) -> int:
    """A pair-classification label: 0 or 1 (also as "0"/"1" or true/false), else a LocalDataError."""
    if (value in (0, 1) and not isinstance(value, float)) or value in ("0", "1"):
        return int(value)
    raise LocalDataError(f"{where}: label must be 0 or 1, got {value!r}")


def _columns(rows: list[dict[str, Any]], names: tuple[str, ...]) -> dict[str, list]:
    return {name: [row[name] for row in rows] for name in names}


def load_sts(folder: Path, task_name: str, splits: list[str]) -> dict[str, dict[str, list]]:
    out = {}
    for split in splits:
        rows = list(read_jsonl(folder / f"{split}.jsonl", ("sentence1", "sentence2", "score"), task_name))
        out[split] = _columns(rows, ("sentence1", "sentence2", "score"))
    return out


def load_classification(folder: Path, task_name: str, splits: list[str]) -> dict[str, dict[str, list]]:
    raw = {
        split: list(read_jsonl(folder / f"{split}.jsonl", ("text", "label"), task_name))
        for split in dict.fromkeys(["train", *splits])
    }
    names = sorted({str(row["label"]) for rows in raw.values() for row in rows})
    index = {name: i for i, name in enumerate(names)}  # string labels -> ints, shared by all splits
    return {
        split: {"text": [r["text"] for r in rows], "label": [index[str(r["label"])] for r in rows]}
        for split, rows in raw.items()
    }


def load_clustering(folder: Path, task_name: str, splits: list[str]) -> dict[str, dict[str, list]]:
    out = {}
    for split in splits:
        rows = list(read_jsonl(folder / f"{split}.jsonl", ("sentences", "labels"), task_name))
        for number, row in enumerate(rows, start=1):
            if len(row["sentences"]) != len(row["labels"]):
                raise LocalDataError(
                    f"{task_name}: {folder / f'{split}.jsonl'}, set {number}: sentences and labels differ in length"
                )
        out[split] = {"sentences": [r["sentences"] for r in rows], "labels": [r["labels"] for r in rows]}
    return out


def load_pair_classification(folder: Path, task_name: str, splits: list[str]) -> dict[str, dict[str, list]]:
    out = {}
    for split in splits:
        path = folder / f"{split}.jsonl"
        rows = list(read_jsonl(path, ("sentence1", "sentence2", "label"), task_name))
        out[split] = {
            "sentence1": [r["sentence1"] for r in rows],
            "sentence2": [r["sentence2"] for r in rows],
            "labels": [_binary_label(r["label"], f"{task_name}: {path}, line {n}") for n, r in enumerate(rows, 1)],
        }
    return out


def load_retrieval(folder: Path, task_name: str, splits: list[str]) -> dict[str, dict[str, Any]]:
    corpus = list(read_jsonl(folder / "corpus.jsonl", ("_id", "text"), task_name))
    queries = list(read_jsonl(folder / "queries.jsonl", ("_id", "text"), task_name))
    out = {}
    for split in splits:
        qrels_path = folder / "qrels" / f"{split}.tsv"
        if not qrels_path.is_file():
            raise LocalDataError(f"{task_name}: missing file {qrels_path}")
        relevant: dict[str, dict[str, int]] = {}
        with open(qrels_path, encoding="utf-8") as handle:
            reader = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)  # an id may contain a quote
            for number, row in enumerate(reader, start=1):
                if not row or number == 1 and row[0] == "query-id":  # a blank line or the header
                    continue
                if len(row) != 3:
                    raise LocalDataError(
                        f"{task_name}: {qrels_path}, line {number}: expected query-id, corpus-id, score"
                    )
                score = as_int(row[2], f"{task_name}: {qrels_path}, line {number}, score (header: query-id ...)")
                relevant.setdefault(row[0], {})[row[1]] = score
        out[split] = {
            "corpus": {
                "id": [str(d["_id"]) for d in corpus],
                "title": [d.get("title", "") for d in corpus],
                "text": [d["text"] for d in corpus],
            },
            "queries": {"id": [str(q["_id"]) for q in queries], "text": [q["text"] for q in queries]},
            "relevant_docs": relevant,
        }
    return out


LOADERS = {
    "STS": load_sts,
    "Classification": load_classification,
    "Clustering": load_clustering,
    "PairClassification": load_pair_classification,
    "Retrieval": load_retrieval,
}
