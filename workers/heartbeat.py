"""How a running shard shows it is alive, and when it counts as stalled.

While an attempt runs, a thread of its process stamps the shard's heartbeat_at every
`heartbeat_period()` seconds, whatever decoding is doing (one sample may take minutes).
A shard still 'running' with no heartbeat for STALL_BEATS periods has no live attempt:
its worker died (killed, a segfault, the OOM killer) or the attempt gave up on an
unreachable database after Celery's retries, and no acknowledgement is coming. The
workers' watchdog (workers/watchdog.py), `resume` and the next attempt of the shard
reclaim it (workers.db.reclaim_stalled); `status` shows it.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta
from types import TracebackType

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from workers import db
from workers.schema import utcnow
from workers.settings import number_setting

log = logging.getLogger(__name__)

HEARTBEAT_ENV = "EAGLE2_HEARTBEAT_S"
DEFAULT_HEARTBEAT_S = 10.0
# Periods without a heartbeat before a running shard counts as stalled: a busy database
# or a long pause of the process may cost a beat or two, never six.
STALL_BEATS = 6


def heartbeat_period() -> float:
    """`EAGLE2_HEARTBEAT_S` in seconds (default 10); must be a positive number."""
    return number_setting(
        HEARTBEAT_ENV, DEFAULT_HEARTBEAT_S, float, lambda v: v > 0, "a positive number of seconds"
    )


def stall_after() -> float:
    """Seconds without a heartbeat after which a running shard counts as stalled."""
    return STALL_BEATS * heartbeat_period()


def silent_since(seconds: float) -> datetime:
    """The moment `seconds` ago: shards whose last heartbeat is older are stalled."""
    return utcnow() - timedelta(seconds=seconds)


class Heartbeat:
    """A daemon thread stamping one shard's heartbeat every `period` seconds while the
    `with` block runs. A database error costs that beat only (the writes of the attempt
    retry on their own)."""

    def __init__(self, engine: Engine, job_id: str, shard: int, period: float) -> None:
        self._beat = (engine, job_id, shard)
        self._period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"heartbeat-{job_id}-{shard}", daemon=True
        )

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                db.heartbeat_shard(*self._beat)
            except DBAPIError as exc:
                log.warning("heartbeat of shard %s/%s missed: %s", *self._beat[1:], exc)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=self._period)  # a beat stuck on a dead link is let go
