"""A new job's rows by COPY (Postgres) or one executemany (SQLite) read back unchanged,
whatever characters they hold."""

from __future__ import annotations

import json

import psycopg
import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from workers import db
from workers.bulk import encode_rows, write_rows

COLUMNS = ("job_id", "sample_id", "line_no", "shard", "payload")
AWKWARD = ["tab\there", "new\nline", "back\\slash", "\\.", "crlf\r\n", "ünï ✓", "\\N", "x"]


def test_rows_round_trip_every_awkward_character(engine):
    job_id = db.insert_job(engine, input_path="in.jsonl", model="m", mode="vanilla")
    payloads = [{"messages": [{"role": "user", "content": text}], "n": None} for text in AWKWARD]
    rows = [
        (job_id, text, i + 1, i // 3, json.dumps(payload, ensure_ascii=False))
        for i, (text, payload) in enumerate(zip(AWKWARD, payloads, strict=True))
    ]
    write_rows(engine, db.requests_t, COLUMNS, encode_rows(engine.dialect.name, rows))
    stmt = select(db.requests_t).where(db.requests_t.c.job_id == job_id)
    with engine.connect() as conn:
        stored = sorted(conn.execute(stmt).mappings(), key=lambda r: r["line_no"])
    assert [r["sample_id"] for r in stored] == AWKWARD
    assert [r["payload"] for r in stored] == payloads
    assert [(r["line_no"], r["shard"]) for r in stored] == [(i + 1, i // 3) for i in range(8)]
    rejected = [(job_id, 1, None, "why\tnot")]
    columns = ("job_id", "line_no", "sample_id", "reason")
    write_rows(engine, db.rejected_lines_t, columns, encode_rows(engine.dialect.name, rejected))
    with engine.connect() as conn:
        mine = select(db.rejected_lines_t).where(db.rejected_lines_t.c.job_id == job_id)
        row = conn.execute(mine).mappings().one()
    assert (row["sample_id"], row["reason"]) == (None, "why\tnot")  # NULL stays NULL
    with pytest.raises((IntegrityError, psycopg.IntegrityError)):  # new rows only
        write_rows(engine, db.requests_t, COLUMNS, encode_rows(engine.dialect.name, rows[:1]))


def test_unknown_columns_are_refused(engine):
    with pytest.raises(ValueError, match="unknown columns"):
        write_rows(engine, db.requests_t, ("job_id", "sampel_id"), [("j", "s")])
