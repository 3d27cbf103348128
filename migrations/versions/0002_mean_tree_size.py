"""samples.mean_tree_size: the tree nodes a sample's rounds verified on average

With --total-tokens auto the engine sizes every round's tree by cost; this records what
it chose, beside tau.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("mean_tree_size", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("mean_tree_size")
