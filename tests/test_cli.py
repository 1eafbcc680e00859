"""The command line as a user runs it."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import SENTENCES

from unimae.cli import main


def test_models_lists_offline_models(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "gemma3-270m" in out and "qwen2.5-coder-0.5b" in out


def test_embed_prints_vectors(tiny_model_dirs, capsys):
    tiny = tiny_model_dirs["llama"]
    assert main(["embed", "--model", str(tiny), "--precision", "fp32", "the cat", "a dog"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and len(rows[0]) == 64


def test_embed_with_a_prompt_dimensions_and_binary_output(tiny_model_dirs, capsys):
    tiny = str(tiny_model_dirs["llama"])
    base = ["embed", "--model", tiny, "--precision", "fp32"]
    assert main([*base, "--prompt", "q: ", "--dimensions", "16", "--normalize", "the cat"]) == 0
    assert main([*base, "--normalize", "q: the cat"]) == 0
    assert main([*base, "--quantize", "ubinary", "the cat", "a dog"]) == 0
    prompted, plain, *bits = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(prompted) == 16 and abs(sum(x * x for x in prompted) - 1) < 1e-4
    # prompt + text, cut to 16 and re-normalised
    cut = plain[:16]
    norm = sum(x * x for x in cut) ** 0.5
    assert max(abs(a - b / norm) for a, b in zip(prompted, cut, strict=True)) < 1e-4
    assert len(bits) == 2 and len(bits[0]) == 64 // 8 and all(0 <= b < 256 for b in bits[0])


def test_embed_to_npy(tiny_model_dirs, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("one\ntwo\nthree\n")
    out = tmp_path / "e.npy"
    assert (
        main(
            [
                "embed",
                "--model",
                str(tiny_model_dirs["qwen2"]),
                "--input",
                str(src),
                "--output",
                str(out),
                "--pooling",
                "mean",
                "--normalize",
            ]
        )
        == 0
    )
    vectors = np.load(out)
    assert vectors.shape == (3, 64) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-4)


def test_embed_output_is_the_path_given_checked_before_the_model_loads(tiny_model_dirs, tmp_path, monkeypatch, capsys):
    import unimae.encoder

    tiny = str(tiny_model_dirs["qwen2"])
    out = tmp_path / "new" / "folder" / "vectors.txt"  # a missing folder, a name without .npy
    assert main(["embed", "--model", tiny, "--output", str(out), "one", "two"]) == 0
    assert np.load(out).shape == (2, 64) and not Path(f"{out}.npy").exists()
    assert f"to {out}" in capsys.readouterr().out

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(unimae.encoder.Encoder, "from_pretrained", no_model)
    assert main(["embed", "--model", tiny, "--output", str(tmp_path), "x"]) == 2  # a folder
    assert "is a folder" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["embed", "--model", tiny, "--output", str(tmp_path / "file" / "v.npy"), "x"]) == 2
    assert "cannot write to" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["embed", "--model", tiny]) == 2
    assert "no texts to embed" in capsys.readouterr().err


def test_wrong_model_path_is_a_clear_error(tmp_path, capsys):
    assert main(["embed", "--model", str(tmp_path / "missing-model"), "x"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Hugging Face model id" in err
    (tmp_path / "empty").mkdir()
    assert main(["generate", "--model", str(tmp_path / "empty"), "hi"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_wrong_adapter_path_is_a_clear_error(tiny_model_dirs, tmp_path, capsys):
    assert main(["embed", "--model", str(tiny_model_dirs["llama"]), "--adapter", str(tmp_path), "x"]) == 2
    assert "not an adapter directory" in capsys.readouterr().err


def _record(monkeypatch, target: str, returns):
    """Replace ``target`` (module.attr) by a fake that records its calls and returns ``returns``."""
    calls = []

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        return returns

    monkeypatch.setattr(target, fake)
    return calls


def test_train_passes_the_resolved_config_and_reports_an_interrupt(monkeypatch, tmp_path, capsys):
    from unimae.training.trainer import TrainResult

    out = tmp_path / "run"
    result = TrainResult(out, out / "adapter", steps=3, interrupted=True, seconds=1.0)
    calls = _record(monkeypatch, "unimae.training.trainer.train", result)
    argv = ["train", "--model", "m", "--data", "d.txt", "--output-dir", str(out), "--steps", "7", "--lr", "0.001"]
    assert main(argv) == 130
    (config,), kwargs = calls[0]
    assert (config.model, config.data, config.output_dir, config.steps, config.lr) == ("m", "d.txt", str(out), 7, 0.001)
    assert kwargs == {"resume": False, "overwrite": False}
    printed = capsys.readouterr().out
    assert "interrupted at step 3/7" in printed and f"unimae train --resume --output-dir {out}" in printed


def test_train_resume_reuses_the_runs_config_and_explicit_flags_win(monkeypatch, tmp_path):
    from unimae.training.config import TrainConfig
    from unimae.training.trainer import TrainResult

    out = tmp_path / "run"
    out.mkdir()
    TrainConfig(model="saved-model", data="saved.txt", output_dir=str(out), steps=9, lr=0.01).save(out / "config.json")
    calls = _record(monkeypatch, "unimae.training.trainer.train", TrainResult(out, out / "adapter", 12, False, 1.0))
    assert main(["train", "--resume", "--output-dir", str(out), "--steps", "12"]) == 0
    (config,), kwargs = calls[0]
    assert kwargs == {"resume": True, "overwrite": False}
    assert (config.model, config.data, config.lr, config.steps) == ("saved-model", "saved.txt", 0.01, 12)


def test_generate_prints_the_models_greedy_continuation(tiny_model_dirs, capsys):
    from unimae.encoder import Encoder

    tiny = str(tiny_model_dirs["llama"])
    assert main(["generate", "--model", tiny, "--precision", "fp32", "--max-new-tokens", "5", "the cat"]) == 0
    expected = Encoder.from_pretrained(tiny, precision="fp32").generate("the cat", max_new_tokens=5)
    assert capsys.readouterr().out == expected + "\n"


def test_check_passes_its_options_and_writes_the_rows(monkeypatch, tmp_path, capsys):
    from unimae.evaluation.check import CheckResult

    result = CheckResult([("base eos", "STSBenchmark test Spearman", 12.345)], {"base": "Paris"})
    calls = _record(monkeypatch, "unimae.evaluation.check.run_check", result)
    out = tmp_path / "check.json"
    argv = ["check", "--model", "m", "--adapter", "a", "--sts", "s.jsonl", "--max-paragraphs", "5", "--device", "cpu"]
    assert main([*argv, "--precision", "fp32", "--output", str(out)]) == 0
    assert calls == [(("m", "a"), {"sts": "s.jsonl", "max_paragraphs": 5, "device": "cpu", "precision": "fp32"})]
    printed = capsys.readouterr().out
    assert "| base eos | STSBenchmark test Spearman | 12.35 |" in printed and "(base): 'Paris'" in printed
    assert json.loads(out.read_text()) == {
        "rows": [["base eos", "STSBenchmark test Spearman", 12.345]],
        "generation": {"base": "Paris"},
    }


def test_evaluate_embeddings_passes_its_options_and_fails_on_task_errors(monkeypatch, tmp_path, capsys):
    from unimae.evaluation.embeddings import EmbeddingRun

    run = EmbeddingRun("lbl", tmp_path / "lbl", errors={"SciFact": "no folder"})
    run.output_dir.mkdir()  # what the evaluation makes
    calls = _record(monkeypatch, "unimae.evaluation.embeddings.evaluate_embeddings", run)
    argv = ["evaluate", "embeddings", "--model", "m", "--adapter", "a", "--pooling", "mean"]
    argv += ["--attention", "bidirectional", "--tasks", "STSBenchmark", "SciFact", "--data-dir", "d"]
    argv += ["--output-dir", str(tmp_path), "--label", "lbl", "--batch-size", "8", "--max-length", "64"]
    argv += ["--precision", "fp32", "--no-cache", "--rerun", "--dimensions", "32", "--device", "cuda:1"]
    assert main(argv) == 1
    assert calls == [
        (
            ("m", ["STSBenchmark", "SciFact"], tmp_path),
            dict(
                adapter="a",
                pooling="mean",
                attention="bidirectional",
                data_dir=Path("d"),
                label="lbl",
                batch_size=8,
                max_length=64,
                precision="fp32",
                use_cache=False,
                rerun=True,
                dimensions=32,
                device="cuda:1",
            ),
        )
    ]
    assert "FAILED SciFact: no folder" in capsys.readouterr().err
    reference = ["evaluate", "embeddings", "--reference", "--tasks", "STS17", "--output-dir", str(tmp_path)]
    assert main([*reference, "--dimensions", "64", "--pooling", "eos"]) == 2  # before: dropped without a word
    assert "--dimensions, --pooling do not apply" in capsys.readouterr().err


def test_evaluate_reference_scores_a_named_sentence_transformers_model_under_its_folder_name(monkeypatch, tmp_path):
    from unimae.evaluation.embeddings import EmbeddingRun

    run = EmbeddingRun("all-mpnet-base-v2", tmp_path / "all-mpnet-base-v2")
    run.output_dir.mkdir()
    loaded = _record(monkeypatch, "unimae.evaluation.reference.load_reference", "st-model")
    calls = _record(monkeypatch, "unimae.evaluation.embeddings.evaluate_model_on_tasks", run)
    argv = ["evaluate", "embeddings", "--reference", "/teachers/all-mpnet-base-v2/", "--tasks", "STS17"]
    assert main([*argv, "--output-dir", str(tmp_path), "--device", "cpu", "--data-dir", "d"]) == 0
    assert loaded == [(("/teachers/all-mpnet-base-v2/", "cpu"), {})]
    info = {"model": "/teachers/all-mpnet-base-v2/"}
    assert calls == [(("st-model", ["STS17"], tmp_path, "all-mpnet-base-v2", info, Path("d"), 32, False), {})]
    assert main(["evaluate", "embeddings", "--reference", "--tasks", "STS17", "--output-dir", str(tmp_path)]) == 0
    assert loaded[1][0][0] == "all-MiniLM-L6-v2" and calls[1][0][3] == "all-MiniLM-L6-v2"  # no value: MiniLM


def test_a_reference_that_is_no_sentence_transformers_model_is_a_clear_error(tmp_path, capsys):
    pytest.importorskip("sentence_transformers")
    argv = ["evaluate", "embeddings", "--reference", str(tmp_path / "nope"), "--tasks", "STS17"]
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 2
    assert "not a sentence-transformers model folder or Hub id" in capsys.readouterr().err
    assert not (tmp_path / "out" / "nope").exists()


def test_evaluate_embeddings_refuses_unknown_task_names_before_any_work(monkeypatch, tmp_path, capsys):
    calls = _record(monkeypatch, "unimae.evaluation.embeddings.evaluate_embeddings", None)
    argv = [
        "evaluate",
        "embeddings",
        "--model",
        "m",
        "--tasks",
        "STS17",
        "{'STS17':",
        "1.0}",
        "--output-dir",
        str(tmp_path),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "unknown task names" in err and "{'STS17':" in err and "1.0}" in err and "STS17'?" in err  # mteb's hint
    assert calls == [] and list(tmp_path.iterdir()) == []


def test_evaluate_summary_finds_every_evaluated_label(monkeypatch, tmp_path, capsys):
    for label in ("b", "a"):
        (tmp_path / label).mkdir()
        (tmp_path / label / "run.json").write_text("{}")
    (tmp_path / "not-a-run").mkdir()
    written = (tmp_path / "t.md", tmp_path / "t.csv", "T")
    calls = _record(monkeypatch, "unimae.evaluation.summary.write_summary", written)
    argv = ["evaluate", "summary", "--output-dir", str(tmp_path), "--tasks", "STSBenchmark", "--name", "t"]
    assert main(argv) == 0
    assert calls == [((tmp_path, ["a", "b"], ["STSBenchmark"], "t"), {})]
    assert main([*argv, "--labels", "b"]) == 0
    assert calls[1] == ((tmp_path, ["b"], ["STSBenchmark"], "t"), {})
    assert capsys.readouterr().out.startswith("T\n")


def test_evaluate_figures_embeds_the_sample_with_the_base_model(monkeypatch, tiny_model_dirs, tmp_path):
    from unimae.encoder import Encoder

    classes = ["a", "b"] * 3
    monkeypatch.setattr("unimae.evaluation.figures.clustering_sample", lambda data_dir: (SENTENCES[:6], classes))
    calls = _record(monkeypatch, "unimae.evaluation.figures.tsne_figure", tmp_path / "tsne.png")
    tiny = str(tiny_model_dirs["llama"])
    argv = ["evaluate", "figures", "--model", tiny, "--data-dir", "d", "--output-dir", str(tmp_path)]
    assert main([*argv, "--precision", "fp32"]) == 0
    (panels, labels, path, _), _ = calls[0]
    assert list(panels) == ["base model, eos pooling"] and labels == classes and path == tmp_path / "tsne.png"
    expected = Encoder.from_pretrained(tiny, pooling="eos", max_length=128, precision="fp32").encode(SENTENCES[:6])
    np.testing.assert_allclose(panels["base model, eos pooling"], expected, rtol=1e-5, atol=1e-5)


def test_evaluate_figures_shows_the_base_untrained_beside_an_adapter_as_it_embeds(
    monkeypatch, tiny_model_dirs, corpus_file, tmp_path
):
    """With an MNTP adapter (bidirectional attention, mean pooling) the base panel is still causal eos."""
    from unimae.encoder import Encoder
    from unimae.training.config import TrainConfig
    from unimae.training.trainer import train

    tiny = str(tiny_model_dirs["llama"])
    run = dict(data=str(corpus_file), steps=1, batch_size=2, micro_batch_size=2, max_length=24, precision="fp32")
    adapter = train(TrainConfig(model=tiny, method="mntp", output_dir=str(tmp_path / "run"), **run)).adapter_dir
    monkeypatch.setattr("unimae.evaluation.figures.clustering_sample", lambda data_dir: (SENTENCES[:6], ["a"] * 6))
    calls = _record(monkeypatch, "unimae.evaluation.figures.tsne_figure", tmp_path / "tsne.png")
    argv = ["evaluate", "figures", "--model", tiny, "--adapter", str(adapter), "--data-dir", "d"]
    assert main([*argv, "--output-dir", str(tmp_path), "--precision", "fp32"]) == 0
    (panels, *_), _ = calls[0]
    assert list(panels) == ["base model, eos pooling", "adapter, mean pooling"]
    expected = Encoder.from_pretrained(tiny, pooling="eos", max_length=128, precision="fp32").encode(SENTENCES[:6])
    np.testing.assert_allclose(panels["base model, eos pooling"], expected, rtol=1e-5, atol=1e-5)


def test_evaluate_generation_passes_its_options_and_prints_headline_metrics(monkeypatch, tmp_path, capsys):
    results = {"piqa": {"acc_norm,none": 0.5, "acc,none": 0.25}, "mmlu": {"alias": "mmlu", "acc,none": 0.3}}
    calls = _record(monkeypatch, "unimae.evaluation.generation.evaluate_generation", {"results": results, "seconds": 1})
    argv = ["evaluate", "generation", "--model", "m", "--tasks", "piqa", "mmlu", "--data-dir", "d", "--rerun"]
    argv += [
        "--output-dir",
        str(tmp_path),
        "--limit",
        "3",
        "--batch-size",
        "2",
        "--precision",
        "fp32",
        "--scorer",
        "hf",
    ]
    assert main(argv) == 0
    options = dict(
        tasks=["piqa", "mmlu"], limit=3, batch_size=2, precision="fp32", rerun=True, scorer="hf", device="auto"
    )
    assert calls == [(("m", None, tmp_path, Path("d")), options)]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["piqa", "acc_norm", "0.5000"]
    assert lines[1].split() == ["mmlu", "acc", "0.3000"]  # a registry task: its own acc, not a KeyError
    assert lines[2].split() == ["average", "acc", "0.4000", "(2", "tasks)"]  # acc_norm 0.5 and acc 0.3


def test_compare_builds_its_config_from_the_flags(monkeypatch, tmp_path):
    from unimae.evaluation.compare import CompareConfig

    calls = _record(monkeypatch, "unimae.evaluation.compare.run_compare", {"embeddings": "| table |"})
    argv = ["compare", "--model", "m", "--adapter", "x/adapter", "--adapter", "y/adapter", "--data-dir", "d"]
    argv += ["--output-dir", str(tmp_path), "--tasks", "STSBenchmark", "--batch-size", "4"]
    argv += ["--generation-limit", "2", "--no-reference", "--no-generation"]
    assert main(argv) == 0
    assert calls == [
        (
            (
                CompareConfig(
                    model="m",
                    adapters=["x/adapter", "y/adapter"],
                    data_dir=Path("d"),
                    output_dir=tmp_path,
                    tasks=["STSBenchmark"],
                    reference=False,
                    generation=False,
                    generation_limit=2,
                    batch_size=4,
                ),
            ),
            {},
        )
    ]


def test_export_passes_its_options(monkeypatch, tmp_path, capsys):
    calls = _record(monkeypatch, "unimae.export.export", tmp_path / "st")
    argv = ["export", "--model", "m", "--adapter", "a", "--format", "sentence-transformers"]
    assert main([*argv, "--output", str(tmp_path / "st"), "--max-length", "128"]) == 0
    assert calls == [(("m", "a", str(tmp_path / "st")), {"fmt": "sentence-transformers", "max_length": 128})]
    assert f"wrote sentence-transformers export to {tmp_path / 'st'}" in capsys.readouterr().out
    assert main(["export", "--model", "m", "--output", str(tmp_path / "hf"), "--type", "q8_0"]) == 2  # was ignored
    assert "--type does nothing for --format hf" in capsys.readouterr().err
    assert main(["export", "--model", "m", "--format", "gguf", "--output", "x.gguf", "--max-length", "64"]) == 2
    assert "--max-length does nothing for --format gguf" in capsys.readouterr().err
    assert len(calls) == 1


def test_every_help_page_renders(capsys):
    """argparse %-formats help text: a bare '%' in any option's help crashes ``--help``."""
    from unimae.cli import build_parser

    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices
    pages = [[name] for name in subcommands]
    pages += [["evaluate", name] for name in subcommands["evaluate"]._subparsers._group_actions[0].choices]
    for argv in pages:
        with pytest.raises(SystemExit) as stop:
            parser.parse_args([*argv, "--help"])
        assert stop.value.code == 0, argv
        assert "usage:" in capsys.readouterr().out, argv


