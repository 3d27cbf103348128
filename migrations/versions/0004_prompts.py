"""prompts: the conversation of a request with n > 1 completions, stored once

Each of a request's n completions is a manifest row of its own; they used to carry a copy
of the prompt each. Now the conversation is a prompts row keyed by (job_id, request_id),
and the completions' payloads leave it out. Rows stored before keep their own copies,
which workers still read.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 06:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "prompts",
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("request_id", sa.String(length=255), nullable=False),
        sa.Column(
            "payload",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_prompts_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "request_id", name=op.f("pk_prompts")),
    )


def downgrade() -> None:
    op.drop_table("prompts")
