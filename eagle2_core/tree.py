"""Draft trees: the tensors verification needs, for one sequence or a whole batch.

Node 0 is the root (the last accepted token, not yet in the target's cache). Nodes
are ordered so that every parent precedes its children. `DraftTree` is one sequence's
tree (drafters that work row by row return it); `TreeBatch` holds every row's tree as
[B, N] tensors, built without a Python loop per node: from a batched candidate pool by
`select` (EAGLE-2), or from per-row trees by `stack`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DraftTree:
    """One sequence's token tree to verify in one target forward."""

    tokens: torch.Tensor  # [N] long
    parents: tuple[int, ...]  # parent node index, -1 for the root
    scores: torch.Tensor  # [N] path log-confidence (0 for the root)
    depths: torch.Tensor = field(init=False)  # [N] long, root 0
    ancestor_mask: torch.Tensor = field(init=False)  # [N, N] bool: node i sees node j

    def __post_init__(self) -> None:
        n = len(self.parents)
        depths = [0] * n
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if i == 0:
                if p != -1:
                    raise ValueError("node 0 must be the root")
                continue
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must precede children")
            depths[i] = depths[p] + 1
            mask[i] |= mask[p]
        object.__setattr__(self, "depths", torch.tensor(depths, dtype=torch.long))
        object.__setattr__(self, "ancestor_mask", mask)

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


@dataclass(frozen=True)
class Pool:
    """Every drafted candidate of one round for each row, [B, P]; pool order is drafting
    order (a parent always precedes its children, shallower levels come first)."""

    tokens: torch.Tensor  # target token ids
    parents: torch.Tensor  # pool index of the parent, -1 for a child of the root
    depths: torch.Tensor  # 1 for the root's children
    scores: torch.Tensor  # path log-confidence: the sum of draft log-probs from the root


@dataclass(frozen=True)
class TreeBatch:
    """One tree per row, padded to N nodes; node j < sizes[b] is real."""

    tokens: torch.Tensor  # [B, N] long
    parents: torch.Tensor  # [B, N] long, node index; -1 for the root and padding
    depths: torch.Tensor  # [B, N] long, root 0
    scores: torch.Tensor  # [B, N] path log-confidence (root 0, padding -inf)
    ancestors: torch.Tensor  # [B, N, N] bool: node i sees node j (padding: itself only)
    sizes: torch.Tensor  # [B] long

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @property
    def real(self) -> torch.Tensor:
        return torch.arange(self.width, device=self.sizes.device)[None] < self.sizes[:, None]

    def has_children(self) -> torch.Tensor:
        """[B, N] bool: the node has at least one child in its tree."""
        child = (self.real & (self.parents >= 0)).long()
        counts = torch.zeros_like(child).scatter_add_(1, self.parents.clamp(min=0), child)
        return counts > 0

    def row(self, b: int) -> DraftTree:
        """Row b as a DraftTree (for the per-row parts of sampling acceptance)."""
        size = int(self.sizes[b])
        return DraftTree(
            self.tokens[b, :size].cpu(),
            tuple(self.parents[b, :size].tolist()),
            self.scores[b, :size].cpu(),
        )


def _ancestors(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, N, N] bool from parent indices [B, N] (-1 = none): each node sees itself and its
    ancestors. One step up per level for all nodes at once, no host round trip."""
    n = parents.shape[1]
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(*parents.shape, n)
    up = parents
    for _ in range(max_depth):
        has = up >= 0
        mask = mask | (F.one_hot(up.clamp(min=0), n).bool() & has[..., None])
        up = torch.where(has, parents.gather(1, up.clamp(min=0)), up)
    return mask


def select(pool: Pool, roots: torch.Tensor, sizes: list[int], max_depth: int) -> TreeBatch:
    """Each row's tree of its sizes[b] - 1 highest-scoring candidates plus the root
    (max_depth: the deepest candidate level, known to the drafter).

    A child never scores above its parent and a stable sort breaks ties toward the
    earlier (shallower) candidate, so a kept node's parent is always kept too.
    """
    b, p = pool.scores.shape
    device = pool.scores.device
    counts = [min(max(size - 1, 0), p) for size in sizes]
    m = max(counts, default=0)
    drafted = torch.tensor(counts, dtype=torch.long, device=device)
    order = torch.sort(pool.scores, dim=1, descending=True, stable=True).indices[:, :m]
    rank = torch.arange(m, device=device)[None]
    chosen = torch.where(rank < drafted[:, None], order, p).sort(dim=1).values  # p: unused
    kept = chosen < p
    safe = chosen.clamp(max=max(p - 1, 0))
    node_of = torch.full((b, p + 1), -1, dtype=torch.long, device=device)
    node_of.scatter_(1, chosen, torch.arange(1, m + 1, device=device).expand(b, m))
    parent_pool = pool.parents.gather(1, safe) if m else safe
    parent_node = torch.where(parent_pool < 0, 0, node_of.gather(1, parent_pool.clamp(min=0)))
    zeros = torch.zeros(b, 1, dtype=torch.long, device=device)
    tokens = torch.cat([roots[:, None], torch.where(kept, pool.tokens.gather(1, safe), 0)], 1)
    parents = torch.cat([zeros - 1, torch.where(kept, parent_node, -1)], 1)
    depths = torch.cat([zeros, torch.where(kept, pool.depths.gather(1, safe), 0)], 1)
    scores = torch.cat(
        [zeros.float(), torch.where(kept, pool.scores.gather(1, safe), float("-inf"))], 1
    )
    ancestors = _ancestors(parents, max_depth if m else 0)
    return TreeBatch(tokens, parents, depths, scores, ancestors, 1 + drafted)


def roots_only(roots: torch.Tensor) -> TreeBatch:
    """Every row verifies its root alone (plain decoding)."""
    b, device = roots.shape[0], roots.device
    zeros = torch.zeros(b, 1, dtype=torch.long, device=device)
    ancestors = torch.ones(b, 1, 1, dtype=torch.bool, device=device)
    return TreeBatch(roots[:, None], zeros - 1, zeros, zeros.float(), ancestors, zeros[:, 0] + 1)


def stack(trees: list[DraftTree], device: torch.device | str) -> TreeBatch:
    """Per-row trees as one padded batch."""
    n = max(t.size for t in trees)
    b = len(trees)
    tokens = torch.zeros(b, n, dtype=torch.long)
    parents = torch.full((b, n), -1, dtype=torch.long)
    depths = torch.zeros(b, n, dtype=torch.long)
    scores = torch.full((b, n), float("-inf"))
    ancestors = torch.eye(n, dtype=torch.bool).repeat(b, 1, 1)
    for row, tree in enumerate(trees):
        size = tree.size
        tokens[row, :size] = tree.tokens
        parents[row, :size] = torch.tensor(tree.parents)
        depths[row, :size] = tree.depths
        scores[row, :size] = tree.scores
        ancestors[row, :size, :size] = tree.ancestor_mask
    sizes = torch.tensor([t.size for t in trees])
    return TreeBatch(*(x.to(device) for x in (tokens, parents, depths, scores, ancestors, sizes)))
