"""BatchKV (the draft head's) and RaggedKV (the target's) bookkeeping on hand-made entries
that name their row and token."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from eagle2_core import kv as kv_module
from eagle2_core.kv import BatchKV, RaggedKV, RowStarts, chunk_cost
from eagle2_core.tree import DraftTree, stack


def new_kv() -> BatchKV:
    """Two layers, 1 head, dim 1: layer 1 holds the label + 100, so layers stay apart."""
    return BatchKV(2, 1, 1, torch.float32, "cpu")


def write(keys: torch.Tensor, values: torch.Tensor, start: int, labels: list[list[float]]):
    """What a forward does: every row's new entries at slots start.."""
    new = torch.tensor(labels, dtype=torch.float32)[:, None, :, None]
    n = new.shape[2]
    for layer, offset in ((0, 0.0), (1, 100.0)):
        keys[layer, :, :, start : start + n] = new + offset
        values[layer, :, :, start : start + n] = -(new + offset)


def add(kv: BatchKV, labels: list[float]) -> None:
    keys, values = kv.add_row(len(labels))
    write(keys, values, 0, [labels])


def contents(kv: BatchKV, layer: int = 0) -> list[list[float]]:
    keys = kv.keys[layer, : kv.rows, 0, : kv.slots, 0]
    values = kv.values[layer, : kv.rows, 0, : kv.slots, 0]
    assert torch.equal(values, -keys)
    return [keys[b][kv.valid[b]].tolist() for b in range(kv.rows)]


def test_rows_of_different_lengths_commit_their_own_nodes_and_compact():
    kv = new_kv()
    add(kv, [1, 2, 3, 4, 5, 6])
    add(kv, [10, 11])
    assert contents(kv) == [[1, 2, 3, 4, 5, 6], [10, 11]]
    start = kv.reserve_new(3)
    assert start == 6
    write(*kv.layer_views(), start, [[7, 70, 8], [12, 120, 13]])
    # Not a prefix: row 0 keeps nodes 0 and 2, row 1 node 1.
    kv.commit(start, torch.tensor([[0, 2], [1, 0]]), torch.tensor([2, 1]))
    assert contents(kv) == [[1, 2, 3, 4, 5, 6, 7, 8], [10, 11, 120]]
    assert contents(kv, layer=1) == [[101, 102, 103, 104, 105, 106, 107, 108], [110, 111, 220]]
    assert kv.slots == 8  # grew by the longest accepted path
    assert kv.remove_rows([0]) == [1]  # the long row finished: the short one fills 3 of 8
    assert contents(kv) == [[10, 11, 120]]
    assert kv.slots == 3 and bool(kv.valid.all())  # compacted, order kept


def test_removed_rows_are_filled_from_the_end():
    kv = new_kv()
    for label in range(5):
        add(kv, [label, label + 0.5])
    assert kv.remove_rows([1, 4]) == [0, 3, 2]
    assert contents(kv) == [[0, 0.5], [3, 3.5], [2, 2.5]]
    add(kv, [9, 9.5, 9.75])  # a new row after removals, longer than the others
    assert contents(kv) == [[0, 0.5], [3, 3.5], [2, 2.5], [9, 9.5, 9.75]]


def test_rows_added_together_keep_their_own_lengths_and_the_padding_is_holes():
    kv = new_kv()
    add(kv, [1, 1.5])
    keys, values = kv.add_rows([3, 0, 1], width=3)  # three prompts padded to 3 slots
    assert keys.shape[1] == 3
    write(keys, values, 0, [[2, 2.5, 2.75], [-9, -9, -9], [4, -9, -9]])
    assert contents(kv) == [[1, 1.5], [2, 2.5, 2.75], [], [4]]
    assert kv.lengths.tolist() == [2, 3, 0, 1]
    add(kv, [5])  # one more after them, as add_row writes it
    assert contents(kv)[-1] == [5]


def test_storage_grows_and_keeps_what_it_holds():
    kv = new_kv()
    add(kv, [1.0] * 70)
    for step in range(40):
        start = kv.reserve_new(4)
        write(*kv.layer_views(), start, [[step, -1, -1, -1]])
        kv.commit(start, torch.tensor([[0]]), torch.tensor([1]))
    assert contents(kv) == [[1.0] * 70 + [float(s) for s in range(40)]]
    assert kv.keys.shape[3] >= 110 and kv.keys.shape[3] % 64 == 0


