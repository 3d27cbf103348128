"""EAGLE-2 drafting for a whole batch: one head step for all rows per tree level.

One sequence is a batch of one. Each round:
1. catch up: the head runs over every row's newly committed tokens (their target
   features and the token after each) and caches them; its last output drafts the
   root's children;
2. expand: the top-k nodes by path confidence of every row (the frontier) are fed at
   once, each seeing the row's context and its own ancestors; all k x k children join
   the row's candidate pool and the best k become the next frontier;
3. the caller picks each row's tree from the pool (tree.select).
The expansion's cache entries are dropped after the round; the next round re-feeds the
target's true features of the accepted tokens. A row with generation controls has its
draft's log-probabilities processed along each node's branch (the `adjust` hook:
controls.py), so its draft proposes what its processed target would choose.

The candidate pool, frontier and masks are tensors; nothing loops over nodes in Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from eagle2_core.lean_head import LeanHead
from eagle2_core.tree import Pool


class DraftPlan(Protocol):
    """Decides the frontier width and when to stop expanding (plan.Planner, or fixed)."""

    width: int

    def drafted(self, tokens_per_row: int) -> None: ...

    def keep_drafting(self, steps: int, pool: Pool, frontier_scores: torch.Tensor) -> bool: ...


@dataclass
class FixedPlan:
    """The reference's fixed tree: top_k wide, `depth` expansion steps."""

    width: int
    depth: int

    def drafted(self, tokens_per_row: int) -> None:
        pass

    def keep_drafting(self, steps: int, pool: Pool, frontier_scores: torch.Tensor) -> bool:
        return steps < self.depth


@dataclass(frozen=True)
class Fresh:
    """Each row's tokens committed since its last draft: target features [B, W, H], the
    token after each [B, W] (the last real one is the next root) and counts [B]."""

    features: torch.Tensor
    tokens: torch.Tensor
    lengths: torch.Tensor

    def roots(self) -> torch.Tensor:
        rows = torch.arange(self.tokens.shape[0], device=self.tokens.device)
        return self.tokens[rows, self.lengths - 1]


