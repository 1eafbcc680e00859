"""Released adapters on tiny models: bf16 weights, resolution by name from any directory, the generated card,
and the refusals (an adapter on top of an init adapter, an unknown name). The released retrievers themselves
are checked against their cards in test_integration.py."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_contrastive import _config, _records, _write

from unimae.adapter import AdapterMeta, adapter_meta, adapter_revision
from unimae.cli import main
from unimae.encoder import Encoder
from unimae.release import card_scores, make_release, resolve_adapter
from unimae.release_card import CardInputs, build_card, train_command
from unimae.training.trainer import train


@pytest.fixture
def adapter(tiny_model_dirs, tmp_path):
    data = _write(tmp_path / "pairs.jsonl", _records(12))
    train(_config(tiny_model_dirs["llama"], data, tmp_path / "run", steps=2, query_prompt="q: "))
    return tmp_path / "run" / "adapter"


ROOT = Path(__file__).resolve().parents[1]
SCORED = ROOT / "results" / "retrieval-smollm2" / "retrieval-eos"  # real mteb result files, as a card reads them


def _task_result(folder, task: str) -> float:
    """Copy a real mteb result of ``task`` into ``folder`` -> its main score x 100."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(SCORED / f"{task}.json", folder / f"{task}.json")
    return round(json.loads((folder / f"{task}.json").read_text())["scores"]["test"][0]["main_score"] * 100, 2)


def test_a_release_is_bf16_found_by_name_and_embeds_as_its_adapter(tiny_model_dirs, adapter, tmp_path, monkeypatch):
    tiny = str(tiny_model_dirs["llama"])
    dev = tmp_path / "dev"
    expected = {task: _task_result(dev, task) for task in ("STS17", "SciFact")}
    shutil.copy(SCORED / "run.json", dev / "run.json")
    with pytest.raises(ValueError, match="not of the adapter released"):  # another adapter's results
        build_card(CardInputs("x", tmp_path, dev), AdapterMeta(), revision="0123456789ab")
    card = build_card(CardInputs("tiny-retriever", tmp_path, dev), adapter_meta(adapter))
    out = make_release(adapter, "tiny-retriever", tmp_path / "releases", card=card)
    weights = load_file(out / "adapter_model.safetensors")
    assert weights and all(v.dtype == torch.bfloat16 for v in weights.values())
    assert card_scores((out / "README.md").read_text()) == expected
    assert "model-index" in card and "q: " in card and "unimae train" in card
    monkeypatch.setenv("UNIMAE_RELEASES", str(tmp_path / "releases"))
    monkeypatch.chdir(tmp_path / "dev")  # any working directory
    assert resolve_adapter("tiny-retriever") == str(out)
    released = Encoder.from_pretrained(tiny, adapter="tiny-retriever", precision="fp32")
    trained = Encoder.from_pretrained(tiny, adapter=str(adapter), precision="fp32")
    texts = ["the cat sat", "a dog ran"]
    assert released.spec == trained.spec
    cos = (released.encode_query(texts, normalize=True) * trained.encode_query(texts, normalize=True)).sum(1)
    assert np.all(cos > 0.999)  # bf16 storage of the LoRA weights only
    assert main(["models"]) == 0


