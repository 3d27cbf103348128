"""Proposers of draft trees behind one seam, so the decoding loop does not care who drafts.

A drafter is told, each round, the target features of the tokens committed since the
last round and the token that follows each of them (the last one is the new root),
and returns a DraftTree of at most `budget` nodes rooted at that token.
"""

from __future__ import annotations

from typing import Protocol

import torch

from eagle2_core.draft import DraftCache, DraftHead
from eagle2_core.models import Target
from eagle2_core.tree import CandidatePool, DraftTree, check_static_tree, rerank, root_only


class Drafter(Protocol):
    def reset(self) -> None:
        """Forget the previous sequence."""

    def draft(
        self, features: torch.Tensor, next_tokens: torch.Tensor, context_len: int, budget: int
    ) -> DraftTree:
        """features [n, H] of the newest committed tokens; next_tokens [n]; root = last."""


def _visible_to_float(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(visible.shape, dtype=dtype)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[None, None]


class _Expansion:
    """The draft's throw-away cache for one round of tree expansion.

    Nodes fed at the same step share a position; each sees the context and the
    expansion entries of its own ancestors.
    """

    def __init__(self, head: DraftHead, target: Target, cache: DraftCache, context_len: int):
        self.head, self.target = head, target
        self.cache, self.context_len = cache, context_len
        self.slot_of: dict[int, int] = {}  # pool index -> expansion slot
        self.ancestors = torch.zeros(0, 0, dtype=torch.bool)  # slot x slot

    def feed(
        self, pool: CandidatePool, nodes: list[int], features: torch.Tensor, step: int
    ) -> torch.Tensor:
        """Run the head on frontier nodes (at tree depth `step`); returns their hidden [k, H]."""
        fed, k = self.ancestors.shape[0], len(nodes)
        rows = torch.zeros(k, fed + k, dtype=torch.bool)
        for row, node in enumerate(nodes):
            parent = pool.parents[node]
            if parent != -1:
                rows[row, :fed] = self.ancestors[self.slot_of[parent]]
            rows[row, fed + row] = True
            self.slot_of[node] = fed + row
        grown = torch.zeros(fed + k, fed + k, dtype=torch.bool)
        grown[:fed, :fed] = self.ancestors
        grown[fed:] = rows
        self.ancestors = grown
        visible = torch.cat([torch.ones(k, self.context_len, dtype=torch.bool), rows], dim=1)
        dtype = features.dtype
        tokens = torch.tensor([pool.tokens[n] for n in nodes], device=features.device)
        positions = torch.full((1, k), self.context_len + step - 1, device=features.device)
        hidden, self.cache = self.head(
            self.target.embed(tokens)[None].to(dtype),
            features[None],
            positions,
            self.cache,
            _visible_to_float(visible, dtype).to(features.device),
        )
        return hidden[0]


class EagleDrafter:
    """The EAGLE head drafting a dynamic (EAGLE-2) or static (EAGLE-1) tree."""

    def __init__(
        self,
        head: DraftHead,
        target: Target,
        top_k: int = 10,
        depth: int = 5,
        static_tree: tuple[tuple[int, ...], ...] | None = None,
    ):
        if top_k < 1 or depth < 0:
            raise ValueError(f"top_k must be >= 1 and depth >= 0, got {top_k} and {depth}")
        self.head, self.target = head, target
        self.top_k, self.depth = top_k, depth
        self.static_tree = check_static_tree(static_tree) if static_tree is not None else None
        self.cache: DraftCache | None = None

    def reset(self) -> None:
        self.cache = None

    def _log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.target.lm_head(hidden.to(self.target.dtype)).float(), dim=-1)

    @torch.inference_mode()
    def draft(
        self, features: torch.Tensor, next_tokens: torch.Tensor, context_len: int, budget: int
    ) -> DraftTree:
        dtype = next(self.head.parameters()).dtype
        n = len(next_tokens)
        start = context_len - n
        if (self.cache.length if self.cache is not None else 0) != start:
            raise RuntimeError(f"draft cache holds {self.cache.length} tokens, expected {start}")
        causal = torch.ones(n, context_len, dtype=torch.bool).tril(diagonal=start)
        positions = torch.arange(start, context_len, device=features.device)[None]
        hidden, self.cache = self.head(
            self.target.embed(next_tokens)[None].to(dtype),
            features[None].to(dtype),
            positions,
            self.cache,
            _visible_to_float(causal, dtype).to(features.device),
        )
        last = hidden[0, -1]
        root = int(next_tokens[-1])
        if budget <= 1:
            return root_only(root)
        expansion = _Expansion(self.head, self.target, self.cache, context_len)
        if self.static_tree is None:
            pool = self._dynamic_pool(expansion, last)
        else:
            pool = self._static_pool(expansion, last)
        return rerank(pool, root, budget)

    def _dynamic_pool(self, expansion: _Expansion, last: torch.Tensor) -> CandidatePool:
        """EAGLE-2: grow the k best paths by confidence; every child joins the pool."""
        k = self.top_k
        pool = CandidatePool()
        top = self._log_probs(last).topk(k)
        frontier = [
            pool.add(t, -1, 1, s)
            for t, s in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        ]
        frontier_features = last.expand(k, -1)
        for step in range(1, self.depth + 1):
            hidden = expansion.feed(pool, frontier, frontier_features, step)
            top = self._log_probs(hidden).topk(k, dim=-1)
            parent_scores = torch.tensor([pool.scores[f] for f in frontier])[:, None]
            child_scores = (parent_scores + top.values).flatten()
            children = [
                pool.add(int(tok), frontier[i // k], step + 1, float(score))
                for i, (tok, score) in enumerate(
                    zip(top.indices.flatten().tolist(), child_scores.tolist(), strict=True)
                )
            ]
            best = child_scores.topk(k).indices
            frontier = [children[i] for i in best.tolist()]
            frontier_features = hidden[best // k]
        return pool

    def _static_pool(self, expansion: _Expansion, last: torch.Tensor) -> CandidatePool:
        """EAGLE-1: a fixed shape; the child of rank r is the draft's r-th best token."""
        pool = CandidatePool()
        node_of: dict[tuple[int, ...], int] = {}
        level_nodes: list[tuple[int, ...]] = [()]  # paths of the nodes whose children we add
        level_log_probs = self._log_probs(last)[None]
        level_hidden = last[None]
        max_depth = max(len(p) for p in self.static_tree)
        for step in range(1, max_depth + 1):
            next_level: list[tuple[int, ...]] = []
            for row, parent_path in enumerate(level_nodes):
                ranks = [
                    p[-1] for p in self.static_tree if p[:-1] == parent_path and len(p) == step
                ]
                if not ranks:
                    continue
                top = level_log_probs[row].topk(max(ranks) + 1)
                base = pool.scores[node_of[parent_path]] if parent_path else 0.0
                for r in ranks:
                    path = parent_path + (r,)
                    parent = node_of.get(parent_path, -1)
                    node_of[path] = pool.add(
                        int(top.indices[r]), parent, step, base + float(top.values[r])
                    )
                    next_level.append(path)
            has_children = [p for p in next_level if any(q[:-1] == p for q in self.static_tree)]
            if not has_children:
                break
            rows = [level_nodes.index(p[:-1]) for p in has_children]
            hidden = expansion.feed(
                pool, [node_of[p] for p in has_children], level_hidden[rows], step
            )
            level_nodes, level_hidden = has_children, hidden
            level_log_probs = self._log_probs(hidden)
        return pool


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
