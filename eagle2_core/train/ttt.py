"""EAGLE-3's objective: training-time test, the head learning from its own drafts.

At drafting time an EAGLE-3 head reads the target's (fused) features only at committed
tokens; every deeper draft step reads the head's own previous output. Training unrolls
the same: step 0 runs the head over the whole conversation on the target's layer states;
step j runs it again with each position's input replaced by the head's step j-1 output
from the same base position, one token further along (position t + j, token x_{t+j+1}).
A step-j query at base t attends to the step-0 entries of bases <= t and to its own
chain's entries of steps 1..j, exactly what a depth-j node sees in a draft tree (the
draft cache holds the committed context, then the node's ancestors).

The loss at every step is the cross-entropy from the target's next-token distribution,
restricted to the draft vocabulary, to the head's; step j weighs STEP_DECAY ** j, as in
the reference. Scored pairs are those whose input token is an answer token.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from eagle2_core.eagle3 import Eagle3Head
from eagle2_core.layers import rotate_heads
from eagle2_core.train.loss import Batch, LossParts

TTT_STEPS = 3  # the reference unrolls 7; each step costs a head forward (CPU: keep few)
STEP_DECAY = 0.8


def _attend(head: Eagle3Head, x, hidden, positions, chain):
    """One pass of the head's layer where queries see step-0 entries causally and, for
    steps >= 1, their own chain's entries (chain: [(k, v), ...] of steps 0..j-1)."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    b, n, _ = x.shape
    shape = (b, n, -1, attn.head_dim)
    q = attn.q_proj(x).view(shape).transpose(1, 2)
    k = attn.k_proj(x).view(shape).transpose(1, 2)
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    q, k = rotate_heads(q, k, *head.rotary(x, positions))
    groups = attn.n_heads // attn.n_kv_heads
    entries = [*chain, (k, v)]
    keys = [e[0][:, :, :n].repeat_interleave(groups, dim=1) for e in entries]
    values = [e[1][:, :, :n].repeat_interleave(groups, dim=1) for e in entries]
    scale = 1 / math.sqrt(attn.head_dim)
    causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
    context = (q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
    own = [(q * key).sum(-1, keepdim=True) * scale for key in keys[1:]]  # [b, h, n, 1] each
    weights = torch.softmax(torch.cat([context, *own], dim=-1), dim=-1)
    out = weights[..., :n] @ values[0]
    for i, value in enumerate(values[1:]):
        out = out + weights[..., n + i : n + i + 1] * value
    out = attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))
    h = hidden + out
    return h + layer.mlp(layer.post_attention_layernorm(h)), (k, v)


def unroll(
    head: Eagle3Head,
    embed: Callable[[torch.Tensor], torch.Tensor],
    ids: torch.Tensor,
    layer_states: torch.Tensor,
    steps: int,
) -> list[torch.Tensor]:
    """The head's outputs [B, T-1-j, H] at steps j = 0..steps-1 (base t: index t)."""
    pairs = ids.shape[1] - 1  # base t reads x_{t+1}
    hidden = head.lift(layer_states[:, :-1].to(head.fc.weight.dtype))
    chain: list[tuple[torch.Tensor, torch.Tensor]] = []
    outs = []
    for j in range(min(steps, pairs)):
        n = pairs - j
        with torch.no_grad():
            embeds = embed(ids[:, 1 + j : 1 + j + n])
        positions = (torch.arange(n, device=ids.device) + j).expand(ids.shape[0], -1)
        x = torch.cat(
            [head.midlayer.input_layernorm(embeds), head.midlayer.hidden_norm(hidden[:, :n])],
            dim=-1,
        )
        hidden, entry = _attend(head, x, hidden[:, :n], positions, chain)
        chain.append(entry)
        outs.append(hidden)
    return outs


def ttt_loss(
    head: Eagle3Head,
    embed: Callable[[torch.Tensor], torch.Tensor],
    target_logits: Callable[[torch.Tensor], torch.Tensor],
    batch: Batch,
    steps: int = TTT_STEPS,
) -> LossParts:
    """The unrolled loss over a batch (batch.layer_states: the target layers' inputs).

    target_logits maps the target's final states to its logits over the draft vocabulary.
    top1 is step 0's agreement (comparable with an EAGLE-2 head's); top1_by_step holds
    every step's, the acceptance a draft of that depth can expect.
    """
    if batch.layer_states is None:
        raise ValueError("an EAGLE-3 head trains on layer states: extract them with its layers")
    mask = batch.loss_mask
    with torch.no_grad():
        target_p = torch.softmax(target_logits(batch.features[:, 1:].float()).float(), dim=-1)
    total, weights, by_step, first = None, 0.0, [], None
    for j, out in enumerate(unroll(head, embed, batch.input_ids, batch.layer_states, steps)):
        n = out.shape[1]
        scored = mask[:, 1 + j : 1 + j + n]
        if not scored.any():
            break  # deeper steps score a subset of these positions
        logits = head.logits(out[scored]).float()
        p = target_p[:, j : j + n][scored]
        ce = -(p * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        total = STEP_DECAY**j * ce if total is None else total + STEP_DECAY**j * ce
        weights += STEP_DECAY**j
        agree = (logits.argmax(-1) == p.argmax(-1)).float().mean().detach()
        by_step.append(float(agree))
        first = first or (ce.detach(), agree, int(scored.sum()))
    if total is None:
        zero = head.fc.weight.sum() * 0.0  # nothing scored: a zero that backward accepts
        return LossParts(zero, zero.detach(), zero.detach(), zero.detach(), 0)
    ce0, top1, positions = first
    zero = ce0 * 0.0
    return LossParts(total / weights, zero, ce0, top1, positions, tuple(by_step))