def test_unknown_names_and_stacked_adapters_are_clear_errors(tiny_model_dirs, adapter, tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a folder nor a release"):
        resolve_adapter("no-such-release")
    data = _write(tmp_path / "more.jsonl", _records(12))
    out = tmp_path / "stacked"
    train(_config(tiny_model_dirs["llama"], data, out, steps=2, init_adapter=str(adapter)))
    with pytest.raises(ValueError, match="one LoRA on the base model"):
        make_release(out / "adapter", "x", tmp_path / "releases")
    assert main(["embed", "--adapter", "no-such-release", "x"]) == 2  # "... or the name of a release"


def test_train_command_names_only_what_differs():
    command = train_command({"method": "contrastive", "steps": 100, "lr": 1e-4, "query_prompt": "Instruct: x\nQ: "})
    assert command.startswith("unimae train") and "--method contrastive" in command
    assert "--query-prompt $'Instruct: x\\nQ: '" in command
    assert "--steps" not in command and "--lr" not in command


def test_a_card_quotes_only_its_own_adapters_generation_rag_and_repetition(tmp_path):
    from unimae.release_card import CardInputs, _generation_lines, _rag_lines

    def write(name, data):
        (tmp_path / name).write_text(json.dumps(data))
        return tmp_path / name

    accuracy = {"acc,none": 0.5, "acc_stderr,none": 0.01, "acc_norm,none": 0.5, "acc_norm_stderr,none": 0.01}
    results = {"arc_easy": accuracy}
    inputs = CardInputs(
        name="r",
        release=tmp_path,
        dev_results=tmp_path,
        generation=write("gen.json", {"revision": "old", "results": results}),
        base_generation=write("base.json", {"revision": "base", "results": results}),
        rag=write(
            "rag.json", {"revision": "old", "rag": [{"mode": "one", "retrieval_acc_at_1": 0.9, "questions": 20}]}
        ),
        repetition=[
            write("rep.json", {"base": {"repeated_trigrams": 1.0}, "x": {"revision": "old", "repeated_trigrams": 2.0}}),
            write(
                "rep-wiki.json",
                {
                    "base": {"repeated_trigrams": 0.05, "repeated_trigrams_se": 0.01},
                    "y": {
                        "revision": "old",
                        "repeated_trigrams": 0.04,
                        "repeated_trigrams_se": 0.02,
                        "prompts": 64,
                        "prompt_set": "wiki-heldout",
                        "vs_base": {"repeated_trigrams_diff": -0.01, "repeated_trigrams_diff_se": 0.005},
                    },
                },
            ),
        ],
    )
    stale = _generation_lines(inputs, "new")
    assert "not measured for this adapter yet" in stale and "3-grams" not in stale and "base model: 50.00" in stale
    assert _rag_lines(inputs, "new") == ""
    own = _generation_lines(inputs, "old")
    assert "this adapter: 50.00" in own and "(8 plain prompts): 2.000 (base model 1.000)" in own
    wiki = "(64 wiki-heldout prompts): 0.040 +- 0.020 (base model 0.050 +- 0.010; paired difference -0.010 +- 0.005)"
    assert wiki in own
    assert "retrieval acc@1 0.90 over 20 questions" in _rag_lines(inputs, "old")
    every = {"all_paragraphs": 676, "all_paragraphs_acc_at_1": 0.8817, "all_paragraphs_acc_at_1_se": 0.0124}
    inputs.rag.write_text(json.dumps({"revision": "old", "rag": [{"mode": "one", "retrieval_acc_at_1": 0.9, **every}]}))
    assert "0.882 +- 0.012 over all 676 paragraphs' questions" in _rag_lines(inputs, "old")


def test_a_card_table_shows_no_average_for_a_row_with_missing_tasks(tmp_path):
    from unimae.release_card import _summary_json_table

    rows = {
        "step-43": {"tasks": {"STS17": 87.0}, "average": 87.0, "missing": ["SciFact"]},
        "step-80": {"tasks": {"STS17": 87.3, "SciFact": 58.5}, "average": 72.9, "missing": []},
    }
    path = tmp_path / "curve.json"
    path.write_text(json.dumps(rows))
    table = _summary_json_table(path)
    assert "| step-43 |  | 87.00 |  |" in table and "| step-80 | 72.90 |" in table


def test_a_cards_extra_table_names_the_text_length_its_rows_were_scored_at(tmp_path):
    from unimae.release_card import _summary_json_table

    rows = {"step-43": {"tasks": {"STS17": 87.0}, "missing": ["SciFact"]}, "step-80": {"tasks": {"STS17": 87.3}}}
    for label in rows:
        (tmp_path / label).mkdir()
        (tmp_path / label / "run.json").write_text(json.dumps({"max_length": 256}))
    path = tmp_path / "curve.json"
    path.write_text(json.dumps(rows))
    caption = _summary_json_table(path, caption=True).splitlines()[0]
    assert caption == "curve (texts up to 256 tokens; a blank cell: the task was not scored for that row):"
    (tmp_path / "step-80" / "run.json").write_text(json.dumps({"max_length": 512}))  # mixed lengths: none named
    assert "tokens" not in _summary_json_table(path, caption=True).splitlines()[0]


def test_a_card_names_its_quantized_base_the_scored_split_and_subset_and_its_first_stage(adapter, tmp_path):
    dev = tmp_path / "dev"
    _task_result(dev, "STS17")
    shutil.copy(SCORED / "run.json", dev / "run.json")
    meta = dataclasses.replace(adapter_meta(adapter), base_model="gemma3-270m", init_lora_revision="c17ce696a9ea")
    card = build_card(CardInputs("r", tmp_path, dev, command="MODEL=gemma3-270m bash recipes/retrieval.sh"), meta)
    front = yaml.safe_load(card.split("---\n")[1])
    dataset = front["model-index"][0]["results"][0]["dataset"]
    assert (dataset["split"], dataset["config"]) == ("test", "en-en")
    assert "GGUF Q4_K_M" in card and "not onto\n  the full-precision Hub weights of `google/gemma-3-270m`" in card
    assert "640 dimensions at full size" in card and "Prohibited Use Policy" in card
    assert "revision c17ce696a9ea" in card and "`enwiki-gensim`" in card


def test_a_card_names_the_distillation_teacher_of_the_steps_that_had_one(adapter, tmp_path):
    dev = tmp_path / "dev"
    _task_result(dev, "STS17")
    options = {"distill_teacher": "/home/u/.cache/unimae-teachers/all-mpnet-base-v2/", "distill_weight": 4.0}
    config = {"batch_size": 256, "options": {**options, "distill_temperature": 0.05}}
    meta = dataclasses.replace(
        adapter_meta(adapter), trained_steps=231, continued_from_step=200, training_config=config
    )
    card = build_card(CardInputs("r", tmp_path, dev), meta)
    assert "Distillation: the 31 steps after step 200 also matched" in card
    lengthened = dataclasses.replace(meta, trained_steps=271, continued_from_step=231, distill_from_step=200)
    longer = build_card(CardInputs("r", tmp_path, dev), lengthened)
    assert "Distillation: the 71 steps after step 200 also matched" in longer
    assert "`all-mpnet-base-v2` (`--distill-weight 4`, temperature 0.05; licence: Apache-2.0)" in card
    similarity = {"batch_size": 256, "options": {**options, "distill_loss": "similarity", "distill_weight": 50.0}}
    matched = build_card(CardInputs("r", tmp_path, dev), dataclasses.replace(meta, training_config=similarity))
    assert "matched the cosines of every pair of a batch's texts of the sentence-transformers model" in matched
    assert "(`--distill-loss similarity --distill-weight 50`; licence: Apache-2.0)" in matched
    plain = build_card(CardInputs("r", tmp_path, dev), dataclasses.replace(meta, training_config={"batch_size": 256}))
    assert "Distillation" not in plain
    assert "Weight averaging" not in plain
    inputs = [
        {"adapter": "runs/cool/adapter", "revision": "aaa", "weight": 0.5},
        {"adapter": "runs/r80", "revision": "bbb"},
    ]
    averaged = build_card(CardInputs("r", tmp_path, dev), dataclasses.replace(meta, extra={"averaged_from": inputs}))
    assert "mean of 2 adapters" in averaged and "`runs/cool/adapter` (revision aaa, share 0.50)" in averaged
    assert "`runs/r80` (revision bbb, share 0.50)" in averaged and "Distillation: the 31 steps" in averaged


def test_the_cards_wall_time_counts_each_step_of_the_released_adapter_once(tmp_path):
    from unimae.adapter import TrainingTime

    log = tmp_path / "log.jsonl"
    steps = [(1, 10.0), (2, 10.0), (3, 99.0), (3, 10.0), (4, 10.0)]  # step 3 logged again after a resume
    log.write_text("".join(json.dumps({"step": s, "seconds": t}) + "\n" for s, t in steps))
    assert TrainingTime.from_log(log) == TrainingTime(40.0, ())
    assert TrainingTime.from_log(log, up_to=2).seconds == 20.0


def test_an_evaluation_by_release_name_records_the_released_weights_revision(
    tiny_model_dirs, adapter, tmp_path, monkeypatch
):
    """The Python API resolves a release name before hashing, as the CLI does: the record names the weights."""
    from unimae.adapter import adapter_revision
    from unimae.evaluation.embeddings import evaluate_embeddings

    out = make_release(adapter, "tiny-retriever", tmp_path / "releases")
    monkeypatch.setenv("UNIMAE_RELEASES", str(tmp_path / "releases"))
    rows = [
        {"sentence1": f"a cat sat {i}", "sentence2": f"the dog ran {i % 3}", "score": float(i % 5)} for i in range(12)
    ]
    (tmp_path / "data" / "sts" / "STS17").mkdir(parents=True)
    (tmp_path / "data" / "sts" / "STS17" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = evaluate_embeddings(
        str(tiny_model_dirs["llama"]),
        ["STS17"],
        tmp_path / "eval",
        adapter="tiny-retriever",
        data_dir=tmp_path / "data",
        precision="fp32",
    )
    record = json.loads((run.output_dir / "run.json").read_text())
    assert "STS17" in run.scores and record["adapter"] == str(out)
    assert record["revision"] == adapter_revision(str(out)) != adapter_revision("tiny-retriever")


def test_a_release_name_is_one_folder_and_a_stopped_swap_loses_no_release(adapter, tmp_path):
    from unimae.files import replace_folder

    root = tmp_path / "releases"
    (root / "kept").mkdir(parents=True)
    for bad in ("", ".", "..", "a/b", "../x", "-x"):
        with pytest.raises(ValueError, match="release name"):
            make_release(adapter, bad, root)
    assert (root / "kept").is_dir() and sorted(p.name for p in root.iterdir()) == ["kept"]
    assert main(["release", "--adapter", str(adapter), "--name", "", "--root", str(root), "--dev-results", "x"]) == 2
    old = make_release(adapter, "r", root)
    first = (old / "adapter_model.safetensors").read_bytes()
    assert (make_release(adapter, "r", root) / "adapter_model.safetensors").read_bytes() == first  # same weights
    old.rename(root / ".r.old")  # a swap stopped between moving the old release aside and moving the new one in
    partial = root / ".r.partial"
    partial.mkdir()
    (partial / "new").write_text("x")
    replace_folder(partial, root / "r")
    assert (root / "r" / "new").is_file() and not (root / ".r.old").exists() and not partial.exists()


def test_a_card_skips_a_cut_off_training_log_line_and_names_a_bad_result_file(tmp_path):
    from unimae.adapter import TrainingTime
    from unimae.release_card import _main_score, _rag_lines

    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "seconds": 2.0}\n{"step": 2, "seconds": 3.0}\n{"step": 3, "sec')
    assert TrainingTime.from_log(log).seconds == 5.0
    (tmp_path / "rag.json").write_text("{not json")
    inputs = CardInputs(name="r", release=tmp_path, dev_results=tmp_path, rag=tmp_path / "rag.json")
    with pytest.raises(ValueError, match=r"rag\.json is not valid JSON"):
        _rag_lines(inputs, "x")
    with pytest.raises(ValueError, match="holds no main score"):
        _main_score({"task_name": "STS17", "scores": {"test": []}})


def test_a_release_of_an_adapter_stored_in_bf16_says_its_scores_are_of_the_shipped_values(adapter, tmp_path):
    """An averaged adapter written in bf16 (recipes/wise.sh) is scored before its release: its rows are of the
    values the release ships, not of an fp32 adapter rounded later; the card says so, now and at --card-only."""
    from safetensors.torch import save_file

    from unimae.release import source_dtype, source_revision

    bf16 = tmp_path / "bf16"
    shutil.copytree(adapter, bf16)
    weights = load_file(bf16 / "adapter_model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, bf16 / "adapter_model.safetensors")
    assert (source_dtype(adapter), source_dtype(bf16)) == ("float32", "bfloat16")
    dev = tmp_path / "dev"
    _task_result(dev, "STS17")
    (dev / "run.json").write_text(json.dumps({"revision": source_revision(bf16)}))
    root = tmp_path / "releases"
    common = ["--name", "tiny-retriever", "--root", str(root), "--dev-results", str(dev)]
    assert main(["release", "--adapter", str(bf16), *common]) == 0
    assert adapter_meta(root / "tiny-retriever").release.source_dtype == "bfloat16"
    for _ in range(2):  # the release, then its card rewritten from the release alone
        card = (root / "tiny-retriever" / "README.md").read_text()
        assert "which stores its LoRA weights in bf16: the values shipped here" in card
        assert "rounded to bf16" not in card
        assert main(["release", "--card-only", *common]) == 0


def test_an_index_opens_with_its_release_by_name(tiny_model_dirs, adapter, tmp_path, monkeypatch):
    from unimae.adapter import adapter_revision
    from unimae.retrieval.index import VectorIndex
    from unimae.retrieval.rag import load_index_and_encoder

    out = make_release(adapter, "tiny-retriever", tmp_path / "releases")
    monkeypatch.setenv("UNIMAE_RELEASES", str(tmp_path / "releases"))
    tiny = str(tiny_model_dirs["llama"])
    encoder = Encoder.from_pretrained(tiny, adapter=str(out), precision="fp32")
    VectorIndex.build(encoder, [("a", "the cat sat"), ("b", "a dog ran")], tmp_path / "idx")  # names its adapter
    loaded, index = load_index_and_encoder(tmp_path / "idx", adapter="tiny-retriever", precision="fp32")
    assert index.manifest["adapter_revision"] == loaded.source["adapter_revision"] == adapter_revision(str(out))
    assert index.search(loaded.encode_document(["the cat sat"], normalize=True), k=1)[0][0].id == "a"


def test_a_card_of_a_release_made_again_accepts_results_of_its_bf16_weights(adapter, tmp_path):
    """The stop rule restores a release's files as the run's adapter: results scored on those bf16 weights describe
    the release as well as its fp32 source's do."""
    from unimae.adapter import adapter_revision
    from unimae.release import release_revisions, source_revision

    out = make_release(adapter, "tiny-retriever", tmp_path / "releases")
    assert release_revisions(adapter) == (source_revision(adapter),)
    assert release_revisions(out) == (source_revision(adapter), adapter_revision(str(out)))
    dev = tmp_path / "dev"
    _task_result(dev, "STS17")
    (dev / "run.json").write_text(json.dumps({"revision": adapter_revision(str(out))}))
    card = build_card(CardInputs("tiny-retriever", tmp_path, dev), adapter_meta(out), release_revisions(out))
    assert "STS17" in card and "Scored on the bf16 weights shipped here" in card
    (dev / "run.json").write_text(json.dumps({"revision": source_revision(adapter)}))
    card = build_card(CardInputs("tiny-retriever", tmp_path, dev), adapter_meta(out), release_revisions(out))
    assert f"Scored on the fp32 adapter this release was made from (revision {source_revision(adapter)})" in card
    (dev / "run.json").write_text(json.dumps({"revision": adapter_revision(str(out))}))
    with pytest.raises(ValueError, match="not of the adapter released"):
        build_card(CardInputs("tiny-retriever", tmp_path, dev), adapter_meta(out), source_revision(adapter))


def test_a_cards_summary_table_shows_the_released_results_once(adapter, tmp_path):
    dev = tmp_path / "retrieval-eos"
    score = _task_result(dev, "STS17")
    shutil.copy(SCORED / "run.json", dev / "run.json")
    summary = tmp_path / "summary.json"
    rows = {"retrieval-eos": {"tasks": {"STS17": score}, "average": score}, "other": {"tasks": {"STS17": 1.0}}}
    summary.write_text(json.dumps(rows))
    card = build_card(CardInputs("tiny-retriever", tmp_path, dev, summary=summary), AdapterMeta())
    assert "| tiny-retriever |" in card and "| other |" in card and "| retrieval-eos |" not in card


def _log(path: Path, steps: list[tuple[int, float]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": s, "seconds": t}) + "\n" for s, t in steps))
    return path


def test_a_release_records_its_training_time_and_a_continued_run_adds_to_it(tiny_model_dirs, adapter, tmp_path):
    """The logs of a sitting stay on its machine: the release records its steps' wall time, a run continued from it
    on a fresh machine carries that record, and its own release adds the new sitting's steps."""
    from unimae.adapter import TrainingTime
    from unimae.release_card import training_time

    dev = tmp_path / "dev"
    _task_result(dev, "STS17")
    steps = adapter_meta(adapter).trained_steps  # 2
    log = _log(tmp_path / "first" / "log.jsonl", [(1, 1800.0), (2, 1800.0), (3, 900.0)])  # step 3: past the adapter
    inputs = CardInputs("tiny-retriever", tmp_path / "releases" / "tiny-retriever", dev, train_logs=[log])
    time = training_time(inputs, adapter_meta(adapter))
    assert time == TrainingTime(3600.0, ())
    card = build_card(inputs, adapter_meta(adapter))
    out = make_release(adapter, "tiny-retriever", tmp_path / "releases", card, time)
    assert adapter_meta(out).release.training == TrainingTime(3600.0, ())
    assert "wall time 1.0 h of\n  training steps (CPU not recorded; 2 CPU cores)" in card
    without_logs = CardInputs("tiny-retriever", out, dev, train_logs=[tmp_path / "gone" / "log.jsonl"])
    assert training_time(without_logs, adapter_meta(out)) == TrainingTime(3600.0, ())  # a fresh machine
    assert training_time(without_logs, adapter_meta(adapter)) is None  # a run's adapter without its logs
    # the release restored as a run's adapter whose log holds only a longer, rejected continuation's steps
    rejected = _log(tmp_path / "rejected" / "log.jsonl", [(3, 1800.0), (4, 1800.0)])
    restored = CardInputs("tiny-retriever", out, dev, train_logs=[rejected])
    assert training_time(restored, adapter_meta(out)) == TrainingTime(3600.0, ())  # not 0 s of steps <= 2

    data = _write(tmp_path / "pairs.jsonl", _records(12))
    config = _config(tiny_model_dirs["llama"], data, tmp_path / "more", steps=steps + 1, query_prompt="q: ")
    train(dataclasses.replace(config, continue_adapter=str(out)))
    continued = adapter_meta(tmp_path / "more" / "adapter")
    assert continued.continued_from_step == steps and continued.continued_from_training == TrainingTime(3600.0, ())
    new_log = _log(tmp_path / "more" / "log.jsonl", [(3, 1800.0)])  # the new sitting's own step
    again = CardInputs("tiny-retriever", out, dev, train_logs=[new_log])
    assert training_time(again, continued).seconds == 5400.0
    # continued again from that run's adapter (no release): its run folder's log up to its step, plus its record
    further = dict(output_dir=str(tmp_path / "further"), steps=steps + 2)
    train(dataclasses.replace(config, continue_adapter=str(tmp_path / "more" / "adapter"), **further))
    assert adapter_meta(tmp_path / "further" / "adapter").continued_from_training.seconds == 5400.0


def test_a_card_made_before_releases_recorded_training_time_keeps_its_stated_one(adapter, tmp_path):
    """`unimae release --card-only` on a release whose unimae.json has no training record reads the card's own
    wall-time sentence and records it, so the card says what it said and later cards need no logs."""
    from unimae.adapter import TrainingTime

    dev = tmp_path / "dev"
    _task_result(dev, "STS17")
    shutil.copy(SCORED / "run.json", dev / "run.json")
    out = make_release(adapter, "tiny-retriever", tmp_path / "releases")
    revision = adapter_revision(str(out))
    (out / "README.md").write_text("- Steps: 2, ...; wall time 2.8 h of\n  training steps (AMD EPYC; 2 CPU cores).\n")
    run_json = dev / "run.json"
    run_json.write_text(json.dumps({"revision": revision}))
    args = ["release", "--card-only", "--name", "tiny-retriever", "--root", str(tmp_path / "releases")]
    assert main([*args, "--dev-results", str(dev)]) == 0
    assert "wall time 2.8 h of\n  training steps (AMD EPYC; 2 CPU cores)" in (out / "README.md").read_text()
    assert adapter_meta(out).release.training == TrainingTime(2.8 * 3600, ("AMD EPYC",))
    assert adapter_revision(str(out)) == revision  # the weights untouched
    (out / "README.md").write_text("no wall time here\n")
    assert main([*args, "--dev-results", str(dev)]) == 0  # now from unimae.json
    assert "wall time 2.8 h of\n  training steps (AMD EPYC; 2 CPU cores)" in (out / "README.md").read_text()


def test_training_time_records_read_back_and_tolerate_damage():
    from unimae.adapter import ReleaseInfo, TrainingTime

    meta = AdapterMeta(
        continued_from_step=80,
        continued_from_training=TrainingTime(10.0, ("AMD EPYC",)),
        release=ReleaseInfo("r", "bfloat16", "0123456789ab", TrainingTime(20.0, ())),
    )
    data = json.loads(json.dumps(meta.to_dict()))
    assert data["continued_from"] == {"step": 80, "training": {"seconds": 10.0, "cpu_models": ["AMD EPYC"]}}
    assert AdapterMeta.from_dict(data) == meta
    data["release"]["training"] = {"seconds": "soon"}  # damaged: read as not recorded
    assert AdapterMeta.from_dict(data).release.training is None
    assert TrainingTime(1.0, ("b",)) + TrainingTime(2.0, ("a", "b")) == TrainingTime(3.0, ("a", "b"))


def test_a_release_with_a_misshaped_unimae_json_is_one_message_in_unimae_models(adapter, tmp_path, monkeypatch, capsys):
    """Before: valid JSON that is not an object (``[1]``) raised a TypeError traceback from ``unimae models``."""
    out = make_release(adapter, "tiny-retriever", tmp_path / "releases", card="card")
    (out / "unimae.json").write_text("[1]")
    monkeypatch.setenv("UNIMAE_RELEASES", str(tmp_path / "releases"))
    assert main(["models"]) == 2
    err = capsys.readouterr().err
    assert "unimae.json is malformed" in err and "Traceback" not in err
