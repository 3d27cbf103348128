"""Matrix products that do not pay per call for few rows.

Decoding multiplies a handful of rows (one token, a small draft tree) by every weight
matrix of the model. On a CPU torch's default fp32 path (MKL sgemm through `F.linear`)
repacks the weight on every call and runs a 2-8 row product at half the speed of a
1-row one: on the 2-core dev VM (2026-12-01, AMD EPYC, AVX-512) the 30 decoder layers of
SmolLM2-135M took 40 ms at 1 row, 66 ms at 2 and 64 ms at 16. oneDNN with the weight
reordered once into its blocked layout (`torch.ops.mkldnn._linear_pointwise`, what
inductor's freezing pass emits) took 21 ms at 1 and 2 rows, 16 at 4, 20 at 8 and 26 at
16: the weights stream at ~21 GB/s of the VM's ~31, and below ~10 rows a product costs
about what one row does, which is what makes a draft tree cheap to verify
(benchmarks/bench_kernels.py). The dense to blocked conversion happens once, at load;
inputs and outputs stay plain dense tensors. The prepared copy replaces the checkpoint's
tensor (a transformers model, where `generate` asks for one, keeps its own).

On an AVX2 CPU without AVX-512 oneDNN streams the weights at only 9-16 GB/s for 1-8
rows (a 2-core Zen 3 EPYC that reads ~22 GB/s): there an fp32 weight also keeps a copy
packed for the kernels' `rows_linear` (cpu_kernels.py), 15-21 GB/s at 1-8 rows, which
takes those products; oneDNN keeps the rest (at 12+ rows it is as fast or faster). The
copy doubles the weights' memory on those CPUs only.

On CUDA (and wherever oneDNN is missing) cuBLAS already handles skinny products well,
so `F.linear` is used as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle2_core import cpu_kernels


def _onednn_usable(weight: torch.Tensor) -> bool:
    """fp32 on any CPU with oneDNN; bf16 only where oneDNN has a bf16 path (AVX-512 or
    AVX-NE-CONVERT: it refuses to reorder a bf16 weight on an AVX2-only CPU)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


class Linear:
    """y = x W^T (+ b) with W prepared once for the device's fastest skinny product."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.bias = bias.detach().contiguous() if bias is not None else None
        self.onednn = _onednn_usable(weight)
        # a second copy for products of a few rows, where the kernels do them faster
        self.packed = None
        if cpu_kernels.multiplies_rows(weight):
            self.packed = cpu_kernels.pack_rows(weight)
        if self.onednn:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        else:
            self.weight = weight

    @classmethod
    def stack(
        cls,
        weights: list[torch.Tensor],
        biases: list[torch.Tensor | None],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> Linear:
        """One product for several projections of the same input (q|k|v, gate|up):
        fewer, larger calls stream the weights faster. `dtype`, `device`: where the
        stacked weight goes, each part cast and moved as it is copied there (one pass and
        one new copy, not two: a model's load touched ~44K fewer pages)."""
        first = weights[0]
        dtype, device = dtype or first.dtype, device or first.device
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    b if b is not None else w.new_zeros(w.shape[0])
                    for w, b in zip(weights, biases, strict=True)
                ]
            ).to(device=device, dtype=dtype)
        stacked = torch.empty(
            sum(w.shape[0] for w in weights), *first.shape[1:], dtype=dtype, device=device
        )
        row = 0
        for weight in weights:  # narrow, not split: split's views refuse copy_ with autograd on
            stacked.narrow(0, row, weight.shape[0]).copy_(weight.detach())
            row += weight.shape[0]
        return cls(stacked, bias)

    @classmethod
    def of(cls, module: torch.nn.Linear) -> Linear:
        return cls(module.weight, module.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        few_rows = x.numel() <= cpu_kernels.ROWS_LINEAR_ROWS * self.in_features
        if self.packed is not None and few_rows:
            rows = x.reshape(-1, self.in_features)
            out = cpu_kernels.rows_linear(rows, self.packed, self.bias, self.out_features)
            return out.view(*x.shape[:-1], self.out_features)
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
