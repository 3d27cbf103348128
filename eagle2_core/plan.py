"""How much to speculate, decided every round from what the device charges.

EAGLE-2's finding is that a node's path confidence (the product of draft probabilities
from the root) approximates the chance that it is accepted, so a tree's expected tokens
per round are 1 + the sum of its nodes' confidences. With the cost table of cost.py the
planner picks, for the whole batch (every row shares one verify forward):

- the frontier width: about as many nodes per level as recent trees held;
- the depth: one more draft step only while the tokens it is expected to add per
  millisecond it costs (the step plus verifying its nodes) beat the round's current
  tokens per millisecond;
- the tree size n: the one that maximises expected tokens / expected round time.

Confidence is calibrated online (realised accepted drafts / predicted, a running ratio),
so an over- or under-confident head, sampling, or a head that knows nothing all get sized by
what they actually achieve. A round whose best tree, drafting included, does not beat
plain decoding's rate tells the decoder to pause drafting, and one that would not beat it
even with drafting free, at the end of the longest pause, to stop drafting for the rest
of the batch (decoder.py). A fixed `total_tokens` bypasses all of this.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

import torch

from eagle2_core.cost import MAX_CURVE, CostModel
from eagle2_core.tree import Pool

MAX_NODES = MAX_CURVE  # the largest tree auto sizing considers
_DECAY = 0.9  # weight of the past in the running statistics
TOLERANCE = 0.005
# The largest share of the time a draft head's guess could be right, for judging a batch
# before any drafting: the best published heads come near it (EAGLE-2 on Vicuna-13B,
# tau 4.83 from depth-6 trees, is a chain right ~0.8 of the time per step); ours is
# right 0.4-0.5 of the time on chat.
BEST_ACCEPT = 0.8
# How far above its held-out top-1 agreement a head's guesses may be right on a job's own
# prompts: the shipped head agrees 37.5% on held-out chat and its trees reach tau 2.35 on
# gsm8k against 1.88 on MT-bench (an easier workload, guessed right more often).
ACCEPT_MARGIN = 0.25
# The least gain over plain decoding, at its head's ceiling, for which a batch starts
# drafting: finding out costs the head's prefill of every prompt and the drafting rounds
# until the batch stops (_retire), 1.4 s of 80 MT-bench rows' 9.2 s of decoding in bf16 on
# the 2-core AMX Xeon (15%), where the best 2-node tree at the ceiling could gain 8%.
PROBE_GAIN = 0.15


@dataclass
class Calibration:
    """Running statistics of one engine's rounds (they carry across batches)."""

    predicted: float = 1.0  # summed confidences of verified drafted nodes
    realised: float = 1.0  # accepted drafted nodes
    retention: float = 0.5  # share of a node's confidence its best child keeps
    nodes: float = 8.0  # tree size of recent rounds
    overhead_ms: float = 0.0  # a round's time beyond the table's forwards

    @property
    def ratio(self) -> float:
        return min(max(self.realised / self.predicted, 0.01), 2.0)

    def record(self, predicted: float, realised: float, nodes: int) -> None:
        self.predicted = _DECAY * self.predicted + predicted
        self.realised = _DECAY * self.realised + realised
        self.nodes = _DECAY * self.nodes + (1 - _DECAY) * nodes

    def record_retention(self, before: float, after: float) -> None:
        if before > 0:
            self.retention = _DECAY * self.retention + (1 - _DECAY) * min(after / before, 1.0)

    def record_overhead(self, ms: float) -> None:
        self.overhead_ms = _DECAY * self.overhead_ms + (1 - _DECAY) * max(ms, 0.0)


