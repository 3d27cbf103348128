"""The greedy-token kernel against torch's max (the attention and norm kernels are
tested beside the forward they serve, in test_llama.py)."""

from __future__ import annotations

import pytest
import torch

from eagle2_core import cpu_kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 15, 16, 49152, 49157])
def test_greedy_tokens_are_torchs_first_maximum(dtype, vocab):
    """Random rows, exact ties (the first wins), -inf masks, NaN (the first NaN wins, as
    torch.max gives it), three dimensions and a strided view: indices equal max's."""
    assert cpu_kernels.kernel() is not None  # CI's machine has a compiler
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, 3, vocab, generator=generator).to(dtype)
    logits[0, 0] = 2.0  # every entry ties
    logits[1, 1] = float("-inf")
    logits[1, 2, vocab // 2 :] = float("-inf")
    if vocab > 1:
        logits[2, 0, [vocab // 3, vocab - 1]] = 50.0  # a tie late in the row
        logits[3, 1, [vocab - 1, vocab // 2]] = float("nan")
        logits[4, 2, :] = torch.finfo(dtype).min
        logits[4, 2, vocab - 1] = float("inf")
    for case in (logits, logits[:, 1:], logits.transpose(0, 1)):
        want = case.max(dim=-1).indices
        got = cpu_kernels.greedy_tokens(case)
        assert got.dtype == torch.long and got.shape == want.shape
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_is_torchs_within_a_bf16_ulp(dtype):
    """The MLP's middle: fp32 exactly torch's ops; bf16 equal to F.silu(gate) * up but for
    rare single-ulp differences (another exp polynomial), with extremes that overflow
    exp or sit at zero."""
    generator = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(37, 2, 2 * 1536, generator=generator) * 4).to(dtype)
    gate_up[0, 0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = cpu_kernels.silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        assert torch.equal(got, want)
        return
    assert cpu_kernels.kernel() is not None
    differ = got != want
    assert differ.float().mean() < 1e-3
    ulp = (got.float() - want.float()).abs() / want.float().abs().clamp(min=1e-30)
    assert (ulp[differ] <= 2**-7).all()  # one bf16 ulp: 8 bits of mantissa
