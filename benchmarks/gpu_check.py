"""Every path a GPU user takes, run on a device: training, embedding, generation and the server, on tiny models.

Users train and serve on CUDA GPUs; this script runs what they run there, on tiny random Llama, Gemma 3 and Qwen2
models (:mod:`unimae.tiny_models`: 2 layers, 64 dimensions, a BPE tokenizer trained in-process on a dozen
sentences), so it needs no download and no internet: from the repository root after ``pip install -e .``
(``pip install -e '.[serve]'`` adds the server check; without FastAPI it is reported as skipped)::

    python benchmarks/gpu_check.py                                   # the GPU (--device auto), results/gpu-check.json
    python benchmarks/gpu_check.py --device cpu --output /tmp/gpu-check-cpu.json    # the same on the CPU

Per model:

* ``train/<method>``: ``--steps`` optimizer steps of every registered method
(:data:`unimae.training.methods.METHOD_REGISTRY`)
  through the real trainer (``unimae.training.trainer.train``, LoRA, ``--device``), in bf16 (fp32 on a GPU without
  native bf16); contrastive with its gradient cache, GEM past its switch to the contrastive phase. Passes when
  every logged loss and gradient norm is finite and the adapter loads and embeds finite vectors on the device.
* ``embed/<precision>``: each text embedded alone against all in one batch, right- and left-padded (eos pooling;
  one text is empty). Passes when the lowest cosine is at least :data:`MIN_COSINE` of the precision; on a GPU the
  fp32 vectors are also compared with the CPU's (``cpu_min_cosine``, same bound).
* ``generate/<precision>``: greedy tokens of unimae's decoder (:func:`unimae.generation.decoding.decode_tokens`)
  against transformers' ``generate`` on the same device, with and without an unmerged LoRA adapter, two prompts
  of :data:`NEW_TOKENS` new tokens each. Passes when they are identical. In bf16 both attend the one new query in
  fp32, as unimae's decode step does (``unimae.tiny_models.one_query_attention_in_fp32``); the prefill runs
  the model's own attention.
* ``serve``: the server's two jobs through FastAPI's TestClient: ``/v1/embeddings`` (vectors equal to
  ``Encoder.encode(normalize=True)``'s, cosine at least :data:`MIN_COSINE`) and greedy ``/v1/completions`` (text
  equal to ``Encoder.generate``'s).

The JSON (``--output``) holds the device and its name, the versions (torch, CUDA, transformers, peft, accelerate),
the precision trained in, and per check: passed, seconds, its numbers, or the error. The exit status is 1 when a
check failed. On a 2-core CPU (``--device cpu``) the whole run takes about 30 s of CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import platform
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

# isort: off
import unimae  # noqa: F401  (first: sets the OpenMP wait policy before torch loads, see unimae.runtime.threads)
import torch

# isort: on
import numpy as np
import transformers

from unimae.encoder import Encoder
from unimae.generation.decoding import decode_tokens, eos_token_ids
from unimae.generation.sampling import GenerationParams
from unimae.models import load_model
from unimae.runtime.memory import cpu_model
from unimae.runtime.precision import DEVICE_HELP, autocast, bf16_supported, resolve_device, weight_dtype
from unimae.tiny_models import ARCHITECTURES, SENTENCES, one_query_attention_in_fp32, save_tiny_model
from unimae.training.config import TrainConfig
from unimae.training.methods import METHOD_REGISTRY
from unimae.training.trainer import train

EMBED_TEXTS = [*SENTENCES[:7], "", "short", "the"]
PROMPTS = ["the cat sat on", SENTENCES[2] + " and the"]
NEW_TOKENS = 24  # more than Gemma 3's sliding window (8): its sliding layers wrap around
MIN_COSINE = {"fp32": 0.9999, "bf16": 0.999}  # batched against one by one (tests/test_encoder.py: 0.9999 in fp32)
# What each method needs beyond the defaults to run its whole objective in a few steps; a method added to the
# registry later runs with the defaults on the text corpus.
METHOD_OPTIONS = {
    "unimae": {"p_mar": 0.5},  # MAR masking on (the CPU recipe's default 0 leaves it out)
    "contrastive": {"data": "pairs", "grad_cache_chunk": 2},
    "gem": {"gem_switch_step": 1},  # step 0 next-token prediction, then contrastive
}


def device_facts(device: torch.device) -> dict:
    """What ran the checks: the device, its name, native bf16, the versions of the libraries on the path."""
    import accelerate
    import peft

    facts = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "bf16_native": bf16_supported(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "accelerate": accelerate.__version__,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(
            compute_capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            cudnn=torch.backends.cudnn.version(),
        )
    else:
        facts["torch_threads"] = torch.get_num_threads()
    return facts


def run_check(name: str, check: Callable[[], dict]) -> dict:
    """``check()`` -> its record: ``passed`` and numbers from the check, ``seconds``, or the error that stopped it."""
    start = time.perf_counter()
    try:
        record = check()
    except Exception as err:  # a check that crashes is a failed check; the others still run
        record = {"passed": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(-3)}
    record = {"name": name, **record, "seconds": round(time.perf_counter() - start, 2)}
    status = "skip" if record.get("skipped") else "PASS" if record["passed"] else "FAIL"
    detail = record.get("error") or record.get("skipped") or record.get("summary", "")
    print(f"{status:4s} {name:28s} {record['seconds']:6.1f} s  {detail}", flush=True)
    return record


def _finite(values) -> bool:
    return all(math.isfinite(v) for v in values)


def check_training(
    model_dir: Path, method: str, data: dict[str, Path], work: Path, device: str, precision: str, steps: int
) -> dict:
    """A few optimizer steps of ``method`` on ``device``; the adapter then embeds there."""
    options = dict(METHOD_OPTIONS.get(method, {}))
    source = data[options.pop("data", "text")]
    out = work / "runs" / f"{model_dir.name}-{method}"
    config = TrainConfig.from_dict(dict(  # flag-named values: the method's own options are nested by from_dict
        model=str(model_dir), data=str(source), output_dir=str(out), method=method, steps=steps, batch_size=4,
        micro_batch_size=4, max_length=24, save_every=0, precision=precision, lora_r=8, lora_alpha=16, lr=5e-3,
        seed=0, device=device, **options,
    ))  # fmt: skip
    placed = resolve_device(device)
    if placed.type == "cuda":
        torch.cuda.reset_peak_memory_stats(placed)
    result = train(config)
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    losses, norms = [r["loss"] for r in log], [r["grad_norm"] for r in log]
    run = json.loads((out / "run.json").read_text())
    encoder = Encoder.from_pretrained(
        str(model_dir), adapter=str(result.adapter_dir), precision=precision, device=device
    )
    vectors = encoder.encode(SENTENCES[:3])
    record = {
        "passed": len(log) == steps and _finite(losses) and _finite(norms) and bool(np.isfinite(vectors).all()),
        "summary": f"loss {losses[0]:.3f} -> {losses[-1]:.3f}",
        "precision": run["resolved_precision"],
        "losses": [round(v, 5) for v in losses],
        "grad_norms": [round(v, 5) for v in norms],
        "tokens_per_s": [r["tokens_per_s"] for r in log],
        "embedding_device": str(encoder.device),
    }
    if placed.type == "cuda":
        record["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated(placed) / 2**20, 1)  # training and embedding
    return record


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=-1, keepdims=True), 1e-12)
    return (a * b).sum(-1)


def _embed(model_dir: Path, precision: str, device: str, padding_side: str = "right", batch_size: int = 1):
    model, tokenizer, _ = load_model(str(model_dir), dtype=weight_dtype(precision))
    encoder = Encoder(model, tokenizer, pooling="eos", precision=precision, device=device, padding_side=padding_side)
    return encoder.encode(EMBED_TEXTS, batch_size=batch_size, show_progress=False)


def check_embedding(model_dir: Path, precision: str, device: str) -> dict:
    """Texts embedded one by one against in one batch, both padding sides; fp32 on a GPU also against the CPU."""
    alone = _embed(model_dir, precision, device)  # (N, D): no padding at all
    record: dict = {"texts": len(EMBED_TEXTS)}
    lowest = 1.0
    for side in ("right", "left"):
        batched = _embed(model_dir, precision, device, side, batch_size=len(EMBED_TEXTS))
        cosine = float(_cosines(batched, alone).min())
        record[f"{side}_padded_min_cosine"] = round(cosine, 7)
        record[f"{side}_padded_max_abs_diff"] = float(np.abs(batched - alone).max())
        lowest = min(lowest, cosine)
    if precision == "fp32" and resolve_device(device).type != "cpu":
        cosine = float(_cosines(alone, _embed(model_dir, precision, "cpu")).min())
        record["cpu_min_cosine"] = round(cosine, 7)
        lowest = min(lowest, cosine)
    record["passed"] = bool(np.isfinite(alone).all()) and lowest >= MIN_COSINE[precision]
    record["summary"] = f"min cosine {lowest:.6f} (>= {MIN_COSINE[precision]})"
    return record


def _generate_reference(model, tokenizer, ids: list[int], precision: str, device: torch.device) -> list[int]:
    """Greedy ids from transformers' ``generate``."""
    x = torch.tensor([ids], device=device)
    with torch.inference_mode(), autocast(precision, device):
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def _with_lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)  # a non-zero update
    return get_peft_model(model, config).eval()


