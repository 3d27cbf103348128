"""Draft trees: rerank a candidate pool to a token budget, and the tensors verification needs.

Node 0 is the root (the last accepted token, not yet in the target's cache). Nodes
are ordered so that every parent precedes its children.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DraftTree:
    """A token tree to verify in one target forward."""

    tokens: torch.Tensor  # [N] long
    parents: tuple[int, ...]  # parent node index, -1 for the root
    scores: torch.Tensor  # [N] path log-confidence (0 for the root)
    depths: torch.Tensor = field(init=False)  # [N] long, root 0
    ancestor_mask: torch.Tensor = field(init=False)  # [N, N] bool: node i sees node j
    children: tuple[tuple[int, ...], ...] = field(init=False)  # by descending score
    paths: torch.Tensor = field(init=False)  # [leaves, max_depth + 1] node ids, -1 padded

    def __post_init__(self) -> None:
        n = len(self.parents)
        depths = [0] * n
        mask = torch.eye(n, dtype=torch.bool)
        kids: list[list[int]] = [[] for _ in range(n)]
        for i, p in enumerate(self.parents):
            if i == 0:
                if p != -1:
                    raise ValueError("node 0 must be the root")
                continue
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must precede children")
            depths[i] = depths[p] + 1
            mask[i] |= mask[p]
            kids[p].append(i)
        scores = self.scores.tolist()
        children = tuple(tuple(sorted(k, key=lambda c: -scores[c])) for k in kids)
        leaves = [i for i in range(n) if not kids[i]]
        max_depth = max(depths)
        paths = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long)
        for row, leaf in enumerate(leaves):
            chain = mask[leaf].nonzero().flatten()  # ancestors in index order = root first
            paths[row, : len(chain)] = chain
        object.__setattr__(self, "depths", torch.tensor(depths, dtype=torch.long))
        object.__setattr__(self, "ancestor_mask", mask)
        object.__setattr__(self, "children", children)
        object.__setattr__(self, "paths", paths)

    @property
    def size(self) -> int:
        return len(self.parents)


def root_only(root_token: int) -> DraftTree:
    """The trivial tree: plain decoding verifies just the root."""
    return DraftTree(torch.tensor([root_token]), (-1,), torch.zeros(1))


@dataclass
class CandidatePool:
    """Every drafted node of one round; parent -1 means the root."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    def add(self, token: int, parent: int, depth: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(depth)
        self.scores.append(score)
        return len(self.tokens) - 1


def rerank(pool: CandidatePool, root_token: int, budget: int) -> DraftTree:
    """Keep the budget-1 highest-scoring pool nodes and build the tree with the root.

    A child never scores above its parent; ties go to the shallower node, then to the
    earlier one, so a kept node's parent is always kept too.
    """
    order = sorted(range(len(pool.tokens)), key=lambda i: (-pool.scores[i], pool.depths[i], i))
    keep = sorted(order[: max(budget - 1, 0)])  # pool order: parents before children
    node_of = {pool_index: node for node, pool_index in enumerate(keep, start=1)}
    parents = [-1]
    for i in keep:
        parent = pool.parents[i]
        if parent != -1 and parent not in node_of:
            raise AssertionError(f"rerank kept node {i} without its parent {parent}")
        parents.append(0 if parent == -1 else node_of[parent])
    tokens = torch.tensor([root_token] + [pool.tokens[i] for i in keep], dtype=torch.long)
    scores = torch.tensor([0.0] + [pool.scores[i] for i in keep])
    return DraftTree(tokens, tuple(parents), scores)


def check_static_tree(paths: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """Validate a static tree shape and order it by depth, then rank (parents first)."""
    shape = tuple(sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p)))
    present = set(shape) | {()}
    for path in shape:
        if not path or any(r < 0 for r in path):
            raise ValueError(f"static tree path {list(path)} must be non-empty ranks >= 0")
        if path[:-1] not in present:
            raise ValueError(f"static tree path {list(path)} has no parent {list(path[:-1])}")
    return shape
