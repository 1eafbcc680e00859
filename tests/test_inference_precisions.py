"""The CPU inference precisions beyond fp32/bf16 (unimae.runtime.precision, unimae.runtime.int8, the weight copies
of unimae.generation.fast_path) on tiny random models, on any CPU (the int8 ones and fbgemm's fp16 on x86).

``bf16-decode`` / ``f16-decode`` / ``int8-decode`` embed in fp32 and decode on bf16 / fp16 / int8 copies of the
weights (int8 also rounds each layer's input); ``int8`` also embeds through dynamically quantized linear layers.
They round, so
generation is compared to fp32 step by step on fp32's own tokens (teacher forcing): the logits stay close, and a
greedy token differs only where fp32's two best logits were nearly tied. Nothing here needs native bf16; nothing
here times anything.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import SENTENCES
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

from unimae.cli import build_parser
from unimae.encoder import Encoder
from unimae.generation import fast_path
from unimae.generation.decoding import decode_tokens, forced_logits
from unimae.generation.fast_path import _fbgemm_f16_copy, fbgemm_f16_product, half_product
from unimae.generation.sampling import GenerationParams
from unimae.runtime.cpu import AVX2_EMULATION
from unimae.runtime.int8 import int8_product, int8_weight, prepack, quantize_rows
from unimae.runtime.precision import (
    DECODE_ONLY_PRECISIONS,
    INFERENCE_PRECISIONS,
    INT8_PRECISIONS,
    PRECISIONS,
    bf16_supported,
    fbgemm_supported,
    resolve_inference_precision,
    resolve_precision,
)

CPU = torch.device("cpu")
PROMPTS = ["the cat sat on", SENTENCES[2] + " and the", "stock markets rose", "children played football"]
NEW = 16
AVX2 = AVX2_EMULATION
FBGEMM = fbgemm_supported(CPU)
NEEDS_FBGEMM = pytest.mark.skipif(not FBGEMM, reason="needs fbgemm (x86 CPUs): the int8 and fp16 products")
ROUNDED = [*DECODE_ONLY_PRECISIONS, "int8"]  # every precision whose decode steps read rounded weights
RUNNABLE = [p for p in ROUNDED if FBGEMM or p not in INT8_PRECISIONS]  # what this CPU runs


def _params(precisions: list[str]) -> list:
    """pytest params of ``precisions``, the int8 ones skipped without fbgemm."""
    return [pytest.param(p, marks=NEEDS_FBGEMM) if p in INT8_PRECISIONS else p for p in precisions]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def _encoder(path, precision: str, **kwargs) -> Encoder:
    return Encoder.from_pretrained(str(path), precision=precision, device="cpu", max_length=64, **kwargs)


def _forced_logits(encoder: Encoder, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits (len(tokens), V) of ``encoder``'s decoder at each position, fed ``tokens`` whatever it picks."""
    return forced_logits(encoder.model, encoder.precision, ids, tokens)


def _greedy(encoder: Encoder, ids: list[int], new: int = NEW) -> list[int]:
    return list(decode_tokens(encoder.model, ids, GenerationParams(max_new_tokens=new), set(), encoder.precision))


@NEEDS_FBGEMM
def test_int8_rows_round_within_half_a_step_and_the_kernel_computes_the_product():
    torch.manual_seed(0)
    weight, x = torch.randn(40, 24), torch.randn(3, 5, 24)  # (N, K), (..., K)
    q, scales = quantize_rows(weight)
    assert q.dtype == torch.int8 and scales.shape == (40,)
    assert ((q.float() * scales[:, None] - weight).abs() <= scales[:, None] / 2 + 1e-6).all()
    bias = torch.randn(40)
    y = int8_product(prepack(q, scales, bias), x)
    assert y.dtype == torch.float32 and y.shape == (3, 5, 40)
    # the input is rounded to 7 bits over the call's range: the error is bounded by half a step of that grid
    step = (x.max() - x.min()).clamp(min=0) / 127
    exact = x @ (q.float() * scales[:, None]).T + bias  # (3, 5, 40)
    bound = (step / 2) * (q.float() * scales[:, None]).abs().sum(dim=1) + 1e-4  # (40,)
    assert ((y - exact).abs() <= bound).all()
    assert not torch.equal(y, exact)  # it does round the input


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_16_bit_product_rounds_input_weight_and_output_only(dtype):
    torch.manual_seed(0)
    weight, bias, x = torch.randn(40, 24), torch.randn(40), torch.randn(3, 5, 24)  # (N, K), (N,), (..., K)
    y = half_product(weight.to(dtype), bias, x)
    assert y.dtype == torch.float32 and y.shape == (3, 5, 40)
    exact = (x.to(dtype).double() @ weight.to(dtype).double().T).to(dtype).float() + bias  # fp32 accumulation
    # one ulp of the 16-bit output: a CPU may sum in another order (AMX), which can flip its last rounding
    torch.testing.assert_close(y, exact, rtol=torch.finfo(dtype).eps, atol=1e-5)  # a 16-bit partial sum: many ulps
    assert not torch.equal(y, torch.nn.functional.linear(x, weight, bias))  # it does round


