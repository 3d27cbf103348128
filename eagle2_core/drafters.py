"""Proposers that draft one sequence at a time, behind one seam.

A drafter is told, each round, the target features of the tokens committed since the
last round and the token that follows each of them (the last one is the new root),
and returns a DraftTree of at most `budget` nodes rooted at that token. The engine's
own EAGLE-2 drafting works on the whole batch instead (dynamic.py); these serve EAGLE-1's
static tree and proposers that need no model.
"""

from __future__ import annotations

from typing import Protocol

import torch

from eagle2_core.kv import BatchKV
from eagle2_core.lean_head import LeanHead
from eagle2_core.tree import CandidatePool, DraftTree, check_static_tree, rerank, root_only


class Drafter(Protocol):
    def reset(self) -> None:
        """Forget the previous sequence."""

    def draft(
        self, features: torch.Tensor, next_tokens: torch.Tensor, context_len: int, budget: int
    ) -> DraftTree:
        """features [n, H] of the newest committed tokens; next_tokens [n]; root = last."""


class StaticDrafter:
    """EAGLE-1: the head drafting a fixed tree shape, where the child of rank r is the
    draft's r-th most likely token."""

    def __init__(self, head: LeanHead, static_tree: tuple[tuple[int, ...], ...]):
        self.head = head
        self.shape = check_static_tree(static_tree)
        self.kv: BatchKV | None = None

    def reset(self) -> None:
        self.kv = self.head.kv()
        self.kv.add_row(0)

    @torch.inference_mode()
    def draft(
        self, features: torch.Tensor, next_tokens: torch.Tensor, context_len: int, budget: int
    ) -> DraftTree:
        kv, device = self.kv, features.device
        n = len(next_tokens)
        if int(kv.lengths[0]) != context_len - n:
            raise RuntimeError(
                f"draft cache holds {int(kv.lengths[0])} tokens, expected {context_len - n}"
            )
        start = kv.reserve_new(n + len(self.shape))
        causal = torch.ones(1, n, n, dtype=torch.bool, device=device).tril()
        keys, values = kv.layer_views()
        positions = torch.arange(context_len - n, context_len, device=device)[None]
        inputs = self.head.lift(features[None])
        hidden = self.head.step(
            next_tokens[None], inputs, positions, keys, values, start, kv.tree_mask(causal)
        )
        kv.commit(start, torch.arange(n, device=device)[None], torch.tensor([n]))
        root = int(next_tokens[-1])
        if budget <= 1:
            return root_only(root)
        return rerank(self._pool(hidden[0, -1], context_len), root, budget)

    def _pool(self, last: torch.Tensor, context_len: int) -> CandidatePool:
        pool = CandidatePool()
        node_of: dict[tuple[int, ...], int] = {}
        slot_of: dict[int, int] = {}  # pool index -> expansion slot
        seen = torch.zeros(0, 0, dtype=torch.bool)  # expansion slot x slot ancestry
        level_nodes: list[tuple[int, ...]] = [()]  # paths of the nodes whose children we add
        level_log_probs = self.head.log_probs(last)[None]
        level_hidden = last[None]
        max_depth = max(len(p) for p in self.shape)
        for step in range(1, max_depth + 1):
            next_level: list[tuple[int, ...]] = []
            for row, parent_path in enumerate(level_nodes):
                ranks = [p[-1] for p in self.shape if p[:-1] == parent_path and len(p) == step]
                if not ranks:
                    continue
                top = level_log_probs[row].topk(max(ranks) + 1)
                base = pool.scores[node_of[parent_path]] if parent_path else 0.0
                for r in ranks:
                    path = parent_path + (r,)
                    token = int(self.head.token_ids[top.indices[r]])
                    parent = node_of.get(parent_path, -1)
                    node_of[path] = pool.add(token, parent, step, base + float(top.values[r]))
                    next_level.append(path)
            expand = [p for p in next_level if any(q[:-1] == p for q in self.shape)]
            if not expand:
                break
            nodes = [node_of[p] for p in expand]
            rows = [level_nodes.index(p[:-1]) for p in expand]
            hidden, seen = self._feed(
                pool, nodes, level_hidden[rows], step, context_len, slot_of, seen
            )
            level_nodes, level_hidden = expand, hidden
            level_log_probs = self.head.log_probs(hidden)
        return pool

    def _feed(self, pool, nodes, features, step, context_len, slot_of, seen):
        """Run the head on nodes of tree depth `step`; each sees the context and the
        expansion slots of its own ancestors."""
        kv, device = self.kv, features.device
        fed, k = seen.shape[0], len(nodes)
        rows = torch.zeros(k, fed + k, dtype=torch.bool)
        for row, node in enumerate(nodes):
            parent = pool.parents[node]
            if parent != -1:
                rows[row, :fed] = seen[slot_of[parent]]
            rows[row, fed + row] = True
            slot_of[node] = fed + row
        grown = torch.zeros(fed + k, fed + k, dtype=torch.bool)
        grown[:fed, :fed] = seen
        grown[fed:] = rows
        mask = torch.cat([kv.valid.expand(k, kv.slots).cpu(), rows], dim=1)[None, None]
        tokens = torch.tensor([pool.tokens[n] for n in nodes], device=device)[None]
        positions = torch.full((1, k), context_len + step - 1, device=device)
        keys, values = kv.layer_views()
        hidden = self.head.step(
            tokens, features[None], positions, keys, values, kv.slots + fed, mask.to(device)
        )
        return hidden[0], grown


class PromptLookupDrafter:
    """N-gram prompt lookup: propose the tokens that followed the latest earlier match.

    Needs no model; shows that any proposer fits the loop (and helps on copy-heavy work).
    """

    def __init__(self, ngram: int = 3, max_draft: int = 10):
        self.ngram, self.max_draft = ngram, max_draft
        self.history: list[int] = []

    def reset(self) -> None:
        self.history = []

    def draft(
        self, features: torch.Tensor, next_tokens: torch.Tensor, context_len: int, budget: int
    ) -> DraftTree:
        self.history.extend(next_tokens.tolist())
        root = self.history[-1]
        length = min(self.max_draft, budget - 1)
        for n in range(self.ngram, 0, -1):
            if len(self.history) <= n or length < 1:
                continue
            tail = self.history[-n:]
            for start in range(len(self.history) - n - 1, -1, -1):
                if self.history[start : start + n] == tail:
                    proposal = self.history[start + n : start + n + length]
                    return chain_tree(root, proposal)
        return root_only(root)


def chain_tree(root: int, proposal: list[int]) -> DraftTree:
    """A single path root -> proposal[0] -> proposal[1] ..."""
    tokens = torch.tensor([root, *proposal], dtype=torch.long)
    parents = tuple(range(-1, len(proposal)))
    return DraftTree(tokens, parents, -torch.arange(len(tokens), dtype=torch.float))