class Planner:
    """One round's decisions for `rows` sequences whose caches span `context` slots."""

    def __init__(
        self,
        costs: CostModel,
        calibration: Calibration,
        rows: int,
        context: int,
        caps: list[int],
        top_k: int,
        depth: int,
    ):
        self.costs, self.calibration = costs, calibration
        self.rows, self.caps = rows, caps  # caps: most nodes each row may verify
        self.depth = depth
        largest = min(MAX_NODES, max(caps))
        self.verify_ms = costs.verify_curve(rows, largest, context)
        self.width = max(1, min(top_k, math.ceil(calibration.nodes)))
        self.draft_ms = 0.0
        self.chosen, self.pays, self.verifying_pays = 1, False, False
        self._previous = torch.zeros(rows, 0)  # the previous level's frontier scores

    def drafted(self, tokens_per_row: int) -> None:
        """A draft step over tokens_per_row tokens per row has run."""
        self.draft_ms += self.costs.draft(self.rows, tokens_per_row)

    def _best(self, scores: torch.Tensor, draft_ms: float) -> tuple[int, float]:
        """(n, expected tokens per ms) of the best tree size for candidates with these
        path log-confidences [B, P], after draft_ms of drafting."""
        r = self.calibration.ratio
        ranked = scores.detach().float().cpu().exp().sort(dim=1, descending=True).values
        cumulative = torch.cat([torch.zeros(self.rows, 1), ranked.cumsum(dim=1)], dim=1)
        largest = self.verify_ms.shape[0] - 1
        sizes = torch.arange(1, largest + 1)
        caps = torch.tensor(self.caps)[:, None]
        drafted = (torch.minimum(sizes[None], caps) - 1).clamp(max=cumulative.shape[1] - 1)
        tokens = (1 + r * cumulative.gather(1, drafted)).sum(dim=0)  # [largest]
        time_ms = draft_ms + self.calibration.overhead_ms + self.verify_ms[1:]
        rate = tokens / time_ms
        # The smallest tree within TOLERANCE of the best: nodes that buy next to nothing
        # only add work (and timing noise would pick them at random).
        best = int((rate >= rate.max() * (1 - TOLERANCE)).nonzero()[0])
        return best + 1, float(rate[best])

    def keep_drafting(self, steps: int, pool: Pool, frontier_scores: torch.Tensor) -> bool:
        """After `steps` expansion steps: is one more worth its time?

        One step of lookahead: the next level would add, below each frontier node, a best
        child holding `retention` of its confidence. Draft it if the best tree over the
        pool plus those children, paying one more draft step, beats the best tree now
        (the children may displace weaker nodes, not only add to the tree)."""
        if steps and self._previous.numel():
            k = self._previous.shape[1]
            best_children = pool.scores[:, -k * k :].reshape(self.rows, k, k)[:, :, 0]
            self.calibration.record_retention(
                float(self._previous.exp().sum()), float(best_children.exp().sum())
            )
        self._previous = frontier_scores.detach().float()
        if steps >= self.depth:
            return False
        _, now = self._best(pool.scores, self.draft_ms)
        retention = max(self.calibration.retention, 1e-6)
        children = self._previous + math.log(retention)
        with_children = torch.cat(
            [pool.scores.detach().float(), children.to(pool.scores.device)], 1
        )
        step_ms = self.costs.draft(self.rows, frontier_scores.shape[1])
        _, then = self._best(with_children, self.draft_ms + step_ms)
        return then > now

    def could_pay(self, accept: float = BEST_ACCEPT) -> bool:
        """Whether any tree could beat plain decoding here by more than PROBE_GAIN, drafting
        free, for a head whose guesses are right at most `accept` of the time
        (`best_tree_tokens`; a head's own ceiling: `accept_ceiling`). Where not, the
        extra nodes cost the verify forward more than such a head brings, or more than
        finding out costs: on a 2-core CPU with a bf16 SmolLM2, from about 48 rows (two
        nodes a row cost 1.5-1.9 plain steps at 64), where drafting, tried, only ever
        cost time."""
        largest = self.verify_ms.shape[0] - 1
        sizes = torch.arange(1, largest + 1)
        caps = torch.tensor(self.caps)[:, None]
        best = best_tree_tokens(largest, accept)
        tokens = best[torch.minimum(sizes[None], caps)].sum(dim=0)
        rate = tokens / (self.calibration.overhead_ms + self.verify_ms[1:])
        return bool(rate.max() > rate[0] * (1 + PROBE_GAIN))

    def sizes(self, pool: Pool) -> list[int]:
        """Nodes to verify per row: the best common size, within each row's cap. Sets
        `pays`: whether this round, drafting included, beats plain decoding's rate, and
        `verifying_pays`: whether it would if drafting cost nothing (where it does not,
        the extra nodes cost the verify forward more than they are expected to bring:
        a batch too large for this head's acceptance on this device)."""
        n, rate = self._best(pool.scores, self.draft_ms)
        plain = self.rows / (self.calibration.overhead_ms + float(self.verify_ms[1]))
        self.chosen, self.pays = n, rate > plain
        free = self._best(pool.scores, 0.0)[1]  # the root alone is plain decoding: no gain
        self.verifying_pays = self.pays or free > plain * (1 + TOLERANCE)
        return [min(n, cap) for cap in self.caps]


def accept_ceiling(held_out_top1: float | None) -> float:
    """The largest share of the time a head's guess could be right on a job's prompts:
    its held-out top-1 agreement (recorded by train-draft) plus ACCEPT_MARGIN, between a
    half (where `best_tree_tokens` holds) and BEST_ACCEPT; BEST_ACCEPT for a head that
    records none. At 80 rows on the 2-core Zen 5 EPYC a head right 0.8 of the time could
    gain 8% in fp32 (a second node a row costs 1.66 plain steps), so the shipped head
    (37.5%) probed every batch: its prefill and probe rounds cost 3-4% of the decoding
    before the batch stopped drafting."""
    if held_out_top1 is None:
        return BEST_ACCEPT
    return min(BEST_ACCEPT, max(0.5, held_out_top1 + ACCEPT_MARGIN))


def best_tree_tokens(largest: int, accept: float = BEST_ACCEPT) -> torch.Tensor:
    """Expected tokens a round of the best trees of 0..largest nodes (index n) could bring,
    for a head whose guess is right at most `accept` of the time (at least a half). The
    children of a node then hold at most `accept` and 1 - `accept` of its path's chance
    between them (what any distribution whose largest share is `accept` concentrates in
    its likeliest children, at most), so no n-node tree beats the n likeliest nodes of
    the binary tree with those two shares."""
    likeliest, frontier = [], [-1.0]  # the root is always "accepted": plain decoding's token
    while len(likeliest) < largest:
        chance = -heapq.heappop(frontier)
        likeliest.append(chance)
        heapq.heappush(frontier, -chance * accept)
        heapq.heappush(frontier, -chance * (1 - accept))
    return torch.tensor([0.0, *itertools.accumulate(likeliest)])
