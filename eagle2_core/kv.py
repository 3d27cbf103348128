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

import torch

# Compact (move every row's tokens to the front) once the longest row fills less than this
# share of the slots: holes cost attention work, a compaction costs one copy of the cache.
MIN_FILL = 0.5
_GROW = 64  # slot capacity is a multiple of this


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

    def _reserve(self, rows: int, slots: int) -> None:
        """Make room for `rows` rows of `slots` slots (doubling), keeping what is stored."""
        _, row_cap, heads, slot_cap, dim = self.keys.shape
        if rows <= row_cap and slots <= slot_cap:
            return
        new_rows = row_cap if rows <= row_cap else max(rows, 2 * row_cap)
        new_slots = slot_cap if slots <= slot_cap else max(slots, 2 * slot_cap)
        new_slots = -(-new_slots // _GROW) * _GROW
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = old.new_zeros(old.shape[0], new_rows, heads, new_slots, dim)
            grown[:, : self.rows, :, : self.slots] = old[:, : self.rows, :, : self.slots]
            setattr(self, name, grown)

    def reserve_new(self, n: int) -> int:
        """Room for n new slots per row after the current ones; returns where they start."""
        self._reserve(self.rows, self.slots + n)
        return self.slots

    def add_row(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A new last row whose first `length` slots the caller fills (a prefill): returns
        that row's key and value views [layers, 1, kv_heads, slots, head_dim]."""
        slots = max(self.slots, length)
        self._reserve(self.rows + 1, slots)
        row = torch.zeros(1, slots, dtype=torch.bool, device=self.device)
        row[0, :length] = True
        grown = torch.zeros(self.rows, slots, dtype=torch.bool, device=self.device)
        grown[:, : self.slots] = self.valid
        self.valid = torch.cat([grown, row])
        return self.layer_views(slice(self.rows - 1, self.rows))

    def copy_prefix(self, source: int, row: int, length: int) -> None:
        """Row `row`'s first `length` slots take row `source`'s entries there (a shared
        prompt: a row's prompt always fills its first slots, which compaction keeps)."""
        self.keys[:, row, :, :length] = self.keys[:, source, :, :length]
        self.values[:, row, :, :length] = self.values[:, source, :, :length]

    def remove_rows(self, rows: list[int]) -> list[int]:
        """Drop the listed rows; rows from the end move into their places. Returns the new
        order: new row i is old row order[i]."""
        gone = set(rows)
        keep = self.rows - len(gone)
        holes = [r for r in sorted(gone) if r < keep]
        movers = [r for r in range(keep, self.rows) if r not in gone]
        order = list(range(keep))
        for hole, mover in zip(holes, movers, strict=True):
            self.keys[:, hole] = self.keys[:, mover]
            self.values[:, hole] = self.values[:, mover]
            order[hole] = mover
        self.valid = self.valid[torch.tensor(order, dtype=torch.long, device=self.device)]
        self._trim()
        self._maybe_compact()
        return order

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
