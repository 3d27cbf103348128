"""Which number format a target decodes in: --dtype auto|fp32|bf16.

bf16 halves the weights' bytes and, where the hardware multiplies it natively (CUDA;
CPUs with AMX tiles or AVX512-BF16), runs matrix products several times faster than
fp32. Elsewhere (AVX2-only CPUs) it is emulated and far slower than fp32: on the 2-core
AVX2 EPYC a bf16 forward of SmolLM2 cost several times an fp32 one (BENCHMARKS.md). So
`auto` picks bf16 only where it is native.

fp32 decoding is token-identical to transformers' `generate`; bf16 keeps the acceptance
rule exact with respect to its own verifying forward, but a many-row pass rounds
differently from a one-row pass, so its greedy output can differ from one-token-at-a-time
bf16 decoding and from fp32 (README.md, "Precision").
"""

from __future__ import annotations

import torch

from eagle2_core.config import DTYPES

_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16}


def native_bf16(device: torch.device | str) -> bool:
    """Whether the device multiplies bf16 in hardware."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    cpu = torch.cpu
    return bool(cpu._is_amx_tile_supported() or cpu._is_avx512_bf16_supported())


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The torch dtype for --dtype `name` on `device` (auto: bf16 where native)."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    if name == "auto":
        name = "bf16" if native_bf16(device) else "fp32"
    return _TORCH[name]


def dtype_name(dtype: torch.dtype) -> str:
    """fp32 or bf16: how rows and reports name a dtype."""
    return {v: k for k, v in _TORCH.items()}.get(dtype, str(dtype).removeprefix("torch."))
