"""A job's progress as the database tells it: what `status` shows, what `submit --wait`
waits for, and whether a finished job fully succeeded."""

from __future__ import annotations

import sys
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine
from tqdm import tqdm

from eagle2_core.registry import draft_label
from producer.database import as_utc
from producer.jobs import JobError
from workers.adapt_schedule import next_round_at
from workers.db import get_job, latest_job_id, refresh_job_state, sample_counts
from workers.head_versions import newest_published
from workers.heartbeat import silent_since, stall_after
from workers.job_queries import completion_tokens, job_ids_with_prefix, shard_rows, stored_per_shard
from workers.job_settings import JobSettings

TERMINAL_STATES = ("completed", "failed", "cancelled")
SHOWN_SHARDS = 20


def find_job(engine: Engine, job: str | None) -> dict[str, Any]:
    """The job row of JOB (its id, or a unique prefix of at least 4 characters), or of
    the latest job when JOB is omitted."""
    job_id = job or latest_job_id(engine)
    if job_id is None:
        raise JobError("no jobs yet")
    row = get_job(engine, job_id)
    if row is None and len(job_id) >= 4:
        ids = job_ids_with_prefix(engine, job_id)
        if len(ids) > 1:
            raise JobError(f"job prefix {job_id!r} matches several jobs")
        row = get_job(engine, ids[0]) if ids else None
    if row is None:
        raise JobError(f"no job {job_id!r}")
    return row


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return (
        f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"
    )


def job_status(engine: Engine, job_id: str) -> dict[str, Any]:
    """Everything `status` shows, JSON-ready: counts, throughput, ETA and every shard.

    Throughput is stored samples (and tokens) over the time since the first shard
    started; the ETA assumes that rate goes on.
    """
    state = refresh_job_state(engine, job_id)
    job = find_job(engine, job_id)
    counts = sample_counts(engine, job_id)
    per_shard = stored_per_shard(engine, job_id)
    tokens = completion_tokens(engine, job_id)
    silent = silent_since(stall_after())
    shards = [
        {
            "shard": row["shard"],
            # A running shard with no heartbeat for the stall limit has no live attempt.
            "state": "stalled" if _stalled(row, silent) else row["state"],
            "lines": [row["line_start"], row["line_end"]],
            "samples": row["n_samples"],
            "stored": per_shard.get(row["shard"], 0),
            "attempts": row["attempts"],
            "lost_attempts": row["lost_attempts"],
            "worker": row["worker"],
            "started_at": as_utc(row["started_at"]),
            "heartbeat_at": as_utc(row["heartbeat_at"]),
            "error": row["error"],
        }
        for row in shard_rows(engine, job_id)
    ]
    stored = counts["ok"] + counts["failed"]
    starts = [s["started_at"] for s in shards if s["started_at"] is not None]
    end = as_utc(job["finished_at"]) or datetime.now(UTC)
    elapsed = (end - min(starts)).total_seconds() if starts else None
    rate = stored / elapsed if elapsed and stored else None
    remaining = max(job["n_expected"] - stored, 0)
    adapting = JobSettings.from_params(job["params"]).adapt_draft
    newest = newest_published(engine, job_id) if adapting else None
    return {
        "job_id": job_id,
        "state": state,
        "input": job["input_path"],
        "model": job["model"],
        "draft": job["draft"],
        "mode": job["mode"],
        "created_at": as_utc(job["created_at"]).isoformat(),
        "expected": job["n_expected"],
        "done": stored,
        "ok": counts["ok"],
        "failed": counts["failed"],
        "remaining": remaining,
        "rejected": job["n_rejected"],
        "elapsed_s": elapsed,
        "samples_per_s": rate,
        "tokens_per_s": tokens / elapsed if elapsed and tokens else None,
        "eta_s": remaining / rate if rate and state not in TERMINAL_STATES else None,
        "shard_states": dict(Counter(s["state"] for s in shards)),
        # --adapt-draft: the head version shards start with now (0: the job's own head)
        "head_version": (newest[0] if newest else 0) if adapting else None,
        "next_adaptation_at": next_round_at(engine, job) if adapting else None,
        "shards": [
            {
                **s,
                "started_at": s["started_at"].isoformat() if s["started_at"] else None,
                "heartbeat_at": s["heartbeat_at"].isoformat() if s["heartbeat_at"] else None,
            }
            for s in shards
        ],
    }


