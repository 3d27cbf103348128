"""A job as `submit` writes it, for the worker tests: the job row, the manifest of Request
payloads and the shard rows, all before any worker runs."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from workers import db
from workers.request import Request


def store_job(
    engine: Engine,
    requests: list[Request],
    shard_size: int,
    params: dict[str, Any],
    model: str = "tiny-llama",
    draft: str = "tiny-eagle",
) -> str:
    """The job's id; request i (line i + 1) goes to shard i // shard_size."""
    n_shards = (len(requests) + shard_size - 1) // shard_size
    job_id = db.insert_job(
        engine,
        input_path="prompts.jsonl",
        model=model,
        draft=draft,
        mode="eagle2",
        params=params,
        n_expected=len(requests),
        n_shards=n_shards,
    )
    db.insert_requests(
        engine,
        [
            {"job_id": job_id, "sample_id": r.sample_id, "line_no": r.line_no,
             "shard": (r.line_no - 1) // shard_size, "payload": r.to_payload()}
            for r in requests
        ],
    )  # fmt: skip
    db.insert_shards(
        engine,
        [
            {"job_id": job_id, "shard": s, "line_start": s * shard_size + 1,
             "line_end": min((s + 1) * shard_size, len(requests)),
             "n_samples": min(shard_size, len(requests) - s * shard_size)}
            for s in range(n_shards)
        ],
    )  # fmt: skip
    return job_id
