"""The planner speculates where it pays and steps aside where it cannot."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
import torch

from eagle2_core.cost import TREE_GRID, CostModel
from eagle2_core.plan import (
    BEST_ACCEPT,
    PROBE_GAIN,
    Calibration,
    Planner,
    accept_ceiling,
    best_tree_tokens,
)
from eagle2_core.tree import Pool


def costs(per_node_ms: float, base_ms: float = 30.0, draft_ms: float = 1.0) -> CostModel:
    """A device where n nodes in each of B rows cost base + per_node x (B n - 8)^+."""

    def verify(b: int, n: int) -> float:
        return base_ms + per_node_ms * max(b * n - 8, 0)

    batches = [1, 4, 16]
    return CostModel(
        key="test",
        measured_at=0.0,
        batch_grid=batches,
        tree_grid=list(TREE_GRID),
        verify_ms=[[verify(b, n) for n in TREE_GRID] for b in batches],
        width_grid=[1, 10],
        draft_ms=[[draft_ms, draft_ms] for _ in batches],
        key_ms=0.0,
    )


def chain_pool(rows: int, p: float, length: int = 12, others: float = 1e-4) -> Pool:
    """Per row: a chain whose node d has confidence p^d, and 4 hopeless siblings per level."""
    tokens, parents, depths, scores = [], [], [], []
    previous = -1
    for depth in range(1, length + 1):
        node = len(tokens)
        tokens += [depth] + [100 + depth] * 4
        parents += [previous] * 5
        depths += [depth] * 5
        scores += [depth * math.log(p)] + [math.log(others)] * 4
        previous = node
    expand = lambda x, dtype: torch.tensor([x] * rows, dtype=dtype)  # noqa: E731
    return Pool(expand(tokens, torch.long), expand(parents, torch.long),
                expand(depths, torch.long), expand(scores, torch.float32))  # fmt: skip


def planner(device: CostModel, rows: int = 1, calibration: Calibration | None = None) -> Planner:
    calibration = calibration or Calibration()
    return Planner(device, calibration, rows, 256, [128] * rows, top_k=10, depth=12)


def test_a_confident_draft_on_a_flat_device_verifies_a_long_chain():
    plan = planner(costs(per_node_ms=0.5))
    # the whole 12-node chain (nodes cost 0.5 ms past 8), none of its hopeless siblings
    assert plan.sizes(chain_pool(1, p=0.9)) == [13]


def test_short_contexts_cost_what_the_table_measured():
    """A steep per-key slope (measured on a loaded machine) never makes a short context's
    forward free: the planner divided by that once."""
    device = dataclasses.replace(costs(per_node_ms=0.5), key_ms=0.01)
    short = device.verify_curve(2, 16, context=40)
    assert torch.equal(short, device.verify_curve(2, 16, context=256))
    assert bool((short[1:] >= 30.0).all())
    assert device.verify(2, 4, context=1256) == device.verify(2, 4) + 0.01 * 2 * 4 * 1000
    plan = Planner(device, Calibration(), 2, 40, [16, 16], top_k=10, depth=5)
    assert plan.sizes(chain_pool(2, p=0.9)) == [13, 13]


def test_a_useless_draft_verifies_the_root_alone():
    plan = planner(costs(per_node_ms=0.5))
    assert plan.sizes(chain_pool(1, p=1e-3)) == [1]
    frontier = torch.full((1, 4), math.log(1e-3))
    assert not plan.keep_drafting(1, chain_pool(1, p=1e-3), frontier)


def test_trees_shrink_as_the_batch_grows():
    device = costs(per_node_ms=2.0)
    alone = planner(device, rows=1).sizes(chain_pool(1, p=0.8))[0]
    batched = planner(device, rows=16).sizes(chain_pool(16, p=0.8))[0]
    assert 1 <= batched < alone


def test_calibration_turns_an_overconfident_head_down():
    calibration = Calibration()
    trusting = planner(costs(per_node_ms=1.0), calibration=calibration).sizes(chain_pool(1, 0.9))
    for _ in range(40):  # it predicts ~5 accepted tokens a round and gets none
        calibration.record(predicted=5.0, realised=0.0, nodes=trusting[0])
    sceptical = planner(costs(per_node_ms=1.0), calibration=calibration).sizes(chain_pool(1, 0.9))
    assert calibration.ratio < 0.05
    assert sceptical[0] < trusting[0]


def test_drafting_goes_deeper_only_while_it_pays():
    plan = planner(costs(per_node_ms=0.2, draft_ms=1.0))
    confident = torch.full((1, 4), math.log(0.8))
    assert plan.keep_drafting(0, chain_pool(1, 0.9, length=1), confident)
    assert not plan.keep_drafting(12, chain_pool(1, 0.9), confident)  # the depth cap
    costly = planner(costs(per_node_ms=0.2, draft_ms=200.0))
    assert not costly.keep_drafting(0, chain_pool(1, 0.9, length=1), confident)


def test_each_row_keeps_within_its_cap():
    plan = Planner(costs(0.1), Calibration(), 2, 256, [3, 128], top_k=10, depth=12)
    n = plan.sizes(chain_pool(2, p=0.95))
    assert n[0] == 3 and n[1] > 3


def test_the_best_tree_tokens_of_a_head_right_at_most_accept_of_the_time():
    """The root, then the likeliest nodes of the binary tree of shares 0.8 and 0.2: down
    the chain (0.8, 0.64, 0.512, 0.4096 ..) until its next node falls below the root's
    second child (0.2), then the chain again (0.168 beats that child's own 0.16)."""
    tokens = best_tree_tokens(9, accept=0.8).tolist()
    chain = [0.8**d for d in range(8)]  # 1 .. 0.21
    expected = [0.0, *itertools.accumulate(chain), sum(chain) + 0.2]
    assert tokens == pytest.approx(expected)
    assert best_tree_tokens(10, accept=0.8)[10] == pytest.approx(expected[-1] + 0.8**8)


def random_tree_tokens(rng: random.Random, nodes: int, accept: float) -> float:
    """Expected tokens of the best `nodes`-node tree when each node's guesses have random
    chances: the first up to `accept`, the rest sharing up to what is left."""
    chances, frontier = [], [1.0]
    while len(chances) < nodes:
        frontier.sort()
        chance = frontier.pop()
        chances.append(chance)
        first = accept * rng.choice([1.0, rng.random()])
        rest = [rng.random() for _ in range(rng.randint(0, 4))]
        left = (1 - first) * rng.choice([1.0, rng.random()])
        shares = [first] + [min(r / sum(rest) * left, first) for r in rest]
        frontier += [chance * share for share in shares]
    return sum(chances)


def test_no_tree_of_a_head_right_at_most_accept_of_the_time_beats_the_bound():
    rng = random.Random(0)
    bound = best_tree_tokens(24)
    for _ in range(500):
        nodes = rng.randint(1, 24)
        assert random_tree_tokens(rng, nodes, BEST_ACCEPT) <= bound[nodes] + 1e-9


def test_a_batch_could_pay_only_where_extra_nodes_cost_little():
    """Nodes past eight cost 3 ms against a 30 ms forward: one row could gain from any
    head near BEST_ACCEPT; 16 rows pay 48 ms for a second node each, where two tokens
    would have to come from 78 / 30 = 2.6 plain steps' time."""
    assert planner(costs(per_node_ms=3.0), rows=1).could_pay()
    assert not planner(costs(per_node_ms=3.0), rows=16).could_pay()
    assert planner(costs(per_node_ms=0.0), rows=16).could_pay()


def test_a_head_recorded_as_weaker_is_judged_by_its_own_ceiling():
    """Nodes past eight cost 1 ms on a 30 ms forward: at 16 rows a second node each costs
    54 / 38 = 1.42 plain steps, which a head right 0.8 of the time repays with room to
    spare (1.8 tokens, 27% more) and one right at most 0.625 of the time (held-out top-1
    0.375 plus the margin) does not by PROBE_GAIN (14% more at best)."""
    assert planner(costs(per_node_ms=1.0), rows=16).could_pay()
    assert not planner(costs(per_node_ms=1.0), rows=16).could_pay(accept_ceiling(0.375))
    assert planner(costs(per_node_ms=1.0), rows=1).could_pay(accept_ceiling(0.375))


def test_a_batch_drafts_only_where_the_best_gain_repays_finding_out():
    """Where a second node a row costs 42 / 34 = 1.24 plain steps at 16 rows, a head right
    at most 0.625 of the time could gain 32% (1.625 tokens), above PROBE_GAIN: that batch
    drafts. At 1.42 (above) the same head could gain only 14%: less than its prefill and
    probe rounds would cost."""
    assert PROBE_GAIN > 1.625 / (54 / 38) - 1
    assert planner(costs(per_node_ms=0.5), rows=16).could_pay(accept_ceiling(0.375))


def test_the_ceiling_is_the_recorded_agreement_plus_a_margin_within_bounds():
    assert accept_ceiling(None) == BEST_ACCEPT  # a head that records nothing
    assert accept_ceiling(0.375) == pytest.approx(0.625)
    assert accept_ceiling(0.7) == BEST_ACCEPT
    assert accept_ceiling(0.05) == 0.5  # where best_tree_tokens' bound holds
