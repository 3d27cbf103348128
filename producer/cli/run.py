"""`eagle2-batch run`: the embedded default, a whole job in this one process
(producer/local_run.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from producer.cli.common import exit_for, spec_from_options, user_errors
from producer.cli.options import batch_size_option, input_argument, job_options, settings_for
from producer.creation import plan_job
from producer.local_run import format_run, run_job


@click.command()
@input_argument
@job_options
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="Where to decode: cpu, cuda or cuda:N (bf16 on GPUs, fp32 on CPUs).",
)
@batch_size_option()
@click.option(
    "--new-job",
    is_flag=True,
    help="Start a new job even when an unfinished one for this input and these settings "
    "exists under --out (default: resume that one).",
)
def run(
    input_path: Path, device: str, batch_size: int | str, new_job: bool, **options: Any
) -> None:
    """Run a whole job in this process: no Redis, no Postgres, no workers to start.

    Validates INPUT like `submit` (same options, bad lines stored and skipped), then
    decodes every sample here with a progress bar, writing rows to OUT/eagle2.db
    (SQLite; EAGLE2_DATABASE_URL or --db-url to use another database) and Parquet to
    OUT/job=<id>/shard=<n>.parquet, and prints the job's statistics at the end. Exits
    non-zero if any sample failed.

    Interrupted (Ctrl-C, a crash)? Run the same command again: it resumes the
    unfinished job of the same input and settings, decoding only what is missing.

    \b
    Examples:
      eagle2-batch run examples/prompts.jsonl --out out/
      eagle2-batch run prompts.jsonl --out out/ --mode vanilla --max-new-tokens 64
      eagle2-batch run prompts.jsonl --out out/ --draft heads/my-head --device cuda
      eagle2-batch run prompts.jsonl --out out/ --n 4 --temperature 0.8 --seed 1
    """
    spec = spec_from_options(options)
    settings = settings_for(options["db_url"], options["out"])
    with user_errors():
        if options["dry_run"]:
            plan = plan_job(input_path, spec)
            click.echo(plan.dry_run(input_path, spec.settings.shard_size, as_json=False))
            return
        # only an --adapt-draft job needs the training code
        between_shards = None
        if spec.settings.adapt_draft:
            from producer.adapt import between_shards
        done = run_job(
            input_path,
            spec,
            database_url=settings.database_url,
            out=settings.output_dir,
            device=device,
            batch_size=batch_size,
            new_job=new_job,
            strict=options["strict"],
            between_shards=between_shards,
        )
    click.echo(format_run(done))
    exit_for(done.status)
