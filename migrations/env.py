"""Alembic environment: migrates the connection handed over in `config.attributes`.

`migrations.upgrade()` passes a connection; the plain `alembic` command line (from a
checkout, with migrations/alembic.ini) falls back to EAGLE2_DATABASE_URL.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from workers.db import make_engine
from workers.schema import metadata
from workers.settings import load_settings

config = context.config
target_metadata = metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode copies the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def _url() -> str:
    return config.get_main_option("sqlalchemy.url") or load_settings().database_url


if context.is_offline_mode():
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=_url().startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()
elif (shared := config.attributes.get("connection")) is not None:
    _run(shared)
else:
    engine = make_engine(_url())
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()
