"""The KV cache of a batch of sequences of different lengths, for every layer at once.

Keys and values live in two preallocated tensors [layers, rows, kv_heads, slots, head_dim]
that grow by doubling, so a forward writes its new entries in place (no per-step
concatenation) and one gather moves the accepted entries of every layer. Rows differ in
length and accept different numbers of tree nodes per round, so a row's slots need not be
contiguous: `valid[b, s]` says whether slot s of row b holds one of its committed tokens.
Attention masks come from `valid`, positions are passed explicitly, so a hole costs a
little attention work and nothing else. Active rows are always 0..rows-1: a finished row's
place is taken by the last row (one row copied, not the whole batch).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

# Compact (move every row's tokens to the front) once the longest row fills less than this
# share of the slots: holes cost attention work, a compaction costs one copy of the cache.
MIN_FILL = 0.5
_GROW = 64  # slot capacity is a multiple of this
LAZY_ZEROS_BYTES = 64 << 20  # caches from this size on are mapped zero pages (_zeros)
# RaggedKV: attention runs over chunks of this many consecutive rows, each reading only its
# own longest row's slots; rows are re-sorted by length when sorting would cut the slots
# attention reads by at least RESORT_GAIN (BENCHMARKS.md, "Batched decoding").
CHUNK_ROWS = 16
RESORT_GAIN = 0.1
# A batch's first row reserves the whole batch's cache at once, each row this many slots at
# most (past that it grows by doubling): growing a row or a slot block at a time copies the
# whole cache each time. Auto batch sizes are budgeted at this many slots a row (engine.py).
RESERVE_SLOTS = 1024


class BatchKV:
    """Rows of committed KV entries plus the validity mask that makes holes invisible."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (layers, 0, kv_heads, 0, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=device)

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    @property
    def lengths(self) -> torch.Tensor:
        """Committed tokens per row [rows]."""
        return self.valid.sum(dim=1)

    def layer_views(self, rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given rows (all active ones by default), as views that a
        forward writes into."""
        rows = rows if rows is not None else slice(0, self.rows)
        return self.keys[:, rows], self.values[:, rows]

    def reserve(self, rows: int, slots: int) -> None:
        """Make room for `rows` rows of `slots` slots (doubling), keeping what is stored."""
        self.keys, self.values = _grown(self.keys, self.values, rows, slots, self.rows, self.slots)

    def reserve_new(self, n: int) -> int:
        """Room for n new slots per row after the current ones; returns where they start."""
        self.reserve(self.rows, self.slots + n)
        return self.slots

    def add_row(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A new last row whose first `length` slots the caller fills (a prefill): returns
        that row's key and value views [layers, 1, kv_heads, slots, head_dim]."""
        return self.add_rows([length], length)

    def add_rows(self, lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New last rows, one per length, whose first `width` slots the caller writes (a
        prefill of prompts padded to `width`); row i keeps its first lengths[i] entries,
        the rest are holes. Returns the rows' key and value views."""
        first, slots = self.rows, max(self.slots, width)
        self.reserve(first + len(lengths), slots)
        kept = torch.tensor(lengths, device=self.device)[:, None]
        new = torch.arange(slots, device=self.device)[None] < kept
        grown = torch.zeros(first, slots, dtype=torch.bool, device=self.device)
        grown[:, : self.slots] = self.valid
        self.valid = torch.cat([grown, new])
        return self.layer_views(slice(first, self.rows))

    def copy_prefix(self, source: int, row: int, length: int) -> None:
        """Row `row`'s first `length` slots take row `source`'s entries there (a shared
        prompt: a row's prompt always fills its first slots, which compaction keeps)."""
        self.keys[:, row, :, :length] = self.keys[:, source, :, :length]
        self.values[:, row, :, :length] = self.values[:, source, :, :length]

    def remove_rows(self, rows: list[int]) -> list[int]:
        """Drop the listed rows; rows from the end move into their places. Returns the new
        order: new row i is old row order[i]."""
        order = _fill_holes(self.keys, self.values, [self.slots] * self.rows, rows)
        self.valid = self.valid[torch.tensor(order, dtype=torch.long, device=self.device)]
        self._trim()
        self._maybe_compact()
        return order

    def reorder(self, order: list[int]) -> None:
        """Rows move: new row i is old row order[i] (a permutation)."""
        _permute_rows(self.keys, self.values, order, self.slots)
        self.valid = self.valid[torch.tensor(order, dtype=torch.long, device=self.device)]

    def tree_mask(self, ancestors: torch.Tensor) -> torch.Tensor:
        """Bool mask [B, 1, N, slots + N] for N new tokens per row that see the row's valid
        slots and, among themselves, what ancestors [B, N, N] allows (True = visible)."""
        b, n, _ = ancestors.shape
        context = self.valid[:, None, :].expand(b, n, self.slots)
        return torch.cat([context, ancestors.to(self.device)], dim=2)[:, None]

    def commit(self, start: int, index: torch.Tensor, lengths: torch.Tensor) -> None:
        """After a forward wrote new entries at slots start.., keep each row's first
        lengths[b] of the new entries listed in index [B, W] (offsets from start).

        They move to the front of the new slots; the cache grows by W, and rows that keep
        fewer get holes there.
        """
        width = index.shape[1]
        index = index.to(self.device)
        prefix = bool((index == torch.arange(width, device=self.device)).all())
        if not prefix:
            gather = index[None, :, None, :, None].expand(
                self.keys.shape[0], self.rows, self.keys.shape[2], width, self.keys.shape[4]
            )
            for store in (self.keys, self.values):
                rows = store[:, : self.rows]
                rows[:, :, :, start : start + width] = rows[:, :, :, start:].gather(3, gather)
        kept = torch.arange(width, device=self.device)[None] < lengths.to(self.device)[:, None]
        self.valid = torch.cat([self.valid[:, :start], kept], dim=1)
        self._maybe_compact()

    def _trim(self) -> None:
        """Drop trailing slots that no row uses."""
        used = self.valid.any(dim=0)
        last = int(used.nonzero().max()) + 1 if bool(used.any()) else 0
        self.valid = self.valid[:, :last]

    def _maybe_compact(self) -> None:
        """Compact when that at least halves the slots: the longest row bounds the gain."""
        if not self.rows:
            return
        lengths = self.lengths
        longest = int(lengths.max())
        if longest >= MIN_FILL * self.slots:
            return
        # A stable sort puts each row's valid slots first, in their original order.
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :longest]
        gather = order[None, :, None, :, None].expand(
            self.keys.shape[0], self.rows, self.keys.shape[2], longest, self.keys.shape[4]
        )
        for store in (self.keys, self.values):
            rows = store[:, : self.rows]
            rows[:, :, :, :longest] = rows[:, :, :, : self.slots].gather(3, gather)
        self.valid = torch.arange(longest, device=self.device)[None] < lengths[:, None]


def _grown(
    keys: torch.Tensor, values: torch.Tensor, rows: int, slots: int, used_rows: int, used: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """keys and values with room for `rows` rows of `slots` slots (capacity doubles),
    their first used_rows x used slots kept; the same tensors when they already fit."""
    _, row_cap, heads, slot_cap, dim = keys.shape
    if rows <= row_cap and slots <= slot_cap:
        return keys, values
    new_rows = row_cap if rows <= row_cap else max(rows, 2 * row_cap)
    new_slots = slot_cap if slots <= slot_cap else max(slots, 2 * slot_cap)
    new_slots = -(-new_slots // _GROW) * _GROW
    out = []
    for old in (keys, values):
        grown = _zeros(old, (old.shape[0], new_rows, heads, new_slots, dim))
        grown[:, :used_rows, :, :used] = old[:, :used_rows, :, :used]
        out.append(grown)
    return out[0], out[1]


def _zeros(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Zeros of like's dtype and device. A large CPU cache is mapped from the kernel's
    zero pages instead of written with zeros: only the slots rows reach are ever touched,
    and torch's huge-page allocation of a whole 80-row fp32 cache (2.6 GB) cost 1.1-4.6 s
    of page faults and compaction on the 2-core Xeon, against ~0.2 s for the slots used."""
    size = math.prod(shape) * like.element_size()
    if like.device.type != "cpu" or size < LAZY_ZEROS_BYTES:
        return like.new_zeros(shape)
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=like.dtype).view(shape)


def _fill_holes(
    keys: torch.Tensor, values: torch.Tensor, used: list[int], gone: list[int]
) -> list[int]:
    """Drop rows `gone` of the first len(used) rows: rows from the end move into their
    places, each row's first used[row] slots (one row per hole, not the batch, and not its
    whole capacity: an 80-row fp32 cache row holds 640+ slots where ~150 are used). What
    lies past them in the hole is the dropped row's, finite, and never visible. Returns the
    new order: new row i is old order[i]."""
    dropped = set(gone)
    rows = len(used)
    keep = rows - len(dropped)
    holes = [r for r in sorted(dropped) if r < keep]
    movers = [r for r in range(keep, rows) if r not in dropped]
    order = list(range(keep))
    for hole, mover in zip(holes, movers, strict=True):
        n = used[mover]
        keys[:, hole, :, :n] = keys[:, mover, :, :n]
        values[:, hole, :, :n] = values[:, mover, :, :n]
        order[hole] = mover
    return order


def _permute_rows(keys: torch.Tensor, values: torch.Tensor, order: list[int], slots: int) -> None:
    """Rows 0..len(order)-1 take rows order[i]'s first `slots` slots, a layer at a time (so
    the copy in flight is one layer's, not the cache's)."""
    index = torch.tensor(order, dtype=torch.long, device=keys.device)
    for store in (keys, values):
        for layer in range(store.shape[0]):
            store[layer, : len(order), :, :slots] = store[layer, index, :, :slots]


def chunk_cost(lens: list[int], size: int = CHUNK_ROWS) -> int:
    """Slots attention reads over rows of these lengths, in chunks of `size` rows that
    each read their longest row's length."""
    return sum(len(lens[a : a + size]) * max(lens[a : a + size]) for a in range(0, len(lens), size))


@dataclass(frozen=True)
class RowStarts:
    """Where a forward writes each row's new entries: slots starts[b] .. starts[b] + n of
    row b, and how many slots attention reads (span = the longest row + n); chunks:
    (first row, end row, span) of each chunk of rows when attention reads them apart."""

    starts: torch.Tensor  # [B]
    span: int
    chunks: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class PrefixReads:
    """A prompt prefix every row copied (a chat template's system prompt), where attention
    may read it: all rows then read one copy, which stays in cache, instead of a copy each
    (on a CPU a batch's attention reads its whole cache every step; the same bits either
    way)."""

    keys: torch.Tensor  # [layers, kv_heads, P, D]
    values: torch.Tensor
    lens: torch.Tensor  # [B] int64 (CPU): each row's first slots that hold it, 0 for none


class RaggedKV:
    """The target's cache: every row's committed entries fill its first lengths[b] slots,
    no holes, whatever the other rows' lengths.

    A forward writes each row's new tokens right after its own entries (RowStarts) and
    attention reads only the longest row's slots, so rows of different lengths cost what
    their padding to the longest costs, nothing more: no slots left behind by a
    neighbour's longer prompt, no compaction copies. (BatchKV, with a shared write
    position and holes, is what the one-layer draft head keeps: its tree expansions are
    written after every row and thrown away each round.)
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (layers, 0, kv_heads, 0, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.lens: list[int] = []  # committed entries per row
        # a shared prefix's cache, keys and values [layers, 1, kv_heads, P, D], and each
        # row's first slots that hold it (prefix_reads)
        self.prefix: tuple[torch.Tensor, torch.Tensor] | None = None
        self.prefix_lens: list[int] = []

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def rows(self) -> int:
        return len(self.lens)

    @property
    def slots(self) -> int:
        """Slots the longest row fills: what attention reads."""
        return max(self.lens, default=0)

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor(self.lens, dtype=torch.long, device=self.device)

    def layer_views(self, rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given rows (all active ones by default), as views that a
        forward writes into."""
        rows = rows if rows is not None else slice(0, self.rows)
        return self.keys[:, rows], self.values[:, rows]

    def reserve(self, rows: int, slots: int) -> None:
        """Capacity for `rows` rows of `slots` slots at once (no doubling on the way)."""
        self.keys, self.values = _grown(self.keys, self.values, rows, slots, self.rows, self.slots)

    def reserve_batch(self, rows: int, slots: int) -> None:
        """Before a batch fills: room for `rows` rows of `slots` slots (RESERVE_SLOTS at
        most), so rows joining and tokens arriving copy nothing."""
        self.reserve(max(rows, self.rows + 1), min(slots, RESERVE_SLOTS))

    def add_row(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A new last row whose first `length` slots the caller fills (a prefill): returns
        that row's key and value views [layers, 1, kv_heads, slots, head_dim]."""
        return self.add_rows([length], length)

    def add_rows(self, lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New last rows, one per length, whose first `width` slots the caller writes (a
        prefill of prompts padded to `width`); row i keeps its first lengths[i] entries,
        and what lies past them is never read. Returns the rows' key and value views."""
        first = self.rows
        self.reserve(first + len(lengths), width)
        self.lens += lengths
        self.prefix_lens += [0] * len(lengths)
        return self.layer_views(slice(first, self.rows))

    def copy_prefix(self, source: int, row: int, length: int) -> None:
        """Row `row`'s first `length` slots take row `source`'s entries (a shared prompt)."""
        self.keys[:, row, :, :length] = self.keys[:, source, :, :length]
        self.values[:, row, :, :length] = self.values[:, source, :, :length]
        self.prefix_lens[row] = min(self.prefix_lens[source], length)

    def hold_prefix(self, rows: range, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`rows` hold keys, values [layers, 1, kv_heads, P, D] (a SharedPrefix's cache) as
        their first P slots. Rows that hold another prefix read their own copies from now
        on: one prefix is read shared at a time."""
        if self.prefix is None or self.prefix[0] is not keys:
            self.prefix = (keys, values)
            self.prefix_lens = [0] * self.rows
        for row in rows:
            self.prefix_lens[row] = keys.shape[3]

    def prefix_reads(self) -> PrefixReads | None:
        """Where attention may read the rows' shared prefix (None where no row holds one,
        and off a CPU: only the CPU kernel reads it there)."""
        if self.prefix is None or not any(self.prefix_lens) or self.device.type != "cpu":
            return None
        keys, values = self.prefix
        lens = torch.tensor(self.prefix_lens, dtype=torch.long)
        return PrefixReads(keys[:, 0], values[:, 0], lens)

    def remove_rows(self, rows: list[int]) -> list[int]:
        """Drop the listed rows; rows from the end move into their places. Returns the new
        order: new row i is old row order[i]."""
        order = _fill_holes(self.keys, self.values, self.lens, rows)
        self.lens = [self.lens[i] for i in order]
        self.prefix_lens = [self.prefix_lens[i] for i in order]
        return order

    def reserve_new(self, n: int) -> RowStarts:
        """Room for n new entries after each row's own; where a forward writes them, and
        the chunks of rows attention reads apart (each up to its own longest row)."""
        span = self.slots + n
        self.keys, self.values = _grown(
            self.keys, self.values, self.rows, span, self.rows, self.slots
        )
        chunks = ()
        if self.rows > CHUNK_ROWS:
            lens = self.lens
            chunks = tuple(
                (a, min(a + CHUNK_ROWS, self.rows), max(lens[a : a + CHUNK_ROWS]) + n)
                for a in range(0, self.rows, CHUNK_ROWS)
            )
        return RowStarts(self.lengths, span, chunks)

    def sorting_order(self) -> list[int] | None:
        """The rows longest first, when that order would cut the slots chunked attention
        reads by RESORT_GAIN or more; else None. Rows join in about that order already (a
        shard decodes longest prompts first); a finished row's place taken by the last
        row is what disturbs it."""
        if self.rows <= CHUNK_ROWS:
            return None
        order = sorted(range(self.rows), key=self.lens.__getitem__, reverse=True)
        cost = chunk_cost(self.lens)
        if chunk_cost([self.lens[i] for i in order]) > (1 - RESORT_GAIN) * cost:
            return None
        return order

    def reorder(self, order: list[int]) -> None:
        """Rows move: new row i is old row order[i] (a permutation)."""
        _permute_rows(self.keys, self.values, order, self.slots)
        self.lens = [self.lens[i] for i in order]
        self.prefix_lens = [self.prefix_lens[i] for i in order]

    def tree_mask(self, ancestors: torch.Tensor) -> torch.Tensor:
        """Bool mask [B, 1, N, span] for N new tokens per row, written after the row's own
        entries: each sees those entries and, among the new ones, what ancestors [B, N, N]
        allows (True = visible)."""
        b, n, _ = ancestors.shape
        lengths = self.lengths[:, None]
        slots = torch.arange(self.slots + n, device=self.device)[None]
        offset = slots - lengths  # [B, span]: which new token a slot holds, if any
        new = (offset >= 0) & (offset < n)
        index = offset.clamp(0, n - 1)[:, None, :].expand(b, n, offset.shape[1])
        tree = ancestors.to(self.device).gather(2, index) & new[:, None, :]
        return ((slots < lengths)[:, None, :] | tree)[:, None]

    def commit(self, start: RowStarts, index: torch.Tensor, lengths: torch.Tensor) -> None:
        """After a forward wrote N new entries per row at start, keep each row's first
        lengths[b] of those listed in index [B, W] (offsets among the new entries): they
        move to the row's next slots; the rest are dropped."""
        width = index.shape[1]
        index = index.to(self.device)
        offsets = torch.arange(width, device=self.device)
        if not bool((index == offsets).all()):
            base = start.starts[:, None]
            rows = torch.arange(self.rows, device=self.device)[:, None]
            source, target = base + index, base + offsets
            for store in (self.keys, self.values):  # indexed: a bf16 scatter_ copies it all
                slots_first = store[:, : self.rows].permute(1, 3, 0, 2, 4)  # [B, S, L, H, D]
                slots_first[rows, target] = slots_first[rows, source]
        self.lens = [n + k for n, k in zip(self.lens, lengths.tolist(), strict=True)]
