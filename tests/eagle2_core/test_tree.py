"""Tree construction and acceptance on small examples worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from eagle2_core.config import DEFAULT_STATIC_TREE, Sampling
from eagle2_core.tree import CandidatePool, DraftTree, check_static_tree, rerank
from eagle2_core.verify import greedy_accept, sample_accept


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
    assert tree.children == ((1, 2), (3,), (4,), (), ())


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
    assert tree.tokens.tolist() == [7] and tree.paths.tolist() == [[0]]


def test_mask_positions_and_paths():
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
    assert tree.paths.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]


def test_children_are_ordered_by_score():
    tree = DraftTree(torch.tensor([0, 5, 6, 7]), (-1, 0, 0, 0), torch.tensor([0, -3.0, -1, -2]))
    assert tree.children[0] == (2, 3, 1)


def test_parents_must_precede_children():
    with pytest.raises(ValueError, match="parents must precede"):
        DraftTree(torch.tensor([0, 1, 2]), (-1, 2, 0), torch.zeros(3))


def one_hot_logits(best: list[int], vocab: int = 20) -> torch.Tensor:
    logits = torch.zeros(len(best), vocab)
    logits[torch.arange(len(best)), torch.tensor(best)] = 10.0
    return logits


def test_greedy_accept_takes_the_longest_matching_path():
    tree = rerank(example_pool(), root_token=99, budget=7)
    # target argmax per node: r->10 (a), a->12 (c), c->15 (f), f->3 (bonus)
    logits = one_hot_logits([10, 12, 0, 15, 0, 0, 3])
    assert greedy_accept(tree, logits) == ([0, 1, 3, 6], 3)
    # r->11 (b), b->0 (not e): accept b only, bonus 0
    logits = one_hot_logits([11, 0, 0, 0, 0, 0, 0])
    assert greedy_accept(tree, logits) == ([0, 2], 0)
    # nothing matches: the root alone, the bonus is the target's argmax at the root
    assert greedy_accept(tree, one_hot_logits([5] * 7)) == ([0], 5)


def test_sample_accept_certain_target_follows_it():
    tree = rerank(example_pool(), root_token=99, budget=7)
    logits = one_hot_logits([11, 0, 14, 0, 0, 2, 0], vocab=20) * 10  # p is one-hot
    got = sample_accept(tree, logits, Sampling(temperature=1.0), torch.Generator().manual_seed(0))
    assert got == ([0, 2, 5], 2)


def test_static_tree_shape_is_checked_and_ordered():
    shape = check_static_tree(((0, 0), (1,), (0,)))
    assert shape == ((0,), (1,), (0, 0))
    with pytest.raises(ValueError, match="no parent"):
        check_static_tree(((0,), (1, 0)))
    assert len(check_static_tree(DEFAULT_STATIC_TREE)) == 25
