"""An independent EAGLE-2 drafter for one sequence: the oracle of the batched one.

Written the plain way: the trainable `DraftHead` module (not the engine's prepared
head), a concatenating cache, a Python loop over the nodes of each level, and
`tree.rerank` over a CandidatePool, as the reference implementation describes it.
"""

from __future__ import annotations

import torch

from eagle2_core.draft import DraftCache, DraftHead
from eagle2_core.tree import CandidatePool, DraftTree, rerank, root_only


def _visible(allowed: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(allowed.shape)
    return mask.masked_fill_(~allowed, torch.finfo(mask.dtype).min)[None, None]


class ReferenceDrafter:
    """EAGLE-2 for one row: top_k wide, `depth` expansion steps, rerank to the budget.
    vocab_ids: the target ids the head may propose (all of them when None)."""

    def __init__(self, head: DraftHead, target, top_k: int, depth: int, vocab_ids=None):
        self.head, self.target = head, target
        self.top_k, self.depth = top_k, depth
        weight = target.model.get_output_embeddings().weight
        self.vocab_ids = vocab_ids if vocab_ids is not None else torch.arange(weight.shape[0])
        self.lm_head = weight[self.vocab_ids]
        self.cache: DraftCache | None = None

    def reset(self) -> None:
        self.cache = None

    def _log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(hidden @ self.lm_head.T, dim=-1)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target.model.get_input_embeddings()(tokens)[None]

    @torch.no_grad()
    def draft(self, features, next_tokens, context_len: int, budget: int) -> DraftTree:
        n = len(next_tokens)
        start = context_len - n
        causal = torch.ones(n, context_len, dtype=torch.bool).tril(diagonal=start)
        hidden, self.cache = self.head(
            self._embed(next_tokens),
            features[None],
            torch.arange(start, context_len)[None],
            self.cache,
            _visible(causal),
        )
        root = int(next_tokens[-1])
        if budget <= 1:
            return root_only(root)
        return rerank(self._pool(hidden[0, -1], context_len), root, budget)

    def _pool(self, last: torch.Tensor, context_len: int) -> CandidatePool:
        k, pool = self.top_k, CandidatePool()
        top = self._log_probs(last).topk(k)
        frontier = [
            pool.add(int(self.vocab_ids[i]), -1, 1, float(s))
            for i, s in zip(top.indices, top.values, strict=True)
        ]
        inputs = last.expand(k, -1)
        cache, slots, seen = self.cache, {}, torch.zeros(0, 0, dtype=torch.bool)
        for step in range(1, self.depth + 1):
            fed = seen.shape[0]
            rows = torch.zeros(k, fed + k, dtype=torch.bool)
            for row, node in enumerate(frontier):
                parent = pool.parents[node]
                if parent != -1:
                    rows[row, :fed] = seen[slots[parent]]
                rows[row, fed + row] = True
                slots[node] = fed + row
            grown = torch.zeros(fed + k, fed + k, dtype=torch.bool)
            grown[:fed, :fed] = seen
            grown[fed:] = rows
            seen = grown
            visible = torch.cat([torch.ones(k, context_len, dtype=torch.bool), rows], dim=1)
            tokens = torch.tensor([pool.tokens[node] for node in frontier])
            hidden, cache = self.head(
                self._embed(tokens),
                inputs[None],
                torch.full((1, k), context_len + step - 1),
                cache,
                _visible(visible),
            )
            top = self._log_probs(hidden[0]).topk(k, dim=-1)
            children = []
            for i, node in enumerate(frontier):
                for index, score in zip(top.indices[i], top.values[i], strict=True):
                    token = int(self.vocab_ids[index])
                    children.append(
                        pool.add(token, node, step + 1, pool.scores[node] + float(score))
                    )
            best = torch.tensor([pool.scores[c] for c in children]).topk(k).indices
            frontier = [children[i] for i in best.tolist()]
            inputs = hidden[0][best // k]
        return pool
