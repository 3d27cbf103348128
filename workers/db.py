"""The queries of a job's database, shared by the producer and the workers.

Every write is idempotent: inserts ignore rows already stored (a redelivered shard
stores nothing twice), state changes name the states they expect. The same code runs
on Postgres (cluster) and SQLite (embedded, one laptop); the tables are workers/schema.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Select,
    create_engine,
    event,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.engine import make_url

from workers.bulk import insert_ignore
from workers.schema import (
    JOB_STATES,
    SAMPLE_FIELDS,
    SAMPLE_STATUSES,
    SHARD_STATES,
    jobs_t,
    prompts_t,
    rejected_lines_t,
    requests_t,
    samples_t,
    shards_t,
    utcnow,
)
from workers.stored_text import OUTPUT_FIELDS, stored_row, unstored_row

# --------------------------------------------------------------------------- engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers (status, stats) run while a worker writes; the busy timeout
    # makes concurrent writers wait instead of failing with "database is locked".
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def make_engine(url: str, **kwargs: Any) -> Engine:
    """Create an engine for `url`; SQLite gets WAL, a busy timeout and foreign keys on.

    Create engines after a fork (Celery's worker_process_init), never before:
    pooled connections must not be shared between processes.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(parsed, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(parsed, pool_pre_ping=True, **kwargs)


# --------------------------------------------------------------------------- inserts


def insert_samples(engine: Engine, rows: Iterable[Mapping[str, Any]]) -> int:
    """Store output rows (keys: `SAMPLE_FIELDS`); returns how many were new.

    Idempotent: a redelivered shard re-inserting its rows stores nothing twice.
    Every sample must already be in the manifest (`requests`), or the insert fails.
    Outputs are stored exactly, whatever characters they hold (workers/stored_text.py).
    """
    return insert_ignore(engine, samples_t, (stored_row(row) for row in rows))


def insert_requests(engine: Engine, rows: Iterable[Mapping[str, Any]]) -> int:
    """Store manifest rows (job_id, sample_id, line_no, shard, payload); returns new count."""
    return insert_ignore(engine, requests_t, rows)


def insert_rejected_lines(engine: Engine, rows: Iterable[Mapping[str, Any]]) -> int:
    """Store rejected input lines (job_id, line_no, sample_id, reason); returns new count."""
    return insert_ignore(engine, rejected_lines_t, rows)


def insert_shards(engine: Engine, rows: Iterable[Mapping[str, Any]]) -> int:
    """Store shard rows (job_id, shard, line_start, line_end, n_samples); returns new count."""
    return insert_ignore(
        engine,
        shards_t,
        ({"state": "queued", "attempts": 0, "lost_attempts": 0, **row} for row in rows),
    )


# --------------------------------------------------------------------------- jobs


def insert_job(engine: Engine, **fields: Any) -> str:
    """Create a job row (state 'queued'); generates a uuid hex id unless `id` is given.

    Required: input_path, model, mode. Optional: draft, params, n_expected, n_rejected,
    n_shards. Returns the job id.
    """
    job_id = fields.pop("id", None) or uuid.uuid4().hex
    with engine.begin() as conn:
        conn.execute(insert(jobs_t).values(id=job_id, **fields))
    return job_id


def update_job(engine: Engine, job_id: str, **fields: Any) -> None:
    """Set plain job columns (e.g. n_expected, n_rejected, n_shards after the manifest)."""
    with engine.begin() as conn:
        conn.execute(update(jobs_t).where(jobs_t.c.id == job_id).values(**fields))


def set_job_state(
    engine: Engine, job_id: str, state: str, *, expect: Sequence[str] | None = None
) -> bool:
    """Move a job to `state`, only from a state in `expect` when given (compare-and-set).

    Returns whether the row changed, so racing producers/workers can tell who won.
    Terminal states stamp finished_at; other states clear it (a resumed job).
    """
    if state not in JOB_STATES:
        raise ValueError(f"unknown job state {state!r}")
    terminal = state in ("completed", "failed", "cancelled")
    stmt = (
        update(jobs_t)
        .where(jobs_t.c.id == job_id)
        .values(state=state, finished_at=utcnow() if terminal else None)
    )
    if expect is not None:
        stmt = stmt.where(jobs_t.c.state.in_(list(expect)))
    with engine.begin() as conn:
        return conn.execute(stmt).rowcount == 1


def get_job(engine: Engine, job_id: str) -> dict[str, Any] | None:
    """The job's row as a dict, or None."""
    with engine.connect() as conn:
        row = conn.execute(select(jobs_t).where(jobs_t.c.id == job_id)).mappings().first()
    return dict(row) if row is not None else None


def latest_job_id(engine: Engine) -> str | None:
    """The most recently created job's id (the default JOB of status/stats), or None."""
    stmt = select(jobs_t.c.id).order_by(jobs_t.c.created_at.desc(), jobs_t.c.id.desc()).limit(1)
    with engine.connect() as conn:
        return conn.execute(stmt).scalar()


def sample_counts(engine: Engine, job_id: str) -> dict[str, int]:
    """Stored samples of a job by status: {'ok': n, 'failed': m}."""
    stmt = (
        select(samples_t.c.status, func.count())
        .where(samples_t.c.job_id == job_id)
        .group_by(samples_t.c.status)
    )
    counts = dict.fromkeys(SAMPLE_STATUSES, 0)
    with engine.connect() as conn:
        for status, n in conn.execute(stmt):
            counts[status] = n
    return counts


def refresh_job_state(engine: Engine, job_id: str) -> str:
    """Derive a job's state from what is stored, not from callbacks; returns the state.

    When every expected sample is stored and no shard is still queued or running (its
    Parquet file may be unwritten) the job becomes 'completed' (none failed) or
    'failed' (some failed). A 'cancelled' job is never touched, nor an unfinished one.
    """
    job = get_job(engine, job_id)
    if job is None:
        raise KeyError(f"no job {job_id!r}")
    if job["state"] == "cancelled":
        return job["state"]
    # Shards first: a few rows per job, where the samples are millions. Every worker
    # asks after every shard, and while any shard is open the job is not finished.
    with engine.connect() as conn:  # every shard's Parquet file is written too
        unfinished = conn.execute(
            select(shards_t.c.shard)
            .where(shards_t.c.job_id == job_id, shards_t.c.state.in_(("queued", "running")))
            .limit(1)
        ).first()
    if unfinished is not None:
        return job["state"]
    counts = sample_counts(engine, job_id)
    if counts["ok"] + counts["failed"] < job["n_expected"]:
        return job["state"]
    state = "failed" if counts["failed"] else "completed"
    if job["state"] != state:
        changed = set_job_state(
            engine, job_id, state, expect=[s for s in JOB_STATES if s != "cancelled"]
        )
        if not changed:  # cancelled meanwhile
            return "cancelled"
    return state


# --------------------------------------------------------------------------- shards


def set_shard_state(
    engine: Engine,
    job_id: str,
    shard: int,
    state: str,
    *,
    worker: str | None = None,
    error: str | None = None,
    parquet_path: str | None = None,
    expect: Sequence[str] | None = None,
) -> bool:
    """Move a shard to `state` (compare-and-set with `expect`); returns whether it changed.

    'running' counts an attempt and stamps started_at/heartbeat_at and the worker;
    'done', 'failed' and 'cancelled' stamp finished_at. `error` and `parquet_path`
    are stored when given.
    """
    if state not in SHARD_STATES:
        raise ValueError(f"unknown shard state {state!r}")
    now = utcnow()
    values: dict[str, Any] = {"state": state}
    if state == "running":
        values.update(
            attempts=shards_t.c.attempts + 1,
            started_at=now,
            heartbeat_at=now,
            finished_at=None,
            error=None,
        )
    else:
        values["finished_at"] = now
    if worker is not None:
        values["worker"] = worker
    if error is not None:
        values["error"] = error
    if parquet_path is not None:
        values["parquet_path"] = parquet_path
    stmt = (
        update(shards_t)
        .where(shards_t.c.job_id == job_id, shards_t.c.shard == shard)
        .values(**values)
    )
    if expect is not None:
        stmt = stmt.where(shards_t.c.state.in_(list(expect)))
    with engine.begin() as conn:
        return conn.execute(stmt).rowcount == 1


def heartbeat_shard(engine: Engine, job_id: str, shard: int) -> None:
    """Stamp heartbeat_at on a running shard so a stalled worker can be told apart."""
    with engine.begin() as conn:
        conn.execute(
            update(shards_t)
            .where(
                shards_t.c.job_id == job_id,
                shards_t.c.shard == shard,
                shards_t.c.state == "running",
            )
            .values(heartbeat_at=utcnow())
        )


def get_shard(engine: Engine, job_id: str, shard: int) -> dict[str, Any]:
    """One shard's row."""
    stmt = select(shards_t).where(shards_t.c.job_id == job_id, shards_t.c.shard == shard)
    with engine.connect() as conn:
        return dict(conn.execute(stmt).mappings().one())


def reclaim_stalled(
    engine: Engine,
    silent_since: datetime,
    job_id: str | None = None,
    shard: int | None = None,
    on_reclaim: Callable[[dict[str, Any]], object] | None = None,
) -> list[dict[str, Any]]:
    """Shards left running with no heartbeat since `silent_since` (of every job, one job,
    or one shard of it): their attempt is gone, its worker dead or given up on an
    unreachable database. Each goes back to 'queued' with one more lost attempt and why
    in `error`. Returns their rows as they were, with the job's model.

    Compare-and-set on the heartbeat read, one transaction a shard: two watchdogs never
    both reclaim one attempt, and one that stamps its heartbeat meanwhile is left alone.
    `on_reclaim(row)` runs inside that transaction once the shard is won (the watchdog
    sends its message there): if it raises, the reclaim is undone and the error raised."""
    stmt = (
        select(shards_t, jobs_t.c.model)
        .join(jobs_t, jobs_t.c.id == shards_t.c.job_id)
        .where(shards_t.c.state == "running", shards_t.c.heartbeat_at < silent_since)
    )
    if job_id is not None:
        stmt = stmt.where(shards_t.c.job_id == job_id)
    if shard is not None:
        stmt = stmt.where(shards_t.c.shard == shard)
    with engine.connect() as conn:
        stalled = [dict(row) for row in conn.execute(stmt).mappings()]
    reclaimed = []
    for row in stalled:
        reason = (
            f"attempt {row['attempts']} on {row['worker']} was lost: no heartbeat since "
            f"{row['heartbeat_at']:%Y-%m-%d %H:%M:%S} UTC (its worker process died, or gave up "
            "on the database)"
        )
        with engine.begin() as conn:
            won = conn.execute(
                update(shards_t)
                .where(
                    shards_t.c.job_id == row["job_id"],
                    shards_t.c.shard == row["shard"],
                    shards_t.c.state == "running",
                    shards_t.c.heartbeat_at == row["heartbeat_at"],
                )
                .values(state="queued", lost_attempts=shards_t.c.lost_attempts + 1, error=reason)
            ).rowcount
            if won and on_reclaim is not None:
                on_reclaim(row)
        if won:
            reclaimed.append(row)
    return reclaimed


# --------------------------------------------------------------------------- reads


def done_sample_ids(engine: Engine, job_id: str, shard: int | None = None) -> set[str]:
    """Ids of the stored samples (ok or failed) of a job, or of one shard of it."""
    stmt = select(samples_t.c.sample_id).where(samples_t.c.job_id == job_id)
    if shard is not None:
        stmt = stmt.where(samples_t.c.shard == shard)
    with engine.connect() as conn:
        return set(conn.execute(stmt).scalars())


def _missing_requests_stmt(job_id: str) -> Select[Any]:
    # Manifest rows with no stored sample (NOT EXISTS: uses both primary keys).
    stored = (
        select(samples_t.c.sample_id)
        .where(
            samples_t.c.job_id == requests_t.c.job_id,
            samples_t.c.sample_id == requests_t.c.sample_id,
        )
        .exists()
    )
    return select(requests_t).where(requests_t.c.job_id == job_id, ~stored)


def missing_shards(engine: Engine, job_id: str) -> list[int]:
    """What `resume` enqueues: shards with a manifest sample not yet stored, and shards
    not marked done (all rows stored but the worker died before its Parquet file)."""
    sub = _missing_requests_stmt(job_id).subquery()
    with_missing = select(sub.c.shard)
    unfinished = select(shards_t.c.shard).where(
        shards_t.c.job_id == job_id, shards_t.c.state != "done"
    )
    stmt = with_missing.union(unfinished).order_by("shard")
    with engine.connect() as conn:
        return list(conn.execute(stmt).scalars())


def pending_requests(engine: Engine, job_id: str, shard: int) -> list[dict[str, Any]]:
    """Manifest rows of one shard not yet stored, in line order: what a worker decodes.

    A redelivered shard thereby decodes only what its previous attempt did not store.
    Completions whose conversation is stored once for their request (`prompts`) get it
    back in their payload.
    """
    stmt = (
        _missing_requests_stmt(job_id)
        .where(requests_t.c.shard == shard)
        .order_by(requests_t.c.line_no, requests_t.c.sample_id)
    )
    with engine.connect() as conn:
        rows = [dict(r) for r in conn.execute(stmt).mappings()]
        return with_shared_prompts(conn, job_id, rows)


def with_shared_prompts(
    conn: Connection, job_id: str, rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Manifest rows (with `payload`) whose conversation is stored once for their request
    (`prompts`) get it back in their payload."""
    shared = sorted(
        {r["payload"].get("request_id") for r in rows if "messages" not in r["payload"]} - {None}
    )
    prompts: dict[str, dict[str, Any]] = {}
    for start in range(0, len(shared), 1000):
        prompts.update(
            conn.execute(
                select(prompts_t.c.request_id, prompts_t.c.payload).where(
                    prompts_t.c.job_id == job_id,
                    prompts_t.c.request_id.in_(shared[start : start + 1000]),
                )
            ).all()
        )
    for row in rows:
        prompt = prompts.get(row["payload"].get("request_id"))
        if prompt is not None and "messages" not in row["payload"]:
            row["payload"] = {**prompt, **row["payload"]}
    return rows


def iter_samples(
    engine: Engine,
    job_id: str,
    *,
    shard: int | None = None,
    columns: Sequence[str] | None = None,
    batch_size: int = 1000,
) -> Iterator[dict[str, Any]]:
    """Stream a job's (or one shard's) output rows in line order, `batch_size` at a time.

    (Ordered by shard, line, completion: shards are line ranges, so this is input order.)

    Rows come from a server-side cursor on Postgres, so a large job is never held whole.
    `columns` limits the fields read (stats needs no output text). Outputs come back as
    the model wrote them (workers/stored_text.py).
    """
    names = columns or SAMPLE_FIELDS
    cols = [samples_t.c[name] for name in names]
    restore = unstored_row if not set(OUTPUT_FIELDS).isdisjoint(names) else dict
    stmt = select(*cols).where(samples_t.c.job_id == job_id)
    if shard is not None:
        stmt = stmt.where(samples_t.c.shard == shard)
    stmt = stmt.order_by(samples_t.c.shard, samples_t.c.line_no, samples_t.c.choice_index)
    with engine.connect() as conn:
        result = conn.execution_options(yield_per=batch_size).execute(stmt).mappings()
        for row in result:
            yield restore(row)
