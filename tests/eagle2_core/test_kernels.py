"""Prepared linears compute what F.linear computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagle2_core import cpu_kernels
from eagle2_core.kernels import Linear


@pytest.mark.parametrize("rows", [1, 3, 16, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_prepared_linear_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 20, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    x = torch.randn(2, rows, 20, generator=g)
    torch.testing.assert_close(Linear(weight, b)(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_stacked_projections_are_the_concatenated_outputs():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, 6, generator=g), torch.randn(4, 6, generator=g)
    k_bias = torch.randn(4, generator=g)
    x = torch.randn(5, 6, generator=g)
    out = Linear.stack([q, k], [None, k_bias])(x)
    torch.testing.assert_close(out[:, :8], x @ q.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 8:], x @ k.T + k_bias, rtol=1e-5, atol=1e-5)


def test_projections_stacked_into_bf16_are_the_parts_cast_then_stacked():
    """Stacking casts each part as it copies it (one pass): the same bf16 weight as casting
    the parts first, and the same outputs; parts that require grad are stacked too."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(64, 32, generator=g).requires_grad_(), torch.randn(32, 32, generator=g)
    bias = torch.randn(32, generator=g)
    x = torch.randn(5, 32, generator=g).bfloat16()
    cast = Linear.stack([q.detach().bfloat16(), k.bfloat16()], [None, bias.bfloat16()])
    stacked = Linear.stack([q, k], [None, bias], torch.bfloat16)
    assert stacked.bias.dtype == torch.bfloat16
    assert torch.equal(stacked.bias, cast.bias)
    assert torch.equal(stacked(x), cast(x))


def test_cpu_fp32_weights_are_prepacked_once():
    layer = Linear(torch.randn(4, 4))
    assert layer.onednn == torch.backends.mkldnn.is_available()


def test_few_rows_go_to_the_row_kernel_where_it_is_faster_and_equal_f_linear():
    """On an AVX2 CPU without AVX-512 an fp32 weight gets a second, packed copy, which
    products of up to ROWS_LINEAR_ROWS rows (any leading shape) read: the kernel's bits,
    which for one row (the even and the odd k summed apart) are not oneDNN's. More rows
    take oneDNN. Every one is F.linear up to rounding."""
    g = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(40, 576, generator=g), torch.randn(40, generator=g)
    layer = Linear(weight, bias)
    avx2_only = torch.cpu._is_avx2_supported() and not torch.cpu._is_avx512_supported()
    assert (layer.packed is not None) == (avx2_only and cpu_kernels.kernel() is not None)
    assert Linear(weight.bfloat16()).packed is None
    for shape in [(1, 576), (2, 4, 576), (8, 576), (9, 576), (3, 5, 576)]:
        x = torch.randn(*shape, generator=g)
        got = layer(x)
        torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
        rows = x.reshape(-1, 576)
        if layer.packed is not None and len(rows) <= 8:
            assert torch.equal(
                got, cpu_kernels.rows_linear(rows, layer.packed, bias, 40).view_as(got)
            )
