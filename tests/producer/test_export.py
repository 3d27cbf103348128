"""`eagle2-batch export`: jsonl, OpenAI Batch output and Parquet, parsed back."""

from __future__ import annotations

import json
import os
import random

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import producer.export as export_module
from producer.cli import main
from workers import db
from workers.parquet_sink import SAMPLE_SCHEMA


def _fill(engine, make_job, fake_sample, failed_sample, n=12):
    job_id, requests = make_job(engine, n=n, shard_size=5)
    rng = random.Random(0)
    rows = [
        failed_sample(r, "decode error") if i == 7 else fake_sample(r, rng)
        for i, r in enumerate(requests)
    ]
    # Stored out of order: exports follow the input's line order anyway.
    db.insert_samples(engine, rows[::-1])
    return job_id, rows


def _export(db_url, job_id, fmt, out, count=12):
    result = CliRunner().invoke(
        main, ["export", job_id, "--format", fmt, "--out", str(out), "--url", db_url]
    )
    assert result.exit_code == 0, result.output
    what = "requests" if fmt == "openai" else "rows"
    assert f"wrote {count} {what} ({fmt})" in result.output


def test_openai_format_round_trips_custom_id(
    engine, db_url, make_job, fake_sample, failed_sample, tmp_path
):
    job_id, rows = _fill(engine, make_job, fake_sample, failed_sample)
    out = tmp_path / "batch_output.jsonl"
    _export(db_url, job_id, "openai", out)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 12
    for line, row in zip(lines, rows, strict=True):
        want_id = row["custom_id"] if row["custom_id"] is not None else row["sample_id"]
        assert line["custom_id"] == want_id
        assert line["id"].startswith("batch_req_")
        if row["status"] == "failed":
            assert line["response"] is None
            assert line["error"] == {"code": "generation_failed", "message": "decode error"}
            continue
        assert line["error"] is None
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"]
        body = response["body"]
        assert body["object"] == "chat.completion" and body["model"] == "tiny-llama"
        choice = body["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": row["output_text"]}
        assert choice["finish_reason"] == row["finish_reason"]
        assert body["usage"] == {
            "prompt_tokens": row["prompt_tokens"],
            "completion_tokens": row["completion_tokens"],
            "total_tokens": row["prompt_tokens"] + row["completion_tokens"],
        }
        assert isinstance(body["created"], int)
    # Both kinds of custom_id occur: the input's own and the sample-id fallback.
    assert {"req-0", "q1"} <= {line["custom_id"] for line in lines}
    assert len({line["id"] for line in lines}) == 12
    # Deterministic: exporting again gives the same bytes.
    again = tmp_path / "again.jsonl"
    _export(db_url, job_id, "openai", again)
    assert again.read_bytes() == out.read_bytes()


def test_openai_format_puts_n_completions_in_one_line_as_choices(
    engine, db_url, make_job, fake_sample, failed_sample, tmp_path
):
    job_id, requests = make_job(engine, n=4, shard_size=3, completions=3)
    rng = random.Random(1)
    rows = [
        failed_sample(r, "decode error") if r["sample_id"] == "q2#1" else fake_sample(r, rng)
        for r in requests
    ]
    db.insert_samples(engine, rows[::-1])
    out = tmp_path / "batch_output.jsonl"
    _export(db_url, job_id, "openai", out, count=4)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["req-0", "q1", "q2", "req-3"]
    assert len({line["id"] for line in lines}) == 4
    for i, line in enumerate(lines):
        mine = [r for r in rows if r["request_id"] == f"q{i}"]
        if i == 2:
            assert line["response"] is None
            assert line["error"] == {
                "code": "generation_failed",
                "message": "completion 1 of 3: decode error",
            }
            continue
        body = line["response"]["body"]
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert [c["message"]["content"] for c in body["choices"]] == [
            r["output_text"] for r in mine
        ]
        assert [c["finish_reason"] for c in body["choices"]] == [r["finish_reason"] for r in mine]
        assert body["usage"]["completion_tokens"] == sum(r["completion_tokens"] for r in mine)
        assert body["usage"]["prompt_tokens"] == mine[0]["prompt_tokens"]
    jsonl = tmp_path / "out.jsonl"
    _export(db_url, job_id, "jsonl", jsonl)
    exported = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert [(x["request_id"], x["choice_index"]) for x in exported] == [
        (f"q{i}", k) for i in range(4) for k in range(3)
    ]


def test_jsonl_has_one_full_row_per_sample(
    engine, db_url, make_job, fake_sample, failed_sample, tmp_path
):
    job_id, rows = _fill(engine, make_job, fake_sample, failed_sample)
    out = tmp_path / "out.jsonl"
    _export(db_url, job_id, "jsonl", out)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["sample_id"] for x in lines] == [r["sample_id"] for r in rows]
    for line, row in zip(lines, rows, strict=True):
        assert set(line) == set(db.SAMPLE_FIELDS)
        for key, value in row.items():
            assert line[key] == value, key
        assert line["created_at"].endswith("+00:00")


def test_parquet_export_is_one_file_with_every_row(
    engine, db_url, make_job, fake_sample, failed_sample, tmp_path, monkeypatch
):
    monkeypatch.setattr(export_module, "_PARQUET_BATCH", 5)  # several row groups
    job_id, rows = _fill(engine, make_job, fake_sample, failed_sample)
    out = tmp_path / "nested" / "job.parquet"
    _export(db_url, job_id, "parquet", out)
    table = pq.read_table(out)
    assert table.schema.remove_metadata().equals(SAMPLE_SCHEMA)
    assert table.num_rows == 12 and pq.ParquetFile(out).num_row_groups == 3
    assert table["sample_id"].to_pylist() == [r["sample_id"] for r in rows]
    assert table["accept_hist"].to_pylist() == [r.get("accept_hist") for r in rows]
    meta = table.schema.metadata
    assert meta[b"job_id"].decode() == job_id
    assert json.loads(meta[b"params"])["tree_depth"] == 5
    assert [p.name for p in out.parent.iterdir()] == ["job.parquet"]  # no temp left


def test_export_unknown_job_fails_and_writes_nothing(sqlite_url, tmp_path):
    out = tmp_path / "x.jsonl"
    result = CliRunner().invoke(
        main, ["export", "nope", "--format", "jsonl", "--out", str(out), "--url", sqlite_url]
    )
    assert result.exit_code == 1 and "no job nope" in result.output
    assert not out.exists()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_export_follows_no_symlink_at_its_old_temporary_name(
    sqlite_url, make_job, fake_sample, tmp_path, fmt
):
    engine = db.make_engine(sqlite_url)
    job_id, rows = make_job(engine, n=3)
    db.insert_samples(engine, [fake_sample(r, random.Random(1)) for r in rows])
    engine.dispose()
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    out = tmp_path / f"job.{fmt}"
    os.symlink(victim, tmp_path / f".{out.name}.tmp")  # the name export used to write to
    _export(sqlite_url, job_id, fmt, out, count=3)
    assert victim.read_text() == "keep me"