def check_generation(model_dir: Path, precision: str, device: str) -> dict:
    """unimae's greedy tokens against ``generate``'s on ``device``, base and with an unmerged LoRA adapter."""
    placed = resolve_device(device)
    record: dict = {"new_tokens": NEW_TOKENS, "cases": []}
    attention = one_query_attention_in_fp32() if precision == "bf16" else contextlib.nullcontext()
    with attention:
        for lora in (False, True):
            model, tokenizer, _ = load_model(str(model_dir), dtype=weight_dtype(precision))
            model = (_with_lora(model) if lora else model).to(placed).eval()
            eos = eos_token_ids(model, tokenizer)
            for prompt in PROMPTS:
                ids = tokenizer(prompt)["input_ids"]
                expected = _generate_reference(model, tokenizer, ids, precision, placed)
                params = GenerationParams(max_new_tokens=NEW_TOKENS)
                ours = list(decode_tokens(model, ids, params, eos, precision))
                differs = [i for i, (a, b) in enumerate(zip(ours, expected, strict=False)) if a != b]
                same = ours == expected
                record["cases"].append(
                    {
                        "lora": lora,
                        "prompt": prompt,
                        "identical": same,
                        "tokens": len(ours),
                        "first_difference": None
                        if same
                        else (differs[0] if differs else min(len(ours), len(expected))),
                    }
                )
    same = sum(case["identical"] for case in record["cases"])
    record["passed"] = same == len(record["cases"])
    record["summary"] = f"{same}/{len(record['cases'])} generations token-identical to generate"
    return record


