"""`eagle2-batch submit`: stream the input into a job, then enqueue one Celery task per
shard (producer/creation.py, producer/control.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from producer.cli.common import database, exit_for, spec_from_options, user_errors
from producer.cli.options import input_argument, job_options, settings_for
from producer.control import enqueue_shards
from producer.creation import create_job, plan_job
from producer.status import find_job, wait_for
from workers.job_queries import ok_sample_ids, shard_ids


@click.command()
@input_argument
@job_options
@click.option(
    "--resume-from",
    metavar="JOB",
    default=None,
    help="Leave out sample ids already done (status ok) in JOB; its failed ones run again.",
)
@click.option("--wait", is_flag=True, help="Block with a progress bar until the job ends.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def submit(
    input_path: Path, resume_from: str | None, wait: bool, as_json: bool, **options: Any
) -> None:
    """Validate INPUT and queue it as a job for the Celery workers.

    INPUT is JSON Lines (prompt / messages / turns / OpenAI Batch lines) or Parquet.
    The file is streamed: the job, its manifest of expected samples, the rejected lines
    and the shards are stored first, then one task per shard goes to the model's queue
    (EAGLE2_BROKER_URL). Bad lines do not stop the job; they are counted, the first
    few quoted on stderr and all stored. The job id is the last line of stdout.

    \b
    Examples:
      eagle2-batch submit prompts.jsonl --max-new-tokens 256
      eagle2-batch submit prompts.jsonl --dry-run        # validate and plan only
      eagle2-batch submit prompts.jsonl --n 4 --temperature 0.8   # best of 4
      JOB=$(eagle2-batch submit prompts.jsonl) && eagle2-batch status $JOB --watch
    """
    spec = spec_from_options(options)
    settings = settings_for(options["db_url"], options["out"])
    skip: set[str] = set()
    if resume_from:
        with database(settings.database_url) as engine:
            skip = ok_sample_ids(engine, find_job(engine, resume_from)["id"])
    if options["dry_run"]:
        with user_errors():
            plan = plan_job(input_path, spec, skip_ids=skip)
        click.echo(plan.dry_run(input_path, spec.settings.shard_size, as_json))
        return
    with database(settings.database_url) as engine:
        job_id, plan = create_job(
            engine,
            input_path,
            spec,
            strict=options["strict"],
            skip_ids=skip,
            extra_params={"resume_from": resume_from} if resume_from else None,
        )
        plan.require_samples(input_path, job_id)
        queue = enqueue_shards(job_id, spec.model, shard_ids(engine, job_id))
        click.echo(
            f"job {job_id}: {plan.counts()} in {plan.shards} shards queued on {queue}"
            + (f", {plan.skipped} already done in {resume_from}" if plan.skipped else ""),
            err=True,
        )
        result: dict[str, Any] = {"job_id": job_id, "queue": queue, **plan.as_dict()}
        final = wait_for(engine, job_id) if wait else None
        if final is not None:
            result.update(state=final["state"], ok=final["ok"], failed=final["failed"])
    click.echo(json.dumps(result) if as_json else job_id)
    if final is not None:
        exit_for(final)
