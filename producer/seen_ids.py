"""The sample ids a file has used so far, and on which line: what refuses a duplicate id
with the line of its first use, in memory that does not grow with the file.

A dict while the file is small (the common case, and the fastest); past `MEMORY_IDS`
ids everything moves to a private temporary SQLite database on disk (deleted when
closed), whose page cache is bounded, so ten million lines cost what one million do.
"""

from __future__ import annotations

import sqlite3

# Ids kept in the dict before spilling to disk (~120 bytes each: about 25 MiB).
MEMORY_IDS = 200_000
_CACHE_KIB = 16 * 1024  # SQLite's page cache for the spilled ids


class SeenIds:
    """id -> the line that first used it."""

    def __init__(self, memory_ids: int = MEMORY_IDS) -> None:
        self._memory: dict[str, int] | None = {}
        self._limit = memory_ids
        self._disk: sqlite3.Connection | None = None

    def first_line(self, sample_id: str) -> int | None:
        if self._memory is not None:
            return self._memory.get(sample_id)
        assert self._disk is not None
        row = self._disk.execute("SELECT line FROM ids WHERE id = ?", (sample_id,)).fetchone()
        return row[0] if row is not None else None

    def add(self, sample_ids: list[str], line_no: int) -> None:
        """Record ids not seen before (check `first_line` first) as used on `line_no`."""
        if self._memory is not None:
            for sample_id in sample_ids:
                self._memory[sample_id] = line_no
            if len(self._memory) > self._limit:
                self._spill()
            return
        assert self._disk is not None
        self._disk.executemany(
            "INSERT INTO ids (id, line) VALUES (?, ?)", [(i, line_no) for i in sample_ids]
        )

    def _spill(self) -> None:
        # "" opens a temporary database on disk, removed when the connection closes.
        disk = sqlite3.connect("", isolation_level=None)
        disk.execute(f"PRAGMA cache_size = -{_CACHE_KIB}")
        disk.execute("PRAGMA journal_mode = OFF")
        disk.execute("PRAGMA synchronous = OFF")
        disk.execute("CREATE TABLE ids (id TEXT PRIMARY KEY, line INTEGER) WITHOUT ROWID")
        disk.execute("BEGIN")  # one transaction for the file's life: nothing to make durable
        assert self._memory is not None
        disk.executemany("INSERT INTO ids (id, line) VALUES (?, ?)", self._memory.items())
        self._memory = None
        self._disk = disk

    def close(self) -> None:
        if self._disk is not None:
            self._disk.close()
            self._disk = None
        self._memory = {}
