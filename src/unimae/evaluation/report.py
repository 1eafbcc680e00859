"""Regenerate the results tables of the README and ``docs/*.md``, and the numbers their prose quotes, from
the JSONs under ``results/``.

Every generated table and number sits between a marker pair; nothing outside the pairs is touched::

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
``index-kinds``
    The entries of a ``benchmarks/index_kinds.py`` JSON (``file: PATH.json``, required; ``entries`` as for
    ``rag``): per index kind and Matryoshka size, memory per million vectors, SciFact nDCG@10, RAG acc@1.

Every source also takes ``caption``, a line printed under the table, and ``name``, a word by which the
numbers quoted in the prose of the same file refer to the table's cells (below). For example::

    <!-- report: results/dev-gemma3
    labels: [base-mean, base-bidirectional-mean]
    tasks: [STSBenchmark, SICK-R, STS17]
    names: {base-mean: base-mean (causal)}
    name: bidir
    -->

**Numbers in prose.** A number a sentence quotes is generated too, from an inline pair on one line::

    UniMAE scores <!-- value: #dev unimae-eos Avg. -->56.31<!-- /value --> on the dev suite.

The text between the pair is rewritten; the SPEC after ``value:`` is a space-separated expression (quote
words that hold spaces). Its operands:

``PATH.json KEY ...``
    The value at that path of a JSON file (keys of objects, indexes of lists), e.g.
    ``results/speed.json unimae tok_s_1``. The key ``[]`` takes every item of a list or object, e.g.
    ``results/speed.json unimae rounds [] single tok_s``; such a list is a number only through a function.
``FUNCTION PATH.json KEY ...``
    ``sum``, ``mean``, ``median``, ``min`` or ``max`` of the numbers at that path (a list or an object's values).
``#NAME ROW COLUMN [N]``
    A cell of the table that the marker named ``NAME`` generates in the same file, as the table shows it:
    ROW is the text of the row's first cell, COLUMN a header; ``N`` picks one number of a cell that shows
    several (``59.2 / 54.3``, ``51.51 ± 0.45``; counted from 0).
``NUMBER``
    A constant, e.g. ``100``.

Operands are joined by ``+``, ``-``, ``*`` or ``/`` (the usual precedence; ``(`` and ``)``, as words of their own,
group), e.g. the lead of one row over another: ``#dev unimae-eos Avg. - #dev base-echo Avg. :.1f``, or an accuracy
difference in points: ``( A.json results piqa acc,none - B.json results piqa acc,none ) * 100 :+.1f``. A last
word starting with ``:`` is a Python format spec (``:.1f``, ``:+.1f``, ``:,.0f``, ``:.0%``); without one a single
operand is shown as its table cell or JSON value is, and an expression is an error. Markers inside code
(backticks, fenced blocks) are left alone.

``python -m unimae.evaluation.report`` rewrites the tables and values in place; ``--check`` rewrites
nothing, lists every stale table and value and exits 1 (``tests/test_report.py`` runs it over the repository).
"""

from __future__ import annotations

