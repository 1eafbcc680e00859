"""Regenerate the results tables of the README and ``docs/*.md`` from the JSONs under ``results/``.

Every generated table sits between a marker pair; nothing outside the pairs is touched::

    <!-- report: results/dev-smollm2/table1.json -->

    | method | Retr. | ... |        <- rewritten by `python -m unimae.evaluation.report`

    <!-- /report -->

The opening marker names a SOURCE; the lines after it, inside the same comment, are optional YAML
options. Paths are relative to the repository root. Sources:

``PATH.json`` written by ``unimae evaluate summary`` (``{label: {"tasks", "average", "missing"}}``)
    The paper-style table, rendered by :func:`unimae.evaluation.summary.summary_table` exactly as the
    summary's own ``.md``. Options: ``labels`` (rows and their order; default all), ``tasks`` (a
    subset; averages are recomputed over it), ``exclude`` (tasks to leave out), ``names``
    (``{label: shown name}``), ``columns`` (header names to keep; ``method`` always stays).
``FOLDER`` holding one ``<label>/<Task>.json`` folder per row (mteb's result format)
    The same table read from the per-task JSONs by :func:`unimae.evaluation.summary.read_row`, for
    rows no summary JSON holds. ``labels`` and ``tasks`` are required; the other options as above.
``averages``
    One column per summary JSON, one row per label: the label's average over that JSON's tasks.
    ``rows: {label: shown name}``; ``columns: {title: PATH.json}`` or
    ``{title: {source: PATH.json, tasks: [...], exclude: [...]}}``.
``generation``
    lm-eval results written by ``unimae evaluate generation``: ``rows: {shown name: .../generation.json}``,
    optional ``tasks``. One column per task with its accuracies (x 100) and perplexities; ``average: true``
    adds the mean headline accuracy with its standard error (:func:`~unimae.evaluation.generation.average_accuracy`),
    marked ``*`` when the row lacks one of the tasks (then it is the mean of those it has).
``rag``
    The RAG benchmark's entries (``results/rag-benchmark.json``, written by ``benchmarks/load_test.py``):
    one row per ``<model>/<mode>`` entry (``entries: [...]`` picks and orders them; default all) with its
    models, index build time, seconds per question, retrieval acc@1 and peak RSS. ``file`` names another
    JSON of the same layout.

Every source also takes ``caption``, a line printed under the table. For example::

    <!-- report: results/dev-gemma3
    labels: [base-mean, base-bidirectional-mean]
    tasks: [STSBenchmark, SICK-R, STS17]
    names: {base-mean: base-mean (causal)}
    -->

``python -m unimae.evaluation.report`` rewrites the tables in place; ``--check`` rewrites nothing,
lists every stale table and exits 1 (``tests/test_report.py`` runs it over the repository).
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from unimae.evaluation import summary
from unimae.evaluation.generation import average_accuracy
from unimae.evaluation.summary import SummaryRow, summary_table
from unimae.files import read_json

# Markers start a line, so a marker quoted inside a sentence or an indented example is left alone.
OPEN = re.compile(r"^<!--\s*report:(?P<spec>.*?)-->", re.DOTALL | re.MULTILINE)
CLOSE = "<!-- /report -->"
CLOSE_LINE = re.compile(r"^<!-- /report -->", re.MULTILINE)
SUMMARY_OPTIONS = {"labels", "tasks", "exclude", "names", "columns", "caption"}
AVERAGES_OPTIONS = {"rows", "columns", "caption"}
GENERATION_OPTIONS = {"rows", "tasks", "average", "caption"}
RAG_OPTIONS = {"entries", "file", "caption"}
RAG_FILE = "results/rag-benchmark.json"
# RAG benchmark entry key -> column header, in column order.
RAG_COLUMNS = {
    "models": "setup",
    "index_build_s": "index build (s)",
    "p50_s": "s per question p50",
    "p99_s": "p99",
    "retrieval_acc1": "retrieval acc@1",
    "peak_rss_gb": "peak RSS (GB)",
    "cpu_model": "CPU",
}
LIST_OPTIONS = {"labels", "tasks", "exclude", "entries"}
# lm-eval metric key -> (shown name, is an accuracy in [0, 1] shown x 100), in column order.
GENERATION_METRICS = {
    "acc": ("acc", True),
    "acc_norm": ("acc_norm", True),
    "perplexity": ("ppl", False),
    "word_perplexity": ("word ppl", False),
    "bits_per_byte": ("bits per byte", False),
}
DEFAULT_FILES = ("README.md", "docs/*.md")


class ReportError(ValueError):
    """A marker that cannot be rendered; the message names the file, the line and the fix."""


@dataclass
class Marker:
    """One marker pair; the generated table is ``text[body_start:body_end]``, between the two markers."""

    path: Path
    line: int  # 1-based line of the opening marker
    source: str
    options: dict
    body_start: int  # offsets of the body in the file's text
    body_end: int

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def find_markers(path: Path, text: str) -> list[Marker]:
    """Every marker pair of ``text``, in order; a missing or nested ``<!-- /report -->`` is an error."""
    markers, position = [], 0
    while (match := OPEN.search(text, position)) is not None:
        line = text.count("\n", 0, match.start()) + 1
        closing = CLOSE_LINE.search(text, match.end())
        close = closing.start() if closing is not None else -1
        following = OPEN.search(text, match.end())
        if close < 0 or (following is not None and following.start() < close):
            raise ReportError(f"{path}:{line}: report marker without its closing '{CLOSE}'; add one after the table")
        source, options = _parse_spec(match.group("spec"), f"{path}:{line}")
        markers.append(Marker(path, line, source, options, match.end(), close))
        position = close + len(CLOSE)
    return markers


def _parse_spec(spec: str, where: str) -> tuple[str, dict]:
    first, _, rest = spec.strip().partition("\n")
    if not first.strip():
        raise ReportError(f"{where}: report marker names no source; write '<!-- report: results/<...>.json -->'")
    try:
        options = yaml.safe_load(rest) if rest.strip() else {}
    except yaml.YAMLError as error:
        raise ReportError(f"{where}: report options are not valid YAML ({error})") from error
    if not isinstance(options, dict):
        raise ReportError(f"{where}: report options must be 'key: value' lines, got {rest.strip()!r}")
    return first.strip(), options


def render(marker: Marker, root: Path) -> str:
    """The Markdown that belongs between ``marker``'s pair (the table, then the caption if any)."""
    kind, build = NAMED_SOURCES.get(marker.source, (SUMMARY_OPTIONS, _summary))
    unknown = sorted(set(marker.options) - kind)
    if unknown:
        raise ReportError(f"{marker.where()}: unknown report option(s) {unknown}; this source takes {sorted(kind)}")
    _check_lists(marker.options, marker)
    table = build(marker, root)
    caption = marker.options.get("caption")
    return f"\n\n{table}\n\n" + (f"{caption}\n\n" if caption else "")


