"""Device and mixed-precision choice: bf16 autocast where the hardware runs it natively."""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("auto", "bf16", "fp32")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(
            torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    return False


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto' -> 'bf16' where supported natively, else 'fp32'."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        return "bf16" if bf16_supported(device) else "fp32"
    return precision


def weight_dtype(precision: str) -> torch.dtype:
    """Storage dtype of FROZEN weights: bf16 under bf16 autocast (saves the per-matmul weight cast
    and half the memory); trainable weights (LoRA, tiny decoder) always stay float32."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def autocast(precision: str, device: torch.device):
    """Autocast context for a resolved precision ('bf16' or 'fp32'); weights stay fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
