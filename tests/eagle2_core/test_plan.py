"""The planner speculates where it pays and steps aside where it cannot."""

from __future__ import annotations

import dataclasses
import math

import torch

from eagle2_core.cost import TREE_GRID, CostModel
from eagle2_core.plan import Calibration, Planner
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