def test_tree_mask_hides_holes_and_other_branches():
    kv = new_kv()
    add(kv, [1, 2, 3])
    add(kv, [9])
    chain = DraftTree(torch.tensor([5, 6]), (-1, 0), torch.zeros(2))
    fork = DraftTree(torch.tensor([5, 6, 7]), (-1, 0, 0), torch.zeros(3))
    visible = kv.tree_mask(stack([chain, fork], "cpu").ancestors)[:, 0]
    assert visible.shape == (2, 3, 3 + 3)
    assert visible[0, :2].tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]
    assert visible[0, 2, 3:].tolist() == [0, 0, 1]  # padding sees only itself among the new
    assert visible[1].tolist() == [[1, 0, 0, 1, 0, 0], [1, 0, 0, 1, 1, 0], [1, 0, 0, 1, 0, 1]]


# --------------------------------------------------------------------- RaggedKV (the target's)


def new_ragged() -> RaggedKV:
    return RaggedKV(2, 1, 1, torch.float32, "cpu")


def write_rows(kv: RaggedKV, start: RowStarts, labels: list[list[float]]) -> None:
    """What a forward does with RowStarts: row b's new entries after its own ones."""
    keys, values = kv.layer_views()
    for b, row in enumerate(labels):
        at = int(start.starts[b])
        for layer, offset in ((0, 0.0), (1, 100.0)):
            new = torch.tensor(row) + offset
            keys[layer, b, 0, at : at + len(row), 0] = new
            values[layer, b, 0, at : at + len(row), 0] = -new


def add_ragged(kv: RaggedKV, labels: list[float]) -> None:
    keys, values = kv.add_row(len(labels))
    write(keys, values, 0, [labels])


def ragged_contents(kv: RaggedKV, layer: int = 0) -> list[list[float]]:
    keys = kv.keys[layer, : kv.rows, 0, :, 0]
    assert torch.equal(kv.values[layer, : kv.rows, 0, :, 0], -keys)
    return [keys[b, :n].tolist() for b, n in enumerate(kv.lens)]


def test_ragged_rows_write_after_their_own_entries_and_commit_their_own_nodes():
    kv = new_ragged()
    add_ragged(kv, [1, 2, 3, 4, 5, 6])
    add_ragged(kv, [10, 11])
    start = kv.reserve_new(3)
    assert start.starts.tolist() == [6, 2] and start.span == 9  # no slot shared, no hole
    write_rows(kv, start, [[7, 70, 8], [12, 120, 13]])
    # Not a prefix: row 0 keeps nodes 0 and 2, row 1 node 1.
    kv.commit(start, torch.tensor([[0, 2], [1, 0]]), torch.tensor([2, 1]))
    assert ragged_contents(kv) == [[1, 2, 3, 4, 5, 6, 7, 8], [10, 11, 120]]
    assert ragged_contents(kv, layer=1) == [
        [101, 102, 103, 104, 105, 106, 107, 108],
        [110, 111, 220],
    ]
    assert kv.lens == [8, 3] and kv.slots == 8
    assert kv.remove_rows([0]) == [1]  # the long row finished: the short one moves up
    assert ragged_contents(kv) == [[10, 11, 120]] and kv.slots == 3


def test_ragged_storage_grows_and_removed_rows_are_filled_from_the_end():
    kv = new_ragged()
    for label in range(5):
        add_ragged(kv, [label, label + 0.5])
    assert kv.remove_rows([1, 4]) == [0, 3, 2]
    assert ragged_contents(kv) == [[0, 0.5], [3, 3.5], [2, 2.5]]
    add_ragged(kv, [9.0] * 70)  # longer than the capacity so far
    for step in range(40):
        start = kv.reserve_new(2)
        write_rows(kv, start, [[step, -1]] * kv.rows)
        kv.commit(start, torch.tensor([[0]] * kv.rows), torch.tensor([1] * kv.rows))
    steps = [float(s) for s in range(40)]
    assert ragged_contents(kv)[0] == [0, 0.5, *steps]
    assert ragged_contents(kv)[3] == [9.0] * 70 + steps
    assert kv.keys.shape[3] >= 112 and kv.keys.shape[3] % 64 == 0


