"""`eagle2-batch run`: the embedded default, a whole job in this one process.

The same job creation as `submit` (producer/jobs.py), then every shard goes through
the same `process_shard` the Celery workers call, here in a loop: SQLite and Parquet
under --out, no Redis, no Postgres. Running the same command again finds the
unfinished job (same input file, unchanged, and same settings) and decodes only what
is missing.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import click
from alembic.util import CommandError
from sqlalchemy import Engine, select
from sqlalchemy.exc import SQLAlchemyError
from tqdm import tqdm

import migrations
from eagle2_core.config import AUTO, DEFAULT_BATCH_SIZE
from producer.jobs import JobSpec, input_fingerprint
from producer.stats import STATS_COLUMNS, compute_stats, format_stats
from producer.submit_cli import (
    build_job,
    database,
    exit_for,
    job_options,
    job_status,
    safe_url,
    settings_for,
    spec_from_options,
)
from workers.db import get_job, iter_samples, jobs_t, missing_shards, sample_counts
from workers.parquet_sink import job_dir


def unfinished_job(engine: Engine, input_path: Path, spec: JobSpec) -> dict[str, Any] | None:
    """The newest queued or running job of this very input (same size and mtime) and
    these settings, whose creation finished (it expects samples); else None."""
    path = input_path.resolve()
    params = spec.stored_params(**input_fingerprint(path))
    draft = jobs_t.c.draft.is_(None) if spec.draft is None else jobs_t.c.draft == spec.draft
    stmt = (
        select(jobs_t)
        .where(
            jobs_t.c.input_path == str(path),
            jobs_t.c.model == spec.model,
            jobs_t.c.mode == spec.mode,
            draft,
            jobs_t.c.state.in_(["queued", "running"]),
            jobs_t.c.n_expected > 0,
        )
        .order_by(jobs_t.c.created_at.desc())
    )
    with engine.connect() as conn:
        for row in conn.execute(stmt).mappings():
            if row["params"] == params:
                return dict(row)
    return None


def _load_decoder(spec: JobSpec, device: str, batch_size: int | None) -> Any:
    import torch

    from eagle2_core.draft import DraftCheckpointError
    from eagle2_core.registry import DraftUnavailableError, ModelLoadError
    from workers.decoding import SampleDecoder

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return SampleDecoder.load(
            spec.model, spec.draft, spec.mode, device=device, dtype=dtype, batch_size=batch_size
        )
    except (DraftUnavailableError, DraftCheckpointError, ModelLoadError, OSError) as exc:
        raise click.ClickException(str(exc).strip().splitlines()[0]) from exc


def _announce_measuring(path: Path) -> None:
    click.echo(
        "measuring this machine's forward costs for --total-tokens auto (once, about half "
        f"a minute on a CPU; cached in {path})",
        err=True,
    )


def _decode(engine: Engine, decoder: Any, job_id: str, out: Path) -> None:
    """process_shard over every shard with missing samples, one progress bar for all."""
    from workers.shards import process_shard

    job = get_job(engine, job_id)
    assert job is not None
    counts = sample_counts(engine, job_id)
    worker = f"run@{socket.gethostname()}"
    with tqdm(
        total=job["n_expected"],
        initial=counts["ok"] + counts["failed"],
        desc="decoding",
        unit=" samples",
        file=sys.stderr,
    ) as bar:
        failed = counts["failed"]

        def progress(row: dict[str, Any], _done: int, _pending: int) -> None:
            nonlocal failed
            failed += row["status"] == "failed"
            bar.set_postfix(failed=failed, refresh=False)
            bar.update(1)

        for shard in missing_shards(engine, job_id):
            result = process_shard(
                engine, decoder, job_id, shard, out, worker, on_progress=progress
            )
            if result.state == "cancelled":
                break


@click.command()
@click.argument(
    "input_path", metavar="INPUT", type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@job_options
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="Where to decode: cpu, cuda or cuda:N (bf16 on GPUs, fp32 on CPUs).",
)
@click.option(
    "--batch-size",
    type=click.IntRange(1),
    help="Sequences decoded at once (continuous batching; outputs do not change). "
    f"Default: {DEFAULT_BATCH_SIZE}.",
)
@click.option(
    "--new-job",
    is_flag=True,
    help="Start a new job even when an unfinished one for this input and these settings "
    "exists under --out (default: resume that one).",
)
def run(
    input_path: Path, device: str, batch_size: int | None, new_job: bool, **options: Any
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
    """
    spec = spec_from_options(options)
    settings = settings_for(options["db_url"], options["out"])
    if options["dry_run"]:
        build_job(None, input_path, spec, strict=options["strict"])
        return
    try:
        migrations.upgrade(settings.database_url)
    except (CommandError, SQLAlchemyError) as exc:
        raise click.ClickException(
            f"cannot prepare the database {safe_url(settings.database_url)}: {exc}"
        ) from exc
    with database(settings.database_url) as engine:
        job = None if new_job else unfinished_job(engine, input_path, spec)
        if job is not None:
            job_id = job["id"]
            counts = sample_counts(engine, job_id)
            click.echo(
                f"resuming job {job_id}: {counts['ok'] + counts['failed']} of "
                f"{job['n_expected']} samples already stored (--new-job starts over)",
                err=True,
            )
        else:
            new_id, _ = build_job(engine, input_path, spec, strict=options["strict"])
            assert new_id is not None
            job_id = new_id
        decoder = _load_decoder(spec, device, batch_size)
        if spec.mode == "eagle2" and spec.params.get("total_tokens") == AUTO:
            decoder.engine.costs(decoder.batch_size, on_measure=_announce_measuring)
        try:
            _decode(engine, decoder, job_id, settings.output_dir)
        except KeyboardInterrupt:
            click.echo(f"\ninterrupted: run the same command to resume job {job_id}", err=True)
            sys.exit(130)
        final = job_status(engine, job_id)
        job_row = get_job(engine, job_id)
        stats = compute_stats(iter_samples(engine, job_id, columns=STATS_COLUMNS))
    click.echo(format_stats(job_row, stats, None))
    click.echo(f"\nParquet: {job_dir(settings.output_dir, job_id)}")
    click.echo(f"database: {safe_url(settings.database_url)}")
    click.echo(job_id)
    exit_for(final)
