"""Parquet output: one file per shard, written atomically, same fields as the samples table.

Layout: ``OUT/job=<job_id>/shard=<n>.parquet``. Rewriting a shard replaces its file, so a
redelivered shard never duplicates rows; write it from the shard's stored rows
(`workers.db.iter_samples(engine, job_id, shard=n)`) so the file is complete even when
the redelivery decoded only what was missing.

Reading: ``pyarrow.dataset.dataset(OUT / "job=<id>", partitioning="hive")`` yields the
file columns only (the ``shard=<n>.parquet`` file names are not partition directories).
Reading all of OUT adds a ``job`` partition column; pass `out_partitioning()` so it stays
a string even for all-digit job ids.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from workers.atomic_file import replacing
from workers.stored_text import stored_row

if TYPE_CHECKING:
    import pyarrow.dataset as ds

_INT_LIST = pa.list_(pa.int64())
# One output token's logprobs (eagle2_core.logprobs.TokenLogprob): fp32, as computed.
LOGPROB = pa.struct(
    [
        pa.field("token_id", pa.int32(), nullable=False),
        pa.field("logprob", pa.float32(), nullable=False),
        pa.field("top_ids", pa.list_(pa.int32())),
        pa.field("top_logprobs", pa.list_(pa.float32())),
    ]
)

# Field for field the samples table (workers.schema.SAMPLE_FIELDS), with its nullability.
SAMPLE_SCHEMA = pa.schema(
    [
        pa.field("job_id", pa.string(), nullable=False),
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("choice_index", pa.int32(), nullable=False),
        pa.field("line_no", pa.int32(), nullable=False),
        pa.field("shard", pa.int32(), nullable=False),
        pa.field("custom_id", pa.string()),
        pa.field("category", pa.string()),
        pa.field("output_text", pa.string()),
        pa.field("turn_outputs", pa.list_(pa.string())),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("finish_reason", pa.string()),
        pa.field("logprobs", pa.list_(LOGPROB)),
        pa.field("mode", pa.string(), nullable=False),
        pa.field("model", pa.string(), nullable=False),
        pa.field("draft", pa.string()),
        pa.field("head_version", pa.int32()),
        pa.field("temperature", pa.float64(), nullable=False),
        pa.field("top_p", pa.float64(), nullable=False),
        pa.field("seed", pa.int64()),
        pa.field("n_cycles", pa.int32()),
        pa.field("mean_accept_length", pa.float64()),
        pa.field("mean_tree_size", pa.float64()),
        pa.field("accept_hist", _INT_LIST),
        pa.field("depth_attempts", _INT_LIST),
        pa.field("depth_accepts", _INT_LIST),
        pa.field("draft_ms", pa.float64()),
        pa.field("verify_ms", pa.float64()),
        pa.field("total_ms", pa.float64()),
        pa.field("tokens_per_s", pa.float64()),
        pa.field("worker", pa.string(), nullable=False),
        pa.field("device", pa.string(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("error", pa.string()),
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
    ]
)


def out_partitioning() -> ds.Partitioning:
    """Hive partitioning of OUT when reading every job at once."""
    import pyarrow.dataset as ds  # for readers only: a writing run skips its ~60 ms import

    return ds.partitioning(pa.schema([("job", pa.string())]), flavor="hive")


# Job ids become directory names: no separators, no '=' and no leading dot.
_SAFE_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


def job_dir(out_dir: str | os.PathLike[str], job_id: str) -> Path:
    """The job's folder ``OUT/job=<job_id>``; rejects ids that are not safe path parts."""
    if not _SAFE_ID.fullmatch(job_id):
        raise ValueError(f"job id {job_id!r} is not usable as a directory name")
    return Path(out_dir) / f"job={job_id}"


def shard_path(out_dir: str | os.PathLike[str], job_id: str, shard: int) -> Path:
    """Where shard `shard` of job `job_id` is stored."""
    return job_dir(out_dir, job_id) / f"shard={int(shard)}.parquet"


def _package_version() -> str:
    try:
        return version("eagle2-batch")
    except PackageNotFoundError:
        return "unknown"


def rows_to_table(
    rows: Iterable[Mapping[str, Any]], metadata: Mapping[str, Any] | None = None
) -> pa.Table:
    """Output rows as a table with `SAMPLE_SCHEMA`, their outputs in stored form
    (workers/stored_text.py: Arrow holds no lone surrogate); unknown keys are an error."""
    rows = [stored_row(row) for row in rows]
    known = set(SAMPLE_SCHEMA.names)
    for row in rows:
        unknown = row.keys() - known
        if unknown:
            raise ValueError(f"unknown output fields {sorted(unknown)}")
    table = pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA)
    # from_pylist fills absent keys with nulls even in non-nullable fields.
    missing = [f.name for f in SAMPLE_SCHEMA if not f.nullable and table[f.name].null_count]
    if missing:
        raise ValueError(f"output rows lack required fields {missing}")
    if metadata:
        table = table.replace_schema_metadata(encode_metadata(metadata))
    return table


def encode_metadata(metadata: Mapping[str, Any]) -> dict[str, str]:
    """Parquet key-value metadata: strings as they are, anything else as JSON, plus version."""
    encoded = {
        k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in metadata.items()
    }
    encoded.setdefault("eagle2_batch_version", _package_version())
    return encoded


def write_shard_parquet(
    out_dir: str | os.PathLike[str],
    job_id: str,
    shard: int,
    rows: Iterable[Mapping[str, Any]],
    metadata: Mapping[str, Any],
) -> Path:
    """Write one shard's rows to ``OUT/job=<id>/shard=<n>.parquet`` atomically; returns it.

    The file is written under a dot-prefixed temporary name in the same folder (which
    dataset readers skip) and then replaces the old one (workers/atomic_file.py), so
    readers see the old file or the new one, never half of one. `metadata` (model, draft,
    mode, tree params ...) is stored as key-value metadata together with the package
    version.
    """
    final = shard_path(out_dir, job_id, shard)
    table = rows_to_table(rows, {"job_id": job_id, "shard": int(shard), **metadata})
    with replacing(final) as fh:
        pq.write_table(table, fh, compression="zstd")
    return final


def read_job_parquet(out_dir: str | os.PathLike[str], job_id: str) -> pa.Table:
    """All shard files of a job as one table (file columns only, rows in shard order),
    outputs in stored form: `workers.stored_text.unstored_row` gives a row's as written."""
    path = job_dir(out_dir, job_id)
    if not path.is_dir():
        return SAMPLE_SCHEMA.empty_table()
    import pyarrow.dataset as ds  # see out_partitioning

    dataset = ds.dataset(path, format="parquet", partitioning="hive", schema=SAMPLE_SCHEMA)
    return dataset.to_table().sort_by([("shard", "ascending"), ("line_no", "ascending")])
