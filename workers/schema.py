"""The database schema: the tables a job lives in, on Postgres and SQLite alike.

The database is the source of truth for a job: the manifest of expected samples
(`requests`) is written before anything is enqueued, every decoded sample lands in
`samples` exactly once (primary key (job_id, sample_id)), and a job is finished when the
stored count reaches the manifest count. Migrations (migrations/) build these tables;
the queries that read and write them are in workers/db.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

JOB_STATES = ("queued", "running", "completed", "failed", "cancelled")
SHARD_STATES = ("queued", "running", "done", "failed", "cancelled")
SAMPLE_STATUSES = ("ok", "failed")

# Postgres stores JSON as JSONB (indexable, compact); SQLite keeps it as JSON text.
# Python None is SQL NULL on both (not the JSON value 'null'), so IS NULL finds it.
JSONType = JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")

# Deterministic constraint names, so migrations can name what they alter or drop.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def _in(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    """Declarative base whose metadata carries the constraint naming convention."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Job(Base):
    """One submitted input file and the generation settings it runs with."""

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(_in("state", JOB_STATES), name="state"),
        Index(None, "created_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    state: Mapped[str] = mapped_column(String(16), default="queued")
    input_path: Mapped[str] = mapped_column(Text)
    model: Mapped[str] = mapped_column(String(255))
    draft: Mapped[str | None] = mapped_column(String(255))
    mode: Mapped[str] = mapped_column(String(16))
    params: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    n_expected: Mapped[int] = mapped_column(Integer, default=0)
    n_rejected: Mapped[int] = mapped_column(Integer, default=0)
    n_shards: Mapped[int] = mapped_column(Integer, default=0)


class Request(Base):
    """Manifest entry: one expected sample and the normalized request a worker decodes."""

    __tablename__ = "requests"
    __table_args__ = (Index(None, "job_id", "shard"),)

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    sample_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    line_no: Mapped[int] = mapped_column(Integer)
    shard: Mapped[int] = mapped_column(Integer)
    payload: Mapped[dict[str, Any]] = mapped_column(JSONType)


class Prompt(Base):
    """The conversation of a request that asks for n > 1 completions, stored once: their
    manifest rows leave it out (a 100 KB prompt asked for 128 times is 100 KB, not 12.8 MB)."""

    __tablename__ = "prompts"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    payload: Mapped[dict[str, Any]] = mapped_column(JSONType)


class Shard(Base):
    """A deterministic range of input lines: the unit of work of one Celery task."""

    __tablename__ = "shards"
    __table_args__ = (CheckConstraint(_in("state", SHARD_STATES), name="state"),)

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    shard: Mapped[int] = mapped_column(Integer, primary_key=True)
    line_start: Mapped[int] = mapped_column(Integer)
    line_end: Mapped[int] = mapped_column(Integer)
    n_samples: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default="queued")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # Attempts that ended without a word: their worker died (or gave up on the database)
    # and the shard was found running with no heartbeat. At the job's max_attempts the
    # shard is given up: its unfinished samples are stored as failed (workers/shards.py).
    lost_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    worker: Mapped[str | None] = mapped_column(String(255))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    parquet_path: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)


