"""fp32 greedy tokens through a bf16 lm_head are exactly the fp32 argmax."""

from __future__ import annotations

import pytest
import torch

from eagle2_core import cpu_kernels
from eagle2_core.greedy_head import ScreenedHead, bounds
from eagle2_core.precision import native_bf16

# Elsewhere nothing is screened (test_only_an_fp32_head_on_a_bf16_cpu_is_screened).
needs_bf16 = pytest.mark.skipif(not native_bf16("cpu"), reason="this CPU has no bf16 in hardware")


def head_and_states(vocab: int, hidden: int, rows: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=generator) * 0.05
    weight[vocab // 2] *= 20  # a few rows far longer than the rest
    states = torch.randn(rows, hidden, generator=generator) * 3
    return weight, states


@needs_bf16
@pytest.mark.parametrize(("vocab", "hidden"), [(49152, 576), (1003, 40), (96, 64)])
def test_the_tokens_are_the_fp32_argmax(vocab, hidden):
    """Against the float64 argmax: random states, vocabularies and sizes off the
    kernel's 16-lane blocks, a row whose top two tokens tie exactly (the first wins, as
    torch's max) and rows whose top two differ by 2^-16 of their scores (far inside
    bf16's bound, so both get scored; outside fp32's rounding)."""
    weight, states = head_and_states(vocab, hidden, rows=33 if vocab < 10_000 else 11)
    longest = float(weight.norm(dim=1).max())
    tied, close = torch.randn(2, hidden, generator=torch.Generator().manual_seed(vocab))
    weight[7] = weight[vocab - 2] = tied * 2 * longest / tied.norm()  # an exact tie
    states[0] = weight[7] * 10
    weight[vocab - 1] = close * 2 * longest / close.norm()
    weight[3] = weight[vocab - 1] * (1 + 2**-16)
    states[1] = weight[vocab - 1] * 10
    screened = ScreenedHead.of(weight)
    assert screened is not None
    # row by row, every token's sum in the same order: tied weights tie (a product's
    # blocking may sum two columns differently)
    want = torch.stack([(weight.double() * row.double()).sum(-1).argmax() for row in states])
    got = screened.tokens(states)
    assert got.dtype == torch.long and torch.equal(got, want)
    assert int(got[0]) == 7 and int(got[1]) == 3
    grid = states.reshape(-1, 11, hidden)
    assert torch.equal(screened.tokens(grid), want.reshape(-1, 11))


@needs_bf16
def test_the_bound_holds_where_the_screen_relies_on_it():
    """Each token's bf16 score stays within its bound of the fp32 score, for states and
    weights of very different sizes (the proof the screen rests on, checked)."""
    weight, states = head_and_states(4096, 576, rows=64, seed=1)
    states[:8] *= 1000
    states[8:16] *= 1e-3
    screened = ScreenedHead.of(weight)
    coeff, rel = bounds(576)
    scores = screened.screen(states.to(torch.bfloat16)).float()
    exact = states.double() @ weight.double().T
    bound = coeff * states.norm(dim=1, keepdim=True) * screened.norms + rel * scores.abs() + 1e-30
    assert ((scores.double() - exact).abs() <= bound.double()).all()


@needs_bf16
def test_rows_with_nan_or_infinite_scores_take_the_full_product():
    weight, states = head_and_states(500, 64, rows=4)
    states[1, 5] = float("nan")
    states[2, 0] = float("inf")
    screened = ScreenedHead.of(weight)
    want = (states @ weight.T).max(dim=-1).indices
    assert torch.equal(screened.tokens(states), want)


def test_only_an_fp32_head_on_a_bf16_cpu_is_screened():
    weight = torch.randn(100, 32)
    assert ScreenedHead.of(weight.to(torch.bfloat16)) is None  # already the fast product
    assert cpu_kernels.kernel() is not None  # CI's machine has a compiler
    assert (ScreenedHead.of(weight) is not None) == native_bf16("cpu")
