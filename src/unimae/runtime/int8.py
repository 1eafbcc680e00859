"""int8 weights for the CPU: symmetric per-row quantization, and dynamically quantized linear layers.

A weight ``W`` (N, K) is stored as ``q = round(W / s)`` in int8 with one fp32 scale per output row,
``s_n = max_k |W_nk| / 127``, so ``W ~= s[:, None] * q`` (error at most ``s_n / 2`` per entry).

* The decode steps (:mod:`unimae.generation.fast_path`): :func:`int8_weight` gives ``(q, s, bias)`` of a plain
  ``nn.Linear`` (quantized here) or of a dynamically quantized one (its own int8 weights); the step stacks q/k/v
  and gate/up, packs them for fbgemm once (:func:`prepack`) and computes :func:`int8_product`: the input is
  quantized to 8 bits per call and multiplied in int8 (fbgemm's dynamic linear). A memory-bound step reads a
  quarter of fp32's bytes, and the int8 products are also cheaper than fp32 ones when several rows (streams)
  share a step. ATen's weight-only kernel (``aten._weight_int8pack_mm``: fp32 activations, int8 weights widened
  in registers) was tried first and was slower than fp32 for one row on the CPUs measured (``docs/results.md``).
* Dynamic quantization (the embedding forwards of ``precision='int8'``): :func:`quantize_linears` replaces the
  linear layers by ``torch.ao.nn.quantized.dynamic.Linear`` (the same per-row int8 weights and products), where a
  compute-bound forward gains.

Activations get one scale per call (the whole (rows, K) input), not one per row: a decode step that stacks
several streams' rows (in-flight batching) quantizes them together, so a stream's tokens can depend on which
other streams share its steps. llama.cpp's q8_0 quantizes activations per 32 values; fbgemm's dynamic linear
offers per-tensor scales only.

A LoRA adapter stays exact: merged in fp32 into the weights before they are quantized, or, unmerged, its
``lora_A`` / ``lora_B`` layers are never quantized (:func:`is_lora_layer`) and run in fp32 beside the int8 base.
Both give the LoRA's update the same rounding noise the base weights get (the adapter was trained against
neither).
"""

from __future__ import annotations

import warnings

import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

LORA_LAYERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (N, K) -> (int8 (N, K), fp32 scales (N,)), symmetric per output row (module docstring)."""
    weight = weight.detach().float()
    scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127  # (N,)
    q = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
    return q.contiguous(), scales.contiguous()


def int8_weight(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(int8 weight (N, K), fp32 scales (N,), fp32 bias (N,) or None) of a plain ``nn.Linear`` (quantized now) or of
    a dynamically quantized linear layer (its per-row symmetric int8 weights as they are)."""
    if type(module) is DynamicQuantizedLinear:
        weight, bias = module.weight(), module.bias()
        per_row = weight.qscheme() in (torch.per_channel_symmetric, torch.per_channel_affine)
        if not per_row or bool(weight.q_per_channel_zero_points().any()):
            raise ValueError(
                f"{module} holds {weight.qscheme()} weights, not symmetric per-row ones; use quantize_linears"
            )
        q = weight.int_repr().contiguous()  # (N, K)
        return q, weight.q_per_channel_scales().float().contiguous(), None if bias is None else bias.float()
    if type(module) is not torch.nn.Linear:
        raise TypeError(f"int8 weights are made for nn.Linear layers, not {type(module).__name__}")
    q, scales = quantize_rows(module.weight)
    return q, scales, None if module.bias is None else module.bias.detach().float()


def prepack(weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.ScriptObject:
    """fbgemm's packed form of an int8 ``weight`` (N, K) with fp32 per-row ``scales`` (N,) and fp32 ``bias`` (N,) or
    None, for :func:`int8_product` (made once per layer; the x86 / fbgemm quantized engine)."""
    zeros = torch.zeros(len(scales), dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors' deprecation notice: fbgemm's kernels are what we want
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch._make_per_channel_quantized_tensor(weight, scales.double(), zeros, 0)  # (N, K) qint8
        return torch.ops.quantized.linear_prepack(qweight, bias)


def int8_product(packed: torch.ScriptObject, x: torch.Tensor) -> torch.Tensor:
    """``x (..., K) @ W.T + bias`` -> (..., N) in fp32 with int8 products (fbgemm's dynamic linear, what a
    ``torch.ao.nn.quantized.dynamic.Linear`` runs): ``x`` is quantized per call to uint8 with one scale and zero
    point over the whole call (range reduced to 7 bits, as PyTorch's dynamic linear does against AVX2's
    saturating int8 multiply), the weights are ``packed`` per-row int8 (:func:`prepack`), products accumulate in
    int32 and are rescaled to fp32. One scale per call means the rows of a several-row call share it: a row's
    numbers then depend on the other rows (module docstring)."""
    return torch.ops.quantized.linear_dynamic(x.float().contiguous(), packed, True)


def is_lora_layer(name: str) -> bool:
    """Whether the module named ``name`` (``model.named_modules()``) belongs to a LoRA adapter's own weights."""
    return any(part in LORA_LAYERS for part in name.split("."))


def quantizable_linears(model: torch.nn.Module) -> list[str]:
    """Names of the plain ``nn.Linear`` layers of ``model`` that are not a LoRA adapter's own (see module docstring)."""
    return [n for n, m in model.named_modules() if type(m) is torch.nn.Linear and not is_lora_layer(n)]


def quantize_linears(model: torch.nn.Module) -> torch.nn.Module:
    """Replace ``model``'s quantizable linear layers (:func:`quantizable_linears`) in place by dynamically
    quantized ones with per-row symmetric int8 weights; returns ``model`` (CPU, fbgemm / x86 engine)."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    spec = dict.fromkeys(quantizable_linears(model), per_channel_dynamic_qconfig)
    with warnings.catch_warnings():  # torch.ao.quantization's deprecation notices: the kernels are what we want
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return quantize_dynamic(model, qconfig_spec=spec, dtype=torch.qint8, inplace=True)
