"""The queries of the job commands: what `status`, `verify`, `cancel`, `resume`,
`submit --resume-from`, `run`'s resume and `train-draft` ask of a job's rows, and the
shards they move at once. Beside workers/db.py, which holds the queries of the shard
path that workers and commands share; the tables are workers/schema.py.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, delete, func, select, update

from workers.schema import (
    SHARD_STATES,
    jobs_t,
    rejected_lines_t,
    requests_t,
    samples_t,
    shards_t,
)

# Shards moved by one UPDATE at most (IN lists stay far below every driver's limit).
_SHARDS_AT_ONCE = 1000


def job_ids(engine: Engine) -> list[str]:
    """Every job's id, oldest first."""
    with engine.connect() as conn:
        return list(conn.execute(select(jobs_t.c.id).order_by(jobs_t.c.created_at)).scalars())


def job_ids_with_prefix(engine: Engine, prefix: str, limit: int = 2) -> list[str]:
    """Up to `limit` job ids that start with `prefix` (taken literally, not as a pattern)."""
    pattern = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    stmt = select(jobs_t.c.id).where(jobs_t.c.id.like(pattern, escape="\\")).limit(limit)
    with engine.connect() as conn:
        return list(conn.execute(stmt).scalars())


def unfinished_jobs(
    engine: Engine, *, input_path: str, model: str, mode: str, draft: str | None
) -> list[dict[str, Any]]:
    """Queued or running jobs of this input, model, mode and draft whose creation finished
    (they expect samples), newest first."""
    same_draft = jobs_t.c.draft.is_(None) if draft is None else jobs_t.c.draft == draft
    stmt = (
        select(jobs_t)
        .where(
            jobs_t.c.input_path == input_path,
            jobs_t.c.model == model,
            jobs_t.c.mode == mode,
            same_draft,
            jobs_t.c.state.in_(["queued", "running"]),
            jobs_t.c.n_expected > 0,
        )
        .order_by(jobs_t.c.created_at.desc())
    )
    with engine.connect() as conn:
        return [dict(row) for row in conn.execute(stmt).mappings()]


def delete_job(engine: Engine, job_id: str) -> None:
    """Remove a job and (cascading) everything stored under it."""
    with engine.begin() as conn:
        conn.execute(delete(jobs_t).where(jobs_t.c.id == job_id))


def shard_ids(engine: Engine, job_id: str) -> list[int]:
    """Every shard of a job, in order (what `submit` enqueues)."""
    stmt = select(shards_t.c.shard).where(shards_t.c.job_id == job_id).order_by(shards_t.c.shard)
    with engine.connect() as conn:
        return list(conn.execute(stmt).scalars())


def shard_rows(engine: Engine, job_id: str) -> list[dict[str, Any]]:
    """Every shard row of a job, in order."""
    stmt = select(shards_t).where(shards_t.c.job_id == job_id).order_by(shards_t.c.shard)
    with engine.connect() as conn:
        return [dict(row) for row in conn.execute(stmt).mappings()]


def recorded_parquet_path(engine: Engine, job_id: str) -> str | None:
    """A Parquet path a worker recorded for one of the job's shards, if any did."""
    stmt = (
        select(shards_t.c.parquet_path)
        .where(shards_t.c.job_id == job_id, shards_t.c.parquet_path.is_not(None))
        .limit(1)
    )
    with engine.connect() as conn:
        return conn.execute(stmt).scalar()


def set_shards_state(
    engine: Engine,
    job_id: str,
    state: str,
    *,
    shards: list[int] | None = None,
    expect: Collection[str] | None = None,
) -> int:
    """Move many shards of a job to `state` at once (cancel, resume); returns how many.

    'queued' clears the previous attempt's finish time and error; other states stamp
    finished_at.
    """
    if state not in SHARD_STATES:
        raise ValueError(f"unknown shard state {state!r}")
    values: dict[str, Any] = {"state": state, "finished_at": None, "error": None}
    if state != "queued":
        values = {"state": state, "finished_at": datetime.now(UTC)}
    chunks: list[list[int] | None] = [None]
    if shards is not None:
        chunks = [shards[i : i + _SHARDS_AT_ONCE] for i in range(0, len(shards), _SHARDS_AT_ONCE)]
    total = 0
    with engine.begin() as conn:
        for chunk in chunks:
            stmt = update(shards_t).where(shards_t.c.job_id == job_id).values(**values)
            if chunk is not None:
                stmt = stmt.where(shards_t.c.shard.in_(chunk))
            if expect is not None:
                stmt = stmt.where(shards_t.c.state.in_(list(expect)))
            total += conn.execute(stmt).rowcount
    return total


def manifest_ids(engine: Engine, job_id: str) -> set[str]:
    """The sample ids a job's manifest expects."""
    stmt = select(requests_t.c.sample_id).where(requests_t.c.job_id == job_id)
    with engine.connect() as conn:
        return set(conn.execute(stmt).scalars())


def ok_sample_ids(engine: Engine, job_id: str) -> set[str]:
    """Ids of a job's successful samples: what `--resume-from` skips (failed ones rerun)."""
    stmt = select(samples_t.c.sample_id).where(
        samples_t.c.job_id == job_id, samples_t.c.status == "ok"
    )
    with engine.connect() as conn:
        return set(conn.execute(stmt).scalars())


def rows_per_sample_id(engine: Engine, job_id: str) -> dict[str, int]:
    """Stored rows per sample id, counted rather than assumed: the primary key should make
    duplicates impossible, and `verify` is what proves it."""
    stmt = (
        select(samples_t.c.sample_id, func.count())
        .where(samples_t.c.job_id == job_id)
        .group_by(samples_t.c.sample_id)
    )
    with engine.connect() as conn:
        return dict(conn.execute(stmt).all())


def stored_per_shard(engine: Engine, job_id: str) -> dict[int, int]:
    """Stored samples per shard of a job."""
    stmt = (
        select(samples_t.c.shard, func.count())
        .where(samples_t.c.job_id == job_id)
        .group_by(samples_t.c.shard)
    )
    with engine.connect() as conn:
        return dict(conn.execute(stmt).all())


def completion_tokens(engine: Engine, job_id: str) -> int:
    """The tokens a job's stored samples generated, all together."""
    stmt = select(func.coalesce(func.sum(samples_t.c.completion_tokens), 0)).where(
        samples_t.c.job_id == job_id
    )
    with engine.connect() as conn:
        return conn.execute(stmt).scalar_one()


def rejected_lines(engine: Engine, job_id: str) -> Iterator[tuple[int, str | None, str]]:
    """(line number, sample id, reason) of every rejected input line, in line order,
    streamed: a job can hold millions."""
    stmt = (
        select(rejected_lines_t.c.line_no, rejected_lines_t.c.sample_id, rejected_lines_t.c.reason)
        .where(rejected_lines_t.c.job_id == job_id)
        .order_by(rejected_lines_t.c.line_no)
    )
    with engine.connect() as conn:
        rows = conn.execution_options(yield_per=1000).execute(stmt)
        yield from (tuple(row) for row in rows)
