"""The docs tables generator (``python -m unimae.evaluation.report``): markers, sources, --check.

No model is loaded. The unit tests use a fixed task -> type map instead of mteb's registry; the
last tests run the real check over README.md and docs/*.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unimae.evaluation import report

ROOT = Path(__file__).resolve().parents[1]
TYPES = {"STSBenchmark": "STS", "SICK-R": "STS", "Banking77Classification": "Classification"}
BEFORE = "# Title\n\nSome prose with 12.34 in it.\n\n"
AFTER = "\nMore prose.\n\n| a hand-written | table |\n|---|---|\n| 1 | 2 |\n"


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A repository with one summary JSON, two generation JSONs and one Markdown file."""
    monkeypatch.setattr(report, "task_type", TYPES.__getitem__)
    results = tmp_path / "results" / "dev"
    results.mkdir(parents=True)
    summary = {
        "base": {"tasks": {"STSBenchmark": 40.0, "SICK-R": 50.0, "Banking77Classification": 60.0}, "missing": []},
        "tuned": {"tasks": {"STSBenchmark": 70.0, "SICK-R": 80.0}, "missing": ["Banking77Classification"]},
    }
    (results / "summary.json").write_text(json.dumps(summary))
    (results / "broken.json").write_text('{"base": {"tasks": ')  # cut off mid-write
    for name, acc in [("base", 0.5), ("tuned", 0.625)]:
        folder = tmp_path / "results" / "gen" / name
        folder.mkdir(parents=True)
        scores = {"arc_easy": {"acc,none": acc, "acc_norm,none": 0.25}, "lambada_openai": {"perplexity,none": 12.345}}
        (folder / "generation.json").write_text(json.dumps({"results": scores}))
    return tmp_path


def write_doc(root: Path, marker: str, body: str = "\n| stale |\n") -> Path:
    doc = root / "doc.md"
    doc.write_text(BEFORE + marker + body + "<!-- /report -->\n" + AFTER)
    return doc


def run(root: Path, doc: Path, *flags: str) -> int:
    return report.main([*flags, "--root", str(root), str(doc)])


def table_of(doc: Path) -> list[str]:
    """The table rows between the marker pair (the separator line left out)."""
    body = doc.read_text().split("-->\n", 1)[1].split("<!-- /report -->", 1)[0]
    return [line for line in body.splitlines() if line.startswith("| ")]


def test_stale_table_fails_check_then_regenerates_and_leaves_other_text_alone(root, capsys):
    doc = write_doc(root, "<!-- report: results/dev/summary.json -->")
    original = doc.read_text()

    assert run(root, doc, "--check") == 1
    assert "doc.md:5: table from 'results/dev/summary.json' is stale" in capsys.readouterr().out
    assert doc.read_text() == original  # --check writes nothing

    assert run(root, doc) == 0
    assert run(root, doc, "--check") == 0
    text = doc.read_text()
    assert text.startswith(BEFORE + "<!-- report: results/dev/summary.json -->\n")
    assert text.endswith("<!-- /report -->\n" + AFTER)
    assert table_of(doc) == [
        "| method | Class. | STS | Avg. | STSBenchmark | SICK-R | Banking77Classification | missing |",
        "| base | 60.00 | 45.00 | 50.00 | 40.00 | 50.00 | 60.00 |  |",
        "| tuned | - | 75.00 | 75.00* | 70.00 | 80.00 | not run | Banking77Classification |",
    ]
    # A second run changes nothing.
    assert run(root, doc) == 0
    assert doc.read_text() == text


def test_a_changed_json_makes_the_table_stale_again(root):
    doc = write_doc(root, "<!-- report: results/dev/summary.json -->")
    assert run(root, doc) == 0
    path = root / "results" / "dev" / "summary.json"
    data = json.loads(path.read_text())
    data["base"]["tasks"]["SICK-R"] = 51.0
    path.write_text(json.dumps(data))
    assert run(root, doc, "--check") == 1
    assert run(root, doc) == 0
    assert "| base | 60.00 | 45.50 | 50.33 | 40.00 | 51.00 | 60.00 |  |" in table_of(doc)


