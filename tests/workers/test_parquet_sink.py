"""Parquet shard files: layout, schema, atomic replacement, agreement with the database."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from workers import db
from workers.parquet_sink import (
    SAMPLE_SCHEMA,
    out_partitioning,
    read_job_parquet,
    shard_path,
    write_shard_parquet,
)

META = {"model": "tiny-llama", "draft": "tiny-eagle", "mode": "eagle2", "tree_depth": 5}


def _requests(job_id: str, n: int, shard_size: int) -> list[dict]:
    return [
        {
            "job_id": job_id,
            "sample_id": f"q{i}",
            "line_no": i + 1,
            "shard": i // shard_size,
            "payload": {"category": "math" if i % 2 else None, "custom_id": None},
        }
        for i in range(n)
    ]


def _rows(fake_sample, job_id: str, n: int = 6, shard_size: int = 3, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    now = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    return [fake_sample(r, rng, created_at=now) for r in _requests(job_id, n, shard_size)]


def test_schema_matches_the_samples_table():
    assert tuple(SAMPLE_SCHEMA.names) == db.SAMPLE_FIELDS
    for column in db.samples_t.columns:
        assert SAMPLE_SCHEMA.field(column.name).nullable == column.nullable, column.name


def test_shard_file_layout_metadata_and_compression(tmp_path, fake_sample):
    rows = [r for r in _rows(fake_sample, "jobA") if r["shard"] == 1]
    path = write_shard_parquet(tmp_path, "jobA", 1, rows, META)
    assert path == tmp_path / "job=jobA" / "shard=1.parquet" == shard_path(tmp_path, "jobA", 1)
    meta = pq.read_metadata(path)
    assert meta.num_rows == 3
    assert meta.row_group(0).column(0).compression == "ZSTD"
    kv = {k.decode(): v.decode() for k, v in meta.metadata.items()}
    assert kv["model"] == "tiny-llama" and kv["mode"] == "eagle2"
    assert json.loads(kv["tree_depth"]) == 5 and json.loads(kv["shard"]) == 1
    assert kv["job_id"] == "jobA" and kv["eagle2_batch_version"]
    table = pq.read_table(path)
    assert table.schema.remove_metadata().equals(SAMPLE_SCHEMA)
    assert table.to_pylist() == rows


def test_logprobs_round_trip_exactly(tmp_path, fake_sample):
    """Logprobs are fp32 as computed: a stored row reads back equal."""
    logprobs = [
        {"token_id": 7, "logprob": -0.25, "top_ids": [7, 3], "top_logprobs": [-0.25, -1.875]},
        {"token_id": 2, "logprob": -3.0517578125e-05, "top_ids": [], "top_logprobs": []},
    ]
    rows = [dict(r, logprobs=logprobs) for r in _rows(fake_sample, "jobL") if r["shard"] == 0]
    path = write_shard_parquet(tmp_path, "jobL", 0, rows, META)
    assert pq.read_table(path).to_pylist() == rows


def test_rewriting_a_shard_replaces_it(tmp_path, fake_sample):
    rows = _rows(fake_sample, "jobB")
    for shard in (0, 1):
        write_shard_parquet(tmp_path, "jobB", shard, [r for r in rows if r["shard"] == shard], META)
    # A redelivered shard 0 (different timings this time) is written again.
    again = [r for r in _rows(fake_sample, "jobB", seed=99) if r["shard"] == 0]
    write_shard_parquet(tmp_path, "jobB", 0, again, META)
    table = read_job_parquet(tmp_path, "jobB")
    assert table.num_rows == 6
    assert sorted(table["sample_id"].to_pylist()) == sorted(r["sample_id"] for r in rows)
    assert table.filter(pc.equal(table["shard"], 0))["total_ms"].to_pylist() == [
        r["total_ms"] for r in again
    ]
    assert sorted(p.name for p in (tmp_path / "job=jobB").iterdir()) == [
        "shard=0.parquet",
        "shard=1.parquet",
    ]


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, fake_sample):
    rows = [r for r in _rows(fake_sample, "jobC") if r["shard"] == 0]
    path = write_shard_parquet(tmp_path, "jobC", 0, rows, META)
    before = path.read_bytes()
    broken = [{**rows[0], "model": None}]  # a required field missing
    with pytest.raises(ValueError, match="model"):
        write_shard_parquet(tmp_path, "jobC", 0, broken, META)
    with pytest.raises(ValueError, match="unknown"):
        write_shard_parquet(tmp_path, "jobC", 0, [{**rows[0], "bogus": 1}], META)
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == ["shard=0.parquet"]


def test_hive_dataset_reads_cleanly(tmp_path, fake_sample):
    for job_id in ("123", "jobD"):  # an all-digit id would otherwise become an int
        rows = _rows(fake_sample, job_id)
        for shard in (0, 1):
            part = [r for r in rows if r["shard"] == shard]
            write_shard_parquet(tmp_path, job_id, shard, part, META)
    # One job's folder: exactly the file columns, no partition columns added.
    one = ds.dataset(tmp_path / "job=jobD", partitioning="hive").to_table()
    assert one.schema.names == SAMPLE_SCHEMA.names and one.num_rows == 6
    # All of OUT: a string `job` partition column next to job_id.
    everything = ds.dataset(tmp_path, partitioning=out_partitioning()).to_table()
    assert everything.schema.field("job").type == pa.string()
    assert everything.num_rows == 12
    assert set(everything["job"].to_pylist()) == {"123", "jobD"}
    assert everything["job"].to_pylist() == everything["job_id"].to_pylist()


def test_unsafe_job_ids_are_refused(tmp_path):
    for bad in ("../x", "a/b", ".hidden", "k=v", ""):
        with pytest.raises(ValueError):
            shard_path(tmp_path, bad, 0)


def test_read_job_without_files_is_empty(tmp_path):
    table = read_job_parquet(tmp_path, "nothing")
    assert table.num_rows == 0 and table.schema.equals(SAMPLE_SCHEMA)


def test_parquet_rows_equal_database_rows(engine, make_job, fake_sample, failed_sample, tmp_path):
    """Shards written from the stored rows (also after a redelivery) match the database."""
    job_id, requests = make_job(engine, n=11, shard_size=4)
    rng = random.Random(3)
    rows = [failed_sample(r) if r["line_no"] == 6 else fake_sample(r, rng) for r in requests]
    db.insert_samples(engine, rows)
    db.insert_samples(engine, rows[:4])  # redelivered shard 0: nothing new
    for shard in (0, 1, 2, 0):
        stored = list(db.iter_samples(engine, job_id, shard=shard))
        write_shard_parquet(tmp_path, job_id, shard, stored, META)
    table = read_job_parquet(tmp_path, job_id)
    in_db = list(db.iter_samples(engine, job_id))
    assert table.num_rows == len(in_db) == 11
    from_parquet = table.to_pylist()
    for got, want in zip(from_parquet, in_db, strict=True):
        if want["created_at"].tzinfo is None:  # SQLite: stored as UTC, returned naive
            want["created_at"] = want["created_at"].replace(tzinfo=UTC)
        assert got == want
