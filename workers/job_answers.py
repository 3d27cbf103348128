"""A finished job's answers as training data: every successful sample with the
conversation it answered (the manifest's messages, the job's system prompt included, and
follow-up turns), so `train-draft --from-job` learns from the target's own outputs on the
job's own distribution. Failed samples are left out; rejected lines never had one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sqlalchemy import Engine, select

from workers.db import with_shared_prompts
from workers.request import Request
from workers.schema import requests_t, samples_t
from workers.stored_text import unstored

BATCH = 1000


def iter_job_answers(engine: Engine, job_id: str) -> Iterator[dict[str, Any]]:
    """(request_id, sample_id, messages, followups, turn_outputs, finish_reason) of each
    ok sample, in line order, BATCH rows at a time."""
    stmt = (
        select(
            samples_t.c.sample_id,
            samples_t.c.request_id,
            samples_t.c.turn_outputs,
            samples_t.c.finish_reason,
            requests_t.c.payload,
        )
        .join(
            requests_t,
            (requests_t.c.job_id == samples_t.c.job_id)
            & (requests_t.c.sample_id == samples_t.c.sample_id),
        )
        .where(samples_t.c.job_id == job_id, samples_t.c.status == "ok")
        .order_by(samples_t.c.line_no, samples_t.c.sample_id)
    )
    with engine.connect() as conn:
        result = conn.execution_options(stream_results=True).execute(stmt).mappings()
        while batch := [dict(row) for row in result.fetchmany(BATCH)]:
            for row in with_shared_prompts(conn, job_id, batch):
                request = Request.from_payload(row["payload"])
                yield {
                    "request_id": row["request_id"] or row["sample_id"],
                    "sample_id": row["sample_id"],
                    "messages": request.messages,
                    "followups": request.followups,
                    "turn_outputs": [unstored(t) for t in row["turn_outputs"] or []],
                    "finish_reason": row["finish_reason"],
                }


def iter_job_prompts(engine: Engine, job_id: str) -> Iterator[tuple[str, list[dict]]]:
    """(request id, messages of its first turn, system prompt included) of every request
    in the job's manifest, decoded or not, once per request, in line order: what
    --adapt-draft measures a head on (the held-out ones)."""
    stmt = (
        select(requests_t.c.sample_id, requests_t.c.line_no, requests_t.c.payload)
        .where(requests_t.c.job_id == job_id)
        .order_by(requests_t.c.line_no, requests_t.c.sample_id)
    )
    with engine.connect() as conn:
        result = conn.execution_options(stream_results=True).execute(stmt).mappings()
        while batch := [dict(row) for row in result.fetchmany(BATCH)]:
            for row in with_shared_prompts(conn, job_id, batch):
                payload = {
                    **row["payload"],
                    "sample_id": row["sample_id"],
                    "line_no": row["line_no"],
                }
                request = Request.from_payload(payload)
                if request.choice_index == 0:
                    yield request.line_id, request.messages