def test_summary_options_select_rename_and_recompute(root):
    marker = (
        "<!-- report: results/dev/summary.json\n"
        "labels: [tuned, base]\n"
        "exclude: [Banking77Classification]\n"
        "names: {tuned: tuned (ours)}\n"
        "columns: [Avg., SICK-R]\n"
        "caption: Scores x 100.\n"
        "-->"
    )
    doc = write_doc(root, marker)
    assert run(root, doc) == 0
    assert table_of(doc) == [
        "| method | Avg. | SICK-R |",
        "| tuned (ours) | 75.00 | 80.00 |",
        "| base | 45.00 | 50.00 |",
    ]
    assert "\nScores x 100.\n\n<!-- /report -->" in doc.read_text()


def test_a_task_failed_as_the_summary_recorded_it(root):
    """A LABEL=FOLDER row keeps its error file in its own folder: the summary's "failed" is what counts."""
    path = root / "results" / "dev" / "summary.json"
    data = json.loads(path.read_text())
    data["tuned"]["failed"] = ["Banking77Classification"]
    path.write_text(json.dumps(data))
    doc = write_doc(root, "<!-- report: results/dev/summary.json\ncolumns: [Banking77Classification]\n-->")
    assert run(root, doc) == 0
    assert table_of(doc)[1:] == ["| base | 60.00 |", "| tuned | failed |"]


def test_averages_and_generation_sources(root):
    averages = (
        "<!-- report: averages\n"
        "rows: {base: Base, tuned: Tuned}\n"
        "columns:\n"
        "  all: results/dev/summary.json\n"
        "  STS only: {source: results/dev/summary.json, tasks: [STSBenchmark, SICK-R]}\n"
        "-->"
    )
    doc = write_doc(root, averages)
    assert run(root, doc) == 0
    assert table_of(doc) == ["| method | all | STS only |", "| Base | 50.00 | 45.00 |", "| Tuned | 75.00* | 75.00 |"]

    generation = (
        "<!-- report: generation\n"
        "rows: {base: results/gen/base/generation.json, tuned: results/gen/tuned/generation.json}\n"
        "-->"
    )
    doc = write_doc(root, generation)
    assert run(root, doc) == 0
    assert table_of(doc) == [
        "| model | arc_easy acc / acc_norm | lambada_openai ppl |",
        "| base | 50.0 / 25.0 | 12.35 |",
        "| tuned | 62.5 / 25.0 | 12.35 |",
    ]

    # average: the mean headline accuracy (acc_norm for arc_easy) and its standard error
    gen = root / "results" / "gen"
    for name, (norm, se) in {"base": (0.25, 0.03), "tuned": (0.5, None)}.items():
        scores = {"arc_easy": {"acc_norm,none": norm, "acc_norm_stderr,none": se}, "winogrande": {"acc,none": 0.5}}
        scores["winogrande"]["acc_stderr,none"] = 0.04
        scores["lambada_openai"] = {"perplexity,none": 9.0}
        (gen / name / "generation.json").write_text(json.dumps({"results": scores}))
    doc = write_doc(root, generation.replace("\n-->", "\naverage: true\n-->"))
    assert run(root, doc) == 0
    assert [line.rsplit("|", 2)[-2].strip() for line in table_of(doc)] == ["avg acc ± SE", "37.50 ± 2.50", "50.00"]

    # a row without one of the tasks (here a registry task the other row ran) averages what it has, marked *
    scores["mmlu"] = {"acc,none": 0.25, "acc_stderr,none": 0.0}
    (gen / "tuned" / "generation.json").write_text(json.dumps({"results": scores}))
    assert run(root, doc) == 0
    assert [line.rsplit("|", 2)[-2].strip() for line in table_of(doc)] == ["avg acc ± SE", "37.50* ± 2.50", "41.67"]