def _check_lists(options: dict, marker: Marker) -> None:
    """ReportError unless every list option in ``options`` is a list of names (a bare name would be split)."""
    for key in LIST_OPTIONS & set(options):
        value = options[key]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ReportError(f"{marker.where()}: report option '{key}' must be a list of names, e.g. '{key}: [a, b]'")


@functools.cache
def task_type(name: str) -> str:
    """mteb's task type of ``name`` (looked up once per task)."""
    return summary.task_type(name)


def _load_json(path: Path, marker: Marker) -> dict:
    if not path.is_file():
        raise ReportError(f"{marker.where()}: {path} does not exist; fix the path (relative to the repository root)")
    try:
        return read_json(path, "result file")
    except ValueError as err:
        raise ReportError(f"{marker.where()}: {err}") from err


def _summary_json(path: Path, marker: Marker) -> dict[str, dict]:
    data = _load_json(path, marker)
    if not all(isinstance(v, dict) and "tasks" in v for v in data.values()):
        raise ReportError(
            f"{marker.where()}: {path} is not a summary JSON ({{label: {{'tasks': ...}}}}) as written by "
            "`unimae evaluate summary`"
        )
    return data


def _pick(requested: list[str] | None, available: list[str], what: str, source: Path, marker: Marker) -> list[str]:
    if requested is None:
        return available
    absent = [name for name in requested if name not in available]
    if absent:
        raise ReportError(f"{marker.where()}: {what} {absent} not in {source}; it has {available}")
    return list(requested)


