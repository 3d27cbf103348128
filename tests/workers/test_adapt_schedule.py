"""When an --adapt-draft job's next round is due: first at --adapt-after completions,
then at 4x the data of the last round while rounds win, never after one that lost or
past the job's end."""

from __future__ import annotations

import random
from pathlib import Path

from sqlalchemy import Engine, select

from tests.workers.manifests import store_job
from workers import db
from workers.adapt_schedule import next_round_at, round_due
from workers.head_versions import Attempt, record
from workers.request import Request
from workers.schema import requests_t


def _job(engine: Engine, n: int, params: dict) -> str:
    requests = [Request(f"q{i}", i + 1, [{"role": "user", "content": "t5"}]) for i in range(n)]
    return store_job(engine, requests, 10, {"max_new_tokens": 4, **params})


def _finish(engine: Engine, job_id: str, count: int, fake_sample) -> None:
    """Store ok samples for the job's first `count` requests."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(requests_t).where(requests_t.c.job_id == job_id).order_by(requests_t.c.line_no)
        ).mappings()
        manifest = [dict(r) for r in rows][:count]
    rng = random.Random(0)
    db.insert_samples(engine, [fake_sample(r, rng) for r in manifest])


def _round(engine: Engine, job_id: str, completions: int, head: Path | None) -> None:
    """A stored round: published with `head`'s files when it won, else without."""
    attempt = Attempt(0, completions, 1.5, 1.7 if head else 1.4, 3, 1.0, head)
    record(engine, job_id, attempt)


def test_rounds_come_at_adapt_after_then_four_times_the_data(
    engine, fake_sample, tmp_path: Path
) -> None:
    head = tmp_path / "head"  # what a published version packs; its contents do not matter
    head.mkdir()
    (head / "config.json").write_text("{}")
    job_id = _job(engine, 100, {"adapt_draft": True, "adapt_after": 10})
    assert next_round_at(engine, db.get_job(engine, job_id)) == 10
    _finish(engine, job_id, 9, fake_sample)
    assert round_due(engine, job_id) is None
    _finish(engine, job_id, 12, fake_sample)  # 12 stored, ids already stored are kept
    assert round_due(engine, job_id) == 10
    _round(engine, job_id, 12, head)
    assert next_round_at(engine, db.get_job(engine, job_id)) == 48
    assert round_due(engine, job_id) is None
    _round(engine, job_id, 50, None)
    assert next_round_at(engine, db.get_job(engine, job_id)) is None  # a loss ends them


def test_no_rounds_without_the_option_or_past_the_jobs_end(engine) -> None:
    plain = _job(engine, 100, {})
    assert next_round_at(engine, db.get_job(engine, plain)) is None
    small = _job(engine, 20, {"adapt_draft": True, "adapt_after": 20})
    assert next_round_at(engine, db.get_job(engine, small)) is None
    default = _job(engine, 1000, {"adapt_draft": True})
    assert next_round_at(engine, db.get_job(engine, default)) == 200  # adapt_first's floor