def check_server(model_dir: Path, precision: str, device: str) -> dict:
    """POST /v1/embeddings and a greedy /v1/completions to the app over an Encoder on ``device``."""
    try:
        from fastapi.testclient import TestClient

        from unimae.serving.app import create_app
        from unimae.serving.config import ServerConfig
    except ImportError as err:
        return {"passed": True, "skipped": f"the server needs pip install -e '.[serve]' ({err})"}
    encoder = Encoder.from_pretrained(str(model_dir), precision=precision, device=device, max_length=64)
    texts, prompt = SENTENCES[:5], PROMPTS[0]
    with TestClient(create_app(encoder, ServerConfig(model_name="tiny"))) as client:
        embedded = client.post("/v1/embeddings", json={"input": texts, "model": "tiny"})
        completed = client.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "model": "tiny"}
        )
    if embedded.status_code != 200 or completed.status_code != 200:
        return {
            "passed": False,
            "error": f"HTTP {embedded.status_code} / {completed.status_code}: {embedded.text[:200]}",
        }
    served = np.array([row["embedding"] for row in embedded.json()["data"]], dtype=np.float32)
    cosine = float(_cosines(served, encoder.encode(texts, normalize=True)).min())
    text, expected = completed.json()["choices"][0]["text"], encoder.generate(prompt, max_new_tokens=8)
    return {
        "passed": cosine >= MIN_COSINE[precision] and text == expected,
        "summary": f"embeddings min cosine {cosine:.6f}, completion {'equal' if text == expected else 'DIFFERENT'}",
        "precision": encoder.precision,
        "embeddings_min_cosine": round(cosine, 7),
        "completion": text,
        "completion_expected": expected,
    }


