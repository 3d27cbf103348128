"""Accept a path of a verified draft tree: greedy, or lossless sampling.

Both return (accepted node ids starting with the root, bonus token). The bonus is
the target's own next token after the last accepted node, so every round emits at
least one token and the output is exactly what the target alone would produce.
"""

from __future__ import annotations

import torch

from eagle2_core.config import Sampling
from eagle2_core.tree import DraftTree


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Softmax of logits / temperature restricted to the top-p nucleus (as HF's warpers)."""
    scaled = logits.float() / sampling.temperature
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= 1 - sampling.top_p
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scaled = scaled.masked_fill(remove, float("-inf"))
    return scaled.softmax(dim=-1)


def choose_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The target's own next token: argmax, or a draw from target_probs."""
    if sampling.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(target_probs(logits, sampling).cpu(), 1, generator=generator))


def greedy_accept(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Longest path whose every drafted token equals the target's argmax at its parent."""
    best = logits.argmax(dim=-1)  # [N]
    paths = tree.paths
    valid = paths[:, 1:] >= 0
    child_tokens = tree.tokens[paths[:, 1:].clamp(min=0)]
    parent_best = best[paths[:, :-1].clamp(min=0)]
    matches = (child_tokens == parent_best) & valid
    accepted_len = matches.long().cumprod(dim=1).sum(dim=1)
    row = int(accepted_len.argmax())
    accepted = paths[row, : int(accepted_len[row]) + 1].tolist()
    return accepted, int(best[accepted[-1]])


def sample_accept(
    tree: DraftTree, logits: torch.Tensor, sampling: Sampling, generator: torch.Generator
) -> tuple[list[int], int]:
    """Lossless multi-candidate acceptance (drafts are deterministic, so q = 1).

    At each node try the children in descending draft score: accept child x with
    probability p(x); on rejection set p(x) = 0 and renormalise. If all are rejected,
    sample the bonus from what remains of p. The output is distributed as p.
    """
    probs = target_probs(logits, sampling).cpu()
    node, accepted = 0, [0]
    while True:
        p = probs[node]
        for child in tree.children[node]:
            token = int(tree.tokens[child])
            if torch.rand((), generator=generator) < p[token]:
                node = child
                accepted.append(child)
                break
            p = p.clone()
            p[token] = 0.0
            p = p / p.sum()
        else:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return accepted, bonus
