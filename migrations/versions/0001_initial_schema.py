"""initial schema: jobs, requests (the manifest), shards, samples, rejected_lines

Revision ID: 0001
Revises:
Create Date: 2026-11-29 08:26:06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine:
    return sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def _ts() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("created_at", _ts(), nullable=False),
        sa.Column("updated_at", _ts(), nullable=False),
        sa.Column("finished_at", _ts(), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("input_path", sa.Text(), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("draft", sa.String(length=255), nullable=True),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("params", _json(), nullable=False),
        sa.Column("n_expected", sa.Integer(), nullable=False),
        sa.Column("n_rejected", sa.Integer(), nullable=False),
        sa.Column("n_shards", sa.Integer(), nullable=False),
        sa.CheckConstraint(
            "state IN ('queued', 'running', 'completed', 'failed', 'cancelled')",
            name=op.f("ck_jobs_state"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    op.create_index(op.f("ix_jobs_created_at"), "jobs", ["created_at"])

    op.create_table(
        "rejected_lines",
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("line_no", sa.Integer(), nullable=False),
        sa.Column("sample_id", sa.String(length=255), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_rejected_lines_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "line_no", name=op.f("pk_rejected_lines")),
    )

    op.create_table(
        "requests",
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("sample_id", sa.String(length=255), nullable=False),
        sa.Column("line_no", sa.Integer(), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("payload", _json(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_requests_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "sample_id", name=op.f("pk_requests")),
    )
    op.create_index(op.f("ix_requests_job_id_shard"), "requests", ["job_id", "shard"])

    op.create_table(
        "shards",
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("line_start", sa.Integer(), nullable=False),
        sa.Column("line_end", sa.Integer(), nullable=False),
        sa.Column("n_samples", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(length=255), nullable=True),
        sa.Column("started_at", _ts(), nullable=True),
        sa.Column("finished_at", _ts(), nullable=True),
        sa.Column("heartbeat_at", _ts(), nullable=True),
        sa.Column("parquet_path", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "state IN ('queued', 'running', 'done', 'failed', 'cancelled')",
            name=op.f("ck_shards_state"),
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_shards_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "shard", name=op.f("pk_shards")),
    )

    op.create_table(
        "samples",
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("sample_id", sa.String(length=255), nullable=False),
        sa.Column("line_no", sa.Integer(), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(length=255), nullable=True),
        sa.Column("category", sa.String(length=255), nullable=True),
        sa.Column("output_text", sa.Text(), nullable=True),
        sa.Column("turn_outputs", _json(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("draft", sa.String(length=255), nullable=True),
        sa.Column("temperature", sa.Double(), nullable=False),
        sa.Column("top_p", sa.Double(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=True),
        sa.Column("n_cycles", sa.Integer(), nullable=True),
        sa.Column("mean_accept_length", sa.Double(), nullable=True),
        sa.Column("accept_hist", _json(), nullable=True),
        sa.Column("depth_attempts", _json(), nullable=True),
        sa.Column("depth_accepts", _json(), nullable=True),
        sa.Column("draft_ms", sa.Double(), nullable=True),
        sa.Column("verify_ms", sa.Double(), nullable=True),
        sa.Column("total_ms", sa.Double(), nullable=True),
        sa.Column("tokens_per_s", sa.Double(), nullable=True),
        sa.Column("worker", sa.String(length=255), nullable=False),
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=8), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", _ts(), nullable=False),
        sa.CheckConstraint(
            "(status = 'ok' AND error IS NULL) OR (status = 'failed' AND error IS NOT NULL)",
            name=op.f("ck_samples_error_iff_failed"),
        ),
        sa.CheckConstraint("status IN ('ok', 'failed')", name=op.f("ck_samples_status")),
        sa.ForeignKeyConstraint(
            ["job_id", "sample_id"],
            ["requests.job_id", "requests.sample_id"],
            name=op.f("fk_samples_job_id_sample_id_requests"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", "sample_id", name=op.f("pk_samples")),
    )
    op.create_index(
        op.f("ix_samples_job_id_shard_line_no"), "samples", ["job_id", "shard", "line_no"]
    )


def downgrade() -> None:
    op.drop_table("samples")
    op.drop_table("shards")
    op.drop_table("requests")
    op.drop_table("rejected_lines")
    op.drop_table("jobs")
