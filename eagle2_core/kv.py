"""The target's KV cache for a batch of sequences of different lengths.

One row per sequence in a single transformers `DynamicCache`, so one forward serves
the whole batch. Rows differ in length and accept different numbers of tree nodes per
round, so a row's slots need not be contiguous: `valid[b, s]` says whether slot s of
row b holds one of its committed tokens. Attention masks come from `valid`, positions
are passed explicitly, so a hole costs a little attention work and nothing else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from eagle2_core.tree import DraftTree

# Compact (move every row's tokens to the front) once the longest row fills less than this
# share of the slots: holes cost attention work, a compaction costs one copy of the cache.
MIN_FILL = 0.5


class BatchKV:
    """Rows of committed KV entries plus the validity mask that makes holes invisible."""

    def __init__(self, cache: DynamicCache, length: int):
        """Start from one sequence's prefilled cache of `length` tokens."""
        self.cache = cache
        self.valid = torch.ones(1, length, dtype=torch.bool, device=self._device)

    @property
    def _device(self) -> torch.device:
        return self.cache.layers[0].keys.device

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    def add(self, cache: DynamicCache, length: int) -> None:
        """Append a prefilled single-sequence cache as the last row."""
        slots = max(self.slots, length)
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_pad(mine.keys, slots), _pad(theirs.keys, slots)])
            mine.values = torch.cat([_pad(mine.values, slots), _pad(theirs.values, slots)])
        row = torch.zeros(1, slots, dtype=torch.bool, device=self._device)
        row[0, :length] = True
        self.valid = torch.cat([F.pad(self.valid, (0, slots - self.slots)), row])

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every row not listed (finished sequences), then trailing empty slots."""
        index = torch.tensor(rows, dtype=torch.long, device=self._device)
        self.valid = self.valid[index]
        used = int(self.valid.any(dim=0).nonzero().max()) + 1 if self.valid.any() else 0
        self.valid = self.valid[:, :used]
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, :used]
            layer.values = layer.values[index, :, :used]
        self._maybe_compact()

    def tree_mask(self, trees: list[DraftTree], dtype: torch.dtype) -> torch.Tensor:
        """Float mask [B, 1, N, slots + N]: each row's own tokens, then its tree's ancestors.

        N is the largest tree; a shorter tree's padding queries see only themselves.
        """
        return self.new_tokens_mask([t.ancestor_mask for t in trees], dtype)

    def new_tokens_mask(self, ancestors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Float mask [B, 1, N, slots + N] for n_b new tokens per row that see the row's
        tokens and, among themselves, what ancestors[b] [n_b, n_b] allows."""
        n = max(a.shape[0] for a in ancestors)
        visible = torch.zeros(self.rows, n, self.slots + n, dtype=torch.bool)
        visible[:, :, : self.slots] = self.valid[:, None, :].cpu()
        for row, allowed in enumerate(ancestors):
            size = allowed.shape[0]
            visible[row, :, self.slots :] = torch.eye(n, dtype=torch.bool)
            visible[row, :size, self.slots : self.slots + size] = allowed
            visible[row, size:, : self.slots] = False
        mask = torch.zeros(visible.shape, dtype=dtype)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
        return mask[:, None].to(self._device)

    def commit(self, accepted: list[list[int]]) -> None:
        """After a forward appended N tree slots per row, keep each row's accepted nodes.

        Accepted entries move to the front of the new slots; the cache grows by the
        longest accepted path, and shorter rows get holes there.
        """
        start = self.slots
        width = max(len(a) for a in accepted)
        ok = torch.zeros(self.rows, width, dtype=torch.bool)
        index = torch.zeros(self.rows, width, dtype=torch.long)
        for row, nodes in enumerate(accepted):
            ok[row, : len(nodes)] = True
            index[row, : len(nodes)] = torch.tensor(nodes, dtype=torch.long)
        prefix = all(nodes == list(range(len(nodes))) for nodes in accepted)
        index = index.to(self._device)
        for layer in self.cache.layers:
            layer.keys = _keep(layer.keys, start, width, index, prefix)
            layer.values = _keep(layer.values, start, width, index, prefix)
        self.valid = torch.cat([self.valid, ok.to(self._device)], dim=1)
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Compact when that at least halves the slots: the longest row bounds the gain."""
        lengths = self.valid.sum(dim=1)
        slots = int(lengths.max()) if self.rows else 0
        if slots >= MIN_FILL * self.slots:
            return
        # Stable sort puts each row's valid slots first, in their original order.
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :slots]
        for layer in self.cache.layers:
            layer.keys = _gather_slots(layer.keys, order)
            layer.values = _gather_slots(layer.values, order)
        self.valid = torch.arange(slots, device=self._device)[None] < lengths[:, None]


def _pad(kv: torch.Tensor, slots: int) -> torch.Tensor:
    return F.pad(kv, (0, 0, 0, slots - kv.shape[2]))


def _gather_slots(kv: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """kv [B, H, S, D] -> [B, H, len(index[b]), D] taking slots index[b] of row b."""
    b, h, _, d = kv.shape
    return kv.gather(2, index[:, None, :, None].expand(b, h, index.shape[1], d))


def _keep(
    kv: torch.Tensor, start: int, width: int, index: torch.Tensor, prefix: bool
) -> torch.Tensor:
    if not prefix:
        kv[:, :, start : start + width] = _gather_slots(kv[:, :, start:], index)
    return kv[:, :, : start + width]
