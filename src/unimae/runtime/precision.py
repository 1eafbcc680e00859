"""Device and precision choice: bf16 autocast where the hardware runs it natively, 16-bit or int8 decode weights
where it does not.

Training and evaluation choose among :data:`PRECISIONS`; inference (:class:`~unimae.encoder.Encoder`,
``unimae embed / generate / serve``) among :data:`INFERENCE_PRECISIONS`, which adds four CPU values:

* ``bf16-decode`` / ``f16-decode``: embeddings in fp32 (the same numbers as ``fp32``); the one-token decode steps
  read each linear layer's weights as bf16 / fp16 copies (weight-only 16-bit; norms, attention and the residual
  stream stay fp32: :mod:`unimae.generation.fast_path`). A decode step of a small model is bound by reading its
  weights, so half of fp32's bytes is where CPUs without native bf16 (AVX2) gain; the prefill stays fp32, so
  the first new token is fp32's. ``f16-decode`` on x86 runs fbgemm's fp16 product (fp32 input and output, the
  fp16 weights widened in registers): no activation is rounded, fp16 keeps 3 more mantissa bits than bf16,
  and it multiplies several streams' rows at once far faster than ATen's 16-bit products do (``docs/results.md``,
  the AVX2 table); a weight beyond fp16's 65504 is an error naming ``bf16-decode``. Elsewhere (ARM) it runs
  ATen's fp16 product, which rounds the layer's input to fp16 (overflow past 65504, which some models'
  activations reach: Gemma's). ``bf16-decode`` runs ATen's bf16 product (input rounded to bf16, fp32
  accumulation, output widened; fp32's range).
* ``int8-decode``: embeddings in fp32 (the same numbers as ``fp32``); the one-token decode steps read each linear
  layer's weights as int8 with one fp32 scale per output row and quantize the layer's input to 8 bits per call
  (fbgemm's dynamic int8 linear, as llama.cpp's q8_0 quantizes activations too: :mod:`unimae.runtime.int8`,
  :mod:`unimae.generation.fast_path`). A decode step of a small model is bound by reading its weights (a quarter
  of fp32's bytes here), and several streams' rows multiply in int8; the prompt's prefill stays fp32, so the
  first new token is fp32's. Rows that share a step share the input's scale (a stream's tokens can depend on
  its neighbours').
* ``int8``: ``int8-decode``, and the embedding forwards through dynamically quantized linear layers too
  (``torch.ao.quantization.quantize_dynamic``: int8 weights per output row, int8 activations per call, fbgemm's int8
  products). This changes the embeddings a lot (every SmolLM2 dev task lower, by several points,
  ``docs/results.md``), so it is opt-in: ``auto`` never picks it. A separate flag was not worth it: the CLI's one
  ``--precision`` already names how the loaded model computes, and ``int8`` keeps the int8 weights in memory instead
  of fp32's (a quarter; the decode steps' stacked q/k/v and gate/up add their int8 size again).

What ``auto`` picks (:func:`resolve_inference_precision`): ``bf16`` where the device runs bf16 natively (CUDA with
bf16, CPUs with AVX-512 bf16 / AMX and oneDNN bf16); on other x86 CPUs (AVX2) ``f16-decode`` (fbgemm), on other
CPUs ``bf16-decode``; ``fp32`` on other devices. ``int8-decode`` is not picked: it rounds the activations too, a
larger change to the generated text than 16-bit weights (its cost is in ``docs/results.md``).
:func:`resolve_precision` (training, evaluation) keeps ``auto`` -> ``bf16`` or ``fp32``. Under
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2``
(:data:`unimae.runtime.cpu.AVX2_EMULATION`) a bigger CPU reports AVX2 and no oneDNN bf16, so ``auto`` picks there
what it picks on a real AVX2 CPU.

Devices (:func:`resolve_device`, every ``--device``): ``auto`` is the first CUDA GPU if PyTorch sees one, else the
CPU; ``cpu``, ``cuda`` and ``cuda:N`` name one, and a GPU that is not there is an error at once. On a GPU ``auto``
precision is ``bf16`` from compute capability 8 on and ``fp32`` below (emulated bf16 is not chosen); the int8
precisions run on x86 CPUs only (fbgemm).
"""

from __future__ import annotations

import contextlib
import re

import torch

PRECISIONS = ("auto", "bf16", "fp32")
HALF_DECODE_PRECISIONS = ("bf16-decode", "f16-decode")
INT8_PRECISIONS = ("int8-decode", "int8")
INFERENCE_PRECISIONS = (*PRECISIONS, *HALF_DECODE_PRECISIONS, *INT8_PRECISIONS)
DECODE_ONLY_PRECISIONS = (*HALF_DECODE_PRECISIONS, "int8-decode")  # embed exactly as fp32; only decode steps differ


