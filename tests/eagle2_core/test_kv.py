"""BatchKV bookkeeping on hand-made caches whose entries name their row and token."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from eagle2_core.kv import BatchKV
from eagle2_core.tree import DraftTree


def cache_of(rows: list[list[float]]) -> DynamicCache:
    """A 1-layer cache, 1 head, dim 1: the entry is the token's label (rows equal length)."""
    cache = DynamicCache()
    keys = torch.tensor(rows, dtype=torch.float32)[:, None, :, None]
    cache.update(keys, keys.clone(), 0)
    return cache


def contents(kv: BatchKV) -> list[list[float]]:
    keys = kv.cache.layers[0].keys[:, 0, :, 0]
    return [keys[b][kv.valid[b]].tolist() for b in range(kv.rows)]


def append_tree(kv: BatchKV, labels: list[list[float]]) -> None:
    """What a verify forward does to the cache: every row gets N new slots."""
    new = torch.tensor(labels, dtype=torch.float32)[:, None, :, None]
    kv.cache.update(new, new.clone(), 0)


def test_rows_of_different_lengths_commit_their_own_nodes_and_compact():
    kv = BatchKV(cache_of([[1, 2, 3, 4, 5, 6]]), 6)
    kv.add(cache_of([[10, 11]]), 2)
    assert contents(kv) == [[1, 2, 3, 4, 5, 6], [10, 11]]
    append_tree(kv, [[7, 70, 8], [12, 120, 13]])
    kv.commit([[0, 2], [1]])  # not a prefix: row 0 keeps nodes 0 and 2, row 1 node 1
    assert contents(kv) == [[1, 2, 3, 4, 5, 6, 7, 8], [10, 11, 120]]
    assert kv.slots == 8  # grew by the longest accepted path
    kv.keep_rows([1])  # the long row finished: the short one alone fills 3 of 8 slots
    assert contents(kv) == [[10, 11, 120]]
    assert kv.slots == 3 and bool(kv.valid.all())  # compacted, order kept


def test_tree_mask_hides_holes_and_other_branches():
    kv = BatchKV(cache_of([[1, 2, 3]]), 3)
    kv.add(cache_of([[9]]), 1)
    chain = DraftTree(torch.tensor([5, 6]), (-1, 0), torch.zeros(2))
    fork = DraftTree(torch.tensor([5, 6, 7]), (-1, 0, 0), torch.zeros(3))
    visible = kv.tree_mask([chain, fork], torch.float32)[:, 0] == 0
    assert visible.shape == (2, 3, 3 + 3)
    assert visible[0, :2].tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]
    assert visible[0, 2].tolist() == [0, 0, 0, 0, 0, 1]  # padding sees only itself
    assert visible[1].tolist() == [[1, 0, 0, 1, 0, 0], [1, 0, 0, 1, 1, 0], [1, 0, 0, 1, 0, 1]]
