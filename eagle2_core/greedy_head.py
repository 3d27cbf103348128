"""fp32 greedy tokens through a bf16 lm_head, exactly.

An fp32 decoding step at 80 rows spent 10.7 ms of its 86 in the lm_head (80 x 49,152 x
576 on the 2-core Zen 5 EPYC), where a bf16 product of the same shape takes 5.7: the
CPU multiplies bf16 pairs twice as fast. A greedy row needs only the argmax of its fp32
scores, and the bf16 scores say where it can be. Token j's bf16 score (hidden and
weight rounded to bf16, products summed in fp32, the sum rounded to bf16) differs from
its fp32 score by at most

    bound_j = (2u + u^2 + 2.1 gamma_H) |h| |w_j| + (2.02 u + 2^-21) |score_j| + 1e-30

(u = 2^-9, bf16's unit roundoff; gamma_H = H 2^-24 / (1 - H 2^-24), fp32's summation
over H terms in any order, counted for the bf16 product's sums and again for the exact
score's; Cauchy-Schwarz bounds sum_k |h_k| |w_jk| by |h| |w_j|; the second term covers
the sum's rounding to bf16, truncating or not, and a few fp32 ulps of the bound's own
arithmetic; the last, bf16 products that flush subnormals). So no token whose bf16 score
plus its bound falls below the highest bf16 score less its bound can hold the fp32
maximum, and the kernel scores only the others in fp32, the first maximum winning as
torch's max gives it. On SmolLM2's own states (1,502 of them, MT-bench answers) that
left 2 tokens a row on average, 21 at most; the true argmax was always among them.
(Within a few fp32 ulps of a tie, torch's full product, which sums in another order,
may pick the other token, as a one-row and a many-row product already can; greedy
output stays that of `generate`: the identity tests run through this.)

Rows whose bf16 scores hold a NaN or an infinity take the full fp32 product. Sampling,
logprobs and logit processors need every fp32 logit: the decoder uses this only where
every row of a round is plain greedy (BatchDecoder._verify).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle2_core import cpu_kernels
from eagle2_core.kernels import Linear
from eagle2_core.precision import native_bf16

_UNIT = 2.0**-9  # bf16's unit roundoff


def bounds(hidden_size: int) -> tuple[float, float]:
    """(coeff, rel) of bound_j = coeff |h| |w_j| + rel |score_j| + 1e-30 (module doc)."""
    gamma = hidden_size * 2.0**-24 / (1 - hidden_size * 2.0**-24)
    return 2 * _UNIT + _UNIT**2 + 2.1 * gamma, 2.02 * _UNIT + 2.0**-21


@dataclass(frozen=True)
class ScreenedHead:
    """The fp32 lm_head weight [V, H], its bf16 copy prepared for products, and each
    row's L2 norm."""

    weight: torch.Tensor
    screen: Linear
    norms: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor) -> ScreenedHead | None:
        """For an fp32 lm_head on a CPU that multiplies bf16 in hardware (AMX or
        AVX512-BF16: elsewhere a bf16 product is emulated, slower than fp32's) and whose
        kernels compiled; else None."""
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            return None
        if not native_bf16(weight.device) or cpu_kernels.kernel() is None:
            return None
        if not torch.backends.mkldnn.is_available():
            return None
        weight = weight.detach().contiguous()
        return cls(weight, Linear(weight.to(torch.bfloat16)), weight.norm(dim=1))

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's fp32 argmax of hidden [..., H] x weight^T (the first maximum)."""
        flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        scores = self.screen(flat.to(torch.bfloat16))
        coeff, rel = bounds(flat.shape[-1])
        tokens = cpu_kernels.kernel().screened_argmax(
            flat, scores, self.weight, self.norms, coeff, rel
        )
        lost = (tokens < 0).nonzero()[:, 0]
        if lost.numel():  # NaN or infinite scores: the full product, as torch's max reads it
            tokens[lost] = (flat[lost] @ self.weight.T).max(dim=-1).indices
        return tokens.reshape(hidden.shape[:-1])
