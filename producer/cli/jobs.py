"""`eagle2-batch status | cancel | resume | verify`: read or steer a job through the
database, which is the truth about it (producer/status.py, control.py, verify.py)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from producer.cli.common import database
from producer.cli.options import db_url_option, settings_for
from producer.control import cancel_job, resume_job
from producer.status import TERMINAL_STATES, find_job, format_status, job_status
from producer.verify import format_report, report_failure, verify_job
from workers.job_queries import rejected_lines


@click.command()
@click.argument("job", required=False)
@click.option("--watch", is_flag=True, help="Refresh until the job ends.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    help="Seconds between refreshes with --watch.",
)
@click.option("--json", "as_json", is_flag=True, help="JSON (one object per refresh).")
@click.option(
    "--rejected",
    "list_rejected",
    is_flag=True,
    help="Instead, list every rejected input line of the job (line, sample id, reason).",
)
@db_url_option
def status(
    job: str | None,
    watch: bool,
    interval: float,
    as_json: bool,
    list_rejected: bool,
    db_url: str | None,
) -> None:
    """Progress of JOB (default: the latest job).

    State; expected, done, failed and rejected counts; throughput and ETA; shards by
    state, and every shard that is not done (queued, running, failed, cancelled).

    \b
    Examples:
      eagle2-batch status                      # the latest job
      eagle2-batch status 3f2c... --watch      # refresh until it ends
      eagle2-batch status 3f2c... --rejected   # the bad input lines and why
    """
    with database(settings_for(db_url, None).database_url) as engine:
        job_id = find_job(engine, job)["id"]
        if list_rejected:
            for line_no, sample_id, reason in rejected_lines(engine, job_id):
                if as_json:
                    line = {"line_no": line_no, "sample_id": sample_id, "reason": reason}
                    click.echo(json.dumps(line))
                else:
                    click.echo(f"line {line_no}: {reason}")
            return
        while True:
            current = job_status(engine, job_id)
            if as_json:
                click.echo(json.dumps(current))
            else:
                if watch and sys.stdout.isatty():
                    click.clear()
                click.echo(format_status(current))
            if not watch or current["state"] in TERMINAL_STATES:
                return
            time.sleep(interval)
            if not as_json and not sys.stdout.isatty():
                click.echo("")


@click.command()
@click.argument("job")
@db_url_option
def cancel(job: str, db_url: str | None) -> None:
    """Cancel JOB: mark it and its unfinished shards cancelled.

    Workers check the job between samples: a running shard stops after its current few
    samples; queued shards are dropped when a worker takes them. Stored samples stay;
    `eagle2-batch resume JOB` continues from there.

    \b
    Example:
      eagle2-batch cancel 3f2c...
    """
    with database(settings_for(db_url, None).database_url) as engine:
        job_id, n = cancel_job(engine, job)
    click.echo(f"cancelled job {job_id} ({n} unfinished shard{'s' * (n != 1)})")


@click.command()
@click.argument("job")
@db_url_option
def resume(job: str, db_url: str | None) -> None:
    """Re-enqueue every unfinished shard of JOB: samples missing from the database, or
    no worker marked it done (its Parquet file may be unwritten).

    Covers a lost broker message, a dead worker, a cancelled or interrupted job. Only
    the missing samples are decoded again: finished ones (ok or failed) are never redone.
    A shard still running elsewhere may be enqueued twice; writes are idempotent.

    \b
    Example:
      eagle2-batch resume 3f2c...
    """
    with database(settings_for(db_url, None).database_url) as engine:
        done = resume_job(engine, job)
    if not done.shards:
        click.echo(
            f"job {done.job_id} is {done.state}: every expected sample is stored, nothing to do"
        )
        return
    n = len(done.shards)
    stalled = (
        f" ({len(done.stalled)} had stalled: running with no heartbeat)" if done.stalled else ""
    )
    click.echo(f"job {done.job_id}: re-enqueued {n} shard{'s' * (n != 1)} on {done.queue}{stalled}")


@click.command()
@click.argument("job", required=False)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Output folder holding job=<JOB>/ (default: where workers recorded the files, "
    "else EAGLE2_OUTPUT_DIR).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@db_url_option
def verify(job: str | None, out: Path | None, as_json: bool, db_url: str | None) -> None:
    """Check that JOB's outputs are complete and stored once (default: the latest job).

    Compares the manifest (expected samples), the database rows and the Parquet files:
    reports samples missing from either, sample ids stored more than once in either, and
    rows that the manifest does not expect, with the job's state. Exits non-zero on any
    problem (an unfinished job alone is not one: its missing samples are).

    \b
    Example:
      eagle2-batch verify 3f2c... --out /data/eagle2-out
    """
    with database(settings_for(db_url, None).database_url) as engine:
        report = verify_job(engine, find_job(engine, job)["id"], out)
    click.echo(json.dumps(report) if as_json else format_report(report))
    failure = report_failure(report)
    if failure:
        raise click.ClickException(failure)
    if not as_json:
        click.echo("ok: every expected sample is stored once in the database and in Parquet")
