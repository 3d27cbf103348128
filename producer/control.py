"""Steering a job on the cluster: enqueue its shards, cancel it, resume what is missing.

The database is the truth about a job; these functions change its rows first and only
then send tasks, so a lost message is always recoverable with `resume`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Engine

from producer.jobs import JobError, one_line
from producer.status import find_job
from workers.db import missing_shards, reclaim_stalled, refresh_job_state, set_job_state
from workers.heartbeat import silent_since, stall_after
from workers.job_queries import set_shards_state


def enqueue_shards(job_id: str, model: str, shards: list[int]) -> str:
    """Send the shards to the model's queue; returns the queue name."""
    from workers import tasks
    from workers.celery_app import queue_for

    try:
        tasks.enqueue_shards(job_id, shards, model)
    except Exception as exc:  # kombu raises its own and the socket's errors
        raise JobError(
            f"cannot reach the broker ({one_line(exc)}); job {job_id} is stored: "
            f"`eagle2-batch resume {job_id}` enqueues it once the broker is up"
        ) from exc
    return queue_for(model)


def cancel_job(engine: Engine, job: str) -> tuple[str, int]:
    """Mark JOB and its unfinished shards cancelled; (job id, shards cancelled)."""
    row = find_job(engine, job)
    if not set_job_state(engine, row["id"], "cancelled", expect=["queued", "running"]):
        state = find_job(engine, job)["state"]
        raise JobError(f"job {row['id']} is {state}: nothing to cancel")
    return row["id"], set_shards_state(engine, row["id"], "cancelled", expect=["queued", "running"])


@dataclass(frozen=True)
class Resumed:
    """What `resume_job` did: the shards it re-enqueued and on which queue, and which of
    them had stalled; with no shards, nothing was missing and `state` is the job's
    (refreshed) state."""

    job_id: str
    shards: list[int] = field(default_factory=list)
    queue: str | None = None
    state: str | None = None
    stalled: list[int] = field(default_factory=list)


def resume_job(engine: Engine, job: str) -> Resumed:
    """Re-enqueue every shard of JOB that misses samples or that no worker marked done.
    A shard left running with no heartbeat (workers/heartbeat.py) is reclaimed first, its
    lost attempt counted as the workers' watchdog would count it."""
    row = find_job(engine, job)
    job_id = row["id"]
    stalled = reclaim_stalled(engine, silent_since(stall_after()), job_id)
    shards = missing_shards(engine, job_id)
    if not shards:
        return Resumed(job_id, state=refresh_job_state(engine, job_id))
    if not row["n_expected"]:
        raise JobError(
            f"job {job_id} was never completely created (its submit was interrupted): "
            "submit the input again"
        )
    reclaimed = {r["shard"] for r in stalled}  # queued already, their loss kept as the error
    set_shards_state(engine, job_id, "queued", shards=[s for s in shards if s not in reclaimed])
    set_job_state(engine, job_id, "queued", expect=["cancelled", "failed", "completed"])
    queue = enqueue_shards(job_id, row["model"], shards)
    return Resumed(job_id, shards, queue, stalled=sorted(reclaimed))
