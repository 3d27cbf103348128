"""Decode attention over a bf16 cache on a CPU, one pass over each row's keys and values.

A decoding step attends a few new tokens per row (one, or a draft tree's nodes) over that
row's cache. torch's CPU kernels do this badly in bf16: its flash kernel took 14.5 ms a
layer at 64 rows x 330 slots on the AVX512-BF16 EPYC, where reading those keys and values
takes about 1 ms, and two fp32 matrix products over an upcast copy still took 4.8 ms
(BENCHMARKS.md, "bf16 on a CPU"). This kernel reads each key and value once, converts
it in registers and serves every query head that shares it (GQA) from there: scores,
softmax and the weighted sum stay in fp32.

It is C++ compiled on first use (torch's cpp_extension, cached per source and CPU); where
no compiler is at hand `kernel()` is None and llama.py keeps torch's kernel. fp32 never
comes here: its attention is the arithmetic transformers' `generate` does.
"""

from __future__ import annotations

import hashlib
import sys
from functools import cache
from pathlib import Path

import torch

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <vector>

static inline void widen(const uint16_t* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) {
    const uint32_t bits = static_cast<uint32_t>(x[d]) << 16;
    std::memcpy(y + d, &bits, 4);
  }
}

// q [B, KV, R, D] fp32 (row r = g * T + t: query head g of the group, new token t);
// keys, values [B, KV, S, D] bf16 (the last dim contiguous); visible [B, T, S] bool.
// Returns [B, KV, R, D] fp32.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                               torch::Tensor visible, double scale) {
  const int64_t B = q.size(0), KV = q.size(1), R = q.size(2), D = q.size(3);
  const int64_t Sall = keys.size(2), T = visible.size(1);
  auto out = torch::zeros_like(q);
  const float* qp = q.data_ptr<float>();
  const bool* mp = visible.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const auto* kp = reinterpret_cast<const uint16_t*>(keys.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(values.data_ptr());
  const int64_t kb = keys.stride(0), kh = keys.stride(1), ks = keys.stride(2);
  const int64_t vb = values.stride(0), vh = values.stride(1), vs = values.stride(2);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(R * Sall), rows(4 * D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / KV, h = i % KV;
      const float* qi = qp + i * R * D;
      const bool* mi = mp + b * T * Sall;
      const uint16_t* ki = kp + b * kb + h * kh;
      const uint16_t* vi = vp + b * vb + h * vh;
      int64_t S = 0;  // this row's slots: up to its last visible one (rows differ in length)
      for (int64_t s = Sall - 1; s >= 0 && S == 0; --s)
        for (int64_t t = 0; t < T; ++t)
          if (mi[t * Sall + s]) { S = s + 1; break; }
      for (int64_t s0 = 0; s0 < S; s0 += 4) {  // 4 keys read once, for every query row
        const int64_t n = std::min<int64_t>(4, S - s0);
        for (int64_t j = 0; j < 4; ++j) {
          if (j < n) widen(ki + (s0 + j) * ks, rows.data() + j * D, D);
          else std::fill(rows.begin() + j * D, rows.begin() + (j + 1) * D, 0.f);
        }
        const float* k0 = rows.data();
        const float *k1 = k0 + D, *k2 = k0 + 2 * D, *k3 = k0 + 3 * D;
        for (int64_t r = 0; r < R; ++r) {
          const float* qr = qi + r * D;
          float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
          for (int64_t d = 0; d < D; ++d) {
            a0 += qr[d] * k0[d];
            a1 += qr[d] * k1[d];
            a2 += qr[d] * k2[d];
            a3 += qr[d] * k3[d];
          }
          const float a[4] = {a0, a1, a2, a3};
          for (int64_t j = 0; j < n; ++j) scores[r * S + s0 + j] = a[j] * sc;
        }
      }
      for (int64_t r = 0; r < R; ++r) {  // softmax over the visible slots
        float* sr = scores.data() + r * S;
        const bool* mr = mi + (r % T) * Sall;
        float peak = -INFINITY, sum = 0.f;
        for (int64_t s = 0; s < S; ++s) {
          sr[s] = mr[s] ? sr[s] : -INFINITY;
          peak = std::max(peak, sr[s]);
        }
#pragma omp simd reduction(+ : sum)
        for (int64_t s = 0; s < S; ++s) {
          sr[s] = std::exp(sr[s] - peak);
          sum += sr[s];
        }
        const float norm = 1.f / sum;
#pragma omp simd
        for (int64_t s = 0; s < S; ++s) sr[s] *= norm;
      }
      float* oi = op + i * R * D;
      for (int64_t s0 = 0; s0 < S; s0 += 4) {  // 4 values read once
        const int64_t n = std::min<int64_t>(4, S - s0);
        for (int64_t j = 0; j < 4; ++j) {
          if (j < n) widen(vi + (s0 + j) * vs, rows.data() + j * D, D);
          else std::fill(rows.begin() + j * D, rows.begin() + (j + 1) * D, 0.f);
        }
        const float* v0 = rows.data();
        const float *v1 = v0 + D, *v2 = v0 + 2 * D, *v3 = v0 + 3 * D;
        for (int64_t r = 0; r < R; ++r) {
          const float* sr = scores.data() + r * S + s0;
          const float p0 = sr[0], p1 = n > 1 ? sr[1] : 0.f, p2 = n > 2 ? sr[2] : 0.f,
                      p3 = n > 3 ? sr[3] : 0.f;
          float* o = oi + r * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
        }
      }
    }
  });
  return out;
}
"""


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


# Up to this many new tokens per row the kernel beat torch's flash kernel (bf16, 64 rows,
# 150-330 slots: 1 token 2.1 vs 14.7 ms, 4 tokens 5.2 vs 11.5); at 6 flash was ahead.
MAX_TOKENS = 4


@cache
def kernel():
    """The compiled module, or None where it cannot be built here (said once)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory, load_inline

        name = f"eagle2_cpu_attention_{_cpu_tag()}"
        if not any(Path(_get_build_directory(name, False)).glob("*.so")):
            print(
                "compiling the bf16 CPU attention kernel (once per machine, about a minute)",
                file=sys.stderr,
                flush=True,
            )
        return load_inline(
            name=name,
            cpp_sources=[SOURCE],
            functions=["decode_attention"],
            extra_cflags=[
                "-O3",
                "-march=native",
                "-fopenmp",
                "-ffast-math",
                "-fno-finite-math-only",
            ],
        )
    except Exception as error:  # no compiler, ninja or headers: torch's kernel instead
        print(f"bf16 CPU attention kernel unavailable, using torch's: {error}", file=sys.stderr)
        return None


def serves(q: torch.Tensor) -> bool:
    """Whether this kernel attends q [B, heads, T, D]: bf16 on a CPU, a few tokens a row."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and q.shape[2] <= MAX_TOKENS
        and kernel() is not None
    )


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """q [B, heads, T, D] over keys, values [B, kv_heads, S, D] (bf16) where mask
    [B, 1, T, S] is True; [B, heads, T, D] in q's dtype. Each row reads its slots up to
    its last visible one, so rows of different lengths need no chunking."""
    b, heads, t, dim = q.shape
    kv_heads = keys.shape[1]
    stacked = q.reshape(b, kv_heads, heads // kv_heads * t, dim).float().contiguous()
    out = kernel().decode_attention(stacked, keys, values, mask[:, 0].contiguous(), dim**-0.5)
    return out.view(b, heads, t, dim).to(q.dtype)
