"""Paper-style tables (UniMAE Table 1) computed from the per-task mteb result JSONs.

Rows are compared methods (one folder of task JSONs each), columns the MTEB categories and the
average over all tasks, all main scores x 100. A failed (``<task>.error.json``) or not yet run task is
named in the ``missing`` column, and the averages it would enter are marked with ``*`` (computed over the
tasks that did run), so an incomplete row never passes for a complete one.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

from unimae.files import atomic_write_json, atomic_write_text

CATEGORIES = [
    ("Retrieval", "Retr."),
    ("Reranking", "Rerank."),
    ("Clustering", "Clust."),
    ("PairClassification", "PairClass."),
    ("Classification", "Class."),
    ("STS", "STS"),
]


@dataclass
class SummaryRow:
    label: str
    task_scores: dict[str, float]  # task -> main score x 100
    task_types: dict[str, str]
    missing: list[str]
    failed: list[str]

    def category(self, category: str) -> tuple[float | None, bool]:
        """(average, incomplete) for a category; None when no task of it ran."""
        scores = [s for t, s in self.task_scores.items() if self.task_types[t] == category]
        incomplete = any(self.task_types.get(t) == category for t in self.missing)
        return (sum(scores) / len(scores) if scores else None), incomplete

    def cell(self, task: str) -> str:
        """``task``'s table cell: its score, or why there is none."""
        if task in self.missing:
            return "failed" if task in self.failed else "not run"
        return format_score(self.task_scores.get(task))

    @property
    def average(self) -> float | None:
        """Mean over the tasks that were scored (a table marks it ``*`` when ``missing`` is not empty)."""
        return sum(self.task_scores.values()) / len(self.task_scores) if self.task_scores else None


def task_type(name: str) -> str:
    """mteb's task type of ``name`` ('unknown' for a name mteb does not know: its row shows it failed)."""
    import mteb

    try:
        return mteb.get_task(name).metadata.type
    except KeyError:
        return "unknown"


def row_folder(results_dir: Path, label: str) -> tuple[str, Path]:
    """(row name, folder) of a ``--labels`` entry: ``LABEL`` is ``results_dir/LABEL``; ``LABEL=FOLDER`` names
    a row whose task JSONs live elsewhere (e.g. a row already scored in another table), read where it is.
    A folder ``results_dir/<entry>`` wins, so labels such as ``p_mar=0.5`` or ``k=1`` stay plain labels, and
    a label may itself hold ``=`` (``k=1=results/x/k=1``): the entry splits at the ``=`` that names a folder."""
    if (results_dir / label).is_dir():
        return label, results_dir / label
    splits = [(label[:i], label[i + 1 :]) for i, char in enumerate(label) if char == "="]
    if not splits:
        raise FileNotFoundError(f"--labels entry {label!r}: no results folder {results_dir / label}")
    for name, folder in splits:
        if name and folder and Path(folder).is_dir():
            return name, Path(folder)
    name, folder = splits[0]
    if not name or not folder:
        raise ValueError(f"--labels entry {label!r}: expected LABEL or LABEL=FOLDER")
    raise FileNotFoundError(f"--labels entry {label!r}: no results folder {folder}")


def read_row(folder: Path, tasks: list[str], label: str | None = None) -> SummaryRow:
    """Main scores of ``tasks`` from ``folder/<task>.json`` (mteb's TaskResult format), as row ``label``
    (default: the folder's name)."""
    from mteb.results import TaskResult

    scores, types, missing, failed = {}, {}, [], []
    for name in tasks:
        types[name] = task_type(name)
        path = folder / f"{name}.json"
        if path.is_file():
            scores[name] = float(TaskResult.from_disk(path).get_score()) * 100
        else:
            missing.append(name)
            if (folder / f"{name}.error.json").is_file():
                failed.append(name)
    return SummaryRow(label or folder.name, scores, types, missing, failed)


def format_score(value: float | None, incomplete: bool = False) -> str:
    """A score as a table shows it: 2 decimals, ``*`` when averaged over an incomplete set, ``-`` for none."""
    if value is None:
        return "-"
    return f"{value:.2f}{'*' if incomplete else ''}"


def summary_table(rows: list[SummaryRow]) -> tuple[list[str], list[list[str]]]:
    """Header and cells: method, categories present, per-task scores, average, missing."""
    present = [(c, short) for c, short in CATEGORIES if any(c in r.task_types.values() for r in rows)]
    tasks = list(dict.fromkeys(t for r in rows for t in r.task_types))
    header = ["method", *[short for _, short in present], "Avg.", *tasks, "missing"]
    cells = []
    for row in rows:
        line = [row.label]
        line += [format_score(*row.category(c)) for c, _ in present]
        line.append(format_score(row.average, bool(row.missing)))
        line += [row.cell(t) for t in tasks]
        line.append(", ".join(row.missing))
        cells.append(line)
    return header, cells


def summary_markdown(results_dir: Path, labels: list[str], tasks: list[str]) -> str:
    """The Markdown table of ``labels`` (rows) on ``tasks``, written nowhere."""
    return markdown_table(*summary_table(read_rows(results_dir, labels, tasks)))


def read_rows(results_dir: Path, labels: list[str], tasks: list[str]) -> list[SummaryRow]:
    """One row per ``--labels`` entry (``LABEL`` or ``LABEL=FOLDER``, see :func:`row_folder`)."""
    rows = []
    for entry in labels:
        name, folder = row_folder(results_dir, entry)
        rows.append(read_row(folder, tasks, name))
    return rows


def markdown_table(header: list[str], cells: list[list[str]]) -> str:
    """A GitHub Markdown table of ``header`` and rows of ``cells``."""
    return "\n".join(
        ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        + ["| " + " | ".join(line) + " |" for line in cells]
    )


def write_summary(
    results_dir: Path, labels: list[str], tasks: list[str], name: str = "summary"
) -> tuple[Path, Path, str]:
    """Write ``<name>.md``, ``.csv`` and ``.json`` in ``results_dir`` (created if every row is LABEL=FOLDER
    elsewhere); return the first two and the Markdown."""
    rows = read_rows(results_dir, labels, tasks)
    header, cells = summary_table(rows)
    markdown = markdown_table(header, cells)
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    md_path, csv_path = results_dir / f"{name}.md", results_dir / f"{name}.csv"
    atomic_write_text(md_path, markdown + "\n")
    table = io.StringIO(newline="")
    csv.writer(table).writerows([header, *cells])
    atomic_write_text(csv_path, table.getvalue())
    payload = {
        r.label: {"tasks": r.task_scores, "average": r.average, "missing": r.missing, "failed": r.failed} for r in rows
    }
    atomic_write_json(results_dir / f"{name}.json", payload)
    return md_path, csv_path, markdown