@NEEDS_FBGEMM
def test_the_fbgemm_fp16_product_rounds_the_weights_only_and_refuses_what_fp16_cannot_hold():
    torch.manual_seed(0)
    layers = (torch.nn.Linear(24, 40), torch.nn.Linear(24, 8))  # stacked by output rows, as q/k/v are
    x = torch.randn(3, 5, 24)  # (..., K)
    y = fbgemm_f16_product(*_fbgemm_f16_copy(layers), x)
    assert y.dtype == torch.float32 and y.shape == (3, 5, 48)
    weight, bias = torch.cat([m.weight for m in layers]).detach(), torch.cat([m.bias for m in layers]).detach()
    exact = x @ weight.half().float().T + bias  # fp16 weights, the fp32 input as it is
    torch.testing.assert_close(y, exact, rtol=0, atol=1e-5)
    assert not torch.equal(y, torch.nn.functional.linear(x, weight, bias))  # it does round the weights
    with torch.no_grad():
        layers[1].weight[0, 0] = 7e4
    with pytest.raises(ValueError, match="does not fit fp16.*pass --precision bf16-decode"):
        _fbgemm_f16_copy(layers)


@NEEDS_FBGEMM
def test_a_dynamically_quantized_layer_lends_its_own_int8_weights():
    from unimae.runtime.int8 import quantize_linears

    torch.manual_seed(0)
    model = quantize_linears(torch.nn.Sequential(torch.nn.Linear(24, 40)))
    assert type(model[0]) is DynamicQuantizedLinear
    q, scales, bias = int8_weight(model[0])
    assert q.dtype == torch.int8 and q.shape == (40, 24) and scales.shape == (40,) and bias.shape == (40,)
    x = torch.randn(2, 24)
    torch.testing.assert_close(int8_product(prepack(q, scales, bias), x), model[0](x), rtol=0, atol=0)


def test_auto_picks_a_16_bit_decode_only_where_bf16_is_not_native_and_training_keeps_fp32():
    expected = "f16-decode" if fbgemm_supported(CPU) else "bf16-decode"
    assert resolve_inference_precision("auto", CPU) == ("bf16" if bf16_supported(CPU) else expected)
    assert resolve_precision("auto", CPU) in ("bf16", "fp32")  # training and evaluation never pick these
    for precision in ("bf16", "fp32", *RUNNABLE):
        assert resolve_inference_precision(precision, CPU) == precision
    for precision in ROUNDED:
        with pytest.raises(ValueError, match="precision must be one of"):
            resolve_precision(precision, CPU)  # training and evaluation take PRECISIONS only
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve_inference_precision("int4", CPU)
    for precision in ROUNDED:
        with pytest.raises(ValueError, match="runs on CPUs"):
            resolve_inference_precision(precision, torch.device("meta"))


def test_generate_embed_serve_and_evaluate_embeddings_take_the_inference_precisions():
    parser = build_parser()
    for argv in (["generate", "hi"], ["embed", "hi"], ["serve"], ["evaluate", "embeddings"]):
        for precision in INFERENCE_PRECISIONS:
            assert parser.parse_args([*argv, "--precision", precision]).precision == precision
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--precision", "int8"])  # training keeps PRECISIONS
    assert "int8" not in PRECISIONS


