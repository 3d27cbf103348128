"""Runtime settings shared by the producer and the workers, read from the environment.

One small frozen object so every process (producer, Celery worker, embedded run)
resolves the same database, broker and output folder from the same variables.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_OUTPUT_DIR = "./eagle2-out"

T = TypeVar("T", int, float)


@dataclass(frozen=True)
class Settings:
    """Where the job's rows, files and broker messages go."""

    database_url: str
    broker_url: str
    output_dir: Path


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Read `EAGLE2_DATABASE_URL`, `EAGLE2_BROKER_URL` and `EAGLE2_OUTPUT_DIR`.

    Without a database URL the embedded default is a SQLite file inside the
    output folder, so a laptop run needs no server at all.
    """
    env = os.environ if environ is None else environ
    output_dir = Path(env.get("EAGLE2_OUTPUT_DIR") or DEFAULT_OUTPUT_DIR)
    database_url = env.get("EAGLE2_DATABASE_URL") or f"sqlite:///{output_dir / 'eagle2.db'}"
    broker_url = env.get("EAGLE2_BROKER_URL") or DEFAULT_BROKER_URL
    return Settings(database_url=database_url, broker_url=broker_url, output_dir=output_dir)


def number_setting(
    name: str, default: T, parse: Callable[[str], T | None], valid: Callable[[T], bool], rule: str
) -> T:
    """The variable `name` as `parse` reads it (`default` where unset or empty); a value
    it cannot read (a ValueError or None) or that `valid` refuses raises a ValueError
    saying the variable `must be {rule}`, with the value given."""
    raw = os.environ.get(name) or str(default)
    try:
        value = parse(raw)
    except ValueError:
        value = None
    if value is None or not valid(value):
        raise ValueError(f"{name} must be {rule}: {raw!r}")
    return value