DEVICE_HELP = "auto = the first CUDA GPU if there is one, else the CPU; or cpu, cuda, cuda:N."
_DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_device_name(name: str) -> str:
    """``name`` if it is a device unimae runs on (auto, cpu, cuda, cuda:N); else a ValueError naming it. Whether
    that GPU exists is checked when a model is placed (:func:`resolve_device`)."""
    if not isinstance(name, str) or not _DEVICE_NAME.fullmatch(name):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N (e.g. cuda:1), got {name!r}")
    return name


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """The device a model runs on: ``auto`` (or None) is :func:`default_device`; ``cpu``, ``cuda`` and ``cuda:N``
    must exist here, else a ValueError that says what there is."""
    if device is None or device == "auto":
        return default_device()
    chosen = torch.device(check_device_name(device) if isinstance(device, str) else device)
    if chosen.type == "cpu":
        return chosen
    if chosen.type != "cuda":
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {str(chosen)!r}")
    if not torch.cuda.is_available():
        build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ValueError(
            f"device {str(chosen)!r}: no CUDA device is available (torch {torch.__version__}, {build}); "
            "pass --device cpu, or auto to take a GPU when there is one"
        )
    count = torch.cuda.device_count()
    if chosen.index is not None and chosen.index >= count:
        raise ValueError(f"device {str(chosen)!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return chosen


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` runs bf16 natively: a CUDA GPU of compute capability 8 or more (Ampere on; not the
    emulation older GPUs offer), a CPU with AVX-512 bf16 or AMX and oneDNN's bf16."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return bool(
            torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    return False


def fbgemm_supported(device: torch.device) -> bool:
    """Whether this PyTorch build has fbgemm (the x86 / fbgemm quantized engine) on ``device``: its dynamic int8
    linear and its fp16-weight / fp32-activation product (a CPU; x86 builds, vectorized for AVX2 and AVX-512)."""
    engines = torch.backends.quantized.supported_engines
    ops = ("fbgemm_pack_gemm_matrix_fp16", "fbgemm_linear_fp16_weight_fp32_activation")  # deprecated in 2.13
    has_ops = all(hasattr(torch.ops.aten, op) for op in ops) and hasattr(torch.ops.quantized, "linear_dynamic")
    return device.type == "cpu" and ("x86" in engines or "fbgemm" in engines) and has_ops


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto' -> 'bf16' where supported natively, else 'fp32' (training and evaluation: :data:`PRECISIONS`)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        return "bf16" if bf16_supported(device) else "fp32"
    return precision


def resolve_inference_precision(precision: str, device: torch.device) -> str:
    """A precision of :data:`INFERENCE_PRECISIONS` -> what an :class:`~unimae.encoder.Encoder` runs: 'auto' ->
    'bf16' where the device runs it natively, else on a CPU 'f16-decode' with fbgemm (x86) or 'bf16-decode'
    without, else 'fp32' (see the module docstring). The 16-bit decode values run on CPUs only, the int8 ones on
    x86 CPUs (fbgemm)."""
    if precision not in INFERENCE_PRECISIONS:
        raise ValueError(f"precision must be one of {INFERENCE_PRECISIONS}, got {precision!r}")
    if precision == "auto":
        if bf16_supported(device):
            return "bf16"
        if device.type != "cpu":
            return "fp32"
        return "f16-decode" if fbgemm_supported(device) else "bf16-decode"
    if precision in HALF_DECODE_PRECISIONS and device.type != "cpu":
        raise ValueError(
            f"precision {precision!r} runs on CPUs (its decode weights are read by ATen's CPU products); this is "
            f"{device}: pass 'bf16' or 'fp32'"
        )
    if precision in INT8_PRECISIONS and not fbgemm_supported(device):
        raise ValueError(
            f"precision {precision!r} runs on CPUs with PyTorch's fbgemm (x86) quantized engine; this is {device} "
            f"on torch {torch.__version__}: pass 'bf16-decode' (CPU), 'fp32' or 'bf16'"
        )
    return precision


def weight_dtype(precision: str) -> torch.dtype:
    """Storage dtype of FROZEN weights: bf16 under bf16 autocast (saves the per-matmul weight cast
    and half the memory); trainable weights (LoRA, tiny decoder) always stay float32. The int8 precisions load
    fp32 weights and quantize them after (:func:`unimae.runtime.int8.quantize_linears`, the decoder's int8 copies)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def autocast(precision: str, device: torch.device):
    """Autocast context for a resolved precision (bf16 only); fp32, the 16-bit decode and the int8 precisions
    compute in fp32 (the decode-weight copies round inside their products only)."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
