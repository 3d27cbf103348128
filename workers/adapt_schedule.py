"""When an --adapt-draft job's next fine-tuning round is due (producer/adapt.py runs it;
`status` reports it): after JobSettings.adapt_first completions, then at ADAPT_GROWTH times
the data of the last round while rounds keep winning."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from workers.db import get_job, sample_counts
from workers.head_versions import versions
from workers.job_settings import ADAPT_GROWTH, JobSettings


def next_round_at(engine: Engine, job: dict[str, Any]) -> int | None:
    """Completions (ok samples) at which the job's next round is due, None once
    adaptation is off or over: a round that lost, or a threshold past the job's end."""
    settings = JobSettings.from_params(job["params"])
    if not settings.adapt_draft or job["mode"] == "vanilla":
        return None
    attempts = versions(engine, job["id"])
    if not attempts:
        due = settings.adapt_first(job["n_expected"])
    elif attempts[-1]["published"]:
        due = attempts[-1]["train_completions"] * ADAPT_GROWTH
    else:
        return None
    return due if due < job["n_expected"] else None


def round_due(engine: Engine, job_id: str) -> int | None:
    """The threshold of the job's next round where its stored completions reached it, else
    None."""
    job = get_job(engine, job_id)
    due = next_round_at(engine, job) if job is not None else None
    if due is None or sample_counts(engine, job_id)["ok"] < due:
        return None
    return due
