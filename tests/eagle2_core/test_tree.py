"""Tree construction and acceptance on small examples worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from eagle2_core.config import DEFAULT_STATIC_TREE, Sampling
from eagle2_core.tree import (
    CandidatePool,
    DraftTree,
    Pool,
    check_static_tree,
    rerank,
    select,
    stack,
)
from eagle2_core.verify import accept, choose_token, draw


def ln(p: float) -> float:
    return math.log(p)


def example_pool() -> CandidatePool:
    """Root r has children a (0.6), b (0.3); a has c (0.5 -> 0.30), d (0.4 -> 0.24);
    b has e (0.9 -> 0.27); c has f (0.5 -> 0.15)."""
    pool = CandidatePool()
    a = pool.add(10, -1, 1, ln(0.6))
    b = pool.add(11, -1, 1, ln(0.3))
    c = pool.add(12, a, 2, ln(0.6) + ln(0.5))
    pool.add(13, a, 2, ln(0.6) + ln(0.4))
    e = pool.add(14, b, 2, ln(0.3) + ln(0.9))
    pool.add(15, c, 3, ln(0.6) + ln(0.5) + ln(0.5))
    assert e == 4
    return pool


def test_rerank_keeps_highest_confidence_nodes_as_a_tree():
    # scores: a .6, c .3, b .3, e .27, d .24, f .15 ; budget 5 -> root + a, b, c, e
    tree = rerank(example_pool(), root_token=99, budget=5)
    assert tree.tokens.tolist() == [99, 10, 11, 12, 14]
    assert tree.parents == (-1, 0, 0, 1, 2)
    assert tree.depths.tolist() == [0, 1, 1, 2, 2]


def test_rerank_ties_prefer_the_shallower_node_so_no_node_is_orphaned():
    pool = CandidatePool()
    a = pool.add(1, -1, 1, -1.0)
    pool.add(2, a, 2, -1.0)  # the draft was certain: the child ties its parent
    pool.add(3, -1, 1, -1.0)  # a sibling of a ties too
    tree = rerank(pool, root_token=0, budget=2)
    assert tree.tokens.tolist() == [0, 1]
    tree = rerank(pool, root_token=0, budget=3)
    assert tree.tokens.tolist() == [0, 1, 3]  # depth 1 first, then index


def test_budget_one_is_the_root_alone():
    tree = rerank(example_pool(), root_token=7, budget=1)
    assert tree.tokens.tolist() == [7] and tree.ancestor_mask.tolist() == [[True]]


def test_mask_and_positions():
    tree = rerank(example_pool(), root_token=99, budget=7)
    # nodes: 0 r, 1 a, 2 b, 3 c, 4 d, 5 e, 6 f
    assert tree.parents == (-1, 0, 0, 1, 1, 2, 3)
    expected_mask = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],
            [1, 0, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.ancestor_mask, expected_mask)
    assert (tree.depths + 40).tolist() == [40, 41, 41, 42, 42, 42, 43]  # positions


def test_parents_must_precede_children():
    with pytest.raises(ValueError, match="parents must precede"):
        DraftTree(torch.tensor([0, 1, 2]), (-1, 2, 0), torch.zeros(3))


def as_pool(pool: CandidatePool) -> Pool:
    """The same candidates as a batch of one."""
    return Pool(
        torch.tensor([pool.tokens]),
        torch.tensor([pool.parents]),
        torch.tensor([pool.depths]),
        torch.tensor([pool.scores], dtype=torch.float32),
    )


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 7, 20])
def test_batched_select_builds_what_rerank_builds(budget):
    pool = example_pool()
    pool.scores[1] = ln(0.29)  # b ties c in exact arithmetic; fp32 and fp64 round it apart
    want = rerank(pool, root_token=99, budget=budget)
    trees = select(as_pool(pool), torch.tensor([99]), [budget], max_depth=3)
    got = trees.row(0)
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.parents == want.parents
    assert trees.depths[0].tolist() == want.depths.tolist()
    assert torch.equal(trees.ancestors[0], want.ancestor_mask)


def test_select_sizes_rows_separately_and_pads():
    pool = as_pool(example_pool())
    two = Pool(*(torch.cat([x, x]) for x in (pool.tokens, pool.parents, pool.depths, pool.scores)))
    trees = select(two, torch.tensor([7, 8]), [3, 6], max_depth=3)
    assert trees.sizes.tolist() == [3, 6]
    assert trees.tokens.shape == (2, 6)
    assert trees.row(0).tokens.tolist() == [7, 10, 11]
    assert trees.real[0].tolist() == [True] * 3 + [False] * 3
    assert trees.ancestors[0, 4].tolist() == [False] * 4 + [True, False]  # padding: itself


def test_ties_keep_parents_in_the_batched_select():
    """A batched pool holds level after level, so a tie goes to the shallower node."""
    pool = CandidatePool()
    a = pool.add(1, -1, 1, -1.0)
    pool.add(3, -1, 1, -1.0)  # a sibling of a ties too
    pool.add(2, a, 2, -1.0)  # the draft was certain: the child ties its parent
    for budget, want in ((2, [0, 1]), (3, [0, 1, 3]), (4, [0, 1, 3, 2])):
        got = select(as_pool(pool), torch.tensor([0]), [budget], max_depth=2).row(0)
        assert got.tokens.tolist() == want


def argmax_of(best: list[int], vocab: int = 20) -> torch.Tensor:
    """Choices [1, N] of a target whose argmax at node i is best[i]."""
    return torch.tensor([best])


def test_accept_takes_the_longest_matching_path():
    trees = stack([rerank(example_pool(), root_token=99, budget=7)], "cpu")
    # target's choice per node: r->10 (a), a->12 (c), c->15 (f), f->3 (bonus)
    got = accept(trees, argmax_of([10, 12, 0, 15, 0, 0, 3]))
    assert got.nodes[0, :4].tolist() == [0, 1, 3, 6] and got.lengths.tolist() == [4]
    assert got.bonus.tolist() == [3]
    # r->11 (b), b->0 (not e): accept b only, bonus 0
    got = accept(trees, argmax_of([11, 0, 0, 0, 0, 0, 0]))
    assert got.nodes[0, :2].tolist() == [0, 2] and got.lengths.tolist() == [2]
    assert got.bonus.tolist() == [0]
    # nothing matches: the root alone, the bonus is the target's choice at the root
    got = accept(trees, argmax_of([5] * 7))
    assert got.lengths.tolist() == [1] and got.bonus.tolist() == [5]


def test_accept_ignores_padding_nodes():
    short = DraftTree(torch.tensor([4, 0]), (-1, 0), torch.tensor([0.0, -1.0]))
    long = rerank(example_pool(), root_token=99, budget=7)
    trees = stack([short, long], "cpu")
    choices = torch.tensor([[0, 0, 0, 0, 0, 0, 0], [10, 12, 0, 15, 0, 0, 3]])
    got = accept(trees, choices)  # row 0's padding holds token 0 under its "root": ignored
    assert got.lengths.tolist() == [2, 4]
    assert got.nodes[0, :2].tolist() == [0, 1]


def test_inverse_cdf_draws():
    probs = torch.tensor([0.2, 0.5, 0.3])
    uniforms = torch.tensor([0.0, 0.1, 0.2, 0.69, 0.7, 0.999])
    assert draw(probs.expand(6, 3), uniforms).tolist() == [0, 0, 1, 1, 2, 2]
    unnormalised = torch.tensor([2.0, 5.0, 3.0])  # a distribution up to its scale
    assert draw(unnormalised.expand(6, 3), uniforms).tolist() == [0, 0, 1, 1, 2, 2]
    logits = torch.tensor([0.0, 5.0, 1.0])
    assert choose_token(logits, Sampling(), 0.0) == 1  # greedy ignores the uniform
    certain = torch.tensor([0.0, 50.0, 1.0])
    assert choose_token(certain, Sampling(temperature=1.0), 0.999) == 1


def test_static_tree_shape_is_checked_and_ordered():
    shape = check_static_tree(((0, 0), (1,), (0,)))
    assert shape == ((0,), (1,), (0, 0))
    with pytest.raises(ValueError, match="no parent"):
        check_static_tree(((0,), (1, 0)))
    assert len(check_static_tree(DEFAULT_STATIC_TREE)) == 25
