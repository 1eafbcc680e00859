"""The recipes' shared shell helpers (recipes/train_run.sh, recipes/json_field.sh) and recipes, run by bash with a
stand-in for the CLI."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HELPER = ROOT / "recipes" / "train_run.sh"
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
        # killed while writing its first checkpoint: a new run (before: --resume, refused on every rerun)
        (["checkpoints/.tmp-step-000001-123/state.pt"], "train --output-dir {run} --steps 3"),
    ],
    ids=["new", "interrupted", "adapter-and-checkpoints", "adapter-only", "killed-mid-first-checkpoint"],
)
def test_train_run_starts_resumes_or_skips(tmp_path, files, expected):
    run = tmp_path / "run"
    for name in files:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("")
    calls = _train_run(tmp_path, run)
    assert calls == ([] if expected is None else [expected.format(run=run)])


def test_json_field_reads_a_key_path_and_prints_nothing_where_it_is_missing(tmp_path):
    """recipes/json_field.sh: a nested value, a list's items space-separated, '' for a missing key or file."""
    meta = tmp_path / "unimae.json"
    meta.write_text(json.dumps({"trained_steps": 80, "embedding": {"matryoshka_dims": [64, 128]}}))
    helper = ROOT / "recipes" / "json_field.sh"
    queries = ["trained_steps", "embedding matryoshka_dims", "embedding pooling"]
    script = "; ".join(f'echo "[$(json_field {meta} {q})]"' for q in queries)
    script += f'; echo "[$(json_field {tmp_path / "missing.json"} trained_steps)]"'
    env = {"PYTHON": str(ROOT / ".venv" / "bin" / "python"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(["bash", "-c", f"source {helper}; {script}"], check=True, env=env, capture_output=True)
    assert out.stdout.decode().splitlines() == ["[80]", "[64 128]", "[]", "[]"]


def _retrieval_calls(tmp_path: Path, env: dict, release_steps: int | None = None) -> list[str]:
    """The `unimae` command lines recipes/retrieval.sh issues with a stand-in CLI (evaluation switched off)."""
    calls, cli, data, runs = tmp_path / "calls", tmp_path / "fake-unimae", tmp_path / "data", tmp_path / "runs"
    cli.write_text(f"#!/bin/sh\nprintf '%s' \"$*\" | tr '\\n' ' ' >> {calls}\necho >> {calls}\n")  # one line a call
    cli.chmod(0o755)
    (data / "train").mkdir(parents=True, exist_ok=True)
    for name in ("a.jsonl", "b.jsonl"):
        (data / "train" / name).write_text("")
    releases = tmp_path / "releases"
    if release_steps is not None:  # a release left by an earlier sitting on another machine
        (releases / "r").mkdir(parents=True)
        (releases / "r" / "unimae.json").write_text(f'{{"trained_steps": {release_steps}}}')
    settings = {
        "UNIMAE": str(cli),
        "PYTHON": str(ROOT / ".venv" / "bin" / "python"),
        "UNIMAE_DATA": str(data),
        "RUNS": str(runs),
        "RELEASES": str(releases),
        "RELEASE": "r",
        "OUT": str(tmp_path / "out"),
        "WIKI": "0",
        "TASKS": "",
        "RAG_QUESTIONS": "0",
        "GENERATION": "0",
        "SUP_STEPS": "200",
        "CURVE_EVERY": "80",
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path / "home"),  # recipes/get_teacher.sh --where names a folder under it (fetches nothing)
        **env,
    }
    subprocess.run(["bash", str(HELPER.parent / "retrieval.sh")], check=True, env=settings, cwd=ROOT)
    return calls.read_text().splitlines()


@pytest.mark.parametrize("start", ["none", "unimae"])
def test_retrieval_recipe_trains_in_curve_steps_and_releases(tmp_path, start):
    """recipes/retrieval.sh: (UniMAE, then) the supervised stage with the recipe's flags, CURVE_EVERY steps at a
    time up to SUP_STEPS, then the release of its adapter."""
    lines = _retrieval_calls(tmp_path, {"START": start})
    trains = [line for line in lines if line.startswith("train")]
    runs = tmp_path / "runs"
    supervised = [line for line in trains if f"--output-dir {runs / 'retriever'}" in line]
    assert [line.split("--steps ")[1].split()[0] for line in supervised] == ["80", "160", "200"]
    for flag in (
        "--method contrastive",
        "--query-prompt",
        "--symmetric-sources",
        "--matryoshka-dims",
        "--lm-weight 0.1",
    ):
        assert all(flag in line for line in supervised)
    assert all(("--init-lora" in line) == (start == "unimae") for line in supervised)  # one LoRA: releasable
    assert (start == "unimae") == any(f"--output-dir {runs / 'unimae'}" in line for line in trains)
    assert lines[-1].startswith("release --adapter") and "--name r" in lines[-1]


def test_retrieval_recipe_continues_from_the_release_on_a_fresh_machine(tmp_path):
    lines = _retrieval_calls(tmp_path, {}, release_steps=100)
    trains = [line for line in lines if line.startswith("train")]
    assert trains[0].startswith(f"train --continue-adapter {tmp_path / 'releases' / 'r'} --output-dir")
    assert [line.split("--steps ")[1].split()[0] for line in trains] == ["160", "200"]  # 80 was held already
    assert not any(f"--output-dir {tmp_path / 'runs' / 'unimae'}" in line for line in trains)  # the start is in it


FAKE_CLI = r'''#!{python}
"""A stand-in for `unimae` that leaves the files recipes/retrieval.sh reads: adapters that hold their step, one
checkpoint, run.json of an evaluation (with the adapter's revision), the curve with the averages it is given."""
import hashlib, json, os, re, shutil, sys
from pathlib import Path

args = sys.argv[1:]
with open({calls!r}, "a") as log:
    log.write(" ".join(args).replace("\n", " ") + "\n")
opt = lambda name: args[args.index(name) + 1] if name in args else None  # noqa: E731
revision = lambda a: hashlib.sha256(Path(a, "adapter_model.safetensors").read_bytes()).hexdigest()[:12]  # noqa
if args[0] == "train":
    run, steps = Path(opt("--output-dir")), int(opt("--steps") or 0)
    (run / "adapter").mkdir(parents=True, exist_ok=True)
    schedule = {{"lr_schedule": opt("--lr-schedule") or "constant", "lr_decay_from": int(opt("--lr-decay-from") or 0)}}
    teacher, weight = opt("--distill-teacher") or "", float(opt("--distill-weight") or 1)
    distill = {{"distill_teacher": teacher, "distill_weight": weight}}
    distill["distill_loss"] = opt("--distill-loss") or "listwise"
    config = {{"options": {{**schedule, **distill}}}}
    meta = {{"trained_steps": steps, "embedding": {{}}, "training_config": config}}
    if opt("--continue-adapter"):
        held = json.loads(Path(opt("--continue-adapter"), "unimae.json").read_text())
        meta["continued_from"] = {{"step": held["trained_steps"]}}
        before = held.get("continued_from") or {{}}
        if teacher and held["training_config"]["options"].get("distill_teacher") == teacher:  # a lengthening
            meta["continued_from"]["distill_from"] = before.get("distill_from", before.get("step", 0))
    record = {{"continue_adapter": opt("--continue-adapter") or "", "steps": steps}}
    (run / "config.json").write_text(json.dumps(record))
    (run / "adapter" / "unimae.json").write_text(json.dumps(meta))
    (run / "adapter" / "adapter_config.json").write_text("{{}}")
    (run / "adapter" / "adapter_model.safetensors").write_text(f"weights of step {{steps}}")
    (run / "checkpoints" / f"step-{{steps:06d}}").mkdir(parents=True, exist_ok=True)
elif args[:2] == ["evaluate", "embeddings"]:
    tasks = args[args.index("--tasks") + 1 : args.index("--data-dir")]
    if not tasks or not all(re.fullmatch(r"[A-Za-z0-9.-]+", task) for task in tasks):
        sys.exit(f"not task names: {{tasks}}")  # as mteb would refuse them
    folder = Path(opt("--output-dir")) / opt("--label")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.json").write_text(json.dumps({{"tasks": {{"STS17": 1.0}}, "revision": revision(opt("--adapter"))}}))
elif args[:2] == ["evaluate", "summary"] and opt("--name") == "curve":
    averages = json.loads(os.environ["FAKE_AVERAGES"])
    labels = args[args.index("--labels") + 1 :]
    rows = {{label: {{"average": averages[label]}} for label in labels}}
    Path(opt("--output-dir"), "curve.json").write_text(json.dumps(rows))
elif args[0] == "rotation":
    spec = Path(opt("--adapter"), "unimae.json")
    spec.write_text(json.dumps({{**json.loads(spec.read_text()), "embedding": {{"rotation": "r0"}}}}))
elif args[0] == "release" and "--card-only" in args:
    pass
elif args[0] == "release":
    target = Path(opt("--root")) / opt("--name")
    target.mkdir(parents=True, exist_ok=True)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy(Path(opt("--adapter")) / name, target / name)
    meta = json.loads(Path(opt("--adapter"), "unimae.json").read_text())
    source = (meta.get("release") or {{}}).get("source_revision") or revision(opt("--adapter"))  # a copy keeps it
    meta["release"] = {{"source_revision": source}}
    (target / "unimae.json").write_text(json.dumps(meta))
'''


def _stand_ins(tmp_path: Path, averages: dict) -> dict:
    """The recipe's settings with the file-writing stand-in CLI (curve averages as given) and a python that records
    and skips the benchmarks, evaluating STS17 up to 400 steps."""
    import json
    import sys

    calls, cli, python = tmp_path / "calls", tmp_path / "fake-unimae-files", tmp_path / "python"
    cli.write_text(FAKE_CLI.format(python=sys.executable, calls=str(calls)))
    skip_benchmarks = f'case "$1" in benchmarks/*) echo "$*" >> {calls}; exit 0;; esac'
    python.write_text(f'#!/bin/sh\n{skip_benchmarks}\nexec {ROOT}/.venv/bin/python "$@"\n')
    for tool in (cli, python):
        tool.chmod(0o755)
    env = {"TASKS": "STS17", "SUP_STEPS": "400", "PYTHON": str(python), "FAKE_AVERAGES": json.dumps(averages)}
    return {**env, "UNIMAE": str(cli)}


def test_retrieval_recipe_stops_when_the_curve_falls_and_finishes_on_the_better_release(tmp_path):
    """STOP_EARLY: each point that rose becomes the release; when the average falls (step 240 below 160), the
    final stage evaluates and releases step 160's adapter (the release's), keeps 240's aside, and a later sitting
    trains no further."""
    import json

    env = _stand_ins(tmp_path, {"step-80": 60.0, "step-160": 62.0, "step-240": 61.0})
    lines = _retrieval_calls(tmp_path, env)
    trains = [line for line in lines if line.startswith("train") and "--steps" in line]  # the supervised stage
    # not 320: the average fell at 240
    assert [line.split("--steps ")[1].split()[0] for line in trains] == ["80", "160", "240"]
    releases = [i for i, line in enumerate(lines) if line.startswith("release")]
    trained = [i for i, line in enumerate(lines) if line.startswith("train") and "--steps" in line]
    assert len(releases) == 3 and trained[1] < releases[1] < trained[2]  # at 80, at 160 (rose), at the end
    run, release = tmp_path / "runs" / "retriever", tmp_path / "releases" / "r"
    assert (run / "adapter" / "adapter_model.safetensors").read_text() == "weights of step 160"
    assert (run / "adapter-step-240" / "adapter_model.safetensors").read_text() == "weights of step 240"
    assert (release / "adapter_model.safetensors").read_text() == "weights of step 160"
    final = [line for line in lines if "--label retrieval-eos " in line + " "]
    assert final and all(f"--adapter {run / 'adapter'}" in line for line in final)
    assert json.loads((run / "stopped-early.json").read_text())["best"] == 160
    assert (run / "adapter-best" / "adapter_model.safetensors").read_text() == "weights of step 160"
    (tmp_path / "calls").write_text("")
    again = _retrieval_calls(tmp_path, env)  # a later sitting: no more training
    assert not any(line.startswith("train") for line in again) and again[-1].startswith("release")


def _fresh_machine(tmp_path: Path, averages: dict, steps: int = 80) -> tuple[dict, Path]:
    """A fresh machine after earlier sittings: no run folder; the release holds step STEPS's weights, whose curve point
    (scored on the trained adapter it was made from) and later ones are in the results."""
    import hashlib
    import json

    release = tmp_path / "releases" / "r"
    release.mkdir(parents=True)
    (release / "adapter_model.safetensors").write_text(f"bf16 weights of step {steps}")
    (release / "adapter_config.json").write_text("{}")
    trained = hashlib.sha256(f"weights of step {steps}".encode()).hexdigest()[:12]  # the adapter it was made from
    meta = {"trained_steps": steps, "embedding": {"rotation": "r0"}, "release": {"source_revision": trained}}
    (release / "unimae.json").write_text(json.dumps(meta))
    for label in averages:
        point = tmp_path / "out" / "curve" / label
        point.mkdir(parents=True)
        (point / "run.json").write_text(json.dumps({"tasks": {"STS17": 1.0}, "revision": trained}))
    return _stand_ins(tmp_path, averages), release


def test_retrieval_recipe_on_a_fresh_machine_keeps_a_stop_the_curve_recorded(tmp_path):
    """The run folder (and its stopped-early.json) went with the machine, but the curve shows the average fell from
    step 80 to 160: the recipe trains no further and finishes on the release's weights (step 80's)."""
    import json

    env, release = _fresh_machine(tmp_path, {"step-80": 62.0, "step-160": 61.0})
    lines = _retrieval_calls(tmp_path, env)
    assert not any(line.startswith("train") for line in lines)
    run = tmp_path / "runs" / "retriever"
    assert (run / "adapter" / "adapter_model.safetensors").read_text() == "bf16 weights of step 80"
    assert json.loads((run / "stopped-early.json").read_text())["best"] == 80
    assert lines[-1].startswith(f"release --adapter {run / 'adapter'}")


def test_retrieval_recipe_on_a_fresh_machine_judges_the_next_point_against_the_release(tmp_path):
    """A sitting with 40-step points released step 200 and stopped at 240 (below 200, above 160); a fresh machine at
    the default 80-step points compares 240 with the release's point, not with 160: it trains no further."""
    import json

    averages = {"step-80": 60.0, "step-160": 62.0, "step-200": 63.0, "step-240": 62.5}
    env, release = _fresh_machine(tmp_path, averages, steps=200)
    lines = _retrieval_calls(tmp_path, env)
    assert not any(line.startswith("train") for line in lines)
    run = tmp_path / "runs" / "retriever"
    assert (run / "adapter" / "adapter_model.safetensors").read_text() == "bf16 weights of step 200"
    stop = json.loads((run / "stopped-early.json").read_text())
    assert stop == {"best": 200, "stopped_at": 240, "adapter": str(release)}


def test_retrieval_recipe_card_command_repeats_the_settings_chosen(tmp_path):
    """The card's command is the one that made the adapter: the recipe settings the caller set (quoted for the
    shell), not the machine's own (RELEASES, TASKS, GENERATION)."""
    lines = _retrieval_calls(tmp_path, {"SUP_FLAGS": "--symmetric-loss", "SUP_RUN": "sym", "QUERY_PROMPT": "Q: x"})
    command = lines[-1].split("--command ")[1]
    assert command.startswith("MODEL=smollm2-135m SUP_RUN=sym OUT=")
    assert "SUP_STEPS=200 " in command and "SUP_FLAGS=--symmetric-loss " in command
    assert "QUERY_PROMPT=Q:\\ x " in command  # quoted for the shell
    assert command.endswith(" bash recipes/retrieval.sh")
    assert not any(name in command for name in ("RELEASES=", "TASKS=", "GENERATION=", "RAG_QUESTIONS="))


def test_retrieval_recipe_on_a_fresh_machine_finishes_on_a_release_that_reached_sup_steps(tmp_path):
    """The release holds the run's last step (SUP_STEPS, no stop): a fresh machine trains nothing and the final
    stage evaluates and releases the release's weights, restored as the run's adapter."""
    env, release = _fresh_machine(tmp_path, {"step-80": 60.0, "step-160": 62.0}, steps=160)
    lines = _retrieval_calls(tmp_path, {**env, "SUP_STEPS": "160"})
    run = tmp_path / "runs" / "retriever"
    assert not any(line.startswith("train") for line in lines)
    assert (run / "adapter" / "adapter_model.safetensors").read_text() == "bf16 weights of step 160"
    final = [line for line in lines if "--label retrieval-eos " in line + " "]
    assert final and all(f"--adapter {run / 'adapter'}" in line for line in final)
    assert lines[-1].startswith(f"release --adapter {run / 'adapter'}")


def test_retrieval_recipe_release_only_on_a_fresh_machine_rewrites_the_card(tmp_path):
    """RELEASE_ONLY=1 where the run's adapter is gone: the release's card from the curve point of its weights."""
    env, release = _fresh_machine(tmp_path, {"step-80": 62.0})
    lines = _retrieval_calls(tmp_path, {**env, "RELEASE_ONLY": "1"})
    out = tmp_path / "out" / "curve"
    assert len(lines) == 1 and lines[0].startswith("release --card-only --name r")
    assert f"--dev-results {out / 'step-80'}" in lines[0] and f"--table {out / 'dimensions-step-80.json'}" in lines[0]


def _cooldown_calls(tmp_path: Path, cooldown_average: float) -> tuple[list[str], Path, Path]:
    """The recipe with COOLDOWN=40 where the curve fell from step 160 to 240: (its calls, the run, the cooldown run)."""
    averages = {"step-80": 60.0, "step-160": 62.0, "step-240": 61.0, "cooldown-step-200": cooldown_average}
    lines = _retrieval_calls(tmp_path, {**_stand_ins(tmp_path, averages), "COOLDOWN": "40"})
    return lines, tmp_path / "runs" / "retriever", tmp_path / "runs" / "retriever-cooldown"


def test_retrieval_recipe_cooldown_that_rose_becomes_the_release(tmp_path):
    """COOLDOWN=40 after the stop at 240: step 160's adapter trains 40 more steps with a linear decay; its curve
    point rose above step 160's, so it is released (the card's command names the cooldown) and the final stage takes
    it; a later sitting trains nothing."""
    lines, run, cool = _cooldown_calls(tmp_path, 63.0)
    trains = [line for line in lines if line.startswith("train")]
    assert f"--output-dir {cool}" in trains[-1] and f"--continue-adapter {run / 'adapter'}" in trains[-1]
    assert "--lr-schedule linear --lr-decay-from 160 --steps 200" in trains[-1]
    assert any("--label cooldown-step-200" in line for line in lines)
    curve = [line for line in lines if "--name curve" in line][-1]
    assert curve.endswith("--labels step-80 step-160 step-240 cooldown-step-200")
    release = tmp_path / "releases" / "r"
    assert (release / "adapter_model.safetensors").read_text() == "weights of step 200"
    releases = [line for line in lines if line.startswith("release")]
    assert "--command COOLDOWN=40 MODEL=" in releases[-1] and f"--adapter {cool / 'adapter'}" in releases[-1]
    final = [line for line in lines if "--label retrieval-eos " in line + " "]
    assert final and all(f"--adapter {cool / 'adapter'}" in line for line in final)
    (tmp_path / "calls").write_text("")
    again = _retrieval_calls(tmp_path, _stand_ins(tmp_path, {}))  # a later sitting, COOLDOWN unset: the decision holds
    assert not any(line.startswith("train") for line in again) and again[-1].startswith(f"release --adapter {cool}")
    assert "COOLDOWN=40 MODEL=" in again[-1]


def test_retrieval_recipe_finishes_an_interrupted_cooldown_evaluation(tmp_path):
    """The cooldown's curve point was cut short (its run.json written, its row not in the curve): the next sitting
    scores it again (finished tasks are skipped) before deciding, rather than taking it for a fall."""
    import json

    lines, run, cool = _cooldown_calls(tmp_path, 63.0)
    curve = tmp_path / "out" / "curve" / "curve.json"
    rows = json.loads(curve.read_text())
    del rows["cooldown-step-200"]
    curve.write_text(json.dumps(rows))
    (tmp_path / "calls").write_text("")
    averages = {"step-80": 60.0, "step-160": 62.0, "step-240": 61.0, "cooldown-step-200": 63.0}
    again = _retrieval_calls(tmp_path, {**_stand_ins(tmp_path, averages), "COOLDOWN": "40"})
    assert not any(line.startswith("train") for line in again)
    assert any("--label cooldown-step-200" in line for line in again)
    assert again[-1].startswith(f"release --adapter {cool / 'adapter'}")


@pytest.mark.parametrize("default", [False, True], ids=["own-teacher", "default-teacher"])
def test_retrieval_recipe_distilled_cooldown_at_a_constant_rate_becomes_the_release(tmp_path, default):
    """COOLDOWN_SCHEDULE=constant DISTILL_WEIGHT=4: the cooldown keeps the learning rate and distills from TEACHER;
    it rose, so it is released with those settings in the card's command (read from its adapter; TEACHER only where
    it is not the folder recipes/get_teacher.sh fetches into), and a later sitting without them keeps the decision."""
    averages = {"step-80": 60.0, "step-160": 62.0, "step-240": 61.0, "cooldown-step-200": 63.0}
    teacher = f"{tmp_path}/.cache/unimae-teachers/all-mpnet-base-v2" if default else "/t/my teacher"
    settings = {"COOLDOWN": "40", "COOLDOWN_SCHEDULE": "constant", "DISTILL_WEIGHT": "4", "TEACHER": teacher}
    lines = _retrieval_calls(tmp_path, {**_stand_ins(tmp_path, averages), **settings, "HOME": str(tmp_path)})
    run, cool = tmp_path / "runs" / "retriever", tmp_path / "runs" / "retriever-cooldown"
    trains = [line for line in lines if line.startswith("train")]
    cooldown = f"--continue-adapter {run / 'adapter'} --distill-teacher {teacher} --distill-weight 4 --steps 200"
    assert cooldown in trains[-1]
    assert "--lr-schedule" not in trains[-1]
    releases = [line for line in lines if line.startswith("release")]
    assert f"--adapter {cool / 'adapter'}" in releases[-1]
    named = "" if default else "TEACHER=/t/my\\ teacher "
    assert f"--command COOLDOWN=40 COOLDOWN_SCHEDULE=constant DISTILL_WEIGHT=4 {named}MODEL=" in releases[-1]
    (tmp_path / "calls").write_text("")
    again = _retrieval_calls(tmp_path, _stand_ins(tmp_path, {}))  # none of the settings: the decision holds
    assert not any(line.startswith("train") for line in again) and again[-1].startswith(f"release --adapter {cool}")
    assert "COOLDOWN=40 COOLDOWN_SCHEDULE=constant DISTILL_WEIGHT=4 " in again[-1]


def test_retrieval_recipe_distilled_cooldown_with_the_similarity_loss_passes_it_and_names_it(tmp_path):
    """DISTILL_LOSS=similarity: the cooldown trains with `--distill-loss similarity`, and the release card's
    command names it (read from the cooldown's adapter), as it names the weight."""
    averages = {"step-80": 60.0, "step-160": 62.0, "step-240": 61.0, "cooldown-step-200": 63.0}
    settings = {"COOLDOWN": "40", "COOLDOWN_SCHEDULE": "constant", "DISTILL_WEIGHT": "50", "TEACHER": "/t"}
    lines = _retrieval_calls(tmp_path, {**_stand_ins(tmp_path, averages), **settings, "DISTILL_LOSS": "similarity"})
    trains = [line for line in lines if line.startswith("train")]
    assert "--distill-teacher /t --distill-weight 50 --distill-loss similarity --steps 200" in trains[-1]
    release = [line for line in lines if line.startswith("release")][-1]
    assert (
        "--command COOLDOWN=40 COOLDOWN_SCHEDULE=constant DISTILL_WEIGHT=50 DISTILL_LOSS=similarity TEACHER=/t"
        in release
    )


DISTILL = {"COOLDOWN_SCHEDULE": "constant", "DISTILL_WEIGHT": "4", "TEACHER": "/t"}


def _lengthened(tmp_path: Path, longer: float) -> tuple[list[str], dict]:
    """A distilled cooldown of step 160 to 200 (COOLDOWN=40) rose and was released; the next sitting asks
    COOLDOWN=80, whose point (cooldown-step-240) scores LONGER: (that sitting's calls, its settings)."""
    averages = {"step-80": 60.0, "step-160": 62.0, "step-240": 61.0, "cooldown-step-200": 63.0}
    _retrieval_calls(tmp_path, {**_stand_ins(tmp_path, averages), **DISTILL, "COOLDOWN": "40"})
    (tmp_path / "calls").write_text("")
    env = {**_stand_ins(tmp_path, {**averages, "cooldown-step-240": longer}), **DISTILL, "COOLDOWN": "80"}
    return _retrieval_calls(tmp_path, env), env


@pytest.mark.parametrize("longer, released", [(64.0, 240), (62.5, 200)], ids=["rose", "fell"])
def test_retrieval_recipe_lengthens_a_constant_rate_cooldown(tmp_path, capfd, longer, released):
    """A larger COOLDOWN resumes the distilled cooldown's checkpoints to the new end and scores it: above the released
    cooldown it becomes the release (the card names COOLDOWN=80); below it the final stage takes the release again
    and the longer adapter is kept aside; a later sitting trains nothing (and says why where it fell)."""
    lines, env = _lengthened(tmp_path, longer)
    cool, release = tmp_path / "runs" / "retriever-cooldown", tmp_path / "releases" / "r"
    trains = [line for line in lines if line.startswith("train")]
    assert len(trains) == 1 and trains[0].startswith(f"train --resume --output-dir {cool}")
    assert "--distill-weight 4 --steps 240" in trains[0]
    assert any("--label cooldown-step-240" in line for line in lines)
    assert (release / "adapter_model.safetensors").read_text() == f"weights of step {released}"
    assert (cool / "adapter" / "adapter_model.safetensors").read_text() == f"weights of step {released}"
    assert (cool / "adapter-step-240").is_dir() == (released == 200)
    final = [line for line in lines if "--label retrieval-eos " in line + " "]
    assert final and all(f"--adapter {cool / 'adapter'}" in line for line in final)
    command = f"--command COOLDOWN={released - 160} COOLDOWN_SCHEDULE=constant DISTILL_WEIGHT=4 TEACHER=/t MODEL="
    assert command in lines[-1]
    (tmp_path / "calls").write_text("")
    capfd.readouterr()
    again = _retrieval_calls(tmp_path, env)
    assert not any(line.startswith("train") for line in again) and command in again[-1]
    assert ("cooldown-step-240, an earlier sitting's cooldown that was not released" in capfd.readouterr().out) == (
        released == 200
    )


@pytest.mark.parametrize("longer, released", [(64.0, 240), (62.5, 200)], ids=["rose", "fell"])
def test_retrieval_recipe_lengthens_the_released_cooldown_on_a_fresh_machine(tmp_path, longer, released):
    """The cooldown's checkpoints went with their machine: a larger COOLDOWN continues the released cooldown (step
    200) to the new end and scores it; the new adapter records where its distillation began (step 160), so the card
    names COOLDOWN=80 when it rose, and the release stays step 200's when it fell."""
    import json

    averages = {"step-80": 60.0, "step-160": 62.0, "step-240": 61.0, "cooldown-step-200": 63.0}
    _retrieval_calls(tmp_path, {**_stand_ins(tmp_path, averages), **DISTILL, "COOLDOWN": "40"})  # released there
    shutil.rmtree(tmp_path / "runs")
    (tmp_path / "calls").write_text("")
    env = {**_stand_ins(tmp_path, {**averages, "cooldown-step-240": longer}), **DISTILL, "COOLDOWN": "80"}
    lines = _retrieval_calls(tmp_path, env)
    cool, release = tmp_path / "runs" / "retriever-cooldown", tmp_path / "releases" / "r"
    trains = [line for line in lines if line.startswith("train")]
    assert len(trains) == 1 and trains[0].startswith(f"train --output-dir {cool}")
    assert f"--continue-adapter {release} " in trains[0] and "--distill-weight 4 --steps 240" in trains[0]
    longest = cool / ("adapter" if released == 240 else "adapter-step-240")
    assert json.loads((longest / "unimae.json").read_text())["continued_from"] == {"step": 200, "distill_from": 160}
    assert (release / "adapter_model.safetensors").read_text() == f"weights of step {released}"
    command = f"--command COOLDOWN={released - 160} COOLDOWN_SCHEDULE=constant DISTILL_WEIGHT=4 TEACHER=/t MODEL="
    assert command in lines[-1]
    (tmp_path / "calls").write_text("")
    again = _retrieval_calls(tmp_path, env)  # the same machine again: nothing to train
    assert not any(line.startswith("train") for line in again) and command in again[-1]


@pytest.mark.parametrize("every", ["80", "160"])
def test_retrieval_recipe_lengthens_a_released_cooldown_of_an_off_grid_step_on_a_fresh_machine(tmp_path, every):
    """A sitting at 40-step points stopped at 240 (below 200, above 160) and released a distilled cooldown of step
    200; a fresh machine at 80- or 160-step points (whose grid misses 200, or 240) judges 240 against step 200
    (where the release cooled from), not 160: it trains no constant-rate step (before, it tried to continue the
    cooldown as the constant-rate stage and failed) and lengthens the released cooldown."""
    averages = {"step-40": 58.0, "step-80": 60.0, "step-120": 61.0, "step-160": 62.0, "step-200": 63.0}
    averages |= {"step-240": 62.5, "cooldown-step-220": 64.0, "cooldown-step-240": 64.5}
    env = {**_stand_ins(tmp_path, averages), **DISTILL}
    _retrieval_calls(tmp_path, {**env, "COOLDOWN": "20", "CURVE_EVERY": "40"})
    release = tmp_path / "releases" / "r"
    assert (release / "adapter_model.safetensors").read_text() == "weights of step 220"
    shutil.rmtree(tmp_path / "runs")
    (tmp_path / "calls").write_text("")
    lines = _retrieval_calls(tmp_path, {**env, "COOLDOWN": "40", "CURVE_EVERY": every})
    trains = [line for line in lines if line.startswith("train")]
    assert len(trains) == 1 and f"--continue-adapter {release} " in trains[0]
    assert "--distill-weight 4 --steps 240" in trains[0]
    assert (release / "adapter_model.safetensors").read_text() == "weights of step 240"
    assert "--command COOLDOWN=40 COOLDOWN_SCHEDULE=constant DISTILL_WEIGHT=4 TEACHER=/t MODEL=" in lines[-1]


def test_retrieval_recipe_release_only_keeps_the_released_cooldown_over_a_lengthening_cut_short(tmp_path):
    """The released cooldown (step 200) is being lengthened to 240 and the sitting ends with SIGTERM at step 220 (its
    adapter written, no curve point): RELEASE_ONLY=1 rewrites the release's card only; before, it released step 160's
    adapter over the cooldown."""
    import json

    averages = {"step-80": 60.0, "step-160": 62.0, "step-240": 61.0, "cooldown-step-200": 63.0}
    env = {**_stand_ins(tmp_path, averages), **DISTILL}
    _retrieval_calls(tmp_path, {**env, "COOLDOWN": "40"})
    cut = tmp_path / "runs" / "retriever-cooldown" / "adapter"
    (cut / "adapter_model.safetensors").write_text("weights of step 220")
    meta = json.loads((cut / "unimae.json").read_text())
    (cut / "unimae.json").write_text(json.dumps({**meta, "trained_steps": 220}))
    (tmp_path / "calls").write_text("")
    lines = _retrieval_calls(tmp_path, {**env, "COOLDOWN": "80", "RELEASE_ONLY": "1"})
    release = tmp_path / "releases" / "r"
    assert len(lines) == 1 and lines[0].startswith("release --card-only --name r")
    assert f"--dev-results {tmp_path / 'out' / 'retrieval-eos'} " in lines[0]  # the final stage's, of the release
    assert "--command COOLDOWN=40 COOLDOWN_SCHEDULE=constant DISTILL_WEIGHT=4" in lines[0]
    assert (release / "adapter_model.safetensors").read_text() == "weights of step 200"


REFUSED = {  # case: (what the later sitting changes, what its error says)
    "decayed": ({"COOLDOWN": "80"}, "does not lengthen"),  # its rate reached 0
    "no-checkpoints": ({"COOLDOWN": "80"}, "resumes its checkpoints"),  # a constant-rate one held here needs them
    "shorter": ({"COOLDOWN": "20"}, "does not shorten"),  # its checkpoints are past the new end
    "fresh-shorter": ({"COOLDOWN": "20"}, "does not shorten"),  # the released cooldown is past it
    "fresh-other-weight": ({"COOLDOWN": "80", "DISTILL_WEIGHT": "2"}, "distilled at weight 4"),  # a new distillation
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_retrieval_recipe_refuses_a_cooldown_it_cannot_lengthen(tmp_path, capfd, case):
    """A cooldown of step 160 to 200 is held (a decay, else a distillation at a constant rate; "fresh": only its
    release, on a fresh machine): a later sitting that cannot go on from it as one cooldown would have says why and
    trains nothing."""
    averages = {"step-80": 60.0, "step-160": 62.0, "step-240": 61.0, "cooldown-step-200": 63.0}
    settings = {} if case == "decayed" else DISTILL
    _retrieval_calls(tmp_path, {**_stand_ins(tmp_path, averages), **settings, "COOLDOWN": "40"})
    if case == "no-checkpoints":
        shutil.rmtree(tmp_path / "runs" / "retriever-cooldown" / "checkpoints")
    if case.startswith("fresh"):
        shutil.rmtree(tmp_path / "runs")
    (tmp_path / "calls").write_text("")
    capfd.readouterr()
    later, error = REFUSED[case]
    with pytest.raises(subprocess.CalledProcessError):
        _retrieval_calls(tmp_path, {**_stand_ins(tmp_path, averages), **settings, **later})
    assert error in capfd.readouterr().err
    assert not any(line.startswith("train") for line in (tmp_path / "calls").read_text().splitlines())


def test_retrieval_recipe_resumes_a_decayed_cooldown_stopped_part_way(tmp_path):
    """A decayed cooldown stopped at step 190 of 200 (SIGTERM: its adapter written at 190, its checkpoints kept) is
    no lengthening: the next sitting with the same COOLDOWN resumes it to 200 and scores it."""
    import json

    averages = {"step-80": 60.0, "step-160": 62.0, "step-240": 61.0, "cooldown-step-200": 63.0}
    env = {**_stand_ins(tmp_path, averages), "COOLDOWN": "40"}
    _retrieval_calls(tmp_path, env)
    cool = tmp_path / "runs" / "retriever-cooldown"
    spec = cool / "adapter" / "unimae.json"
    spec.write_text(json.dumps({**json.loads(spec.read_text()), "trained_steps": 190}))
    shutil.rmtree(tmp_path / "out" / "curve" / "cooldown-step-200")
    (tmp_path / "calls").write_text("")
    lines = _retrieval_calls(tmp_path, env)
    trains = [line for line in lines if line.startswith("train")]
    assert len(trains) == 1 and trains[0].startswith(f"train --resume --output-dir {cool}")
    assert f"--continue-adapter {tmp_path / 'runs' / 'retriever' / 'adapter'} " in trains[0]
    assert "--lr-schedule linear --lr-decay-from 160 --steps 200" in trains[0]
    assert any("--label cooldown-step-200" in line for line in lines)


@pytest.mark.parametrize(
    "settings",
    [{"COOLDOWN_SCHEDULE": "cosine"}, {"COOLDOWN": "40", "COOLDOWN_SCHEDULE": "constant"}],
    ids=["unknown-schedule", "constant-without-distillation"],  # the latter would never replace the best point
)
def test_retrieval_recipe_refuses_a_cooldown_it_cannot_take(tmp_path, settings):
    with pytest.raises(subprocess.CalledProcessError):
        _retrieval_calls(tmp_path, settings)
    assert not (tmp_path / "calls").exists()


def test_retrieval_recipe_cooldown_that_fell_leaves_the_best_point(tmp_path):
    lines, run, cool = _cooldown_calls(tmp_path, 61.5)
    assert (cool / "adapter" / "adapter_model.safetensors").read_text() == "weights of step 200"
    assert (tmp_path / "releases" / "r" / "adapter_model.safetensors").read_text() == "weights of step 160"
    final = [line for line in lines if "--label retrieval-eos " in line + " "]
    assert final and all(f"--adapter {run / 'adapter'}" in line for line in final)
    assert "--command MODEL=" in [line for line in lines if line.startswith("release")][-1]


DECAYED = ({"lr_schedule": "linear", "lr_decay_from": 80}, {}, "COOLDOWN=40 MODEL=")
DISTILLED = (
    {"lr_schedule": "constant", "distill_teacher": "/t", "distill_weight": 4.0},
    {"continued_from": {"step": 80}},
    "COOLDOWN=40 COOLDOWN_SCHEDULE=constant DISTILL_WEIGHT=4 TEACHER=/t MODEL=",
)


@pytest.mark.parametrize("options, facts, command", [DECAYED, DISTILLED], ids=["decayed", "distilled"])
def test_retrieval_recipe_on_a_fresh_machine_takes_the_released_cooldown(tmp_path, options, facts, command):
    """The release is the cooldown of step 80 (its curve point rose; a decay, or a distillation at a constant rate),
    the curve fell from 80 to 160: a fresh machine trains nothing, restores the release as the cooldown's adapter and
    finishes on it; the card's command names the cooldown's settings."""
    import hashlib
    import json

    revision = lambda text: hashlib.sha256(text.encode()).hexdigest()[:12]  # noqa: E731
    release = tmp_path / "releases" / "r"
    release.mkdir(parents=True)
    (release / "adapter_model.safetensors").write_text("bf16 weights of step 120")
    (release / "adapter_config.json").write_text("{}")
    meta = {"trained_steps": 120, "embedding": {"rotation": "r0"}, "training_config": {"options": options}, **facts}
    meta["release"] = {"source_revision": revision("weights of step 120")}
    (release / "unimae.json").write_text(json.dumps(meta))
    for label, step in (("step-80", 80), ("step-160", 160), ("cooldown-step-120", 120)):
        (tmp_path / "out" / "curve" / label).mkdir(parents=True)
        record = {"tasks": {"STS17": 1.0}, "revision": revision(f"weights of step {step}")}
        (tmp_path / "out" / "curve" / label / "run.json").write_text(json.dumps(record))
    averages = {"step-80": 62.0, "step-160": 61.0, "cooldown-step-120": 63.0}
    env = {**_stand_ins(tmp_path, averages), "COOLDOWN": "40"}
    only = _retrieval_calls(tmp_path, {**env, "RELEASE_ONLY": "1"})  # the card alone, from the cooldown's point
    out = tmp_path / "out" / "curve"
    assert len(only) == 1 and only[0].startswith("release --card-only --name r") and command in only[0]
    assert f"--dev-results {out / 'cooldown-step-120'}" in only[0]
    assert f"--table {out / 'dimensions-cooldown-step-120.json'}" in only[0]
    (tmp_path / "calls").write_text("")
    lines = _retrieval_calls(tmp_path, _stand_ins(tmp_path, averages))  # COOLDOWN unset: read from the release
    cool = tmp_path / "runs" / "retriever-cooldown"
    assert not any(line.startswith("train") for line in lines)
    assert (cool / "adapter" / "adapter_model.safetensors").read_text() == "bf16 weights of step 120"
    assert lines[-1].startswith(f"release --adapter {cool / 'adapter'}") and command in lines[-1]
    (tmp_path / "calls").write_text("")
    again = _retrieval_calls(tmp_path, {**env, "RELEASE_ONLY": "1"})  # here, after it: still the cooldown's
    assert again[0].startswith(f"release --adapter {cool / 'adapter'}")
    assert f"--train-log {cool / 'log.jsonl'}" in again[0]


def test_average_adapters_takes_the_weighted_mean_and_refuses_another_base(tmp_path):
    """recipes/average_adapters.py: each LoRA tensor is the inputs' mean; a rotation is dropped; adapters of
    another base model are refused."""
    import importlib.util

    import torch
    from safetensors.torch import load_file, save_file

    spec = importlib.util.spec_from_file_location("average_adapters", Path("recipes/average_adapters.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    folders = []
    for i, fingerprint in enumerate(["base", "base", "other"]):
        folder = tmp_path / f"a{i}"
        folder.mkdir()
        save_file({"lora_A.weight": torch.full((4, 8), float(i)), "lora_B.weight": torch.full((8, 4), 2.0 * i)},
                  str(folder / module.WEIGHTS))  # fmt: skip
        targets = config["target_modules"][:: 1 if i == 0 else -1]  # peft writes them in no fixed order
        (folder / module.CONFIG).write_text(json.dumps({**config, "target_modules": targets}))
        meta = {"base_fingerprint": fingerprint, "embedding": {"pooling": "eos", "rotation": f"r{i}"}}
        (folder / module.META).write_text(json.dumps(meta))
        folders.append(folder)
    assert module.main([str(folders[0]), str(folders[1]), "--output", str(tmp_path / "mean")]) == 0
    mean = load_file(str(tmp_path / "mean" / module.WEIGHTS))
    assert torch.equal(mean["lora_A.weight"], torch.full((4, 8), 0.5))
    assert torch.equal(mean["lora_B.weight"], torch.full((8, 4), 1.0))
    written = json.loads((tmp_path / "mean" / module.META).read_text())
    assert "rotation" not in written["embedding"] and len(written["averaged_from"]) == 2
    with pytest.raises(ValueError, match="another base model"):
        module.main([str(folders[0]), str(folders[2]), "--output", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()
    # --weights: WiSE-FT's interpolation, normalised; a count that does not match is refused before any write
    pair = [str(folders[0]), str(folders[1])]
    assert module.main([*pair, "--output", str(tmp_path / "wise"), "--weights", "3", "1"]) == 0
    wise = load_file(str(tmp_path / "wise" / module.WEIGHTS))
    assert torch.equal(wise["lora_A.weight"], torch.full((4, 8), 0.25))
    assert torch.equal(wise["lora_B.weight"], torch.full((8, 4), 0.5))
    written = json.loads((tmp_path / "wise" / module.META).read_text())
    assert [entry["weight"] for entry in written["averaged_from"]] == [0.75, 0.25]
    with pytest.raises(SystemExit):
        module.main([*pair, "--output", str(tmp_path / "bad"), "--weights", "1"])
    assert not (tmp_path / "bad").exists()
    # a bf16 input (a release) beside an fp32 one: the mean is written in fp32, the widest
    save_file({k: v.bfloat16() for k, v in load_file(str(folders[0] / module.WEIGHTS)).items()},
              str(folders[0] / module.WEIGHTS))  # fmt: skip
    assert module.main([*pair, "--output", str(tmp_path / "mixed")]) == 0
    mixed = load_file(str(tmp_path / "mixed" / module.WEIGHTS))["lora_A.weight"]
    assert mixed.dtype == torch.float32 and torch.equal(mixed, torch.full((4, 8), 0.5))


def test_wise_recipe_averages_tuned_and_start_scores_the_ends_and_releases_the_average(tmp_path):
    """recipes/wise.sh: the mean of TUNED and START with shares ALPHA and 1 - ALPHA, carrying TUNED's record, scored
    at the curve's length beside START's given row and TUNED scored here; with FINAL=1 the final stage (the dev
    suite, the rotation, the per-size rows) and the release of the average, whose card command repeats the settings."""
    import torch
    from safetensors.torch import load_file, save_file

    env = _stand_ins(tmp_path, {})
    ends = {}
    for name, value, steps, dtype in (("start", 0.0, 80, torch.bfloat16), ("tuned", 1.0, 111, torch.float32)):
        folder = tmp_path / name / "adapter"
        folder.mkdir(parents=True)
        save_file({"lora_A.weight": torch.full((4, 8), value, dtype=dtype)}, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["q_proj"]}))
        spec = {"pooling": "eos", "matryoshka_dims": [64, 128], **({"rotation": "r1"} if name == "start" else {})}
        (folder / "unimae.json").write_text(
            json.dumps({"base_fingerprint": "f", "trained_steps": steps, "embedding": spec})
        )
        ends[name] = folder
    calls, runs = tmp_path / "calls", tmp_path / "runs"
    settings = {
        **env,
        "MODEL": "gemma3-270m",
        "START": str(ends["start"]),
        "TUNED": str(ends["tuned"]),
        "ALPHA": "0.25",
        "START_ROW": "results/curve/step-80",
        "FINAL": "1",
        "TUNED_COMMAND": "DISTILL_WEIGHT=4 bash recipes/retrieval.sh",
        "RUNS": str(runs),
        "WISE_OUT": str(tmp_path / "wise-out"),
        "RELEASES": str(tmp_path / "releases"),
        "RELEASE": "r",
        "UNIMAE_DATA": str(tmp_path / "data"),
        "RAG_QUESTIONS": "0",
        "GENERATION": "0",
        "PATH": "/usr/bin:/bin",
    }
    subprocess.run(["bash", str(ROOT / "recipes" / "wise.sh")], check=True, env=settings, cwd=ROOT)
    wise = runs / "wise-0.25" / "adapter"
    for folder, dtype in ((wise, torch.bfloat16), (runs / "wise-0.25" / "adapter-fp32", torch.float32)):
        weights = load_file(str(folder / "adapter_model.safetensors"))["lora_A.weight"]
        assert weights.dtype == dtype and torch.equal(weights, torch.full((4, 8), 0.25, dtype=dtype))
    meta = json.loads((wise / "unimae.json").read_text())
    assert meta["trained_steps"] == 111 and [e["weight"] for e in meta["averaged_from"]] == [0.25, 0.75]
    lines = calls.read_text().splitlines()
    scored = [line.split("--label ")[1].split()[0] for line in lines if line.startswith("evaluate embeddings")]
    assert scored[:3] == ["wise-0.25", "wise-0.25-fp32", "tuned"] and "start" not in scored  # START's was given
    assert "retrieval-eos" in scored and "retrieval-eos-d64" in scored and "retrieval-eos-d128" in scored
    summary = next(line for line in lines if "--name summary-wise-0.25" in line)
    assert summary.endswith("--labels wise-0.25 wise-0.25-fp32 start=results/curve/step-80 tuned")
    assert any(line.startswith(f"rotation --model gemma3-270m --adapter {wise}") for line in lines)
    release = lines[-1]
    assert (
        release.startswith(f"release --adapter {wise} --name r")
        and f"--train-log {tmp_path / 'tuned'}/log.jsonl" in release
    )
    assert release.endswith(f"TUNED={ends['tuned']} ALPHA=0.25 NAME=wise-0.25 FINAL=1 bash recipes/wise.sh")
    assert "--command DISTILL_WEIGHT=4 bash recipes/retrieval.sh && MODEL=gemma3-270m START=" in release
    assert f"--dev-results {tmp_path / 'wise-out'}/retrieval-eos" in release  # the release's own rows stay
    assert (tmp_path / "releases" / "r" / "adapter_model.safetensors").is_file()
