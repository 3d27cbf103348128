"""Runtime settings shared by the producer and the workers, read from the environment.

One small frozen object so every process (producer, Celery worker, embedded run)
resolves the same database, broker and output folder from the same variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_OUTPUT_DIR = "./eagle2-out"


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