import argparse
import functools
import operator
import re
import shlex
import statistics
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
COMMON_OPTIONS = {"caption", "name"}
SUMMARY_OPTIONS = {"labels", "tasks", "exclude", "names", "columns"} | COMMON_OPTIONS
AVERAGES_OPTIONS = {"rows", "columns"} | COMMON_OPTIONS
GENERATION_OPTIONS = {"rows", "tasks", "average"} | COMMON_OPTIONS
RAG_OPTIONS = {"entries", "file"} | COMMON_OPTIONS
RAG_FILE = "results/rag-benchmark.json"
# RAG benchmark entry key -> column header, in column order.
RAG_COLUMNS = {
    "models": "setup",
    "index_build_s": "index build (s)",
    "p50_s": "s per question p50",
    "p99_s": "p99",
    "retrieval_acc1": "retrieval acc@1",
    "all_paragraphs_acc_at_1": "acc@1, every paragraph",
    "peak_rss_gb": "peak RSS (GB)",
    "cpu_model": "CPU",
}
# benchmarks/index_kinds.py entry key -> column header, in column order.
INDEX_KINDS_COLUMNS = {
    "kind": "index",
    "rescore": "binary rescoring",
    "dimensions": "dimensions",
    "mb_per_million": "MB per 1M vectors",
    "disk_mb_per_million": "on disk, MB per 1M",
    "scifact_ndcg10": "SciFact nDCG@10",
    "rag_acc1": "RAG acc@1",
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
# An inline value: the pair and the text between them on one line.
VALUE = re.compile(r"<!--\s*value:(?P<spec>[^\n]*?)-->(?P<text>[^\n]*?)<!--\s*/value\s*-->")
OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
FUNCTIONS = {"sum": sum, "mean": statistics.fmean, "median": statistics.median, "min": min, "max": max}
# A number shown in a table cell ("59.2 / 54.3", "75.00*", "51.51 ± 0.45"), not one inside a word ("k=1").
CELL_NUMBER = re.compile(r"(?<![\w.=])-?\d+(?:\.\d+)?(?![\w.])")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
# A line that starts a Markdown block of its own: a list item, a heading, a table row or a quote.
BLOCK_LINE = re.compile(r"[ \t]*(?:[-*+][ \t]|\d+[.)][ \t]|#|\||>)")


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

    @property
    def what(self) -> str:
        return f"table from '{self.source}'"


@dataclass
class Value:
    """One inline value pair; the generated number is ``text[start:end]``."""

    path: Path
    line: int
    spec: str
    start: int
    end: int
    old: str = ""
    new: str = ""

    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def what(self) -> str:
        return f"value '{self.spec}' ('{self.old}' -> '{self.new}')"


@dataclass
class Table:
    """A generated table's header and rows as shown, for the values that quote its cells."""

    header: list[str]
    rows: dict[str, list[str]]


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
    name = marker.options.get("name")
    if name is not None and not (isinstance(name, str) and re.fullmatch(r"[\w.-]+", name)):
        raise ReportError(f"{marker.where()}: report option 'name' must be one word, e.g. 'name: dev'")
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


def _entries(marker: Marker, root: Path, default_file: str | None, columns: dict[str, str]) -> str:
    """One row per entry of a benchmark's ``{key: {field: value}}`` JSON, the ``columns`` fields shown as is."""
    file = marker.options.get("file", default_file)
    if file is None:
        raise ReportError(f"{marker.where()}: this source needs 'file: PATH.json'")
    source = root / file
    data = _load_json(source, marker)
    entries = _pick(marker.options.get("entries"), list(data), "entries", source, marker)
    header = ["entry", *columns.values()]
    cells = [[key, *(str(data[key].get(field, "-")) for field in columns)] for key in entries]
    return summary.markdown_table(header, cells)


def _rag(marker: Marker, root: Path) -> str:
    return _entries(marker, root, RAG_FILE, RAG_COLUMNS)


def _index_kinds(marker: Marker, root: Path) -> str:
    return _entries(marker, root, None, INDEX_KINDS_COLUMNS)


# Sources named by a word -> (their options, their table); any other source is a summary JSON or a folder.
NAMED_SOURCES = {
    "averages": (AVERAGES_OPTIONS, _averages),
    "generation": (GENERATION_OPTIONS, _generation),
    "rag": (RAG_OPTIONS, _rag),
    "index-kinds": (RAG_OPTIONS, _index_kinds),
}


def parse_table(markdown: str) -> Table:
    """The header and the rows (keyed by their first cell) of the Markdown table in ``markdown``."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    header, *rows = [[cell.strip() for cell in line.strip()[1:-1].split("|")] for line in lines]
    return Table(header, {row[0]: row for row in rows})


def block_start(text: str, position: int) -> int:
    """Where the Markdown block holding ``position`` starts: its paragraph's or list item's first line (an inline
    code span may run over the lines of its block, never past it)."""
    start = text.rfind("\n", 0, position) + 1
    while start > 0 and not BLOCK_LINE.match(text, start):
        previous = text.rfind("\n", 0, start - 1) + 1
        if not text[previous : start - 1].strip():  # a blank line ends the block above
            break
        start = previous
    return start


def find_values(path: Path, text: str, skip: list[tuple[int, int]]) -> list[Value]:
    """Every inline value pair of ``text`` outside the ``skip`` ranges, fenced code and inline code."""
    skip = skip + [match.span() for match in FENCE.finditer(text)]
    values = []
    for match in VALUE.finditer(text):
        in_code = text.count("`", block_start(text, match.start()), match.start()) % 2 == 1
        if in_code or any(start <= match.start() < end for start, end in skip):
            continue
        line = text.count("\n", 0, match.start()) + 1
        spec = match.group("spec").strip()
        values.append(Value(path, line, spec, match.start("text"), match.end("text"), match.group("text")))
    return values


def evaluate(value: Value, tables: dict[str, Table], root: Path) -> str:
    """The text of ``value``: its SPEC evaluated (module docstring) and formatted."""
    where = value.where()
    try:
        words = shlex.split(value.spec)
    except ValueError as err:
        raise ReportError(f"{where}: value '{value.spec}' does not split into words ({err})") from err
    spec = words.pop() if words and words[-1].startswith(":") else None
    if not words:
        raise ReportError(f"{where}: value '{value.spec}' names nothing; e.g. '#dev unimae-eos Avg.'")
    if spec is None:
        if any(word in OPERATORS or word in "()" for word in words):
            raise ReportError(f"{where}: value '{value.spec}' computes a number; end it with a format such as ':.1f'")
        return _operand(words, tables, root, where, as_text=True)
    result = _calculate(words, lambda operand: _number(_operand(operand, tables, root, where), where), value)
    try:
        return format(result, spec[1:])
    except (TypeError, ValueError) as err:
        raise ReportError(f"{where}: value format '{spec}' does not apply to {result!r} ({err})") from err


def _calculate(words: list[str], number, value: Value) -> float:
    """``words`` as arithmetic (``+ - * /``, the usual precedence, spaced ``( )``); ``number`` reads an operand."""
    position = 0

    def fail(what: str) -> ReportError:
        return ReportError(
            f"{value.where()}: value '{value.spec}' {what}; write e.g. '( #t a Avg. - #t b Avg. ) * 100'"
        )

    def peek() -> str | None:
        return words[position] if position < len(words) else None

    def expression() -> float:
        nonlocal position
        result = term()
        while peek() in ("+", "-"):
            position += 1
            result = OPERATORS[words[position - 1]](result, term())
        return result

    def term() -> float:
        nonlocal position
        result = factor()
        while peek() in ("*", "/"):
            position += 1
            op, right = words[position - 1], factor()
            if op == "/" and right == 0:
                raise fail("divides by zero")
            result = OPERATORS[op](result, right)
        return result

    def factor() -> float:
        nonlocal position
        if peek() == "(":
            position += 1
            result = expression()
            if peek() != ")":
                raise fail("misses a ')'")
            position += 1
            return result
        start = position
        while peek() is not None and peek() not in OPERATORS and peek() not in ("(", ")"):
            position += 1
        if start == position:
            raise fail("has an empty operand")
        return number(words[start:position])

    result = expression()
    if position != len(words):
        raise fail(f"has {words[position]!r} where an operator belongs")
    return result


def _operand(words: list[str], tables: dict[str, Table], root: Path, where: str, as_text: bool = False):
    """One operand of a value's SPEC: a table cell's number, a JSON value or a constant."""
    first, keys = words[0], words[1:]
    if first in FUNCTIONS and keys and keys[0].endswith(".json"):
        data = _json_path(_json_at(root / keys[0], where), keys[1:], f"{where}: {keys[0]}")
        numbers = [_number(number, where) for number in _flatten(data)]
        if not numbers:
            raise ReportError(f"{where}: {' '.join(words)!r} has no numbers to take the {first} of")
        result = FUNCTIONS[first](numbers)
        return str(result) if as_text else result
    if first.startswith("#"):
        return _cell(first[1:], keys, tables, where)
    if first.endswith(".json"):
        data = _json_path(_json_at(root / first, where), keys, f"{where}: {first}")
        return str(data) if as_text else data
    if len(words) == 1:
        try:
            return first if as_text else float(first)
        except ValueError:
            pass
    raise ReportError(
        f"{where}: value operand {' '.join(words)!r} is not '#TABLE ROW COLUMN', '[FUNCTION] PATH.json KEY ...' "
        "or a number"
    )


def _json_path(data, keys: list[str], where: str):
    """The value at ``keys`` in ``data`` (object keys, list indexes; ``[]``: every item, as a list)."""
    for depth, key in enumerate(keys):
        if key == "[]" and isinstance(data, dict | list):
            items = data.values() if isinstance(data, dict) else data
            return [_json_path(item, keys[depth + 1 :], where) for item in items]
        if isinstance(data, dict) and key in data:
            data = data[key]
        elif isinstance(data, list) and re.fullmatch(r"-?\d+", key) and -len(data) <= int(key) < len(data):
            data = data[int(key)]
        else:
            there = sorted(data)[:20] if isinstance(data, dict) else f"{type(data).__name__} {str(data)[:40]}"
            raise ReportError(f"{where} has no {key!r} under {keys[:depth]}; there: {there}")
    return data


def _flatten(data) -> list:
    """The leaves of nested lists and objects, in order."""
    if isinstance(data, dict):
        data = list(data.values())
    if not isinstance(data, list):
        return [data]
    return [leaf for item in data for leaf in _flatten(item)]


def _cell(name: str, keys: list[str], tables: dict[str, Table], where: str) -> str:
    if name not in tables:
        raise ReportError(
            f"{where}: no table named {name!r} in this file (add 'name: {name}' to its marker); named: {sorted(tables)}"
        )
    if len(keys) not in (2, 3) or (len(keys) == 3 and not keys[2].isdigit()):
        raise ReportError(f"{where}: a table cell is '#{name} ROW COLUMN [N]' (quote words with spaces), got {keys}")
    table, (row, column) = tables[name], keys[:2]
    if row not in table.rows:
        raise ReportError(f"{where}: table {name!r} has no row {row!r}; rows: {list(table.rows)}")
    if column not in table.header:
        raise ReportError(f"{where}: table {name!r} has no column {column!r}; columns: {table.header}")
    cell = table.rows[row][table.header.index(column)]
    numbers = CELL_NUMBER.findall(cell)
    index = int(keys[2]) if len(keys) == 3 else None
    if index is None and len(numbers) != 1 or index is not None and index >= len(numbers):
        raise ReportError(f"{where}: cell {row!r} / {column!r} of {name!r} is {cell!r}; pick one of its numbers with N")
    return numbers[index or 0]


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ReportError(f"{where}: {value!r} is not a number")
    try:
        return float(value)
    except ValueError as err:
        raise ReportError(f"{where}: {value!r} is not a number") from err


@functools.cache
def _read_json_cached(path: Path, mtime_ns: int, size: int):
    """A result file read once per version (a doc quotes the same file many times)."""
    return read_json(path, "result file")


def _json_at(path: Path, where: str):
    if not path.is_file():
        raise ReportError(f"{where}: {path} does not exist; fix the path (relative to the repository root)")
    try:
        stat = path.stat()
        return _read_json_cached(path, stat.st_mtime_ns, stat.st_size)
    except ValueError as err:
        raise ReportError(f"{where}: {err}") from err


def update(path: Path, root: Path, write: bool) -> list[Marker | Value]:
    """Regenerate every table and value of ``path``; return the stale ones (rewritten when ``write``)."""
    text = path.read_text()
    markers = find_markers(path, text)
    fresh = {id(marker): render(marker, root) for marker in markers}
    tables: dict[str, Table] = {}
    for marker in markers:
        name = marker.options.get("name")
        if name in tables:
            raise ReportError(f"{marker.where()}: a second table named {name!r}; names are unique within a file")
        if name is not None:
            tables[name] = parse_table(fresh[id(marker)])
    values = find_values(path, text, [(marker.body_start, marker.body_end) for marker in markers])
    for value in values:
        value.new = evaluate(value, tables, root)
    spans = [(m.body_start, m.body_end, fresh[id(m)], m) for m in markers]
    spans += [(v.start, v.end, v.new, v) for v in values]
    stale, pieces, position = [], [], 0
    for start, end, new, item in sorted(spans, key=lambda span: span[0]):
        if text[start:end] != new:
            stale.append(item)
        pieces += [text[position:start], new]
        position = end
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
        "markers, and the values between '<!-- value: ... -->' and '<!-- /value -->', from the JSONs under results/.",
    )
    parser.add_argument("files", nargs="*", type=Path, help="Markdown files (default: README.md and docs/*.md).")
    parser.add_argument(
        "--root", type=Path, default=Path("."), help="Repository root; marker paths are relative to it."
    )
    parser.add_argument("--check", action="store_true", help="Rewrite nothing; exit 1 if any table or value is stale.")
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
    for item in stale:
        verb = "is stale" if args.check else "regenerated"
        print(f"{item.where()}: {item.what} {verb}")
    if stale and args.check:
        print("run `python -m unimae.evaluation.report` (or `make docs`) and commit the result", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