def _row_from_summary(label: str, entry: dict, tasks: list[str], folder: Path, typed: bool = True) -> SummaryRow:
    """A :class:`SummaryRow` from one label of a summary JSON, over ``tasks``."""
    scores = {t: entry["tasks"][t] for t in tasks if t in entry["tasks"]}
    missing = [t for t in tasks if t not in scores]
    if "failed" in entry:  # as the summary recorded it (a LABEL=FOLDER row's errors are in its own folder)
        failed = [t for t in missing if t in entry["failed"]]
    else:  # summaries written before "failed" was recorded
        failed = [t for t in missing if (folder / label / f"{t}.error.json").is_file()]
    types = {t: task_type(t) if typed else "" for t in tasks}
    return SummaryRow(label, scores, types, missing, failed)


def _json_tasks(data: dict[str, dict]) -> list[str]:
    return list(dict.fromkeys(t for entry in data.values() for t in [*entry["tasks"], *entry.get("missing", [])]))


def _select_tasks(options: dict, available: list[str]) -> list[str]:
    tasks = list(options.get("tasks") or available)
    return [t for t in tasks if t not in set(options.get("exclude") or [])]


def _summary(marker: Marker, root: Path) -> str:
    source, options = root / marker.source, marker.options
    if source.is_dir():
        if not options.get("labels") or not options.get("tasks"):
            raise ReportError(
                f"{marker.where()}: a results folder needs 'labels: [...]' and 'tasks: [...]' options "
                "(or name a summary JSON instead)"
            )
        tasks = _select_tasks(options, [])
        rows = [summary.read_row(source / label, tasks) for label in _folder_labels(options["labels"], source, marker)]
    else:
        data = _summary_json(source, marker)
        tasks = _select_tasks(options, _json_tasks(data))
        labels = _pick(options.get("labels"), list(data), "labels", source, marker)
        rows = [_row_from_summary(label, data[label], tasks, source.parent) for label in labels]
    names = options.get("names") or {}
    for row in rows:
        row.label = names.get(row.label, row.label)
    header, cells = summary_table(rows)
    if options.get("columns"):
        keep = [0] + [header.index(c) for c in _pick(options["columns"], header[1:], "columns", source, marker)]
        header, cells = [header[i] for i in keep], [[line[i] for i in keep] for line in cells]
    return summary.markdown_table(header, cells)


def _folder_labels(labels: list[str], folder: Path, marker: Marker) -> list[str]:
    absent = [label for label in labels if not (folder / label).is_dir()]
    if absent:
        raise ReportError(f"{marker.where()}: no result folder for {absent} in {folder}")
    return labels


def _averages(marker: Marker, root: Path) -> str:
    rows, columns = marker.options.get("rows"), marker.options.get("columns")
    if not isinstance(rows, dict) or not isinstance(columns, dict):
        raise ReportError(
            f"{marker.where()}: 'averages' needs 'rows: {{label: shown name}}' and 'columns: {{title: PATH.json}}'"
        )
    cells = [[shown] for shown in rows.values()]
    for spec in columns.values():
        spec = spec if isinstance(spec, dict) else {"source": spec}
        if "source" not in spec or set(spec) - {"source", "tasks", "exclude"}:
            raise ReportError(f"{marker.where()}: an 'averages' column is a PATH.json or {{source, tasks, exclude}}")
        _check_lists(spec, marker)
        source = root / spec["source"]
        data = _summary_json(source, marker)
        tasks = _select_tasks(spec, _json_tasks(data))
        for line, label in zip(cells, _pick(list(rows), list(data), "rows", source, marker), strict=True):
            row = _row_from_summary(label, data[label], tasks, source.parent, typed=False)
            line.append(summary.format_score(row.average, bool(row.missing)))
    return summary.markdown_table(["method", *columns], cells)


