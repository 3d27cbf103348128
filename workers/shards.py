"""Process one shard: decode what is missing, store it, write the shard's Parquet file.

This is the single shard-processing path: the Celery task (workers/tasks.py) and the
embedded `eagle2-batch run` both call `process_shard`, so it knows nothing of Celery.
It is safe to run twice, even at once (a redelivered message, `resume`): it decodes only
the samples not yet stored, inserts ignore rows already there, and the Parquet file is
rebuilt from every stored row of the shard, so it is complete whichever run writes last.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, InterfaceError, InternalError, OperationalError

from workers import db
from workers.head_versions import follow_newest
from workers.heartbeat import Heartbeat, heartbeat_period, silent_since, stall_after
from workers.job_settings import JobSettings
from workers.parquet_sink import write_shard_parquet
from workers.request import Request
from workers.settings import number_setting

if TYPE_CHECKING:  # decoding imports torch; the producer side of this module must not
    from workers.decoding import SampleDecoder

# A crash loses at most the decoded samples not yet flushed: flush every FLUSH_ROWS rows, or
# sooner when FLUSH_S have passed (long samples).
FLUSH_ROWS = 8
FLUSH_S = 10.0

# Database errors a retry can cure: connection lost, server restarting, deadlock, a
# read-only replica during failover. Others (a violated constraint, a value too long, bad
# SQL) would fail the same way again, so they fail the shard at once.
RETRYABLE_DB_ERRORS = (OperationalError, InterfaceError, InternalError)

# How long a flush keeps retrying a retryable error in place before the shard gives up
# (and Celery retries it): decoded rows are kept in memory meanwhile, not decoded again.
FLUSH_RETRY_ENV = "EAGLE2_DB_WRITE_RETRY_S"
DEFAULT_FLUSH_RETRY_S = 60.0

ProgressCallback = Callable[[dict[str, Any], int, int], None]


@dataclass(frozen=True)
class ShardResult:
    """What one call did to a shard."""

    job_id: str
    shard: int
    state: str  # 'done' or 'cancelled'
    decoded: int  # samples decoded by this call
    stored: int  # of those, rows newly stored (fewer if a concurrent run stored them first)
    failed: int  # decoded samples with status 'failed'
    skipped: int  # samples already stored before this call (a redelivered shard)
    parquet_path: Path | None
    job_state: str
    decode_ms: float  # summed total_ms of the decoded samples
    wall_s: float


@dataclass
class _Tally:
    decoded: int = 0
    stored: int = 0
    failed: int = 0
    skipped: int = 0
    decode_ms: float = 0.0


class ShardGivenUp(Exception):
    """The error of the samples of a shard whose attempts kept being lost."""


class JobNotFoundError(LookupError):
    """The task names a job this database does not hold."""


def load_job(engine: Engine, job_id: str) -> dict[str, Any]:
    """The job's row; a clear error when this database does not hold it."""
    job = db.get_job(engine, job_id)
    if job is None:
        raise JobNotFoundError(
            f"job {job_id!r} is not in the database {engine.url.render_as_string()}: "
            "was it submitted against another EAGLE2_DATABASE_URL?"
        )
    return job


def mark_failed(engine: Engine, job_id: str, shard: int, worker: str, exc: Exception) -> None:
    """Record why a shard failed; best effort, the original error is what matters."""
    with contextlib.suppress(DBAPIError):
        error = f"{type(exc).__name__}: {exc}"
        db.set_shard_state(engine, job_id, shard, "failed", worker=worker, error=error)


def _cancelled(engine: Engine, job_id: str) -> bool:
    return load_job(engine, job_id)["state"] == "cancelled"


def flush_retry_s() -> float:
    """`EAGLE2_DB_WRITE_RETRY_S`: seconds a running shard's writes retry a lost database in
    place (default 60; longer than the database's failover keeps its decoded rows); a
    non-negative number."""
    return number_setting(
        FLUSH_RETRY_ENV,
        DEFAULT_FLUSH_RETRY_S,
        float,
        lambda v: 0 <= v < float("inf"),
        "a number of seconds, 0 or more",
    )


def _retrying(retry_s: float, write: Callable[..., Any], *args: Any) -> Any:
    """Run an idempotent database write, retrying a lost connection for retry_s seconds."""
    deadline, pause = time.monotonic() + retry_s, 0.5
    while True:
        try:
            return write(*args)
        except RETRYABLE_DB_ERRORS:
            if time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 8.0)


