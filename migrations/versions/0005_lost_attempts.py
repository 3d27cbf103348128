"""shards.lost_attempts: attempts whose worker died, counted so a poison shard ends

A shard that kills its worker process (a segfault, the OOM killer) came back after every
visibility timeout. Each attempt found running with no heartbeat now counts here; at the
job's max_attempts the shard's unfinished samples are stored as failed.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 07:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.add_column(
            sa.Column("lost_attempts", sa.Integer(), server_default="0", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.drop_column("lost_attempts")
