"""On a CUDA GPU (marked ``cuda``; skipped with "no CUDA device" elsewhere): training steps, embeddings and greedy
generation run there, embeddings as on the CPU and batch-invariant, greedy tokens as transformers' ``generate``;
the server's two jobs. benchmarks/gpu_check.py runs the same on every method and model (docs/deploy.md)."""

import json
import math

import numpy as np
import pytest
import torch
from conftest import SENTENCES, read_log, tiny_train_config

from unimae.encoder import Encoder
from unimae.generation.decoding import decode_tokens, eos_token_ids
from unimae.generation.sampling import GenerationParams
from unimae.models import load_model
from unimae.runtime.precision import bf16_supported
from unimae.training.trainer import train

pytestmark = pytest.mark.cuda

TEXTS = [*SENTENCES[:7], "", "short", "the"]
NEW = 24  # more than gemma3's sliding window (8)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=-1, keepdims=True), 1e-12)
    return (a * b).sum(-1)


def _bf16_or_fp32() -> str:
    return "bf16" if bf16_supported(torch.device("cuda")) else "fp32"


@pytest.mark.parametrize("method", ["unimae", "simcse"])
def test_training_steps_run_on_the_gpu(tiny_dir, corpus_file, tmp_path, method):
    precision = _bf16_or_fp32()
    torch.cuda.reset_peak_memory_stats()
    out = tmp_path / "run"
    result = train(
        tiny_train_config(tiny_dir, corpus_file, out, method=method, steps=3, precision=precision, device="cuda")
    )
    log = read_log(out)
    assert len(log) == 3 and all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in log)
    assert json.loads((out / "run.json").read_text())["resolved_precision"] == precision
    assert torch.cuda.max_memory_allocated() > 0  # the steps ran on the GPU
    encoder = Encoder.from_pretrained(str(tiny_dir), adapter=str(result.adapter_dir), precision="fp32", device="cuda")
    assert encoder.device.type == "cuda" and np.isfinite(encoder.encode(SENTENCES[:3])).all()


def test_embeddings_on_the_gpu_are_batch_invariant_and_the_cpu_s(tiny_dir):
    model, tokenizer, _ = load_model(str(tiny_dir))
    on_cpu = Encoder(model, tokenizer, precision="fp32", device="cpu").encode(TEXTS, batch_size=1)
    model, tokenizer, _ = load_model(str(tiny_dir))
    encoder = Encoder(model, tokenizer, precision="fp32", device="cuda")
    alone = encoder.encode(TEXTS, batch_size=1)
    assert next(encoder.model.parameters()).device.type == "cuda"
    assert _cos(alone, on_cpu).min() >= 0.9999
    for side in ("right", "left"):
        encoder.padding_side = side
        assert _cos(encoder.encode(TEXTS, batch_size=len(TEXTS)), alone).min() >= 0.9999, side


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_greedy_on_the_gpu_is_token_identical_to_generate(tiny_dir, lora):
    model, tokenizer, _ = load_model(str(tiny_dir))
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    model = model.to("cuda").eval()
    for prompt in ("the cat sat on", SENTENCES[2] + " and the"):
        ids = tokenizer(prompt)["input_ids"]
        x = torch.tensor([ids], device="cuda")
        with torch.inference_mode():
            expected = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(ids) :].tolist()  # fmt: skip
        eos = eos_token_ids(model, tokenizer)
        assert list(decode_tokens(model, ids, GenerationParams(max_new_tokens=NEW), eos, "fp32")) == expected, prompt


def test_cuda_index_places_the_model_on_that_gpu(tiny_model_dirs):
    last = torch.cuda.device_count() - 1
    encoder = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), precision="fp32", device=f"cuda:{last}")
    assert next(encoder.model.parameters()).device == torch.device("cuda", last)
    assert encoder.encode("the cat").shape == (encoder.embedding_dim,)


def test_the_server_s_two_jobs_on_the_gpu(tiny_model_dirs):
    pytest.importorskip("fastapi", reason="the server needs pip install 'unimae[serve]'")
    from fastapi.testclient import TestClient

    from unimae.serving.app import create_app
    from unimae.serving.config import ServerConfig

    encoder = Encoder.from_pretrained(str(tiny_model_dirs["llama"]), precision="fp32", device="cuda", max_length=64)
    with TestClient(create_app(encoder, ServerConfig(model_name="tiny"))) as client:
        embedded = client.post("/v1/embeddings", json={"input": SENTENCES[:4]})
        completed = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 6, "temperature": 0})
    assert embedded.status_code == 200 and completed.status_code == 200, (embedded.text, completed.text)
    served = np.array([row["embedding"] for row in embedded.json()["data"]])
    assert _cos(served, encoder.encode(SENTENCES[:4])).min() >= 0.9999
    assert completed.json()["choices"][0]["text"] == encoder.generate("the cat", max_new_tokens=6)