class Sample(Base):
    """One output row (DESIGN.md): one completion and its acceptance statistics.

    Result columns are NULL when `status` is 'failed' and nothing was measured;
    a failed row always carries `error`, an ok row never does.
    """

    __tablename__ = "samples"
    __table_args__ = (
        ForeignKeyConstraint(
            ["job_id", "sample_id"],
            ["requests.job_id", "requests.sample_id"],
            ondelete="CASCADE",
        ),
        CheckConstraint(_in("status", SAMPLE_STATUSES), name="status"),
        CheckConstraint(
            "(status = 'ok' AND error IS NULL) OR (status = 'failed' AND error IS NOT NULL)",
            name="error_iff_failed",
        ),
        Index(None, "job_id", "shard", "line_no"),
    )

    job_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    sample_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    # The input line's id and which of its n completions this is (0 when n is 1, where
    # sample_id == request_id; else sample_id is "<request_id>#<choice_index>").
    request_id: Mapped[str] = mapped_column(String(255))
    choice_index: Mapped[int] = mapped_column(Integer, server_default="0")
    line_no: Mapped[int] = mapped_column(Integer)
    shard: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str | None] = mapped_column(String(255))
    category: Mapped[str | None] = mapped_column(String(255))
    output_text: Mapped[str | None] = mapped_column(Text)
    turn_outputs: Mapped[list[str] | None] = mapped_column(JSONType)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    # Asked-for logprobs of the answer's tokens: [{token_id, logprob, top_ids, top_logprobs}]
    logprobs: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType)
    mode: Mapped[str] = mapped_column(String(16))
    model: Mapped[str] = mapped_column(String(255))
    draft: Mapped[str | None] = mapped_column(String(255))
    # Which of the job's draft heads drafted it: 0 the one it started with, N the job's
    # head version N (--adapt-draft, table head_versions); NULL without a draft.
    head_version: Mapped[int | None] = mapped_column(Integer)
    temperature: Mapped[float] = mapped_column(Double)
    top_p: Mapped[float] = mapped_column(Double)
    seed: Mapped[int | None] = mapped_column(BigInteger)
    n_cycles: Mapped[int | None] = mapped_column(Integer)
    mean_accept_length: Mapped[float | None] = mapped_column(Double)
    mean_tree_size: Mapped[float | None] = mapped_column(Double)
    accept_hist: Mapped[list[int] | None] = mapped_column(JSONType)
    depth_attempts: Mapped[list[int] | None] = mapped_column(JSONType)
    depth_accepts: Mapped[list[int] | None] = mapped_column(JSONType)
    draft_ms: Mapped[float | None] = mapped_column(Double)
    verify_ms: Mapped[float | None] = mapped_column(Double)
    total_ms: Mapped[float | None] = mapped_column(Double)
    tokens_per_s: Mapped[float | None] = mapped_column(Double)
    worker: Mapped[str] = mapped_column(String(255))
    device: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(8))
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class HeadVersion(Base):
    """A draft head the job trained on its own outputs (--adapt-draft): every attempt,
    with the tau of the head before it and its own on the job's held-out prompts. Only a
    published one (it beat the head before it) carries its files, and workers switch to
    the newest published at their next shard. Rows are written once, never changed."""

    __tablename__ = "head_versions"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    published: Mapped[bool] = mapped_column(Boolean)
    based_on: Mapped[int] = mapped_column(Integer)  # the version it was fine-tuned from
    train_completions: Mapped[int] = mapped_column(Integer)  # the job's ok samples then
    tau_before: Mapped[float | None] = mapped_column(Double)
    tau_after: Mapped[float | None] = mapped_column(Double)
    eval_prompts: Mapped[int] = mapped_column(Integer)
    train_s: Mapped[float] = mapped_column(Double)
    sha256: Mapped[str | None] = mapped_column(String(64))  # of `files`
    files: Mapped[bytes | None] = mapped_column(LargeBinary)  # the head's folder, as a tar


class RejectedLine(Base):
    """An input line that failed validation, kept so the user can fix and resubmit it."""

    __tablename__ = "rejected_lines"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    line_no: Mapped[int] = mapped_column(Integer, primary_key=True)
    sample_id: Mapped[str | None] = mapped_column(String(255))
    reason: Mapped[str] = mapped_column(Text)


jobs_t: Table = Job.__table__  # type: ignore[assignment]
requests_t: Table = Request.__table__  # type: ignore[assignment]
prompts_t: Table = Prompt.__table__  # type: ignore[assignment]
shards_t: Table = Shard.__table__  # type: ignore[assignment]
samples_t: Table = Sample.__table__  # type: ignore[assignment]
rejected_lines_t: Table = RejectedLine.__table__  # type: ignore[assignment]
head_versions_t: Table = HeadVersion.__table__  # type: ignore[assignment]

# The output row's field names, in table order (Parquet and exports use the same).
SAMPLE_FIELDS: tuple[str, ...] = tuple(samples_t.columns.keys())
