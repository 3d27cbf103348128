"""samples.request_id, samples.choice_index: n completions per request

A line may ask for several completions; each is its own sample ("<id>#<k>"), and these
columns say which line (request_id) and which of its completions (choice_index) it is.
Rows stored before hold one completion per line: request_id = sample_id, index 0.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 17:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("request_id", sa.String(255), nullable=True))
        batch.add_column(
            sa.Column("choice_index", sa.Integer(), server_default="0", nullable=False)
        )
    op.execute("UPDATE samples SET request_id = sample_id")
    with op.batch_alter_table("samples") as batch:
        batch.alter_column("request_id", existing_type=sa.String(255), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("choice_index")
        batch.drop_column("request_id")
