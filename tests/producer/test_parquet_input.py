"""Parquet input in bounded memory: a row over the cap is a named bad line like an
over-long JSONL line, row sizes are the bytes of their values, and record batches shrink
for wide rows."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from producer.inputs import Rejected, Request, read_requests
from producer.parquet_input import BATCH_BYTES, _batch_rows, row_bytes

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])


def test_a_row_over_the_cap_is_rejected_and_its_neighbours_kept(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    table = pa.table(
        {
            "id": ["a", "b", "c", "d"],
            "prompt": ["short", "x" * 5000, None, "y" * 900],
            "turns": [None, None, ["t" * 600, "u" * 600], None],
            "temperature": [None, 0.5, None, None],
        }
    )
    pq.write_table(table, path)
    items = list(read_requests(path, max_line_bytes=1000))
    assert isinstance(items[0], Request) and isinstance(items[3], Request)
    assert items[1] == Rejected(
        2, None, "row too long: 5009 bytes, the limit is 1000 (max_line_bytes)"
    )
    assert items[2] == Rejected(
        3, None, "row too long: 1209 bytes, the limit is 1000 (max_line_bytes)"
    )
    assert [i.line_no for i in items] == [1, 2, 3, 4]


def test_row_bytes_are_the_bytes_of_the_values() -> None:
    rows = [
        {"id": "ü1", "messages": [{"role": "user", "content": "✓✓"}], "seed": 3},
        {"id": None, "messages": None, "seed": None},
        {
            "id": "x",
            "messages": [{"role": "system", "content": ""}, {"role": "user", "content": "q"}],
            "seed": 1,
        },
    ]
    schema = pa.schema([("id", pa.string()), ("messages", pa.list_(MESSAGE)), ("seed", pa.int64())])
    batch = pa.RecordBatch.from_pylist(rows, schema=schema)
    expected = []
    for row in rows:
        texts = [row["id"] or ""] + [
            m[k] for m in row["messages"] or [] for k in ("role", "content")
        ]
        expected.append(sum(len(t.encode()) for t in texts) + 8)
    assert row_bytes(batch).tolist() == expected
    assert row_bytes(batch.slice(1)).tolist() == expected[1:]  # a slice counts its own rows


def test_batches_are_bounded_in_bytes_not_only_in_rows(tmp_path: Path) -> None:
    narrow, wide = tmp_path / "narrow.parquet", tmp_path / "wide.parquet"
    pq.write_table(pa.table({"prompt": ["p"] * 5000}), narrow)
    prompts = [f"{i:03d}" + "w" * 999_997 for i in range(40)]  # 1 MB each, all different
    pq.write_table(pa.table({"prompt": prompts}), wide, compression="zstd")
    assert _batch_rows(pq.ParquetFile(narrow)) == 1024
    rows = _batch_rows(pq.ParquetFile(wide))
    assert 1 <= rows <= BATCH_BYTES // 1_000_000
    items = list(read_requests(wide))  # under the 16 MB cap: every row is read
    assert len(items) == 40 and all(isinstance(i, Request) for i in items)
