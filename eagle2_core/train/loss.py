"""The EAGLE training objective for a draft head.

At position t the head reads the target's feature f_t (with uniform noise, because at
drafting time it reads its own imperfect outputs) and the embedding of token x_{t+1},
and predicts f_{t+1}. The loss is SmoothL1(pred, f_{t+1}) plus 0.1 x the cross-entropy
from the target's next-token distribution softmax(lm_head(f_{t+1})) to the draft's
log_softmax(lm_head(pred)), both through the target's frozen lm_head, over answer
positions only. Top-1 agreement of the two argmaxes is what drafting acceptance tracks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle2_core.draft import DraftHead

REGRESSION_WEIGHT = 1.0  # the reference's v_w
CE_WEIGHT = 0.1  # the reference's p_w
NOISE_WIDTH = 0.2  # the reference's std: noise = (U(0, 1) - 0.5) * 0.2


@dataclass
class Batch:
    """Right-padded conversations: ids [B, T], features [B, T, H], mask [B, T], and for an
    EAGLE-3 head the target layers' inputs.

    mask is True on answer tokens of real (non-padding) positions.
    """

    input_ids: torch.Tensor
    features: torch.Tensor
    loss_mask: torch.Tensor
    layer_states: torch.Tensor | None = None  # [B, T, k * H]: an EAGLE-3 head's inputs

    def to(self, device: torch.device | str) -> Batch:
        states = self.layer_states.to(device) if self.layer_states is not None else None
        return Batch(
            self.input_ids.to(device), self.features.to(device), self.loss_mask.to(device), states
        )


@dataclass
class LossParts:
    """The loss and its parts; `positions` is how many predictions were scored."""

    loss: torch.Tensor
    regression: torch.Tensor
    ce: torch.Tensor
    top1: torch.Tensor  # fraction of scored positions whose argmaxes agree
    positions: int
    top1_by_step: tuple[float, ...] = ()  # EAGLE-3: top-1 at each unrolled draft step


def uniform_noise(
    features: torch.Tensor, width: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """features + U(-width/2, width/2), drawn on the features' device."""
    if width == 0:
        return features
    noise = torch.rand(
        features.shape, generator=generator, device=features.device, dtype=features.dtype
    )
    return features + (noise - 0.5) * width


def eagle_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    mask: torch.Tensor,
    regression_weight: float = REGRESSION_WEIGHT,
    ce_weight: float = CE_WEIGHT,
) -> LossParts:
    """Loss of predicted features pred [..., H] against target [..., H] where mask [...] holds.

    Only the scored positions go through lm_head: the vocabulary-sized logits are the
    largest tensors of a step.
    """
    pred, target = pred[mask], target[mask].to(pred.dtype)
    positions = pred.shape[0]
    if positions == 0:
        zero = pred.sum() * 0.0
        return LossParts(zero, zero, zero, zero.detach(), 0)
    regression = F.smooth_l1_loss(pred.float(), target.float(), reduction="mean")
    with torch.no_grad():
        target_logits = lm_head(target).float()
        target_p = torch.softmax(target_logits, dim=-1)
    draft_logits = lm_head(pred).float()
    ce = -(target_p * torch.log_softmax(draft_logits, dim=-1)).sum(-1).mean()
    top1 = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
    loss = regression_weight * regression + ce_weight * ce
    return LossParts(loss, regression, ce, top1, positions)


def causal_mask(length: int, device: torch.device | str) -> torch.Tensor:
    """Float mask [1, 1, T, T]: 0 where visible, -inf above the diagonal.

    Right padding needs nothing more: a real position never sees a later pad.
    """
    hidden = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
    mask = torch.zeros(length, length, device=device)
    return mask.masked_fill_(hidden, float("-inf"))[None, None]


def batch_loss(
    head: DraftHead,
    embed: Callable[[torch.Tensor], torch.Tensor],
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    batch: Batch,
    noise_width: float = NOISE_WIDTH,
    generator: torch.Generator | None = None,
    regression_weight: float = REGRESSION_WEIGHT,
    ce_weight: float = CE_WEIGHT,
) -> LossParts:
    """Run the head over a batch and score it: input (f_t + noise, x_{t+1}), target f_{t+1}.

    A pair is scored when x_{t+1} is an answer token, which includes the step from the
    last prompt token: the first draft after prefill.
    """
    features = batch.features.float()
    inputs = uniform_noise(features[:, :-1], noise_width, generator)
    with torch.no_grad():
        embeds = embed(batch.input_ids[:, 1:])
    length = inputs.shape[1]
    positions = torch.arange(length, device=inputs.device).expand(inputs.shape[0], -1)
    pred, _ = head(embeds, inputs, positions, None, causal_mask(length, inputs.device))
    return eagle_loss(
        pred, features[:, 1:], lm_head, batch.loss_mask[:, 1:], regression_weight, ce_weight
    )
