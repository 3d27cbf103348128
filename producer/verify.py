"""Whether a job's outputs are complete and stored once: its manifest (expected samples)
against its database rows and its Parquet rows, counted rather than assumed."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from workers.db import refresh_job_state
from workers.job_queries import manifest_ids, recorded_parquet_path, rows_per_sample_id
from workers.parquet_sink import job_dir
from workers.settings import load_settings

SHOWN_IDS = 10


def _parquet_ids(directory: Path, job_id: str) -> tuple[Counter[str], int, int]:
    """(rows per sample id of this job, rows of other jobs, files) in a job's folder."""
    import pyarrow.parquet as pq

    per_id: Counter[str] = Counter()
    foreign = 0
    files = sorted(directory.glob("shard=*.parquet")) if directory.is_dir() else []
    for path in files:
        table = pq.read_table(path, columns=["job_id", "sample_id"])
        for row_job, sample_id in zip(
            table.column("job_id").to_pylist(), table.column("sample_id").to_pylist(), strict=True
        ):
            if row_job == job_id:
                per_id[sample_id] += 1
            else:
                foreign += 1
    return per_id, foreign, len(files)


def _parquet_dir(engine: Engine, job_id: str, out: Path | None) -> Path:
    """--out's job folder; else the folder workers recorded, when this host sees it."""
    if out is None:
        recorded = recorded_parquet_path(engine, job_id)
        if recorded and Path(recorded).parent.is_dir():
            return Path(recorded).parent
    return job_dir(out or load_settings().output_dir, job_id)


def verify_job(engine: Engine, job_id: str, out: Path | None) -> dict[str, Any]:
    """Compare manifest, database rows and Parquet rows of a job; JSON-ready report."""
    manifest = manifest_ids(engine, job_id)
    stored = Counter(rows_per_sample_id(engine, job_id))
    directory = _parquet_dir(engine, job_id, out)
    parquet, foreign, files = _parquet_ids(directory, job_id)
    problems = {
        "missing_in_database": sorted(manifest - stored.keys()),
        "missing_in_parquet": sorted(manifest - parquet.keys()),
        "duplicates_in_database": sorted(i for i, n in stored.items() if n > 1),
        "duplicates_in_parquet": sorted(i for i, n in parquet.items() if n > 1),
        "extra_in_database": sorted(stored.keys() - manifest),
        "extra_in_parquet": sorted(parquet.keys() - manifest),
    }
    return {
        "job_id": job_id,
        "parquet_dir": str(directory),
        "parquet_files": files,
        "manifest": len(manifest),
        "job_state": refresh_job_state(engine, job_id),
        "database_rows": stored.total(),
        "parquet_rows": sum(parquet.values()) + foreign,
        "parquet_rows_of_other_jobs": foreign,
        "counts": {name: len(ids) for name, ids in problems.items()},
        "examples": {name: ids[:SHOWN_IDS] for name, ids in problems.items() if ids},
        "ok": not foreign and not any(problems.values()),
    }


def format_report(report: dict[str, Any]) -> str:
    """The human-readable report: the counts, then each kind of problem with examples."""
    lines = [
        f"job {report['job_id']} ({report['job_state']}): manifest {report['manifest']}, "
        f"database rows "
        f"{report['database_rows']}, Parquet rows {report['parquet_rows']} in "
        f"{report['parquet_files']} files under {report['parquet_dir']}"
    ]
    for name, n in report["counts"].items():
        if n:
            shown = ", ".join(report["examples"][name])
            lines.append(f"  {name.replace('_', ' ')}: {n} (e.g. {shown})")
    if report["parquet_rows_of_other_jobs"]:
        lines.append(f"  Parquet rows of other jobs: {report['parquet_rows_of_other_jobs']}")
    return "\n".join(lines)


def report_failure(report: dict[str, Any]) -> str | None:
    """Why verification failed, in one line; None when the report is ok."""
    if report["ok"]:
        return None
    found = [f"{n} {k.replace('_', ' ')}" for k, n in report["counts"].items() if n]
    if report["parquet_rows_of_other_jobs"]:
        found.append(f"{report['parquet_rows_of_other_jobs']} Parquet rows of other jobs")
    return f"verify failed: {', '.join(found)}"
