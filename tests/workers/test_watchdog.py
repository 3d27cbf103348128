"""The watchdog's sweep on SQLite and Postgres: a stalled shard is sent again and reclaimed
once, a beating one is left alone, and a broker that cannot be reached leaves the shard
for the next sweep. (Real workers doing it through Redis: test_worker_integration.py.)"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, update

from tests.workers.manifests import store_job
from workers import db
from workers.request import Request
from workers.schema import utcnow
from workers.watchdog import sweep


def job_of_three_shards(engine: Engine) -> str:
    requests = [Request(f"q{i}", i + 1, [{"role": "user", "content": "t5"}]) for i in range(3)]
    return store_job(engine, requests, 1, {"max_new_tokens": 4})


def beat(engine: Engine, job_id: str, shard: int, seconds_ago: float) -> None:
    db.set_shard_state(engine, job_id, shard, "running", worker=f"w{shard}@host")
    with engine.begin() as conn:
        conn.execute(
            update(db.shards_t)
            .where(db.shards_t.c.job_id == job_id, db.shards_t.c.shard == shard)
            .values(heartbeat_at=utcnow() - timedelta(seconds=seconds_ago))
        )


def ours(job_id: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of this test's job (the sweep sees every job of a shared database)."""
    return [row for row in rows if row["job_id"] == job_id]


def test_a_stalled_shard_is_sent_and_reclaimed_once(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EAGLE2_HEARTBEAT_S", "1")  # stalled after 6 s without a beat
    job_id = job_of_three_shards(engine)
    beat(engine, job_id, 0, 30)  # its worker died half a minute ago
    beat(engine, job_id, 1, 2)  # alive
    sent: list[tuple[str, list[int], str]] = []
    reclaimed = ours(job_id, sweep(engine, lambda *message: sent.append(message)))
    assert [m for m in sent if m[0] == job_id] == [(job_id, [0], "tiny-llama")]
    assert [(r["shard"], r["worker"]) for r in reclaimed] == [(0, "w0@host")]
    row = db.get_shard(engine, job_id, 0)
    assert (row["state"], row["lost_attempts"]) == ("queued", 1)
    assert row["error"].startswith("attempt 1 on w0@host was lost: no heartbeat since ")
    assert db.get_shard(engine, job_id, 1)["state"] == "running"
    assert ours(job_id, sweep(engine, lambda *message: sent.append(message))) == []


def test_a_broker_that_cannot_be_reached_leaves_the_shard_for_the_next_sweep(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EAGLE2_HEARTBEAT_S", "1")
    job_id = job_of_three_shards(engine)
    beat(engine, job_id, 2, 30)

    def down(*_: Any) -> None:
        raise ConnectionError("Error 111 connecting to 127.0.0.1:6379")

    with pytest.raises(ConnectionError):
        sweep(engine, down)
    row = db.get_shard(engine, job_id, 2)
    assert (row["state"], row["lost_attempts"]) == ("running", 0)  # untouched
    sent: list[Any] = []
    assert len(ours(job_id, sweep(engine, lambda *message: sent.append(message)))) == 1
    assert [m for m in sent if m[0] == job_id] == [(job_id, [2], "tiny-llama")]
