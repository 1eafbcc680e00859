"""The recipes' shared shell helper (recipes/train_run.sh), run by bash with a stand-in for the CLI."""

import subprocess
from pathlib import Path

import pytest

HELPER = Path(__file__).resolve().parents[1] / "recipes" / "train_run.sh"
RESUME = "train --resume --output-dir {run} --steps 3"


def _train_run(tmp_path: Path, run: Path) -> list[str]:
    """The `unimae` command lines `train_run RUN --steps 3` issues (the stand-in records them)."""
    calls, cli = tmp_path / "calls", tmp_path / "fake-unimae"
    cli.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    cli.chmod(0o755)
    script = f'UNIMAE={cli}; source {HELPER}; train_run "{run}" --steps 3'
    subprocess.run(["bash", "-c", script], check=True)
    return calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ([], "train --output-dir {run} --steps 3"),  # nothing there: a new run
        (["checkpoints/step-000001/state.pt"], RESUME),  # interrupted
        # an adapter beside checkpoints may be an interrupted run's: resume (returns at once if it finished)
        (
            ["checkpoints/step-000003/state.pt", "adapter/adapter_config.json"],
            RESUME,
        ),
        (["adapter/adapter_config.json"], None),  # an adapter without checkpoints: finished, left alone
    ],
    ids=["new", "interrupted", "adapter-and-checkpoints", "adapter-only"],
)
def test_train_run_starts_resumes_or_skips(tmp_path, files, expected):
    run = tmp_path / "run"
    for name in files:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("")
    calls = _train_run(tmp_path, run)
    assert calls == ([] if expected is None else [expected.format(run=run)])


@pytest.mark.parametrize(
    ("env", "stages"),
    [
        ({}, ["unimae", "unimae-simcse", "unimae-simcse-sup"]),
        ({"SIMCSE_STEPS": "0"}, ["unimae", "unimae-sup"]),
        (
            {"SUP_RUN": "unimae-simcse-suplm", "SUP_FLAGS": "--lm-weight 0.1"},
            ["unimae", "unimae-simcse", "unimae-simcse-suplm"],
        ),
    ],
    ids=["default", "no-simcse", "named-supervised-run"],
)
def test_retrieval_recipe_chains_its_stages(tmp_path, env, stages):
    """recipes/retrieval.sh trains UniMAE -> (SimCSE) -> supervised, each from the previous stage's adapter, on
    the files of train/ (evaluation switched off); SUP_RUN names the supervised run, SUP_FLAGS reach it."""
    calls, cli, data, runs = tmp_path / "calls", tmp_path / "fake-unimae", tmp_path / "data", tmp_path / "runs"
    cli.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    cli.chmod(0o755)
    (data / "train").mkdir(parents=True)
    for name in ("a.jsonl", "b.jsonl"):
        (data / "train" / name).write_text("")
    recipe = HELPER.parent / "retrieval.sh"
    settings = {
        "UNIMAE": str(cli),
        "UNIMAE_DATA": str(data),
        "RUNS": str(runs),
        "WIKI": "0",
        "TASKS": "",
        "RAG_QUESTIONS": "0",
        "GENERATION": "0",
        "PATH": "/usr/bin:/bin",
        **env,
    }
    subprocess.run(["bash", str(recipe)], check=True, env=settings)
    lines = calls.read_text().splitlines()
    assert [line.split("--output-dir ")[1].split()[0] for line in lines] == [str(runs / s) for s in stages]
    for previous, line in zip(stages, lines[1:], strict=False):
        assert f"--init-adapter {runs / previous}/adapter" in line
    assert f"--data {data}/train/a.jsonl,{data}/train/b.jsonl" in lines[-1]
    assert lines[-1].endswith(env.get("SUP_FLAGS", "--save-every 5"))