def process_shard(
    db_engine: Engine,
    decoder: SampleDecoder,
    job_id: str,
    shard: int,
    out_dir: str | Path,
    worker: str,
    device: str | None = None,
    on_progress: ProgressCallback | None = None,
    lost_after: float | None = None,
    decoding: Callable[[Iterator[dict[str, Any]]], Iterator[dict[str, Any]]] | None = None,
) -> ShardResult:
    """Decode and store the shard's missing samples, then write its Parquet file.

    Marks the shard running (one more attempt), stamps its heartbeat from a thread while it
    runs (workers/heartbeat.py), flushes rows every few samples, and stops early, leaving
    the shard 'cancelled', once the job is cancelled. At the end the shard is 'done' and the
    job's state is re-derived from the stored counts. `on_progress(row, n_done, n_pending)`
    is called after each decoded sample. `decoding`, where given, wraps the decoder's
    stream of rows (`run` lets Ctrl-C land only there: producer/interrupts.py).

    A previous attempt found running with no heartbeat for `lost_after` seconds (default:
    the stall limit) counts as lost. Once the job's max_attempts (default 3) are lost, the
    shard is given up: its unfinished samples are stored as failed with the last loss as
    their error, and nothing is decoded (decoding it is what kept killing its workers).

    Errors mark the shard 'failed' and are re-raised, except `RETRYABLE_DB_ERRORS`, which
    are re-raised untouched for the caller to retry (nothing stored is lost).
    """
    from workers.decoding import RowOrigin  # torch: loaded already, with the decoder

    started = time.perf_counter()
    shard = int(shard)
    tally = _Tally()

    def result(state: str, path: Path | None, job_state: str) -> ShardResult:
        return ShardResult(
            job_id=job_id,
            shard=shard,
            state=state,
            **asdict(tally),
            parquet_path=path,
            job_state=job_state,
            wall_s=time.perf_counter() - started,
        )

    def cancel() -> ShardResult:
        db.set_shard_state(
            db_engine, job_id, shard, "cancelled", worker=worker, expect=["queued", "running"]
        )
        return result("cancelled", None, "cancelled")

    job = load_job(db_engine, job_id)
    if job["state"] == "cancelled":
        return cancel()
    silent = stall_after() if lost_after is None else lost_after
    db.reclaim_stalled(db_engine, silent_since(silent), job_id, shard)
    lost = db.get_shard(db_engine, job_id, shard)
    db.set_shard_state(db_engine, job_id, shard, "running", worker=worker)
    if job["state"] == "queued":
        db.set_job_state(db_engine, job_id, "running", expect=["queued"])
    params = job["params"] or {}
    settings = JobSettings.from_params(params)
    origin = RowOrigin(job_id, shard, worker, device)
    try:
        retry_s = flush_retry_s()
        with Heartbeat(db_engine, job_id, shard, heartbeat_period()):
            tally.skipped = len(db.done_sample_ids(db_engine, job_id, shard))
            pending = db.pending_requests(db_engine, job_id, shard)
            requests = (
                Request.from_payload(
                    {**row["payload"], "sample_id": row["sample_id"], "line_no": row["line_no"]}
                )
                for row in pending
            )
            if lost["lost_attempts"] >= settings.max_attempts:
                given_up = ShardGivenUp(
                    f"gave up after {lost['lost_attempts']} lost attempts (max_attempts "
                    f"{settings.max_attempts}); the last: {lost['error']}"
                )
                rows = list(decoder.failed_rows(requests, params, origin, given_up))
                tally.failed = len(rows)
                tally.stored = _retrying(retry_s, db.insert_samples, db_engine, rows)
            else:
                if decoder.head_version is not None:
                    follow_newest(db_engine, decoder, job_id, settings.adapt_draft)
                samples = decoder.decode_many(requests, params, origin)
                if decoding is not None:
                    samples = decoding(samples)
                stored = _store(
                    db_engine, job_id, samples, len(pending), tally, on_progress, retry_s
                )
                if not stored:
                    return cancel()
            metadata = {"model": job["model"], "draft": job["draft"], "mode": job["mode"]}
            path = write_shard_parquet(
                out_dir,
                job_id,
                shard,
                db.iter_samples(db_engine, job_id, shard=shard),
                {**metadata, "params": params},
            )
            db.set_shard_state(
                db_engine,
                job_id,
                shard,
                "done",
                worker=worker,
                parquet_path=str(path),
                expect=["running"],
            )
    except RETRYABLE_DB_ERRORS:
        raise
    except Exception as exc:
        mark_failed(db_engine, job_id, shard, worker, exc)
        raise
    return result("done", path, db.refresh_job_state(db_engine, job_id))


def _store(
    db_engine: Engine,
    job_id: str,
    samples: Iterator[dict[str, Any]],
    n_pending: int,
    tally: _Tally,
    on_progress: ProgressCallback | None,
    retry_s: float,
) -> bool:
    """Store decoded samples as they come, FLUSH_ROWS at a time (or every FLUSH_S);
    False when the job was cancelled meanwhile (the rest is not decoded)."""
    unflushed: list[dict[str, Any]] = []
    last_flush = time.monotonic()
    for sample in samples:
        unflushed.append(sample)
        tally.decoded += 1
        tally.failed += sample["status"] == "failed"
        tally.decode_ms += sample["total_ms"] or 0.0
        if on_progress is not None:
            on_progress(sample, tally.decoded, n_pending)
        if len(unflushed) >= FLUSH_ROWS or time.monotonic() - last_flush >= FLUSH_S:
            tally.stored += _retrying(retry_s, db.insert_samples, db_engine, unflushed)
            unflushed.clear()
            last_flush = time.monotonic()
            if tally.decoded < n_pending and _cancelled(db_engine, job_id):
                return False
    tally.stored += _retrying(retry_s, db.insert_samples, db_engine, unflushed)
    return True
