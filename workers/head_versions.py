"""A job's draft head versions (--adapt-draft): stored in the database, read by every worker.

The database is the one place every worker host of a job already reads and writes, so a
version lives there as bytes (a tar of the head's folder, ~10-20 MB) with its sha256: no
shared file system to assume, and a version is visible to all at once, or not at all (one
insert). Rows are immutable; a worker takes the newest published version at its next
shard and unpacks it once per host, into a folder named by its checksum.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, func, insert, select
from sqlalchemy.exc import IntegrityError

from eagle2_core.registry import cache_root
from workers.schema import head_versions_t

if TYPE_CHECKING:  # torch
    from workers.decoding import SampleDecoder

# The columns every reader wants; `files` (megabytes) only where a head is loaded.
SUMMARY_COLUMNS = [c for c in head_versions_t.c if c.name != "files"]


@dataclass(frozen=True)
class Attempt:
    """One fine-tuning round's outcome, before it is stored."""

    based_on: int
    train_completions: int
    tau_before: float | None
    tau_after: float | None
    eval_prompts: int
    train_s: float
    head_dir: Path | None  # the head's folder where it is to be published, else None


def pack(directory: Path) -> bytes:
    """The files of a head folder as one uncompressed tar (safetensors do not compress),
    in name order with fixed metadata: the same head packs to the same bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(p for p in directory.iterdir() if p.is_file()):
            info = tarfile.TarInfo(path.name)
            info.size = path.stat().st_size
            with path.open("rb") as handle:
                tar.addfile(info, handle)
    return buffer.getvalue()


def unpack(files: bytes, sha256: str, cache: Path) -> Path:
    """The head folder of a stored version under `cache`, unpacked once per host (a
    concurrent unpack by another worker is harmless: the rename is atomic)."""
    if hashlib.sha256(files).hexdigest() != sha256:
        raise ValueError(f"a stored head version does not match its checksum {sha256}")
    directory = cache / sha256
    if directory.is_dir():
        return directory
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=".unpacking-"))
    with tarfile.open(fileobj=io.BytesIO(files)) as tar:
        tar.extractall(staging, filter="data")
    try:
        os.rename(staging, directory)
    except OSError:  # another worker got there first
        if not directory.is_dir():
            raise
    return directory


def record(engine: Engine, job_id: str, attempt: Attempt) -> tuple[int, bool]:
    """Store an attempt as the job's next version; (its number, whether it is published).

    Published with its files only if it has a head folder and is based on the job's newest
    published head: a head that beat an older one, while another trainer published a
    newer one, was never judged against what the workers now draft with. Two trainers
    storing at once get different numbers (the second insert meets the primary key and
    counts again)."""
    files = pack(attempt.head_dir) if attempt.head_dir is not None else None
    for _ in range(3):
        try:
            return _insert(engine, job_id, attempt, files)
        except IntegrityError:
            continue
    raise RuntimeError(f"job {job_id}: could not number a head version (trainers racing)")


def _insert(engine: Engine, job_id: str, attempt: Attempt, files: bytes | None) -> tuple[int, bool]:
    mine = head_versions_t.c.job_id == job_id
    with engine.begin() as conn:
        newest = conn.execute(select(func.max(head_versions_t.c.version)).where(mine)).scalar()
        current = conn.execute(
            select(func.max(head_versions_t.c.version)).where(mine, head_versions_t.c.published)
        ).scalar()
        publish = files is not None and (current or 0) == attempt.based_on
        version = (newest or 0) + 1
        conn.execute(
            insert(head_versions_t).values(
                job_id=job_id,
                version=version,
                published=publish,
                based_on=attempt.based_on,
                train_completions=attempt.train_completions,
                tau_before=attempt.tau_before,
                tau_after=attempt.tau_after,
                eval_prompts=attempt.eval_prompts,
                train_s=attempt.train_s,
                sha256=hashlib.sha256(files).hexdigest() if publish else None,
                files=files if publish else None,
            )
        )
    return version, publish


def versions(engine: Engine, job_id: str) -> list[dict[str, Any]]:
    """Every attempt of the job, oldest first, without the files."""
    stmt = (
        select(*SUMMARY_COLUMNS)
        .where(head_versions_t.c.job_id == job_id)
        .order_by(head_versions_t.c.version)
    )
    with engine.connect() as conn:
        return [dict(row) for row in conn.execute(stmt).mappings()]


def newest_published(engine: Engine, job_id: str) -> tuple[int, str] | None:
    """(version, sha256) of the job's newest published head, or None."""
    stmt = (
        select(head_versions_t.c.version, head_versions_t.c.sha256)
        .where(head_versions_t.c.job_id == job_id, head_versions_t.c.published)
        .order_by(head_versions_t.c.version.desc())
        .limit(1)
    )
    with engine.connect() as conn:
        row = conn.execute(stmt).first()
    return (row.version, row.sha256) if row is not None else None


def head_folder(engine: Engine, job_id: str, version: int, cache: Path) -> Path:
    """The folder of a published version, unpacked under `cache` (read from the database
    only where this host has not unpacked it yet)."""
    where = (head_versions_t.c.job_id == job_id) & (head_versions_t.c.version == version)
    with engine.connect() as conn:
        sha256 = conn.execute(select(head_versions_t.c.sha256).where(where)).scalar_one()
        if (cache / sha256).is_dir():
            return cache / sha256
        files = conn.execute(select(head_versions_t.c.files).where(where)).scalar_one()
    return unpack(files, sha256, cache)


def follow_newest(engine: Engine, decoder: SampleDecoder, job_id: str, adapts: bool) -> None:
    """Where a shard starts (so that one version drafts a whole shard): the job's newest
    published head if it adapts and has one, else the head the decoder was loaded with (a
    worker's decoder serves job after job)."""
    newest = newest_published(engine, job_id) if adapts else None
    if newest is None:
        if decoder.head_of is not None:
            decoder.use_first_head()
    elif decoder.head_of != (job_id, newest[0]):
        folder = head_folder(engine, job_id, newest[0], cache_root() / "job-heads")
        decoder.use_head(folder, job_id, newest[0])