def test_rag_source_lists_the_benchmark_entries(root):
    entry = {"models": "m (embed + generate)", "index_build_s": 70.1, "p50_s": 1.5, "p99_s": 2.0}
    entries = {
        "m/one": {
            **entry,
            "retrieval_acc1": 0.9,
            "all_paragraphs_acc_at_1": 0.88,
            "peak_rss_gb": 1.4,
            "cpu_model": "AMD EPYC",
        },
        "m/two": {**entry, "models": "MiniLM + m", "retrieval_acc1": 0.95, "peak_rss_gb": 1.5},
    }
    (root / "results" / "rag-benchmark.json").write_text(json.dumps(entries))
    doc = write_doc(root, "<!-- report: rag\nentries: [m/two, m/one]\n-->")
    assert run(root, doc) == 0
    rows = table_of(doc)
    assert rows[0].startswith("| entry | setup | index build (s) |") and "retrieval acc@1" in rows[0]
    assert rows[1] == "| m/two | MiniLM + m | 70.1 | 1.5 | 2.0 | 0.95 | - | 1.5 | - |"
    assert rows[2] == "| m/one | m (embed + generate) | 70.1 | 1.5 | 2.0 | 0.9 | 0.88 | 1.4 | AMD EPYC |"
    doc = write_doc(root, "<!-- report: rag\nentries: [m/three]\n-->")
    assert run(root, doc) == 2


def test_index_kinds_source_lists_a_files_entries_and_needs_the_file(root):
    entry = {"kind": "binary", "dimensions": 640, "mb_per_million": 76.3, "scifact_ndcg10": 60.1, "rag_acc1": 0.9}
    entry |= {"disk_mb_per_million": 686.6, "rescore": "int8"}
    (root / "results" / "kinds.json").write_text(json.dumps({"a/binary/640": {**entry, "cpu_model": "AMD EPYC"}}))
    doc = write_doc(root, "<!-- report: index-kinds\nfile: results/kinds.json\n-->")
    assert run(root, doc) == 0
    rows = table_of(doc)
    header = (
        "| entry | index | binary rescoring | dimensions | MB per 1M vectors | on disk, MB per 1M | SciFact nDCG@10 |"
    )
    header += " RAG acc@1 | CPU |"
    assert rows[0] == header
    assert rows[1] == "| a/binary/640 | binary | int8 | 640 | 76.3 | 686.6 | 60.1 | 0.9 | AMD EPYC |"
    doc = write_doc(root, "<!-- report: index-kinds\nentries: [a/binary/640]\n-->")
    assert run(root, doc) == 2


def test_an_inline_code_span_over_two_lines_hides_only_the_values_inside_it(root, capsys):
    """A code span may run over the lines of its paragraph or list item: a value after it is checked, one inside it
    is left alone, and a new list item or paragraph starts with no span open."""
    after = "<!-- value: results/dev/summary.json base tasks STSBenchmark :.1f -->0<!-- /value -->"
    inside = "<!-- value: results/dev/summary.json base tasks STSBenchmark :.1f -->in code<!-- /value -->"
    doc = root / "doc.md"
    doc.write_text(
        f"- (`unimae evaluate\n  --label x`; {after} min)\n- `a span {inside}\n  closed` here\n"
        f"- an item with an odd tick ` {inside}\n\nA paragraph: {after}\n"
    )
    assert run(root, doc, "--check") == 1
    assert "doc.md:2: value" in capsys.readouterr().out  # the first item's value, after the span closed
    assert run(root, doc) == 0
    text = doc.read_text()
    assert text.count("-->40.0<!-- /value -->") == 2
    assert text.count("-->in code<!-- /value -->") == 2