def test_embed_gives_one_row_per_input_line_and_int8_codes_scaled_by_a_calibration_file(
    tiny_model_dirs, tmp_path, capsys
):
    """Before: empty lines of an --input file were dropped (stdin kept them), so the .npy rows no longer lined up
    with the file's lines."""
    tiny = str(tiny_model_dirs["llama"])
    src = tmp_path / "in.txt"
    src.write_text("one\n\nthree\n   \n")
    base = ["embed", "--model", tiny, "--precision", "fp32"]
    assert main([*base, "--input", str(src), "--output", str(tmp_path / "e.npy")]) == 0
    rows = np.load(tmp_path / "e.npy")
    assert rows.shape == (4, 64) and np.array_equal(rows[1], rows[3])  # '' and '   ' both embed as BOS/EOS
    calibration = tmp_path / "calibration.npy"
    np.save(calibration, rows)
    capsys.readouterr()
    assert main([*base, "--quantize", "int8", "--calibration", str(calibration), "two"]) == 0
    codes = json.loads(capsys.readouterr().out)
    from unimae.encoder import Encoder

    encoder = Encoder.from_pretrained(tiny, precision="fp32")
    assert codes == encoder.encode("two", precision="int8", calibration_embeddings=rows).tolist()
    assert main([*base, "--quantize", "int8", "two"]) == 2  # one vector: its own ranges say nothing
    assert "needs per-dimension ranges" in capsys.readouterr().err
    assert main([*base, "--calibration", str(calibration), "two"]) == 2
    assert "scales --quantize int8 or uint8" in capsys.readouterr().err
    (tmp_path / "bad.npy").write_text("not an array")
    assert main([*base, "--quantize", "int8", "--calibration", str(tmp_path / "bad.npy"), "two"]) == 2
    assert "not a readable .npy" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["evaluate", "embeddings"],
        ["evaluate", "generation"],
        ["evaluate", "figures"],
        ["compare"],
    ],
)
def test_data_dir_defaults_to_unimae_data(monkeypatch, argv):
    from unimae.cli import build_parser

    monkeypatch.setenv("UNIMAE_DATA", "/data/here")
    assert build_parser().parse_args(argv).data_dir == "/data/here"
    assert build_parser().parse_args([*argv, "--data-dir", "mine"]).data_dir == "mine"
    monkeypatch.delenv("UNIMAE_DATA")
    if argv[-1] == "figures":  # it needs the data: required without the variable
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
    else:
        assert build_parser().parse_args(argv).data_dir is None


def test_rotation_of_a_release_name_says_to_copy_it_first(capsys):
    assert main(["rotation", "--adapter", "unimae-smollm2-135m-retriever"]) == 2
    err = capsys.readouterr().err
    assert "is a release" in err and "cp -r " in err and "unimae rotation --adapter my-adapter" in err
    assert main(["rotation", "--adapter", "no-such-adapter-folder"]) == 2
    assert "no such adapter folder" in capsys.readouterr().err
