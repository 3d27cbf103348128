"""The database as the producer's commands use it: migrated before use, its errors told
in one line (as JobError, which the CLI prints), its URL printed without the password."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import overload

from sqlalchemy import Engine, inspect
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

import migrations
from producer.jobs import JobError, one_line
from workers.db import make_engine


def safe_url(url: str) -> str:
    """A database URL fit to print (password hidden)."""
    return make_url(url).render_as_string(hide_password=True)


@overload
def as_utc(value: datetime) -> datetime: ...
@overload
def as_utc(value: None) -> None: ...
def as_utc(value: datetime | None) -> datetime | None:
    """A stored timestamp as an aware UTC one: SQLite hands them back naive."""
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


def prepare_database(url: str) -> None:
    """Create or migrate the schema at `url` (what `run` does before its job)."""
    try:
        migrations.upgrade(url)
    except (migrations.MigrationError, SQLAlchemyError) as exc:
        raise JobError(f"cannot prepare the database {safe_url(url)}: {exc}") from exc


@contextmanager
def open_database(url: str) -> Iterator[Engine]:
    """An engine on a migrated database; a missing schema, and any database error inside
    the block, raise JobError with the one-line reason."""
    engine = make_engine(url)
    try:
        if not inspect(engine).has_table("jobs"):
            raise JobError(
                f"{safe_url(url)} holds no eagle2-batch schema: run "
                f"`eagle2-batch db upgrade --url {safe_url(url)}` first"
            )
        yield engine
    except SQLAlchemyError as exc:
        raise JobError(f"database error ({safe_url(url)}): {one_line(exc)}") from exc
    finally:
        engine.dispose()
