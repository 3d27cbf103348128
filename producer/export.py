"""`eagle2-batch export`: a job's stored rows as JSONL, OpenAI Batch output, or Parquet.

Rows are streamed from the database (`iter_samples`, a server-side cursor on Postgres)
into a private temporary file beside the target, which replaces it at the end
(workers/atomic_file.py), so a large job is never held in memory, a reader never sees
half an export, and two exports to one path do not mix.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from itertools import groupby, islice
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from sqlalchemy import Engine

from producer.database import as_utc
from producer.openai_logprobs import TokenText, openai_logprobs
from workers.atomic_file import replacing
from workers.db import get_job, iter_samples
from workers.parquet_sink import SAMPLE_SCHEMA, encode_metadata, rows_to_table

FORMATS = ("jsonl", "openai", "parquet")
_PARQUET_BATCH = 1000


def _json_default(value: Any) -> str:
    if isinstance(value, datetime):
        return as_utc(value).isoformat()
    raise TypeError(f"cannot export {type(value).__name__} value {value!r}")


def openai_line(rows: Sequence[Mapping[str, Any]], text: TokenText) -> dict[str, Any]:
    """One OpenAI Batch API output line for a request: its completions' rows (one, or the
    n of a line that asked for several) as `choices[0..n-1]`, with their logprobs where
    asked for (`text`: the tokens' text and bytes).

    `custom_id` is the input's custom_id, else the line's id. Ids are derived from
    (job_id, request_id), so exporting twice gives identical files. A request with a
    failed completion has `response: null` and `error: {code, message}` (the other
    completions are in the jsonl and Parquet exports).
    """
    first = rows[0]
    request_id = first["request_id"]
    digest = hashlib.sha256(f"{first['job_id']}\0{request_id}".encode()).hexdigest()
    custom_id = first["custom_id"] if first["custom_id"] is not None else request_id
    line: dict[str, Any] = {"id": f"batch_req_{digest[:24]}", "custom_id": custom_id}
    failed = [row for row in rows if row["status"] != "ok"]
    if failed:
        line["response"] = None
        message = failed[0]["error"]
        if len(rows) > 1:
            message = f"completion {failed[0]['choice_index']} of {len(rows)}: {message}"
        line["error"] = {"code": "generation_failed", "message": message}
        return line
    prompt_tokens = first["prompt_tokens"] or 0
    completion_tokens = sum(row["completion_tokens"] or 0 for row in rows)
    line["response"] = {
        "status_code": 200,
        "request_id": f"req_{digest[24:48]}",
        "body": {
            "id": f"chatcmpl-{digest[48:64]}",
            "object": "chat.completion",
            "created": int(max(as_utc(row["created_at"]) for row in rows).timestamp()),
            "model": first["model"],
            "choices": [
                {
                    "index": row["choice_index"],
                    "message": {"role": "assistant", "content": row["output_text"]},
                    "logprobs": openai_logprobs(row["logprobs"], text),
                    "finish_reason": row["finish_reason"],
                }
                for row in rows
            ],
            # As OpenAI counts n > 1: the prompt once, every choice's tokens.
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        },
    }
    line["error"] = None
    return line


def by_request(rows: Iterable[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Rows in line order (`iter_samples`) grouped into one list per request."""
    for _, group in groupby(rows, key=lambda row: (row["line_no"], row["request_id"])):
        yield list(group)


def _batches(rows: Iterable[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    it = iter(rows)
    while batch := list(islice(it, size)):
        yield batch


def _write_lines(path: Path, lines: Iterable[Mapping[str, Any]]) -> int:
    n = 0
    # A lone surrogate in an output (workers/stored_text.py) leaves json.dumps as it is;
    # written as \\udXXX it is the JSON escape that reads back as that very character.
    with replacing(path, "w", encoding="utf-8", errors="backslashreplace") as fh:
        for line in lines:
            fh.write(json.dumps(line, ensure_ascii=False, default=_json_default) + "\n")
            n += 1
    return n


def _write_parquet(path: Path, rows: Iterable[dict[str, Any]], metadata: dict[str, Any]) -> int:
    n = 0
    schema = SAMPLE_SCHEMA.with_metadata(encode_metadata(metadata))
    with replacing(path) as fh, pq.ParquetWriter(fh, schema, compression="zstd") as writer:
        for batch in _batches(rows, _PARQUET_BATCH):
            writer.write_table(rows_to_table(batch))
            n += len(batch)
    return n


def export_job(engine: Engine, job_id: str, fmt: str, out: Path) -> int:
    """Write job `job_id` to `out` in `fmt` (jsonl|openai|parquet), in line order.

    Returns the number of rows written (openai: one per request, its completions as
    choices; else one per completion); raises KeyError for an unknown job.
    """
    job = get_job(engine, job_id)
    if job is None:
        raise KeyError(job_id)
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}")
    rows = iter_samples(engine, job_id)
    if fmt == "jsonl":
        return _write_lines(out, rows)
    if fmt == "openai":
        text = TokenText(job["model"])
        return _write_lines(out, (openai_line(group, text) for group in by_request(rows)))
    meta = {k: job[k] for k in ("model", "draft", "mode", "params")}
    return _write_parquet(out, rows, {"job_id": job_id, **meta})