class DynamicDrafter:
    """Dynamic draft trees for the rows of a batch; rows join with `add` and leave with
    `remove_rows`, in step with the target's cache."""

    def __init__(self, head: LeanHead, depth: int):
        self.head = head
        self.depth = depth
        self.kv = head.kv()

    @property
    def rows(self) -> int:
        return self.kv.rows

    @torch.inference_mode()
    def add_rows(self, joins: list[tuple[torch.Tensor, torch.Tensor]], budget: int) -> None:
        """Rows join after their prefill, in this order: each row's (features,
        next_tokens) caches the head over all but its last committed token (its first
        round drafts from that one, like every later round). In padded groups of
        consecutive rows of up to `budget` slots: a head forward of a few hundred tokens
        instead of one per row (80 MT-bench rows one at a time took 1.25 s in fp32 and
        0.35-0.47 s in bf16 on the 2-core EPYC). The cache grows once for all of them:
        growing it group by group zero-filled and copied it ~20 times."""
        self.kv.reserve(self.rows + len(joins), max(len(t) - 1 for _, t in joins))
        first = 0
        while first < len(joins):
            end, width = first + 1, len(joins[first][1]) - 1
            while end < len(joins):
                wider = max(width, len(joins[end][1]) - 1)
                if wider * (end - first + 1) > budget:
                    break
                end, width = end + 1, wider
            self._add_group(joins[first:end], width)
            first = end

    def _add_group(self, joins: list[tuple[torch.Tensor, torch.Tensor]], width: int) -> None:
        """One head forward over rows padded to `width` (causal: a real token never sees
        the padding after it, and the padding's slots stay holes)."""
        lengths = [len(tokens) - 1 for _, tokens in joins]
        keys, values = self.kv.add_rows(lengths, width)
        if width == 0:
            return
        features = joins[0][0]
        b, device = len(joins), features.device
        tokens = torch.zeros(b, width, dtype=torch.long, device=device)
        inputs = features.new_zeros(b, width, features.shape[-1])
        for row, ((row_features, row_tokens), n) in enumerate(zip(joins, lengths, strict=True)):
            tokens[row, :n] = row_tokens[:n]
            inputs[row, :n] = row_features[:n]
        positions = torch.arange(width, device=device)[None].expand(b, width)
        self.head.step(tokens, self.head.lift(inputs), positions, keys, values, 0, None)

    @torch.inference_mode()
    def remove_rows(self, rows: list[int]) -> list[int]:
        return self.kv.remove_rows(rows)

    @torch.inference_mode()
    def draft(
        self,
        fresh: Fresh,
        context_lens: torch.Tensor,
        plan: DraftPlan,
        adjust: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[Pool, int]:
        """Every row's candidate pool, and the deepest level in it.

        context_lens [B]: tokens in each row's target cache (the root is not among them).
        adjust: processes the draft's log-probabilities [B, M, Vd] of nodes whose branches
        below the root are [B, M, D] (controls.draft_adjust); None leaves them as they are."""
        head, kv = self.head, self.kv
        k = min(plan.width, head.vocab_size)
        last = self._catch_up(fresh, context_lens, room=self.depth * k)
        plan.drafted(fresh.tokens.shape[1])
        b, device = kv.rows, last.device
        log_probs = head.log_probs(last)
        if adjust is not None:
            no_branch = torch.zeros(b, 1, 0, dtype=torch.long, device=device)
            log_probs = adjust(log_probs[:, None], no_branch)[:, 0]
        top = log_probs.topk(k, dim=-1)  # the root's children [B, k]
        pool = _PoolBuilder(head.token_ids[top.indices], top.values)
        frontier = torch.arange(k, device=device).expand(b, k)  # pool index of each node
        frontier_tokens, frontier_scores = pool.tokens[0], top.values
        hidden_in = last[:, None].expand(b, k, last.shape[-1])
        parent_slot = torch.full((b, k), -1, dtype=torch.long, device=device)  # -1: the root
        ancestors = torch.zeros(b, 0, 0, dtype=torch.bool, device=device)  # [B, fed, fed]
        base = kv.slots
        paths = pool.tokens[0][:, :, None] if adjust is not None else None  # [B, k, depth]
        steps = 0
        while plan.keep_drafting(steps, pool.build(), frontier_scores):
            fed = ancestors.shape[1]
            own = torch.zeros(b, k, fed + k, dtype=torch.bool, device=device)
            if fed:
                index = parent_slot.clamp(min=0)[:, :, None].expand(b, k, fed)
                own[:, :, :fed] = ancestors.gather(1, index) & (parent_slot >= 0)[:, :, None]
            own[:, torch.arange(k), fed + torch.arange(k)] = True
            grown = torch.zeros(b, fed + k, fed + k, dtype=torch.bool, device=device)
            grown[:, :fed, :fed] = ancestors
            grown[:, fed:] = own
            ancestors = grown
            mask = torch.cat([kv.valid[:, None, :].expand(b, k, base), own], dim=2)[:, None]
            positions = (context_lens + steps)[:, None].expand(b, k)  # depth steps + 1
            keys, values = kv.layer_views()
            hidden = head.step(
                frontier_tokens, hidden_in, positions, keys, values, base + fed, mask
            )
            plan.drafted(k)
            log_probs = head.log_probs(hidden)
            if paths is not None:
                log_probs = adjust(log_probs, paths)
            top = log_probs.topk(k, dim=-1)  # [B, k, k]
            child_scores = (frontier_scores[:, :, None] + top.values).reshape(b, k * k)
            child_tokens = head.token_ids[top.indices].reshape(b, k * k)
            offset = pool.add(child_tokens, frontier.repeat_interleave(k, dim=1), child_scores)
            best = child_scores.topk(k, dim=-1).indices  # [B, k]
            frontier = offset + best
            frontier_tokens = child_tokens.gather(1, best)
            frontier_scores = child_scores.gather(1, best)
            hidden_in = hidden.gather(1, (best // k)[:, :, None].expand(b, k, hidden.shape[-1]))
            parent_slot = fed + best // k
            if paths is not None:  # each new frontier node's branch: its parent's, then it
                up = paths.gather(1, (best // k)[:, :, None].expand(-1, -1, paths.shape[2]))
                paths = torch.cat([up, frontier_tokens[:, :, None]], dim=2)
            steps += 1
        return pool.build(), steps + 1

    def _catch_up(self, fresh: Fresh, context_lens: torch.Tensor, room: int) -> torch.Tensor:
        """Run the head over each row's fresh tokens and cache them (with `room` more
        slots free for the expansion); returns each row's last output state [B, H]."""
        kv = self.kv
        b, w = fresh.tokens.shape
        device = fresh.tokens.device
        start = kv.reserve_new(w + room)
        offsets = torch.arange(w, device=device)
        positions = (context_lens - fresh.lengths)[:, None] + offsets[None]
        causal = torch.ones(w, w, dtype=torch.bool, device=device).tril().expand(b, w, w)
        keys, values = kv.layer_views()
        hidden = self.head.step(
            fresh.tokens,
            self.head.lift(fresh.features),
            positions,
            keys,
            values,
            start,
            kv.tree_mask(causal),
        )
        kv.commit(start, offsets.expand(b, w), fresh.lengths)
        rows = torch.arange(b, device=device)
        return hidden[rows, fresh.lengths - 1]


class _PoolBuilder:
    """A row-batched candidate pool grown one level at a time (tree.Pool when done)."""

    def __init__(self, tokens: torch.Tensor, scores: torch.Tensor):
        b, k = tokens.shape
        device = tokens.device
        self.tokens = [tokens]
        self.parents = [torch.full((b, k), -1, dtype=torch.long, device=device)]
        self.depths = [torch.ones(b, k, dtype=torch.long, device=device)]
        self.scores = [scores]
        self.size = k

    def add(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> int:
        """Append one level (children of pool nodes `parents`); returns its first index."""
        offset = self.size
        self.tokens.append(tokens)
        self.parents.append(parents)
        self.depths.append(self.depths[-1][:, :1].expand_as(tokens) + 1)
        self.scores.append(scores)
        self.size += tokens.shape[1]
        return offset

    def build(self) -> Pool:
        return Pool(
            *(torch.cat(x, dim=1) for x in (self.tokens, self.parents, self.depths, self.scores))
        )


def extend_fresh(old: Fresh, new: Fresh) -> Fresh:
    """Each row's fresh tokens followed by its newer ones (a round that skipped drafting)."""
    b, hidden = old.features.shape[0], old.features.shape[2]
    lengths = old.lengths + new.lengths
    width = int(lengths.max())
    features = old.features.new_zeros(b, width + 1, hidden)  # column `width`: a discard
    tokens = old.tokens.new_zeros(b, width + 1)
    keep = min(old.tokens.shape[1], width)
    features[:, :keep] = old.features[:, :keep]
    tokens[:, :keep] = old.tokens[:, :keep]
    offsets = torch.arange(new.tokens.shape[1], device=tokens.device)[None]
    index = torch.where(offsets < new.lengths[:, None], old.lengths[:, None] + offsets, width)
    features.scatter_(1, index[:, :, None].expand(-1, -1, hidden), new.features)
    tokens.scatter_(1, index, new.tokens)
    return Fresh(features[:, :width], tokens[:, :width], lengths)


def cat_fresh(a: Fresh, b: Fresh) -> Fresh:
    """The rows of a, then those of b (sequences joining the batch)."""
    width = max(a.tokens.shape[1], b.tokens.shape[1])

    def pad(x: torch.Tensor) -> torch.Tensor:
        extra = width - x.shape[1]
        return torch.nn.functional.pad(x, (0, 0, 0, extra) if x.dim() == 3 else (0, extra))

    return Fresh(
        torch.cat([pad(a.features), pad(b.features)]),
        torch.cat([pad(a.tokens), pad(b.tokens)]),
        torch.cat([a.lengths, b.lengths]),
    )
