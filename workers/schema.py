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

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
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


def _job_key() -> Column:
    """The first key column of a table whose rows belong to a job: they go with it."""
    return Column("job_id", String(64), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)


# The tables share one MetaData, whose naming convention names every constraint.
metadata = MetaData(naming_convention=NAMING_CONVENTION)


# One submitted input file and the generation settings it runs with.
jobs_t = Table(
    "jobs",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("created_at", DateTime(timezone=True), default=utcnow, nullable=False),
    Column("updated_at", DateTime(timezone=True), default=utcnow, onupdate=utcnow, nullable=False),
    Column("finished_at", DateTime(timezone=True)),
    Column("state", String(16), default="queued", nullable=False),
    Column("input_path", Text, nullable=False),
    Column("model", String(255), nullable=False),
    Column("draft", String(255)),
    Column("mode", String(16), nullable=False),
    Column("params", JSONType, default=dict, nullable=False),
    Column("n_expected", Integer, default=0, nullable=False),
    Column("n_rejected", Integer, default=0, nullable=False),
    Column("n_shards", Integer, default=0, nullable=False),
    CheckConstraint(_in("state", JOB_STATES), name="state"),
    Index(None, "created_at"),
)


# Manifest entry: one expected sample and the normalized request a worker decodes.
requests_t = Table(
    "requests",
    metadata,
    _job_key(),
    Column("sample_id", String(255), primary_key=True),
    Column("line_no", Integer, nullable=False),
    Column("shard", Integer, nullable=False),
    Column("payload", JSONType, nullable=False),
    Index(None, "job_id", "shard"),
)


# The conversation of a request that asks for n > 1 completions, stored once: their
# manifest rows leave it out (a 100 KB prompt asked for 128 times is 100 KB, not 12.8 MB).
prompts_t = Table(
    "prompts",
    metadata,
    _job_key(),
    Column("request_id", String(255), primary_key=True),
    Column("payload", JSONType, nullable=False),
)


# A deterministic range of input lines: the unit of work of one Celery task.
shards_t = Table(
    "shards",
    metadata,
    _job_key(),
    Column("shard", Integer, primary_key=True),
    Column("line_start", Integer, nullable=False),
    Column("line_end", Integer, nullable=False),
    Column("n_samples", Integer, nullable=False),
    Column("state", String(16), default="queued", nullable=False),
    Column("attempts", Integer, default=0, nullable=False),
    # Attempts that ended without a word: their worker died (or gave up on the database)
    # and the shard was found running with no heartbeat. At the job's max_attempts the
    # shard is given up: its unfinished samples are stored as failed (workers/shards.py).
    Column("lost_attempts", Integer, default=0, server_default="0", nullable=False),
    Column("worker", String(255)),
    Column("started_at", DateTime(timezone=True)),
    Column("finished_at", DateTime(timezone=True)),
    Column("heartbeat_at", DateTime(timezone=True)),
    Column("parquet_path", Text),
    Column("error", Text),
    CheckConstraint(_in("state", SHARD_STATES), name="state"),
)


# One output row (DESIGN.md): one completion and its acceptance statistics.
#
# Result columns are NULL when `status` is 'failed' and nothing was measured;
# a failed row always carries `error`, an ok row never does.
samples_t = Table(
    "samples",
    metadata,
    Column("job_id", String(64), primary_key=True),
    Column("sample_id", String(255), primary_key=True),
    # The input line's id and which of its n completions this is (0 when n is 1, where
    # sample_id == request_id; else sample_id is "<request_id>#<choice_index>").
    Column("request_id", String(255), nullable=False),
    Column("choice_index", Integer, server_default="0", nullable=False),
    Column("line_no", Integer, nullable=False),
    Column("shard", Integer, nullable=False),
    Column("custom_id", String(255)),
    Column("category", String(255)),
    Column("output_text", Text),
    Column("turn_outputs", JSONType),
    Column("prompt_tokens", Integer),
    Column("completion_tokens", Integer),
    Column("finish_reason", String(32)),
    # Asked-for logprobs of the answer's tokens: [{token_id, logprob, top_ids, top_logprobs}]
    Column("logprobs", JSONType),
    Column("mode", String(16), nullable=False),
    Column("model", String(255), nullable=False),
    Column("draft", String(255)),
    # Which of the job's draft heads drafted it: 0 the one it started with, N the job's
    # head version N (--adapt-draft, table head_versions); NULL without a draft.
    Column("head_version", Integer),
    Column("temperature", Double, nullable=False),
    Column("top_p", Double, nullable=False),
    Column("seed", BigInteger),
    Column("n_cycles", Integer),
    Column("mean_accept_length", Double),
    Column("mean_tree_size", Double),
    Column("accept_hist", JSONType),
    Column("depth_attempts", JSONType),
    Column("depth_accepts", JSONType),
    Column("draft_ms", Double),
    Column("verify_ms", Double),
    Column("total_ms", Double),
    Column("tokens_per_s", Double),
    Column("worker", String(255), nullable=False),
    Column("device", String(64), nullable=False),
    Column("status", String(8), nullable=False),
    Column("error", Text),
    Column("created_at", DateTime(timezone=True), default=utcnow, nullable=False),
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


# A draft head the job trained on its own outputs (--adapt-draft): every attempt,
# with the tau of the head before it and its own on the job's held-out prompts. Only a
# published one (it beat the head before it) carries its files, and workers switch to
# the newest published at their next shard. Rows are written once, never changed.
head_versions_t = Table(
    "head_versions",
    metadata,
    _job_key(),
    Column("version", Integer, primary_key=True),
    Column("created_at", DateTime(timezone=True), default=utcnow, nullable=False),
    Column("published", Boolean, nullable=False),
    Column("based_on", Integer, nullable=False),  # the version it was fine-tuned from
    Column("train_completions", Integer, nullable=False),  # the job's ok samples then
    Column("tau_before", Double),
    Column("tau_after", Double),
    Column("eval_prompts", Integer, nullable=False),
    Column("train_s", Double, nullable=False),
    Column("sha256", String(64)),  # of `files`
    Column("files", LargeBinary),  # the head's folder, as a tar
)


# An input line that failed validation, kept so the user can fix and resubmit it.
rejected_lines_t = Table(
    "rejected_lines",
    metadata,
    _job_key(),
    Column("line_no", Integer, primary_key=True),
    Column("sample_id", String(255)),
    Column("reason", Text, nullable=False),
)


# The output row's field names, in table order (Parquet and exports use the same).
SAMPLE_FIELDS: tuple[str, ...] = tuple(samples_t.columns.keys())