def _stalled(row: Any, silent: datetime) -> bool:
    beat = as_utc(row["heartbeat_at"])
    return row["state"] == "running" and beat is not None and beat < silent


def format_status(status: dict[str, Any]) -> str:
    """The human-readable status: counts, speed, then the shards that are not done."""
    rate = "-" if status["samples_per_s"] is None else f"{status['samples_per_s']:.2f}"
    tokens = "-" if status["tokens_per_s"] is None else f"{status['tokens_per_s']:.1f}"
    lines = [
        f"job {status['job_id']}  {status['state']}  model={status['model']}  "
        f"draft={draft_label(status['model'], status['draft'], status['mode']) or '-'}  "
        f"mode={status['mode']}",
        f"input {status['input']}",
        f"samples: expected {status['expected']}  done {status['done']} "
        f"(ok {status['ok']}, failed {status['failed']})  remaining {status['remaining']}  "
        f"rejected lines {status['rejected']}",
        f"speed: {rate} samples/s, {tokens} tokens/s over {_duration(status['elapsed_s'])}"
        f"  ETA {_duration(status['eta_s'])}",
        "shards: "
        + (", ".join(f"{n} {s}" for s, n in sorted(status["shard_states"].items())) or "none"),
    ]
    if status["head_version"] is not None:
        due = status["next_adaptation_at"]
        lines.append(
            f"draft head: version {status['head_version']} for shards that start now "
            "(--adapt-draft; `stats` has every version's tau); "
            + (f"next fine-tuning at {due} completions" if due else "no more fine-tuning")
        )
    stalled = status["shard_states"].get("stalled", 0)
    if stalled:
        lines.append(
            f"{stalled} stalled: running with no heartbeat for over {stall_after():.0f} s, so "
            f"no worker holds {'them' if stalled > 1 else 'it'}; the workers' watchdog "
            f"re-enqueues stalled shards, or `eagle2-batch resume {status['job_id']}`"
        )
    pending = [s for s in status["shards"] if s["state"] != "done"]
    if pending:
        lines.append(
            f"{'shard':>7}  {'state':<9}  {'lines':<15}  {'stored':>11}  tries  lost  worker"
        )
        for s in pending[:SHOWN_SHARDS]:
            span = f"{s['lines'][0]}-{s['lines'][1]}"
            lines.append(
                f"{s['shard']:>7}  {s['state']:<9}  {span:<15}  "
                f"{str(s['stored']) + '/' + str(s['samples']):>11}  {s['attempts']:>5}  "
                f"{s['lost_attempts']:>4}  {s['worker'] or '-'}"
                + (f"  error: {s['error']}" if s["error"] else "")
            )
        if len(pending) > SHOWN_SHARDS:
            lines.append(f"... {len(pending) - SHOWN_SHARDS} more (--json lists every shard)")
    return "\n".join(lines)


def job_failure(status: dict[str, Any]) -> str | None:
    """Why a finished job did not fully succeed (cancelled, failed samples); else None."""
    if status["state"] == "cancelled":
        return f"job {status['job_id']} was cancelled"
    if status["failed"]:
        return (
            f"{status['failed']} of {status['expected']} samples failed in job "
            f"{status['job_id']} (errors: `eagle2-batch export {status['job_id']}`)"
        )
    return None


def wait_for(engine: Engine, job_id: str, interval: float = 2.0) -> dict[str, Any]:
    """Block until the job ends, with a progress bar on stderr; returns its status."""
    job = find_job(engine, job_id)
    counts = sample_counts(engine, job_id)
    with tqdm(
        total=job["n_expected"],
        initial=counts["ok"] + counts["failed"],
        desc=f"job {job_id[:12]}",
        unit=" samples",
        file=sys.stderr,
    ) as bar:
        while True:
            state = refresh_job_state(engine, job_id)
            counts = sample_counts(engine, job_id)
            bar.update(counts["ok"] + counts["failed"] - bar.n)
            bar.set_postfix(state=state, failed=counts["failed"], refresh=False)
            if state in TERMINAL_STATES:
                break
            time.sleep(interval)
    return job_status(engine, job_id)