def test_rows_that_hold_the_shared_prefix_are_tracked_as_rows_move():
    """prefix_reads names, row by row, the slots each row holds of the prefix (a copy of a
    row copies that too) as rows are removed and reordered; a new prefix leaves the rows
    of the old one to their own copies."""
    kv = new_ragged()
    prefix = torch.arange(6.0).view(2, 1, 1, 3, 1)  # [layers, 1, kv_heads, P, D]
    assert kv.prefix_reads() is None
    for label in range(3):
        add_ragged(kv, [label] * 5)
    kv.hold_prefix(range(1, 3), prefix, -prefix)
    add_ragged(kv, [7.0] * 4)  # a row of its own prompt
    kv.add_row(5)
    kv.copy_prefix(1, 4, 5)  # the same prompt as row 1
    reads = kv.prefix_reads()
    assert reads.lens.tolist() == [0, 3, 3, 0, 3]
    assert torch.equal(reads.keys, prefix[:, 0]) and torch.equal(reads.values, -prefix[:, 0])
    assert kv.remove_rows([1]) == [0, 4, 2, 3]
    assert kv.prefix_lens == [0, 3, 3, 0]
    kv.reorder([2, 3, 0, 1])
    assert kv.prefix_lens == [3, 0, 0, 3]
    other = prefix + 10
    kv.hold_prefix(range(1, 2), other, -other)
    assert kv.prefix_lens == [0, 3, 0, 0]
    kv.remove_rows([1])
    assert kv.prefix_reads() is None


def test_large_caches_are_mapped_zero_pages_and_grow_as_any(monkeypatch):
    """Past LAZY_ZEROS_BYTES a cache is an anonymous mapping: zeros where nothing was
    written (masked slots that torch's attention reads must be finite), the same contents
    after growing and removing rows."""
    monkeypatch.setattr(kv_module, "LAZY_ZEROS_BYTES", 0)
    kv = new_ragged()
    kv.reserve_batch(3, 8)
    assert kv.keys.untyped_storage().nbytes() == kv.keys.numel() * kv.keys.element_size()
    assert not kv.keys.any() and not kv.values.any()
    for label in range(3):
        add_ragged(kv, [label, label + 0.5])
    add_ragged(kv, [9.0] * 70)  # grows rows and slots
    assert kv.remove_rows([0]) == [3, 1, 2]
    assert ragged_contents(kv) == [[9.0] * 70, [1, 1.5], [2, 2.5]]
    assert not kv.keys[:, 1:3, :, 2:].any()  # past the short rows: still zeros


def resident_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def test_a_large_cache_takes_memory_only_where_rows_write():
    """SmolLM2-135M's fp32 cache for 8 rows of 1,024 slots (377 MB): reserving it touches
    nothing, and a 100-token prompt takes about its own share."""
    kv = RaggedKV(30, 3, 64, torch.float32, "cpu")
    before = resident_bytes()
    kv.reserve_batch(8, 1024)
    assert kv.keys.numel() * 4 * 2 > 350e6
    assert resident_bytes() - before < 32e6
    keys, values = kv.add_row(100)  # views of the whole row; a prefill writes 100 slots
    keys[..., :100, :] = 1.0
    values[..., :100, :] = 1.0
    assert resident_bytes() - before < 32e6


def test_ragged_tree_mask_sees_each_rows_own_entries_and_branch():
    kv = new_ragged()
    add_ragged(kv, [1, 2, 3])
    add_ragged(kv, [9])
    chain = DraftTree(torch.tensor([5, 6]), (-1, 0), torch.zeros(2))
    fork = DraftTree(torch.tensor([5, 6, 7]), (-1, 0, 0), torch.zeros(3))
    visible = kv.tree_mask(stack([chain, fork], "cpu").ancestors)[:, 0]
    assert visible.shape == (2, 3, 3 + 3)  # the longest row + the new tokens
    # row 0's new tokens sit at slots 3..5, row 1's at 1..3: right after their own
    assert visible[0, :2].tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]
    assert visible[0, 2, 3:].tolist() == [0, 0, 1]  # padding sees only itself among the new
    assert visible[1].tolist() == [[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0]]


def test_ragged_rows_are_read_in_chunks_and_sorted_when_that_pays():
    kv = new_ragged()
    # rows that joined in no order of length: long and short ones alternate
    lengths = [n for i in range(20) for n in (100 - i, 5 + i % 3)][:36]
    for n in lengths:
        add_ragged(kv, [float(n)] * n)
    start = kv.reserve_new(2)
    assert [c[:2] for c in start.chunks] == [(0, 16), (16, 32), (32, 36)]
    assert [c[2] for c in start.chunks] == [102, 94, 86]  # each chunk's own longest + 2
    assert chunk_cost(kv.lens) == 16 * 100 + 16 * 92 + 4 * 84
    order = kv.sorting_order()
    assert order is not None and [kv.lens[i] for i in order] == sorted(lengths, reverse=True)
    kv.reorder(order)
    assert ragged_contents(kv) == [[float(n)] * n for n in sorted(lengths, reverse=True)]
    assert kv.sorting_order() is None  # sorted already