def write_data(work: Path) -> dict[str, Path]:
    """The training data: a text corpus and (query, positive, negative) pairs for ``contrastive``."""
    text, pairs = work / "corpus.txt", work / "pairs.jsonl"
    text.write_text("\n".join(SENTENCES) + "\n")
    rows = [{"query": SENTENCES[i], "positive": SENTENCES[i + 4], "negative": SENTENCES[i + 8]} for i in range(4)]
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"text": text, "pairs": pairs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument("--output", default="results/gpu-check.json", help="Where the JSON is written.")
    parser.add_argument("--steps", type=int, default=3, help="Optimizer steps per training check.")
    parser.add_argument("--archs", nargs="+", default=list(ARCHITECTURES), choices=ARCHITECTURES)
    parser.add_argument("--methods", nargs="+", default=sorted(METHOD_REGISTRY), choices=sorted(METHOD_REGISTRY))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    transformers.utils.logging.disable_progress_bar()  # a bar per model load; the trainer's bars stay
    placed = resolve_device(args.device)
    device = str(placed)
    precision = "bf16" if placed.type == "cpu" or bf16_supported(placed) else "fp32"  # CPUs run bf16 autocast anyway
    facts = device_facts(placed)
    print(f"gpu_check on {device} ({facts['device_name']}), torch {facts['torch']}, training in {precision}")
    checks, start = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="unimae-gpu-check-") as tmp:
        work = Path(tmp)
        data = write_data(work)
        for arch in args.archs:
            model_dir = save_tiny_model(arch, work / f"tiny-{arch}")
            planned = [
                (
                    f"train/{method}",
                    partial(check_training, model_dir, method, data, work, device, precision, args.steps),
                )
                for method in args.methods
            ]
            for kind in dict.fromkeys(("fp32", precision)):  # fp32, and bf16 where it trains in bf16
                planned.append((f"embed/{kind}", partial(check_embedding, model_dir, kind, device)))
                planned.append((f"generate/{kind}", partial(check_generation, model_dir, kind, device)))
            planned.append(("serve", partial(check_server, model_dir, precision, device)))
            checks += [{"arch": arch, **run_check(f"{arch} {name}", check)} for name, check in planned]
    failed = [c["name"] for c in checks if not c["passed"]]
    report = {
        **facts,
        "precision": precision,
        "steps": args.steps,
        "seconds": round(time.perf_counter() - start, 1),
        "passed": len(checks) - len(failed),
        "failed": len(failed),
        "skipped": sum(1 for c in checks if c.get("skipped")),
        "checks": checks,
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    skipped = f" ({report['skipped']} skipped)" if report["skipped"] else ""
    print(f"\n{report['passed']}/{len(checks)} checks passed{skipped} on {device} in {report['seconds']} s")
    print(f"wrote {output}")
    for name in failed:
        print(f"failed: {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
