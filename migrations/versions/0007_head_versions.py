"""samples.head_version and the head_versions table (--adapt-draft)

A job may train its draft head on its own outputs while it runs: every attempt is a row of
head_versions (the published ones carry the head's files), and every sample records which
version drafted it (0: the head the job started with; NULL: no draft). Rows stored before
this have NULL.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04 21:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("head_version", sa.Integer(), nullable=True))
    op.create_table(
        "head_versions",
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("published", sa.Boolean(), nullable=False),
        sa.Column("based_on", sa.Integer(), nullable=False),
        sa.Column("train_completions", sa.Integer(), nullable=False),
        sa.Column("tau_before", sa.Double(), nullable=True),
        sa.Column("tau_after", sa.Double(), nullable=True),
        sa.Column("eval_prompts", sa.Integer(), nullable=False),
        sa.Column("train_s", sa.Double(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=True),
        sa.Column("files", sa.LargeBinary(), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_head_versions_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", "version", name=op.f("pk_head_versions")),
    )


def downgrade() -> None:
    op.drop_table("head_versions")
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("head_version")
