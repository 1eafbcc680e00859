"""Training as 2 processes under torchrun or accelerate launch (gloo on CPU) averages gradients correctly.

One process with 2 micro-batches of gradient accumulation and two processes with one micro-batch
each see the same global batch; with per-example loss normalization and correct gradient
averaging their losses, gradient norms and resulting adapters match.
"""

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


def _run(launcher: list[str], tiny_dir, corpus_file, out, extra_env=None):
    args = [
        "train",
        "--model",
        str(tiny_dir),
        "--data",
        str(corpus_file),
        "--output-dir",
        str(out),
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--micro-batch-size",
        "2",
        "--max-length",
        "24",
        "--precision",
        "fp32",
        "--lora-r",
        "4",
        "--lora-alpha",
        "8",
        "--lora-dropout",
        "0",
        "--save-every",
        "0",
        "--threads",
        "1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    proc = subprocess.run(launcher + args, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29531"],
    # accelerate's multi-process launcher is called --multi_gpu; without a GPU the trainer runs it on gloo.
    "accelerate": [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--main_process_port",
        "29532",
    ],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_two_processes_match_one_process_with_accumulation(launcher, tiny_model_dirs, corpus_file, tmp_path):
    tiny = tiny_model_dirs["llama"]
    single = _run([sys.executable, "-m", "unimae.cli"], tiny, corpus_file, tmp_path / "one")
    double = _run(LAUNCHERS[launcher] + ["-m", "unimae.cli"], tiny, corpus_file, tmp_path / "two")
    run_info = json.loads((tmp_path / "two" / "run.json").read_text())
    assert run_info["world_size"] == 2 and run_info["grad_accum_steps"] == 1
    for a, b in zip(single, double, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["tokens"] == b["tokens"]
    w1 = load_file(tmp_path / "one" / "adapter" / "adapter_model.safetensors")
    w2 = load_file(tmp_path / "two" / "adapter" / "adapter_model.safetensors")
    assert w1.keys() == w2.keys()
    for key in w1:
        assert (w1[key] - w2[key]).abs().max() < 1e-5, key
