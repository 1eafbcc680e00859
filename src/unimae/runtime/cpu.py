"""What the CPU offers PyTorch (recorded with every speed figure), and running as if it were an AVX2 machine.

``ATEN_CPU_CAPABILITY=avx2`` makes PyTorch dispatch its AVX2 kernels and report AVX2; ``ONEDNN_MAX_CPU_ISA=AVX2``
keeps oneDNN to AVX2 (no AVX-512, no bf16 instructions); ``FBGEMM_ENABLE_INSTRUCTIONS=AVX2`` keeps fbgemm (the
int8 and fp16 products of the decode precisions, dynamic int8) to its AVX2 kernels, which read its own CPU
detection, not ATen's. All are read when the libraries load, so :func:`emulate_avx2` starts the program again
with them set. Under them ``--precision auto`` chooses what it
chooses on a real AVX2 CPU (:func:`unimae.runtime.precision.resolve_inference_precision`); the memory bandwidth
and core count stay the bigger machine's, so speeds are an AVX2 CPU's only roughly.
"""

from __future__ import annotations

import os
import sys

import torch

from unimae.runtime.memory import cpu_model
from unimae.runtime.precision import bf16_supported, fbgemm_supported, resolve_inference_precision

AVX2_EMULATION = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"}
SPEED_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def cpu_flags() -> list[str]:
    """The CPU's flags of :data:`SPEED_FLAGS` (from /proc/cpuinfo; empty where there is none), as the hardware has
    them: an emulation does not change them."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("flags"):
                    present = set(line.partition(":")[2].split())
                    return [flag for flag in SPEED_FLAGS if flag in present]
    except OSError:
        pass
    return []


def cpu_facts() -> dict:
    """What a CPU speed figure ran on: model, flags, the kernels PyTorch dispatched (``torch_cpu_capability``),
    native bf16, fbgemm, what ``--precision auto`` resolves to, and the emulation variables if set."""
    cpu = torch.device("cpu")
    emulation = {name: os.environ[name] for name in AVX2_EMULATION if name in os.environ}
    return {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_native": bf16_supported(cpu),
        "fbgemm": fbgemm_supported(cpu),  # the x86 int8 / fp16 products of the decode precisions
        "auto_precision": resolve_inference_precision("auto", cpu),
        "emulation": emulation or None,
        "avx2_emulated": emulation == AVX2_EMULATION,
    }


def emulate_avx2() -> None:
    """Run this program again (same interpreter and arguments) under :data:`AVX2_EMULATION`; returns at once when
    they are already set (in the program started again)."""
    if all(os.environ.get(name) == value for name, value in AVX2_EMULATION.items()):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_EMULATION})