def test_values_in_prose_quote_a_json_path_or_a_named_tables_cell(root, capsys):
    """Inline values: a JSON path, a cell of a named table (before or after it), arithmetic with a format."""
    (root / "results" / "speed.json").write_text(json.dumps({"engine": {"tok_s": [39.06144, 63.7787]}, "cpu": "EPYC"}))
    table = "<!-- report: results/dev/summary.json\nname: dev\n-->"
    prose = (
        "Tuned leads by <!-- value: #dev tuned Avg. - #dev base Avg. :+.1f -->0<!-- /value --> points "
        "(<!-- value: #dev tuned Avg. -->?<!-- /value -->, STS <!-- value: #dev tuned STS -->?<!-- /value -->).\n"
        "Speed <!-- value: results/speed.json engine tok_s 0 :.1f -->1.0<!-- /value --> tokens/s on "
        "<!-- value: results/speed.json cpu -->?<!-- /value -->, "
        "<!-- value: results/speed.json engine tok_s 0 / results/speed.json engine tok_s -1 :.0% -->?<!-- /value -->"
        " of the other; `<!-- value: #dev base Avg. -->in code<!-- /value -->` is left alone.\n"
    )
    doc = root / "doc.md"
    after = "After: <!-- value: #dev base Avg. --><!-- /value -->\n"
    doc.write_text(prose + "\n" + table + "\n<!-- /report -->\n\n" + after)
    assert run(root, doc, "--check") == 1
    out = capsys.readouterr().out
    assert "doc.md:1: value '#dev tuned Avg. - #dev base Avg. :+.1f' ('0' -> '+25.0') is stale" in out
    assert run(root, doc) == 0
    text = doc.read_text()
    assert text.startswith(
        "Tuned leads by <!-- value: #dev tuned Avg. - #dev base Avg. :+.1f -->+25.0<!-- /value --> points "
        "(<!-- value: #dev tuned Avg. -->75.00<!-- /value -->, STS <!-- value: #dev tuned STS -->75.00<!-- /value -->)."
    )
    assert "Speed <!-- value: results/speed.json engine tok_s 0 :.1f -->39.1<!-- /value --> tokens/s on " in text
    assert "<!-- value: results/speed.json cpu -->EPYC<!-- /value -->, " in text
    assert ":.0% -->61%<!-- /value --> of the other; `<!-- value: #dev base Avg. -->in code<!-- /value -->`" in text
    assert text.endswith("After: <!-- value: #dev base Avg. -->50.00<!-- /value -->\n")
    assert run(root, doc, "--check") == 0  # idempotent

    # A changed JSON makes the quoted numbers stale, as it does the table.
    (root / "results" / "speed.json").write_text(json.dumps({"engine": {"tok_s": [42.0, 63.7787]}, "cpu": "EPYC"}))
    assert run(root, doc, "--check") == 1
    assert run(root, doc) == 0
    assert "tok_s 0 :.1f -->42.0<!-- /value -->" in doc.read_text()


@pytest.mark.parametrize(
    ("spec", "shown"),
    [
        ("#dev tuned Avg. - #dev base Avg. / 100 :.1f", "74.5"),  # * and / before + and -
        ("( #dev tuned Avg. - #dev base Avg. ) / 100 :.2f", "0.25"),
        ("max results/runs.json rounds [] tok_s :.1f", "41.0"),  # [] takes every item, a function reduces them
        ("median results/runs.json rounds [] tok_s / min results/runs.json rounds [] tok_s :.0%", "120%"),
        ("sum results/runs.json seconds / 60 :.1f", "2.0"),  # an object's values
        ('#gen tuned "arc_easy acc / acc_norm" 1', "25.0"),  # one number of a cell that shows two
    ],
)
def test_value_arithmetic_functions_and_cells(root, spec, shown):
    rounds = {"rounds": [{"tok_s": 30.0}, {"tok_s": 36.0}, {"tok_s": 41.0}], "seconds": {"a": 50, "b": 70}}
    (root / "results" / "runs.json").write_text(json.dumps(rounds))
    doc = root / "doc.md"
    tables = (
        "<!-- report: results/dev/summary.json\nname: dev\n-->\n<!-- /report -->\n\n"
        "<!-- report: generation\nrows: {tuned: results/gen/tuned/generation.json}\nname: gen\n-->\n<!-- /report -->\n"
    )
    doc.write_text(f"{tables}\nIt is <!-- value: {spec} -->?<!-- /value -->.\n")
    assert run(root, doc) == 0
    assert doc.read_text().endswith(f"It is <!-- value: {spec} -->{shown}<!-- /value -->.\n")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("#nope base Avg.", "no table named 'nope'"),
        ("#dev nobody Avg.", "has no row 'nobody'"),
        ("#dev base Retr.", "has no column 'Retr.'"),
        ("#dev base Avg. - #dev tuned Avg.", "end it with a format"),
        ("results/dev/summary.json base tasks Nope", "has no 'Nope' under ['base', 'tasks']"),
        ("results/dev/absent.json base", "absent.json does not exist"),
        ("results/dev/summary.json base tasks SICK-R - :.1f", "empty operand"),
        ("results/dev/summary.json base missing :.1f", "is not a number"),
        ("( #dev base Avg. - 1 :.1f", "misses a ')'"),
        ("#dev base Avg. / 0 :.1f", "divides by zero"),
        ("#dev base Avg. :.1x", "format ':.1x' does not apply"),
    ],
)
def test_bad_values_name_the_file_line_and_fix(root, capsys, value, message):
    doc = root / "doc.md"
    table = "<!-- report: results/dev/summary.json\nname: dev\n-->\n<!-- /report -->\n"
    doc.write_text(f"{table}\nA value: <!-- value: {value} -->1<!-- /value -->\n")
    assert run(root, doc, "--check") == 2
    err = capsys.readouterr().err
    assert "doc.md:6:" in err and message in err