@NEEDS_FBGEMM
def test_auto_under_avx2_emulation_chooses_what_an_avx2_cpu_gets_and_its_kernels_run(tiny_model_dirs):
    """Under AVX2_EMULATION (ATen, oneDNN and fbgemm kept to AVX2; a subprocess): PyTorch reports AVX2 and no oneDNN
    bf16, ``auto`` resolves to f16-decode (fbgemm on x86), and it and the int8 precision load, embed and generate
    (their AVX2 kernels run)."""
    script = f"""
import json, torch
from unimae.encoder import Encoder
from unimae.generation import fast_path
from unimae.runtime.precision import bf16_supported, resolve_inference_precision
cpu = torch.device("cpu")
facts = {{"capability": torch.backends.cpu.get_cpu_capability(), "bf16": bf16_supported(cpu),
    "resolves": resolve_inference_precision("auto", cpu)}}
for precision in ("auto", "int8"):
    enc = Encoder.from_pretrained({str(tiny_model_dirs["llama"])!r}, precision=precision, device="cpu", max_length=32)
    facts[precision] = {{"resolved": enc.precision, "dim": int(enc.encode("the cat").shape[0]),
        "text": enc.generate("the cat", max_new_tokens=4), "head_copy": enc.model.lm_head in fast_path._PACKED}}
print(json.dumps(facts))
"""
    env = {**os.environ, **AVX2, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["capability"] == "AVX2" and facts["bf16"] is False and facts["resolves"] == "f16-decode"
    assert facts["auto"]["resolved"] == "f16-decode" and facts["int8"]["resolved"] == "int8"
    for precision in ("auto", "int8"):
        assert facts[precision]["dim"] == 64 and facts[precision]["head_copy"], facts[precision]


@pytest.mark.parametrize("precision", _params(ROUNDED))
def test_rounded_precisions_embed_like_fp32(tiny_dir, precision):
    """The decode-only precisions embed in fp32 (identical vectors); int8's dynamically quantized layers stay within
    cosine 0.99."""
    reference = _encoder(tiny_dir, "fp32").encode(SENTENCES)
    encoder = _encoder(tiny_dir, precision)
    vectors = encoder.encode(SENTENCES)
    if precision in DECODE_ONLY_PRECISIONS:
        assert encoder.embedding_precision == "fp32"
        np.testing.assert_array_equal(vectors, reference)
        assert not any(type(m) is DynamicQuantizedLinear for m in encoder.model.modules())
    else:
        assert _cosines(vectors, reference).min() >= 0.99
        assert type(encoder.model.get_output_embeddings()) is DynamicQuantizedLinear


@pytest.mark.parametrize("precision", _params(ROUNDED))
def test_rounded_decode_follows_fp32_up_to_near_ties(tiny_dir, precision):
    """On fp32's own greedy tokens, every rounded step's logits are within cosine 0.99 of fp32's, and where its
    argmax differs, fp32's two best logits were closer than twice the step's largest logit error. The decode-only
    precisions prefill in fp32, so their first token is fp32's. The first free-running divergence is recorded
    (random tiny models have flat logits, so it can come early)."""
    reference, encoder = _encoder(tiny_dir, "fp32"), _encoder(tiny_dir, precision)
    divergences = {}
    for prompt in PROMPTS:
        ids = reference.prompt_ids(prompt)
        tokens = _greedy(reference, ids)
        exact = _forced_logits(reference, ids, tokens)  # (N, V)
        rounded = _forced_logits(encoder, ids, tokens)
        assert torch.equal(exact.argmax(-1), torch.tensor(tokens))
        assert not torch.equal(rounded[1:], exact[1:]), "the decode steps should read rounded weights"
        assert torch.nn.functional.cosine_similarity(rounded, exact, dim=-1).min() >= 0.99
        error = (rounded - exact).abs().max(-1).values  # (N,)
        top2 = exact.topk(2, dim=-1).values
        flipped = rounded.argmax(-1) != exact.argmax(-1)
        assert ((top2[:, 0] - top2[:, 1])[flipped] <= 2 * error[flipped]).all()
        if precision in DECODE_ONLY_PRECISIONS:
            assert not flipped[0]
        free = _greedy(encoder, ids)
        divergences[prompt] = next((i for i, (a, b) in enumerate(zip(tokens, free, strict=True)) if a != b), None)
    print(f"first divergence from fp32 ({precision}, {NEW} new tokens):", divergences)


@pytest.mark.parametrize("precision", _params(DECODE_ONLY_PRECISIONS))
def test_decode_copies_are_made_for_the_base_weights_only_and_warm_up_makes_them(tiny_model_dirs, precision):
    from peft import LoraConfig, get_peft_model

    from unimae.generation.decoding import warm_up
    from unimae.models import load_model

    model, _, _ = load_model(str(tiny_model_dirs["llama"]))
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).eval()
    warm_up(model, "fp32")
    assert model.get_output_embeddings() not in fast_path._PACKED
    warm_up(model, precision)
    proj = model.base_model.model.model.layers[0].mlp.down_proj
    assert proj.base_layer in fast_path._PACKED and getattr(proj.base_layer, "_unimae_weight_only", False)
    lora = (*proj.lora_A.values(), *proj.lora_B.values())
    assert not any(getattr(m, "_unimae_weight_only", False) for m in lora)
    kinds = {key[0] for entry in fast_path._PACKED.values() for key in entry}
    assert fast_path.decode_weights(precision, CPU) in kinds