def _generation(marker: Marker, root: Path) -> str:
    rows = marker.options.get("rows")
    if not isinstance(rows, dict):
        raise ReportError(f"{marker.where()}: 'generation' needs 'rows: {{shown name: .../generation.json}}'")
    results = {shown: _load_json(root / path, marker).get("results", {}) for shown, path in rows.items()}
    available = list(dict.fromkeys(t for r in results.values() for t in r))
    tasks = _pick(marker.options.get("tasks"), available, "tasks", Path("the generation JSONs"), marker)
    metrics = {
        t: [m for m in GENERATION_METRICS if any(f"{m},none" in r.get(t, {}) for r in results.values())] for t in tasks
    }
    header = ["model"] + [f"{t} " + " / ".join(GENERATION_METRICS[m][0] for m in metrics[t]) for t in tasks]
    cells = [
        [shown] + [" / ".join(_generation_value(result.get(t, {}), m) for m in metrics[t]) for t in tasks]
        for shown, result in results.items()
    ]
    if marker.options.get("average"):
        header.append("avg acc ± SE")
        for line, result in zip(cells, results.values(), strict=True):
            try:
                mean, se, _ = average_accuracy({t: result[t] for t in tasks if result.get(t)})
            except ValueError as err:
                raise ReportError(f"{marker.where()}: {err}") from err
            incomplete = "*" if any(not result.get(t) for t in tasks) else ""  # as summary tables mark it
            line.append(f"{mean * 100:.2f}{incomplete}" + (f" ± {se * 100:.2f}" if se is not None else ""))
    return summary.markdown_table(header, cells)


def _generation_value(task_result: dict, metric: str) -> str:
    value = task_result.get(f"{metric},none")
    if value is None:
        return "-"
    return f"{value * 100:.1f}" if GENERATION_METRICS[metric][1] else f"{value:.2f}"


def _rag(marker: Marker, root: Path) -> str:
    source = root / marker.options.get("file", RAG_FILE)
    data = _load_json(source, marker)
    entries = _pick(marker.options.get("entries"), list(data), "entries", source, marker)
    header = ["entry", *RAG_COLUMNS.values()]
    cells = [[key, *(str(data[key].get(field, "-")) for field in RAG_COLUMNS)] for key in entries]
    return summary.markdown_table(header, cells)


# Sources named by a word -> (their options, their table); any other source is a summary JSON or a folder.
NAMED_SOURCES = {
    "averages": (AVERAGES_OPTIONS, _averages),
    "generation": (GENERATION_OPTIONS, _generation),
    "rag": (RAG_OPTIONS, _rag),
}


def update(path: Path, root: Path, write: bool) -> list[Marker]:
    """Regenerate every table of ``path``; return the stale markers (rewritten when ``write``)."""
    text = path.read_text()
    stale, pieces, position = [], [], 0
    for marker in find_markers(path, text):
        fresh = render(marker, root)
        if text[marker.body_start : marker.body_end] != fresh:
            stale.append(marker)
        pieces += [text[position : marker.body_start], fresh]
        position = marker.body_end
    if stale and write:
        path.write_text("".join(pieces) + text[position:])
    return stale


def doc_files(root: Path) -> list[Path]:
    """The README and every ``docs/*.md`` under ``root``."""
    return [p for pattern in DEFAULT_FILES for p in sorted(root.glob(pattern))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m unimae.evaluation.report",
        description="Regenerate the results tables between '<!-- report: ... -->' and '<!-- /report -->' "
        "markers from the JSONs under results/.",
    )
    parser.add_argument("files", nargs="*", type=Path, help="Markdown files (default: README.md and docs/*.md).")
    parser.add_argument(
        "--root", type=Path, default=Path("."), help="Repository root; marker paths are relative to it."
    )
    parser.add_argument("--check", action="store_true", help="Rewrite nothing; exit 1 if any table is stale.")
    args = parser.parse_args(argv)
    files = args.files or doc_files(args.root)
    absent = [str(path) for path in files if not path.is_file()]
    if absent:
        print(f"error: no such Markdown file(s): {', '.join(absent)}", file=sys.stderr)
        return 2
    try:
        stale = [marker for path in files for marker in update(path, args.root, write=not args.check)]
    except ReportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for marker in stale:
        verb = "is stale" if args.check else "regenerated"
        print(f"{marker.where()}: table from '{marker.source}' {verb}")
    if stale and args.check:
        print("run `python -m unimae.evaluation.report` (or `make docs`) and commit the result", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