def test_markers_inside_prose_or_indented_are_not_tables(root):
    doc = root / "doc.md"
    text = "Write `<!-- report: x.json -->` to add one:\n\n    <!-- report: x.json -->\n    <!-- /report -->\n"
    doc.write_text(text)
    assert run(root, doc, "--check") == 0
    assert report.find_markers(doc, text) == []


@pytest.mark.parametrize(
    ("marker", "body", "message"),
    [
        ("<!-- report: results/dev/missing.json -->", "\n<!-- /report -->\n", "missing.json does not exist"),
        ("<!-- report: results/dev/summary.json\nlabel: [base]\n-->", "\n<!-- /report -->\n", "unknown report option"),
        ("<!-- report: results/dev/summary.json\nlabels: [nobody]\n-->", "\n<!-- /report -->\n", "['nobody'] not in"),
        ("<!-- report: results/dev -->", "\n<!-- /report -->\n", "needs 'labels: [...]' and 'tasks: [...]'"),
        ("<!-- report: results/dev/summary.json\ntasks: SICK-R\n-->", "\n<!-- /report -->\n", "must be a list"),
        ("<!-- report: results/dev/summary.json -->", "\n| no closing marker |\n", "without its closing"),
        ("<!-- report: results/dev/broken.json -->", "\n<!-- /report -->\n", "broken.json is not valid JSON"),
        (
            "<!-- report: averages\nrows: {base: B}\n"
            "columns: {c: {source: results/dev/summary.json, tasks: SICK-R}}\n-->",
            "\n<!-- /report -->\n",
            "'tasks' must be a list",
        ),
    ],
)
def test_bad_markers_name_the_file_line_and_fix(root, capsys, marker, body, message):
    doc = root / "doc.md"
    doc.write_text(BEFORE + marker + body)
    assert run(root, doc, "--check") == 2
    err = capsys.readouterr().err
    assert "doc.md:5:" in err and message in err


def test_repository_docs_tables_are_up_to_date(capsys):
    files = report.doc_files(ROOT)
    assert ROOT / "README.md" in files
    assert {p.name for p in files} >= {"methods.md", "serving.md", "evaluation.md", "results.md"}
    assert sum(len(report.find_markers(p, p.read_text())) for p in files) > 0
    status = report.main(["--check", "--root", str(ROOT)])
    assert status == 0, capsys.readouterr().out + "\nrun `make docs` (python -m unimae.evaluation.report)"


def test_readme_stays_short():
    size = (ROOT / "README.md").stat().st_size
    assert size <= 15_000, f"README.md is {size} bytes (limit 15 KB); move details to docs/"
