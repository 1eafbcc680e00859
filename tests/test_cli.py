"""The command line as a user runs it."""

import json

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


def test_embed_to_npy(tiny_model_dirs, tmp_path, capsys):
    import numpy as np

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


def test_every_subcommand_is_wired():
    from unimae.cli import build_parser

    parser = build_parser()
    for argv in (
        ["evaluate", "summary"],
        ["evaluate", "figures", "--data-dir", "x"],
        ["evaluate", "embeddings"],
        ["evaluate", "generation"],
        ["compare"],
        ["export", "--output", "x"],
        ["check"],
        ["train"],
    ):
        assert callable(parser.parse_args(argv).func), argv


def test_every_help_page_renders(capsys):
    """argparse %-formats help text: a bare '%' in any option's help crashes ``--help``."""
    import pytest

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