def _adapter(tiny_dir, path) -> str:
    from peft import LoraConfig, get_peft_model

    from unimae.models import load_model

    model, _, _ = load_model(str(tiny_dir))
    torch.manual_seed(1)
    get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("merge", [None, False], ids=["merged", "unmerged"])
@pytest.mark.parametrize("precision", _params(["bf16-decode", "f16-decode", "int8-decode", "int8"]))
def test_the_adapter_moves_rounded_outputs_as_it_moves_fp32(tiny_dir, tmp_path, precision, merge):
    """What the adapter changes (adapter minus base) in the embeddings and in the decode steps' logits points the
    same way in int8 as in fp32 (cosine >= 0.9); unmerged, its own layers stay fp32 beside the int8 base."""
    adapter = _adapter(tiny_dir, tmp_path / "adapter")
    fp32 = {a: _encoder(tiny_dir, "fp32", adapter=a) for a in (None, adapter)}
    int8 = {a: _encoder(tiny_dir, precision, adapter=a, merge=merge) for a in (None, adapter)}
    change = {
        name: encs[adapter].encode(SENTENCES) - encs[None].encode(SENTENCES)
        for name, encs in (("fp32", fp32), ("int8", int8))
    }
    assert _cosines(change["int8"], change["fp32"]).min() >= 0.9
    ids = fp32[None].prompt_ids(PROMPTS[0])
    tokens = _greedy(fp32[adapter], ids)
    moved = {
        name: _forced_logits(encs[adapter], ids, tokens) - _forced_logits(encs[None], ids, tokens)
        for name, encs in (("fp32", fp32), ("int8", int8))
    }
    assert torch.nn.functional.cosine_similarity(moved["int8"], moved["fp32"], dim=-1).min() >= 0.9
    if merge is False:
        model = int8[adapter].model
        lora = [m for n, m in model.named_modules() if n.endswith("lora_A.default") or n.endswith("lora_B.default")]
        assert lora and all(type(m) is torch.nn.Linear and not getattr(m, "_unimae_weight_only", False) for m in lora)
        with int8[adapter].adapter_disabled():
            np.testing.assert_allclose(int8[adapter].encode(SENTENCES[:3]), int8[None].encode(SENTENCES[:3]), atol=1e-5)


def test_emulate_avx2_runs_the_program_again_and_cpu_facts_record_it(tmp_path):
    """What the benchmarks' ``--emulate-avx2`` does: the program starts again under the two variables, and
    :func:`cpu_facts` records the emulation, PyTorch's AVX2 kernels and what ``auto`` picks there."""
    script = tmp_path / "facts.py"
    script.write_text(
        "import json\nfrom unimae.runtime.cpu import cpu_facts, emulate_avx2\n"
        "emulate_avx2()\nprint(json.dumps(cpu_facts()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in AVX2}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["avx2_emulated"] and facts["emulation"] == AVX2
    assert facts["torch_cpu_capability"] == "AVX2" and facts["auto_precision"] == "f16-decode"
    assert facts["fbgemm"] and not facts["bf16_native"]
