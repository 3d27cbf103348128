"""bf16 on a CPU: attention, RoPE with the cache write, and the residual add with its
RMSNorm, in C++ (bf16_cpu.cpp).

A decoding step attends a few new tokens per row (one, or a draft tree's nodes) over that
row's cache. torch's CPU kernels do this badly in bf16: its flash kernel took 14.5 ms a
layer at 64 rows x 330 slots on the AVX512-BF16 EPYC, where reading those keys and values
takes about 1 ms. This kernel reads each key and value once, multiplies bf16 pairs into
fp32 sums (vdpbf16ps where the CPU has it) and serves every query head that shares a key
(GQA) from there: scores, softmax and the weighted sum stay in fp32. Many new tokens (a
prefill) go in blocks, so it serves those too (1.4-2.3x torch's bf16 SDPA, 4 to 400
tokens). Around it, torch spends a dozen small ops a layer on RoPE, the cache write, the
residual add and RMSNorm, each a pass over the rows: `rope_attend` and `add_rms_norm` do
them in one, rounding each step as those ops do (BENCHMARKS.md, "bf16 kernels").

It is compiled on first use (torch's cpp_extension, cached per source and CPU); where no
compiler is at hand `kernel()` is None and llama.py keeps torch's ops. fp32 never comes
here: its arithmetic is the one transformers' `generate` does.
"""

from __future__ import annotations

import hashlib
import sys
from functools import cache
from pathlib import Path

import torch

SOURCE = (Path(__file__).parent / "bf16_cpu.cpp").read_text()


def _cpu_tag() -> str:
    """What the compiled code depends on: -march=native ties it to this CPU's flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return hashlib.sha256((SOURCE + flags + torch.__version__).encode()).hexdigest()[:16]


@cache
def kernel():
    """The compiled module, or None where it cannot be built here (said once)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory, load_inline

        name = f"eagle2_bf16_cpu_{_cpu_tag()}"
        if not any(Path(_get_build_directory(name, False)).glob("*.so")):
            print(
                "compiling the bf16 CPU kernels (once per machine, about a minute)",
                file=sys.stderr,
                flush=True,
            )
        return load_inline(
            name=name,
            cpp_sources=[SOURCE],
            functions=["decode_attention", "rope_attend", "add_rms_norm"],
            extra_cflags=[
                "-O3",
                "-march=native",
                "-fopenmp",
                "-ffast-math",
                "-fno-finite-math-only",
            ],
        )
    except Exception as error:  # no compiler, ninja or headers: torch's kernel instead
        print(f"bf16 CPU kernels unavailable, using torch's: {error}", file=sys.stderr)
        return None


def fuses(x: torch.Tensor) -> bool:
    """Whether these kernels take x's arithmetic: bf16 on a CPU, where they compiled."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and kernel() is not None


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its RMSNorm) in one pass over the rows (x alone where delta is None),
    rounded as torch rounds `x + delta` and F.rms_norm in bf16."""
    total, normed = kernel().add_rms_norm(x, delta, weight, eps)  # the binding gives a list
    return total, normed


def rope_attend(
    mixed: torch.Tensor,
    angles: tuple[torch.Tensor, torch.Tensor],
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """An attention block's middle in one call: RoPE (cos, sin [B, T, 1, D]) on the
    queries and keys of mixed [B, T, (heads + 2 kv_heads) * D], the new keys and values
    written to slots [B, T] of the cache [B, kv_heads, capacity, D], attention over the
    first mask.shape[-1] slots; [B, T, heads * D]. Each step rounds as llama.rotate, the
    cache writes and decode_attention do one after the other, in fewer passes."""
    cos, sin = angles
    return kernel().rope_attend(
        mixed, cos[:, :, 0], sin[:, :, 0], keys, values, slots, mask[:, 0].contiguous(),
        heads, keys.shape[-1] ** -0.5,
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """q [B, T, heads, D] (as the q|k|v product lays it out) over keys, values
    [B, kv_heads, S, D] (bf16) where mask [B, 1, T, S] is True; [B, T, heads * D], what
    the output projection takes. Each row reads its slots up to its last visible one, so
    rows of different lengths need no chunking."""
    return kernel().decode_attention(
        q, keys, values, mask[:, 0].contiguous(), q.shape[-1] ** -0.5
    )
