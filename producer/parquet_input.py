"""A Parquet input file as records: (row number, row as a dict, its bytes), one bounded
record batch in memory at a time, and every row capped like a JSONL line.

A row's size is the bytes of its values (strings, and strings inside lists and structs,
plus fixed-width numbers), measured by Arrow before the row becomes Python objects: a
row above `max_row_bytes` is a Rejected line, and is never converted. Batches hold at most
about BATCH_BYTES of data, going by the widest row group's average row size as its
metadata gives it. Two limits remain, both Arrow's: it reads an oversized cell once, to
measure it (a JSONL line is never held past its cap), and a row group's size in the
metadata is that of its encoded data, so a column of one huge value repeated by a
dictionary decodes larger than its estimate.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from producer.validate import Rejected

if TYPE_CHECKING:  # imported where used: `bench` reads its options without pyarrow
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

CONTENT_COLUMNS = ("prompt", "messages", "turns")
COLUMNS = (
    "id",
    *CONTENT_COLUMNS,
    "category",
    "max_new_tokens",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "n",
)
BATCH_ROWS = 1024
BATCH_BYTES = 16 * 1024 * 1024


class InputFileError(Exception):
    """The file as a whole cannot be read (not one bad line): say why in one line."""


def parquet_records(path: Path, max_row_bytes: int) -> Iterator[tuple[int, Any, int] | Rejected]:
    """(row number from 1, row, bytes) per row, or Rejected for a row over the cap."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        if not any(name in names for name in CONTENT_COLUMNS):
            raise InputFileError(
                f'{path}: expected a "prompt" (string), "messages" (list of role/content '
                f'structs) or "turns" (list of strings) column, found {names}'
            )
        columns = [name for name in COLUMNS if name in names]
        row_no = 0
        for batch in parquet.iter_batches(batch_size=_batch_rows(parquet), columns=columns):
            sizes = row_bytes(batch)
            fits = sizes <= max_row_bytes
            rows = iter((batch if fits.all() else batch.filter(pa.array(fits))).to_pylist())
            for size, ok in zip(sizes.tolist(), fits.tolist(), strict=True):
                row_no += 1
                if ok:
                    yield row_no, next(rows), size
                else:
                    yield Rejected(
                        row_no,
                        None,
                        f"row too long: {size} bytes, the limit is {max_row_bytes} "
                        "(max_line_bytes)",
                    )
    except pa.ArrowException as exc:
        raise InputFileError(f"{path}: not a readable Parquet file: {exc}") from exc


def _batch_rows(parquet: pq.ParquetFile) -> int:
    """Rows per record batch: BATCH_ROWS, fewer where the widest row group's average row
    would make a batch larger than BATCH_BYTES."""
    meta = parquet.metadata
    groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
    widest = max((g.total_byte_size / max(1, g.num_rows) for g in groups), default=1.0)
    return int(max(1, min(BATCH_ROWS, BATCH_BYTES // max(1.0, widest))))


def row_bytes(batch: pa.RecordBatch) -> np.ndarray:
    """The bytes of each row's values."""
    import numpy as np

    total = np.zeros(batch.num_rows, dtype=np.int64)
    for column in batch.columns:
        total += _value_bytes(column)
    return total


def _value_bytes(array: pa.Array) -> np.ndarray:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = array.type
    if (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    ):
        return pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        inner = _value_bytes(array.flatten())
        parents = pc.list_parent_indices(array).to_numpy(zero_copy_only=False)
        return np.bincount(parents, weights=inner, minlength=len(array)).astype(np.int64)
    if pa.types.is_struct(kind):
        total = np.zeros(len(array), dtype=np.int64)
        for child in array.flatten():
            total += _value_bytes(child)
        return total
    try:
        width = kind.bit_width  # numbers, booleans, timestamps
    except ValueError:
        width = 0
    if width > 0:
        return np.full(len(array), max(1, width // 8), dtype=np.int64)
    # Anything else (a map, a dictionary column): each value's own buffers.
    return np.array([array.slice(i, 1).nbytes for i in range(len(array))], dtype=np.int64)
