"""A whole job in this one process: what `eagle2-batch run` does, and `train-draft` too
for its answers.

The same job creation as `submit` (producer/creation.py), then every shard goes through
the same `process_shard` the Celery workers call, here in a loop: SQLite and Parquet
under the output folder, no Redis, no Postgres. Running the same job again finds the
unfinished one (same input file, unchanged, and same settings) and decodes only what
is missing.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from tqdm import tqdm

from producer.creation import create_job, input_fingerprint
from producer.database import open_database, prepare_database, safe_url
from producer.interrupts import CtrlC
from producer.jobs import JobError, JobSpec, one_line
from producer.stats import STATS_COLUMNS, compute_stats, format_stats
from producer.status import job_status
from workers.db import get_job, iter_samples, missing_shards, sample_counts
from workers.job_queries import set_shards_state, unfinished_jobs
from workers.parquet_sink import job_dir


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while decoding: what is stored stays, and the same run resumes the job."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"interrupted: run the same command to resume job {job_id}")


@dataclass(frozen=True)
class LocalRun:
    """A finished local run: the job's final status, row and statistics, and where it is."""

    job_id: str
    status: dict[str, Any]
    job: dict[str, Any]
    stats: dict[str, Any]
    parquet_dir: Path
    database_url: str


def unfinished_job(engine: Engine, input_path: Path, spec: JobSpec) -> dict[str, Any] | None:
    """The newest queued or running job of this very input (same size and mtime) and
    these settings, whose creation finished (it expects samples); else None."""
    path = input_path.resolve()
    params = spec.settings.to_params(**input_fingerprint(path))
    jobs = unfinished_jobs(
        engine, input_path=str(path), model=spec.model, mode=spec.mode, draft=spec.draft
    )
    return next((job for job in jobs if job["params"] == params), None)


def _load_decoder(spec: JobSpec, device: str, batch_size: int | str | None) -> Any:
    from eagle2_core.draft import DraftCheckpointError
    from eagle2_core.precision import resolve_dtype
    from eagle2_core.registry import DraftUnavailableError, ModelLoadError
    from workers.decoding import SampleDecoder

    dtype = resolve_dtype(spec.settings.dtype, device)
    try:
        return SampleDecoder.load(
            spec.model, spec.draft, spec.mode, device=device, dtype=dtype, batch_size=batch_size
        )
    except (DraftUnavailableError, DraftCheckpointError, ModelLoadError, OSError) as exc:
        raise JobError(one_line(exc)) from exc


def _rows_line(decoder: Any, spec: JobSpec, rows: int) -> str:
    """What `run` says before decoding: the rows at once, and where EAGLE-2 trees sized by
    cost could not pay at that many on this device, that they decode plain (the tau of
    1.00 in the stats then is this machine's verdict, not a broken head)."""
    from eagle2_core.config import DecodeConfig

    line = f"decoding up to {rows} sequences at once"
    if spec.auto_tree:
        config = DecodeConfig.from_settings(spec.mode, spec.settings.decode_for({}))
        if not decoder.engine.drafts_at(rows, config):
            line += f", plain: no draft tree could pay at {rows} rows on this machine"
    return line


# (engine, database URL, job id, output folder, device): a hook run before each shard
RoundHook = Callable[[Engine, str, str, Path, str], None]


def _announce_measuring(path: Path) -> None:
    print(
        "measuring this machine's forward costs for --batch-size auto and --total-tokens "
        f"auto (once, one to two minutes on a 2-core CPU; cached in {path})",
        file=sys.stderr,
        flush=True,
    )


def _decode(
    engine: Engine,
    decoder: Any,
    job_id: str,
    out: Path,
    adapt: Callable[[], None],
    ctrl_c: CtrlC,
) -> None:
    """process_shard over every shard with missing samples, one progress bar for all;
    `adapt()` before each shard (a draft-head round where one is due). Ctrl-C lands
    while the decoder computes, never in a database write (producer/interrupts.py)."""
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
            # One process runs the job: a shard still running was left by an earlier one
            # that died, a lost attempt; Ctrl-C is not one.
            adapt()
            try:
                result = process_shard(
                    engine,
                    decoder,
                    job_id,
                    shard,
                    out,
                    worker,
                    on_progress=progress,
                    lost_after=0,
                    decoding=ctrl_c.decoding,
                )
            except KeyboardInterrupt:
                set_shards_state(engine, job_id, "queued", shards=[shard], expect=["running"])
                raise
            if result.state == "cancelled":
                break


def run_job(
    input_path: Path,
    spec: JobSpec,
    *,
    database_url: str,
    out: Path,
    device: str = "cpu",
    batch_size: int | str | None = None,
    new_job: bool = False,
    strict: bool = False,
    between_shards: RoundHook | None = None,
) -> LocalRun:
    """Create (or, unless `new_job`, resume) the job of INPUT and decode it all here,
    with progress on stderr. User errors raise JobError; Ctrl-C raises Interrupted.
    An --adapt-draft job calls `between_shards` before each shard (`run` passes
    producer.adapt.between_shards; without it the job decodes with its first head)."""
    with CtrlC() as ctrl_c:  # Ctrl-C never lands in a database write (producer/interrupts.py)
        prepare_database(database_url)
        with open_database(database_url) as engine:
            job_id = _job_to_run(engine, input_path, spec, new_job=new_job, strict=strict)
            samples = min(get_job(engine, job_id)["n_expected"], spec.settings.shard_size)
            try:
                with ctrl_c.allowed():  # loading and measuring write nothing
                    decoder = _load_decoder(spec, device, batch_size)
                    decoder.on_measure = _announce_measuring
                    if spec.auto_tree:
                        decoder.engine.costs(decoder.batch_size, on_measure=_announce_measuring)
                    rows = min(decoder.rows_for(samples), samples)
                print(_rows_line(decoder, spec, rows), file=sys.stderr, flush=True)

                def adapt() -> None:
                    if spec.settings.adapt_draft and between_shards is not None:
                        between_shards(engine, database_url, job_id, out, device)

                _decode(engine, decoder, job_id, out, adapt, ctrl_c)
            except KeyboardInterrupt:
                raise Interrupted(job_id) from None
            status = job_status(engine, job_id)  # first: it brings the job's state up to date
            job_row = get_job(engine, job_id)
            assert job_row is not None
            return LocalRun(
                job_id=job_id,
                status=status,
                job=job_row,
                stats=compute_stats(iter_samples(engine, job_id, columns=STATS_COLUMNS)),
                parquet_dir=job_dir(out, job_id),
                database_url=database_url,
            )


def _job_to_run(
    engine: Engine, input_path: Path, spec: JobSpec, *, new_job: bool, strict: bool
) -> str:
    """The unfinished job of this input and settings (said so on stderr), unless
    `new_job`; else a new one."""
    job = None if new_job else unfinished_job(engine, input_path, spec)
    if job is not None:
        counts = sample_counts(engine, job["id"])
        print(
            f"resuming job {job['id']}: {counts['ok'] + counts['failed']} of "
            f"{job['n_expected']} samples already stored (--new-job starts over)",
            file=sys.stderr,
            flush=True,
        )
        return job["id"]
    job_id, plan = create_job(engine, input_path, spec, strict=strict)
    plan.require_samples(input_path, job_id)
    return job_id


def format_run(run: LocalRun) -> str:
    """What `run` prints at the end: the job's statistics, where it is stored, its id."""
    return (
        f"{format_stats(run.job, run.stats, None)}\n\nParquet: {run.parquet_dir}\n"
        f"database: {safe_url(run.database_url)}\n{run.job_id}"
    )
