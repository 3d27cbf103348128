"""samples.logprobs, and the tree options renamed in jobs.params

A line may ask for logprobs: per output token its id, logprob and the position's most likely
tokens, a JSON list (NULL when not asked for). And `top_k` now means what it means in every
sampling API (keep the k most likely tokens), so the draft tree's width and depth, stored
as `top_k` and `depth` in a job's params until now, are `tree_width` and `tree_depth`: a job
created before keeps its tree, and is not read as asking for top-k sampling.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
_RENAMED = {"top_k": "tree_width", "depth": "tree_depth"}


def _rename_params(renames: dict[str, str]) -> None:
    """Rename keys of every job's params (jobs are few: one row per submitted file)."""
    jobs = sa.table("jobs", sa.column("id", sa.String), sa.column("params", _JSON))
    conn = op.get_bind()
    for job_id, params in conn.execute(sa.select(jobs.c.id, jobs.c.params)).all():
        if params and renames.keys() & params.keys():
            renamed = {renames.get(key, key): value for key, value in params.items()}
            conn.execute(jobs.update().where(jobs.c.id == job_id).values(params=renamed))


def upgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("logprobs", _JSON, nullable=True))
    _rename_params(_RENAMED)


def downgrade() -> None:
    _rename_params({new: old for old, new in _RENAMED.items()})
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("logprobs")
