"""Bulk writes of a new job's rows (its manifest and rejected lines): millions of rows
that nothing else can have stored yet, so no conflict handling is needed and the fastest
path each database has is right: COPY on Postgres, one executemany in one transaction on
SQLite. Rows are tuples in `columns` order; JSON columns take JSON text.

Encoding (`encode_rows`) and writing (`write_rows`) are apart so that job creation
encodes in the process that parses and the writing process only sends
(producer/manifest.py).

(Every other write, a worker's results above all, goes through the idempotent inserts of
workers/db.py: a redelivered shard must store nothing twice.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Engine, Table

Row = tuple[Any, ...]
Encoded = bytes | list[Row]  # COPY text for Postgres, the rows for SQLite

# COPY's text format: fields split by tabs, rows by newlines, \N for NULL, and these
# characters escaped inside a field.
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def encode_rows(dialect: str, rows: Iterable[Row]) -> Encoded:
    """Rows as `write_rows` sends them to a database of `dialect` (an engine's
    `dialect.name`: the encoding may happen in another process than the engine)."""
    if dialect == "postgresql":
        return "".join([_copy_line(row) for row in rows]).encode("utf-8")
    if dialect == "sqlite":
        return list(rows)
    raise NotImplementedError(f"unsupported database backend: {dialect}")


def write_rows(engine: Engine, table: Table, columns: Sequence[str], encoded: Encoded) -> None:
    """Write encoded rows into `table` in one transaction. A key already stored is an
    error (an IntegrityError, psycopg's own for COPY): callers write only new rows."""
    unknown = set(columns) - set(table.columns.keys())
    if unknown:
        raise ValueError(f"{table.name}: unknown columns {sorted(unknown)}")
    if not encoded:
        return
    names = ", ".join(columns)
    with engine.begin() as conn:
        if isinstance(encoded, bytes):
            with conn.connection.dbapi_connection.cursor() as cursor:
                with cursor.copy(f"COPY {table.name} ({names}) FROM STDIN") as copy:
                    copy.write(encoded)
        else:
            marks = ", ".join("?" * len(columns))
            conn.exec_driver_sql(f"INSERT INTO {table.name} ({names}) VALUES ({marks})", encoded)


def _copy_field(value: Any) -> str:
    if value is None:
        return "\\N"
    text = value if type(value) is str else str(value)
    if "\\" in text or "\t" in text or "\n" in text or "\r" in text:
        return text.translate(_COPY_ESCAPES)
    return text


def _copy_line(row: Row) -> str:
    """One row in COPY text format (ints and strings, the types these rows hold)."""
    return "\t".join([_copy_field(value) for value in row]) + "\n"
