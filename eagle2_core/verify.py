"""Choose the target's own token at every tree node, and accept the matching path.

Greedy, the target's token is its argmax. Sampling, it is a draw from the target's
distribution p (temperature, top-k, top-p and min-p as transformers' warpers, applied after
the row's logits processors: processors.py) by the inverse CDF of one uniform per output
position: every node at depth d shares the uniform of position context + d + 1. A drafted
child is accepted when it equals the token its parent chose, and the round emits the
accepted tokens plus the choice after the last one (the bonus).

Lossless: the token emitted at each position is the inverse-CDF draw of that position's
own uniform under the target's p given the tokens before it, exactly what plain sampling
with the same uniforms emits. The draft only decides how many positions one forward
settles: a drafted x is accepted with probability p(x) (the residual rule's rate for a
deterministic draft), and siblings add up (p(x1) + p(x2) + ...). So the output does not
depend on the tree, the draft vocabulary or the batch: a seed reproduces it anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle2_core.config import Sampling
from eagle2_core.tree import TreeBatch

UNIFORM_CHUNK = 16  # uniforms are drawn in fixed chunks so every run consumes alike


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Softmax of logits / temperature restricted to the top-k tokens, the top-p nucleus and
    the tokens of at least min_p times the top probability, in that order (transformers'
    warpers: ties at the k-th logit are kept, as there)."""
    scaled = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scaled.shape[-1]:
        kth = scaled.topk(sampling.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= 1 - sampling.top_p
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scaled = scaled.masked_fill(remove, float("-inf"))
    if sampling.min_p > 0.0:
        probs = scaled.softmax(dim=-1)
        floor = sampling.min_p * probs.amax(dim=-1, keepdim=True)
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    return scaled.softmax(dim=-1)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: probs [..., V], uniforms [...] in [0, 1) -> token ids [...]."""
    cumulative = probs.cumsum(dim=-1)
    target = uniforms.to(cumulative.dtype)[..., None] * cumulative[..., -1:]
    index = torch.searchsorted(cumulative.contiguous(), target.contiguous(), right=True)
    return index[..., 0].clamp(max=probs.shape[-1] - 1)


def choose_token(logits: torch.Tensor, sampling: Sampling, uniform: float) -> int:
    """The target's own next token: argmax, or the draw of `uniform` from target_probs."""
    if sampling.greedy:
        return int(logits.argmax())
    uniforms = torch.tensor(uniform, device=logits.device)
    return int(draw(target_probs(logits, sampling), uniforms))


class Uniforms:
    """One sequence's stream of uniforms, one per output position, from its generator."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self.buffer: list[float] = []

    def peek(self, n: int) -> list[float]:
        """The uniforms of the next n positions (drawn in fixed chunks as needed)."""
        while len(self.buffer) < n:
            self.buffer += torch.rand(UNIFORM_CHUNK, generator=self.generator).tolist()
        return self.buffer[:n]

    def take(self, n: int) -> list[float]:
        """The next n positions are settled: their uniforms are used up."""
        taken = self.peek(n)
        del self.buffer[:n]
        return taken


@dataclass(frozen=True)
class Accepted:
    """Each row's accepted path: nodes [B, N] (root first, then deeper; padded with 0),
    lengths [B] (nodes on the path, root included) and the bonus token [B]."""

    nodes: torch.Tensor
    lengths: torch.Tensor
    bonus: torch.Tensor


def accept(trees: TreeBatch, choices: torch.Tensor) -> Accepted:
    """Per row, the deepest node whose every drafted ancestor equals the token chosen at
    its parent (choices [B, N]); siblings hold distinct tokens, so one path qualifies."""
    parent_choice = choices.gather(1, trees.parents.clamp(min=0))
    matches = (trees.tokens == parent_choice) & trees.real
    matches[:, 0] = True  # the root is committed already
    # A node is on an accepted path when it and all its ancestors match.
    ok = ~(trees.ancestors & ~matches[:, None, :]).any(dim=-1)
    depth = torch.where(ok, trees.depths, -1)
    last = depth.argmax(dim=1)  # [B]
    rows = torch.arange(trees.tokens.shape[0], device=last.device)
    on_path = trees.ancestors[rows, last]  # [B, N]: the path's nodes
    lengths = on_path.sum(dim=1)
    # Node order is parents first, so the path's nodes in index order run root to leaf.
    order = torch.sort((~on_path).to(torch.int8), dim=1, stable=True).indices
    width = torch.arange(order.shape[1], device=last.device)[None]
    nodes = torch.where(width < lengths[:, None], order, 0)
    return Accepted(nodes, lengths, choices[rows, last])
