"""The workers' watchdog: every worker process re-enqueues the shards that stalled.

A shard stays 'running' with no live attempt when its acknowledgement was lost: its worker
died and Redis would hand the message out again only after the visibility timeout (6 h by
default), or the attempt gave up on an unreachable database after Celery's retries and
its message was acknowledged, so nothing would ever run it again. A daemon thread in
every worker process sweeps every SWEEP_BEATS heartbeat periods: each shard of any job
with no heartbeat for the stall limit (workers/heartbeat.py) is sent to its model's queue
again and reclaimed (workers.db.reclaim_stalled: 'queued', one more lost attempt, the
loss as its error). The message is sent inside the reclaim's transaction: one watchdog
wins each shard, and a broker that cannot be reached undoes the reclaim, leaving the shard
to the next sweep. After a database error of its own the watchdog sweeps again only a
stall limit after it sees the database back, so that attempts whose heartbeats failed in
the same outage stamp them again before anything is judged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError

from workers import db
from workers.heartbeat import heartbeat_period, silent_since, stall_after

log = logging.getLogger(__name__)

SWEEP_BEATS = 3

Enqueue = Callable[[str, list[int], str], Any]  # (job id, shards, model), as tasks sends


def sweep(engine: Engine, enqueue: Enqueue) -> list[dict[str, Any]]:
    """One pass: re-enqueue and reclaim every stalled shard; returns their rows."""

    def send(row: dict[str, Any]) -> None:
        enqueue(row["job_id"], [row["shard"]], row["model"])

    reclaimed = db.reclaim_stalled(engine, silent_since(stall_after()), on_reclaim=send)
    for row in reclaimed:
        log.warning(
            "watchdog: shard %s of job %s stalled (running on %s, no heartbeat since %s): "
            "re-enqueued",
            row["shard"],
            row["job_id"],
            row["worker"],
            row["heartbeat_at"],
        )
    return reclaimed


def start_watchdog(engine: Engine, enqueue: Enqueue) -> threading.Thread:
    """Run `sweep` every SWEEP_BEATS heartbeat periods in a daemon thread, for good."""

    def loop() -> None:
        quiet_until = 0.0  # negative: the database was unreachable and is not seen back yet
        while True:
            time.sleep(SWEEP_BEATS * heartbeat_period())
            if time.monotonic() < quiet_until:
                continue
            try:
                if quiet_until < 0:  # back: let heartbeats resume for a stall limit first
                    with engine.connect() as conn:
                        conn.execute(text("SELECT 1"))
                    quiet_until = time.monotonic() + stall_after()
                    continue
                sweep(engine, enqueue)
            except DBAPIError as exc:
                quiet_until = -1.0
                log.warning("watchdog: database unreachable (%s); sweeping once it is back", exc)
            except Exception:  # the broker, a bug: log it, keep watching
                log.exception("watchdog: sweep failed")

    thread = threading.Thread(target=loop, name="eagle2-watchdog", daemon=True)
    thread.start()
    return thread
