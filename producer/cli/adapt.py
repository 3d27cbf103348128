"""`eagle2-batch adapt JOB`: the fine-tuning rounds of a submitted --adapt-draft job,
beside its workers (producer/adapt.py)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from producer.cli.common import database
from producer.cli.options import choice_option, db_url_option, folder_option, settings_for
from producer.status import TERMINAL_STATES, find_job


@click.command()
@click.argument("job")
@db_url_option
@folder_option(
    "--work",
    "Folder for the rounds' answers, features and checkpoints (default: "
    "OUT/_adapt/JOB under EAGLE2_OUTPUT_DIR).",
)
@choice_option("--device", ["cpu", "cuda"], "cpu", "Where the head is trained and measured.")
@click.option(
    "--interval",
    type=click.FloatRange(min=1),
    default=30.0,
    show_default=True,
    help="Seconds between looks at the job's stored completions.",
)
def adapt(job: str, db_url: str | None, work: Path | None, device: str, interval: float) -> None:
    """Train JOB's draft head on its own outputs while its workers decode it.

    The job must have been submitted with --adapt-draft. Whenever its stored completions
    reach the next threshold (--adapt-after, then 4x the data of the last round), this
    fine-tunes the newest head on them, measures it against that head on the job's
    held-out prompts, and publishes it in the database if it wins: workers switch to it
    at their next shard. It returns when the job ends or a round does not win. Stopped
    midway, it loses that round only; run it again to go on.

    \b
    Example:
      eagle2-batch submit prompts.jsonl --adapt-draft
      eagle2-batch adapt 3f2c... --device cuda
    """
    from producer.adapt import adapt_round
    from workers.adapt_schedule import next_round_at, round_due

    settings = settings_for(db_url, None)
    with database(settings.database_url) as engine:
        row = find_job(engine, job)
        if next_round_at(engine, row) is None:
            raise click.ClickException(
                f"job {row['id']} has no fine-tuning round to come: it was not submitted "
                "with --adapt-draft, or its last round did not win, or it is nearly done"
            )
        folder = work or settings.output_dir / "_adapt" / row["id"]
        while find_job(engine, row["id"])["state"] not in TERMINAL_STATES:
            due = round_due(engine, row["id"])
            if due is not None:
                click.echo(f"fine-tuning on the job's first {due}+ completions", err=True)
                done = adapt_round(engine, settings.database_url, row, folder, device)
                click.echo(done.describe())
                if next_round_at(engine, row) is None:
                    return
            time.sleep(interval)
