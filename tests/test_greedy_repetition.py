"""benchmarks/greedy_repetition.py's measures: repetition of a continuation, standard errors over the prompts, and
an adapter's paired difference from the base model on the same prompts."""

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture
def bench(monkeypatch):
    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(folder))
    spec = importlib.util.spec_from_file_location("greedy_repetition", folder / "greedy_repetition.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repetition_counts_repeated_trigrams_and_distinct_words(bench):
    assert bench.repetition("a b c d") == {"distinct_words": 1.0, "repeated_trigrams": 0.0}
    loop = bench.repetition("x y z x y z x y z")  # 7 trigrams, 3 distinct
    assert loop["repeated_trigrams"] == pytest.approx(1 - 3 / 7) and loop["distinct_words"] == pytest.approx(3 / 9)
    assert bench.repetition("") == {"distinct_words": 0.0, "repeated_trigrams": 0.0}


def test_an_adapter_is_compared_with_the_base_prompt_by_prompt(bench):
    base = {"continuations": {"p1": "a b c d", "p2": "x y z x y z x y z", "p3": "k l m n"}}
    adapter = {"continuations": {"p1": "a b a b a b", "p2": "x y z w v u", "p3": "k l m n"}}
    versus = bench.versus_base(adapter, base)
    differences = [1 - 2 / 4, -(1 - 3 / 7), 0.0]
    assert versus["repeated_trigrams_diff"] == round(sum(differences) / 3, 4)
    assert versus["repeated_trigrams_diff_se"] == round(bench.standard_error(differences), 4)
    assert (versus["prompts_more"], versus["prompts_fewer"]) == (1, 1)
    assert bench.standard_error([0.5]) == 0.0 and bench.standard_error([0.0, 2.0]) == pytest.approx(1.0)


def test_the_plain_prompt_set_is_the_fixed_eight(bench):
    assert bench.prompt_set("plain", 64, 8) == bench.PROMPTS and len(bench.PROMPTS) == 8


def test_a_base_run_again_with_other_continuations_keeps_the_one_earlier_rows_were_paired_with(bench):
    old_base = {"cpu_model": "AMD EPYC", "continuations": {"p": "a b c"}}
    previous = {"base": old_base, "release": {"vs_base": {"repeated_trigrams_diff": -0.1}}, "note": "x"}
    new_base = {"cpu_model": "Intel Xeon", "continuations": {"p": "a b d"}}
    kept = bench.keep_earlier_base(previous, {"base": new_base, "wise": {"vs_base": {}}})
    assert kept == {
        "base@AMD EPYC": old_base,
        "release": {"vs_base": {"repeated_trigrams_diff": -0.1, "paired_with": "base@AMD EPYC"}},
    }
    again = {**previous, "base@AMD EPYC": {"continuations": {"p": "z"}}}  # a base kept from an even earlier run
    assert "base@AMD EPYC'" in bench.keep_earlier_base(again, {"base": new_base})
    assert bench.keep_earlier_base(previous, {"base": dict(old_base)}) == {}  # the same continuations: one base
    assert bench.keep_earlier_base(previous, {"release": {}}) == {}  # no base run: nothing to keep
