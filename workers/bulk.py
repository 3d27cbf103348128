"""Writing many rows at once, the two ways this service needs, on Postgres and SQLite.

- `insert_ignore`: idempotent inserts, for every write that may happen twice (a
  redelivered shard's samples above all): rows whose key is stored are skipped.
- `encode_rows` + `write_rows`: a new job's manifest and rejected lines, millions of rows
  that nothing else can have stored yet, so the fastest path each database has is right:
  COPY on Postgres, one executemany in one transaction on SQLite. Rows are tuples in
  `columns` order; JSON columns take JSON text. Encoding and writing are apart so that
  job creation encodes in the process that parses while the other one sends
  (producer/creation.py).

The queries that name these tables' rows are workers/db.py.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Double, Engine, Table, bindparam, cast, column, func, select
from sqlalchemy.dialects import postgresql, sqlite

from workers.schema import utcnow

Row = tuple[Any, ...]
# Rows per INSERT statement: bounds statement size and memory for large batches.
_CHUNK_ROWS = 1000
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


def _normalize(table: Table, rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    # Every row gets every column (absent ones NULL, created_at now); unknown keys are
    # typos, and non-finite floats are rejected on both backends alike.
    columns = table.columns.keys()
    known = set(columns)
    floats = [c.name for c in table.columns if isinstance(c.type, Double)]
    out = []
    for row in rows:
        unknown = row.keys() - known
        if unknown:
            raise ValueError(f"{table.name}: unknown fields {sorted(unknown)}")
        full = {c: row.get(c) for c in columns}
        if "created_at" in full and full["created_at"] is None:
            full["created_at"] = utcnow()
        for name in floats:
            value = full[name]
            if value is not None and not math.isfinite(value):
                key = {k: full[k] for k in table.primary_key.columns.keys()}
                raise ValueError(f"{table.name}.{name} is {value} in row {key}")
        out.append(full)
    return out


def _json_default(value: Any) -> str:
    if isinstance(value, datetime):
        # A naive timestamp is UTC here (SQLite returns them naive), never server-local.
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()
    raise TypeError(f"cannot store {type(value).__name__} value {value!r}")


@functools.cache
def _pg_insert_ignore_stmt(table: Table) -> Any:
    # INSERT INTO t (cols) SELECT cols FROM jsonb_to_recordset(:rows) AS r(col type, ...)
    # ON CONFLICT DO NOTHING: one statement and one bound parameter per chunk. (A
    # multi-row VALUES with ~30k placeholders spends seconds in client-side parsing.)
    names = table.columns.keys()
    records = (
        func.jsonb_to_recordset(cast(bindparam("rows"), postgresql.JSONB))
        .table_valued(*(column(c.name, c.type) for c in table.columns))
        .render_derived(name="r", with_types=True)
    )
    return (
        postgresql.insert(table)
        .from_select(names, select(*(records.c[n] for n in names)))
        .on_conflict_do_nothing()
    )


def insert_ignore(engine: Engine, table: Table, rows: Iterable[Mapping[str, Any]]) -> int:
    """Insert rows, skipping any whose primary key is already stored; one transaction.

    Postgres: one `INSERT ... SELECT FROM jsonb_to_recordset(:rows) ON CONFLICT DO
    NOTHING` per chunk. SQLite (in-process, no round trips): one prepared
    `INSERT ... ON CONFLICT DO NOTHING` executed over the chunk. The summed rowcount
    is the number of rows actually inserted.
    """
    full = _normalize(table, rows)
    dialect = engine.dialect.name
    if dialect not in ("postgresql", "sqlite"):
        raise NotImplementedError(f"unsupported database backend: {dialect}")
    inserted = 0
    with engine.begin() as conn:
        conn = conn.execution_options(preserve_rowcount=True)
        for start in range(0, len(full), _CHUNK_ROWS):
            chunk = full[start : start + _CHUNK_ROWS]
            if dialect == "postgresql":
                payload = json.dumps(chunk, default=_json_default, allow_nan=False)
                result = conn.execute(_pg_insert_ignore_stmt(table), {"rows": payload})
            else:
                result = conn.execute(sqlite.insert(table).on_conflict_do_nothing(), chunk)
            inserted += result.rowcount
    return inserted
