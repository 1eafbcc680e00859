"""``--device`` wherever a model loads: names checked early, a missing GPU named, the CPU path as before; and
benchmarks/gpu_check.py runs (a small part of it, on the device 'auto' picks)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from unimae.cli import build_parser, main
from unimae.encoder import Encoder
from unimae.runtime.precision import check_device_name, default_device, resolve_device
from unimae.training.config import TrainConfig, resolve_config

GPU_CHECK = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
LOADS_A_MODEL = [
    ["embed", "x"],
    ["generate", "x"],
    ["serve"],
    ["index"],
    ["ask", "q", "--index", "i"],
    ["check"],
    ["evaluate", "embeddings"],
    ["evaluate", "generation"],
    ["evaluate", "figures", "--data-dir", "d"],
]


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_names_unimae_runs_on(name):
    assert check_device_name(name) == name


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda0", "mps", "", "cpu:0"])
def test_other_device_names_are_refused_naming_the_choices(name):
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        check_device_name(name)


def test_auto_is_the_gpu_if_there_is_one_and_cpu_is_the_cpu():
    assert resolve_device("auto") == resolve_device(None) == default_device()
    assert default_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
def test_a_gpu_that_is_not_there_is_an_error_naming_what_to_pass():
    with pytest.raises(ValueError, match="'cuda': no CUDA device is available .*pass --device cpu"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="no CUDA device"):
        Encoder(torch.nn.Linear(2, 2), tokenizer=None, device="cuda:0")


def test_a_gpu_index_beyond_the_machines_is_an_error_naming_the_ones_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"'cuda:2': this machine has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")


def test_every_command_that_loads_a_model_takes_device():
    parser = build_parser()
    for argv in LOADS_A_MODEL:
        assert parser.parse_args(argv).device == "auto", argv
        assert parser.parse_args([*argv, "--device", "cuda:1"]).device == "cuda:1", argv
    with pytest.raises(SystemExit):
        parser.parse_args(["embed", "x", "--device", "gpu"])
    assert resolve_config(parser.parse_args(["train", "--device", "cuda"])).device == "cuda"
    assert resolve_config(parser.parse_args(["train"])).device == "auto"
    with pytest.raises(ValueError, match=r"device must be auto, cpu, cuda or cuda:N \(e.g. cuda:1\), got 'gpu'"):
        TrainConfig(device="gpu").validate()


def test_embed_on_the_cpu_device_gives_the_default_path_s_vectors(tiny_model_dirs, capsys):
    tiny = str(tiny_model_dirs["llama"])
    assert main(["embed", "--model", tiny, "--precision", "fp32", "--device", "cpu", "the cat"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = Encoder.from_pretrained(tiny, precision="fp32", device="cpu").encode("the cat")
    np.testing.assert_allclose(printed, expected, rtol=0, atol=1e-6)


def test_serve_with_llamacpp_refuses_a_device(capsys):
    pytest.importorskip("uvicorn", reason="the server needs pip install 'unimae[serve]'")
    assert main(["serve", "--engine", "llama.cpp", "--gguf", "m.gguf", "--device", "cuda"]) == 2
    assert "--device and --precision are for --engine torch" in capsys.readouterr().err


def test_gpu_check_runs_and_writes_its_json(tmp_path):
    """benchmarks/gpu_check.py, one model and one method, on 'auto' (the GPU where the tests run on one)."""
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "check.json"
    assert gpu_check.main(["--archs", "llama", "--methods", "unimae", "--steps", "1", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == str(default_device()) and report["failed"] == 0
    names = [check["name"] for check in report["checks"]]
    assert names[:3] == ["llama train/unimae", "llama embed/fp32", "llama generate/fp32"] and names[-1] == "llama serve"
    assert report["checks"][0]["losses"] and report["checks"][0]["precision"] == report["precision"]
