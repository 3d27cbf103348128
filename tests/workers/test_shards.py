"""process_shard on SQLite and Postgres: storage, redelivery, Parquet completeness, cancel,
lost attempts and poison shards, the heartbeat."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine, select
from sqlalchemy.exc import OperationalError

from eagle2_core.engine import Engine as DecodeEngine
from tests.eagle2_core.tiny import tiny_head
from tests.workers.manifests import store_job
from tests.workers.test_decoding import chat_target
from workers import db, shards
from workers.decoding import SampleDecoder
from workers.parquet_sink import read_job_parquet, shard_path
from workers.request import Request
from workers.shards import JobNotFoundError, process_shard

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N, SHARD_SIZE = 10, 4  # shards 0 and 1 hold 4 samples, shard 2 holds 2
PARAMS = {"max_new_tokens": 6, "tree_width": 4, "tree_depth": 3, "total_tokens": 12}
WORKER = "cpu0@test"


class Crash(BaseException):
    """Stands for the worker process dying: nothing catches it, no cleanup runs."""


class Decoder:
    """Wraps the real decoder: records the rows it yields, can crash or act after n rows."""

    def __init__(self, inner: SampleDecoder, after: int | None = None, action=None):
        self.inner, self.after, self.action = inner, after, action
        self.decoded: list[str] = []

    def __getattr__(self, name: str):  # the rest (head_version, use_head ...) is the real one's
        return getattr(self.inner, name)

    def decode_many(self, requests, *args):
        for row in self.inner.decode_many(requests, *args):
            if self.after is not None and len(self.decoded) == self.after:
                self.action()
            self.decoded.append(row["sample_id"])
            yield row


@pytest.fixture(scope="module")
def decoder() -> SampleDecoder:
    target = chat_target()
    return SampleDecoder(
        DecodeEngine(target, tiny_head(target)), model="tiny-llama", draft="tiny-eagle"
    )


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shards, "FLUSH_ROWS", 2)


def make_job(engine: Engine, prompts: list[str] | None = None) -> str:
    """A job with its manifest (Request payloads) and shards, as the producer writes it."""
    prompts = prompts or [f"t{5 + i} t{6 + i} t7" for i in range(N)]
    requests = [
        Request(f"q{i}", i + 1, [{"role": "user", "content": p}], category="c")
        for i, p in enumerate(prompts)
    ]
    return store_job(engine, requests, SHARD_SIZE, PARAMS)


def shard_row(engine: Engine, job_id: str, shard: int) -> dict:
    stmt = select(db.shards_t).where(db.shards_t.c.job_id == job_id, db.shards_t.c.shard == shard)
    with engine.connect() as conn:
        return dict(conn.execute(stmt).mappings().one())


def stored(engine: Engine, job_id: str, shard: int | None = None) -> list[dict]:
    return list(db.iter_samples(engine, job_id, shard=shard))


def parquet_ids(tmp_path, job_id: str, shard: int) -> list[str]:
    return pq.read_table(shard_path(tmp_path, job_id, shard)).column("sample_id").to_pylist()


@pytest.fixture
def out(tmp_path) -> Iterator:
    yield tmp_path / "out"


def test_whole_job_stored_once_in_database_and_parquet(engine, decoder, out):
    job_id = make_job(engine)
    progress = []
    results = [
        process_shard(
            engine, decoder, job_id, s, out, WORKER, "cpu",
            on_progress=lambda row, done, total: progress.append((row["sample_id"], done, total)),
        )
        for s in range(3)
    ]  # fmt: skip
    assert [r.state for r in results] == ["done"] * 3
    assert [r.decoded for r in results] == [r.stored for r in results] == [4, 4, 2]
    assert [r.job_state for r in results] == ["running", "running", "completed"]
    assert progress[:2] == [("q0", 1, 4), ("q1", 2, 4)] and len(progress) == N
    assert results[0].decode_ms > 0 and results[0].wall_s > 0
    rows = stored(engine, job_id)
    assert [r["sample_id"] for r in rows] == [f"q{i}" for i in range(N)]
    assert {(r["worker"], r["device"], r["status"]) for r in rows} == {(WORKER, "cpu", "ok")}
    table = read_job_parquet(out, job_id)
    assert table.column("sample_id").to_pylist() == [f"q{i}" for i in range(N)]
    assert table.column("output_text").to_pylist() == [r["output_text"] for r in rows]
    for s in range(3):
        row = shard_row(engine, job_id, s)
        assert (row["state"], row["attempts"], row["worker"]) == ("done", 1, WORKER)
        assert row["parquet_path"] == str(shard_path(out, job_id, s))
    assert db.get_job(engine, job_id)["state"] == "completed"


def test_redelivered_shard_decodes_only_what_is_missing(engine, decoder, out, small_batches):
    job_id = make_job(engine)
    crashing = Decoder(decoder, after=3, action=lambda: (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        process_shard(engine, crashing, job_id, 0, out, WORKER)
    before = stored(engine, job_id, 0)
    assert [r["sample_id"] for r in before] == ["q0", "q1"]  # one batch flushed, one lost
    assert shard_row(engine, job_id, 0)["state"] == "running"  # the process died
    assert not shard_path(out, job_id, 0).exists()

    again = Decoder(decoder)
    result = process_shard(engine, again, job_id, 0, out, "cpu0@other")
    assert again.decoded == ["q2", "q3"]
    assert (result.decoded, result.stored, result.skipped) == (2, 2, 2)
    after = stored(engine, job_id, 0)
    assert after[:2] == before  # the first attempt's rows are kept as they were
    assert [r["worker"] for r in after] == [WORKER, WORKER, "cpu0@other", "cpu0@other"]
    assert parquet_ids(out, job_id, 0) == ["q0", "q1", "q2", "q3"]  # complete, not just q2, q3
    row = shard_row(engine, job_id, 0)
    assert (row["state"], row["attempts"], row["worker"]) == ("done", 2, "cpu0@other")

    # A duplicate delivery of the finished shard decodes nothing and keeps the file whole.
    dup = Decoder(decoder)
    result = process_shard(engine, dup, job_id, 0, out, WORKER)
    assert dup.decoded == [] and (result.state, result.skipped) == ("done", 4)
    assert parquet_ids(out, job_id, 0) == ["q0", "q1", "q2", "q3"]
    assert len(stored(engine, job_id)) == 4


def test_errors_fail_the_shard_but_retryable_database_errors_do_not(engine, decoder, out):
    job_id = make_job(engine)

    def fail():
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        process_shard(engine, Decoder(decoder, after=1, action=fail), job_id, 1, out, WORKER)
    row = shard_row(engine, job_id, 1)
    assert row["state"] == "failed" and row["error"] == "OSError: disk full"

    def connection_lost():
        raise OperationalError("INSERT ...", {}, ConnectionError("server closed the connection"))

    with pytest.raises(OperationalError):  # left for the caller to retry, not failed
        process_shard(engine, Decoder(decoder, 1, connection_lost), job_id, 2, out, WORKER)
    assert shard_row(engine, job_id, 2)["state"] == "running"


def test_a_flush_retries_a_lost_connection_in_place(engine, decoder, out, monkeypatch):
    """Decoded rows wait in memory while the database is away; none is decoded again."""
    job_id = make_job(engine)
    real_insert, failures = db.insert_samples, []

    def flaky_insert(*args):
        if len(failures) < 2:
            failures.append(1)
            raise OperationalError("INSERT ...", {}, ConnectionError("server closed"))
        return real_insert(*args)

    monkeypatch.setattr(db, "insert_samples", flaky_insert)
    counting = Decoder(decoder)
    result = process_shard(engine, counting, job_id, 0, out, WORKER)
    assert len(failures) == 2 and result.state == "done"
    assert sorted(counting.decoded) == ["q0", "q1", "q2", "q3"]  # each decoded once
    assert [r["sample_id"] for r in stored(engine, job_id)] == ["q0", "q1", "q2", "q3"]


def test_the_in_place_retries_last_as_long_as_the_setting_says(engine, decoder, out, monkeypatch):
    """EAGLE2_DB_WRITE_RETRY_S=1: a database away for good is tried again for about a
    second (0.5 s, then 1 s would pass the deadline), then the error goes to the caller,
    the shard left running for it to retry."""
    job_id = make_job(engine)
    attempts = []

    def lost_insert(*_args):
        attempts.append(time.monotonic())
        raise OperationalError("INSERT ...", {}, ConnectionError("server closed"))

    monkeypatch.setattr(db, "insert_samples", lost_insert)
    monkeypatch.setenv("EAGLE2_DB_WRITE_RETRY_S", "1")
    with pytest.raises(OperationalError):
        process_shard(engine, Decoder(decoder), job_id, 0, out, WORKER)
    assert len(attempts) == 2 and 0.4 < attempts[1] - attempts[0] < 0.9
    assert shard_row(engine, job_id, 0)["state"] == "running"


@pytest.mark.parametrize("value", ["soon", "-1", "inf"])
def test_a_bad_write_retry_setting_fails_the_shard_before_decoding(
    engine, decoder, out, monkeypatch, value
):
    job_id = make_job(engine)
    monkeypatch.setenv("EAGLE2_DB_WRITE_RETRY_S", value)
    counting = Decoder(decoder)
    with pytest.raises(ValueError, match="EAGLE2_DB_WRITE_RETRY_S must be a number of seconds"):
        process_shard(engine, counting, job_id, 0, out, WORKER)
    assert counting.decoded == []
    assert shard_row(engine, job_id, 0)["state"] == "failed"


def test_failed_sample_is_stored_and_fails_the_job(engine, decoder, out):
    job_id = make_job(engine, ["t5 t6", " ".join(["t9"] * 600)])  # the second is too long
    result = process_shard(engine, decoder, job_id, 0, out, WORKER)
    assert (result.state, result.failed, result.job_state) == ("done", 1, "failed")
    rows = stored(engine, job_id)
    assert [r["status"] for r in rows] == ["ok", "failed"]
    assert "PromptError" in rows[1]["error"]
    assert pq.read_table(shard_path(out, job_id, 0)).column("status").to_pylist() == [
        "ok",
        "failed",
    ]


def test_cancelled_job_stops_and_leaves_the_shard_cancelled(engine, decoder, out, small_batches):
    job_id = make_job(engine)
    db.set_job_state(engine, job_id, "cancelled")
    untouched = Decoder(decoder)
    result = process_shard(engine, untouched, job_id, 0, out, WORKER)
    assert (result.state, result.decoded, untouched.decoded) == ("cancelled", 0, [])
    assert shard_row(engine, job_id, 0)["state"] == "cancelled"

    job_id = make_job(engine)
    cancel = Decoder(decoder, after=1, action=lambda: db.set_job_state(engine, job_id, "cancelled"))
    result = process_shard(engine, cancel, job_id, 0, out, WORKER)
    assert result.state == "cancelled" and cancel.decoded == ["q0", "q1"]  # stops at the flush
    assert [r["sample_id"] for r in stored(engine, job_id)] == ["q0", "q1"]
    assert shard_row(engine, job_id, 0)["state"] == "cancelled"
    assert not shard_path(out, job_id, 0).exists()
    assert db.get_job(engine, job_id)["state"] == "cancelled"


def test_unknown_job_is_a_clear_error(engine, decoder, out):
    with pytest.raises(JobNotFoundError, match="another EAGLE2_DATABASE_URL"):
        process_shard(engine, decoder, "no-such-job", 0, out, WORKER)


def crash_on_first_sample(decoder: SampleDecoder) -> Decoder:
    return Decoder(decoder, after=0, action=lambda: (_ for _ in ()).throw(Crash()))


def test_a_shard_whose_attempts_keep_dying_is_given_up(engine, decoder, out):
    """Each attempt dies (the process: nothing catches Crash); each next one counts it
    lost. The third loss ends it: every unfinished sample stored as failed with the last
    loss, nothing decoded, the job finished with them counted."""
    job_id = make_job(engine)
    for attempt in range(1, 4):
        with pytest.raises(Crash):
            process_shard(engine, crash_on_first_sample(decoder), job_id, 0, out, f"w{attempt}",
                          lost_after=0)  # fmt: skip
        assert shard_row(engine, job_id, 0)["lost_attempts"] == attempt - 1
    for s in (1, 2):  # the other shards are fine
        process_shard(engine, decoder, job_id, s, out, WORKER)
    untouched = Decoder(decoder)
    untouched.failed_rows = decoder.failed_rows  # what a given-up shard calls instead
    result = process_shard(engine, untouched, job_id, 0, out, "w4", lost_after=0)
    assert untouched.decoded == [] and (result.state, result.failed) == ("done", 4)
    row = shard_row(engine, job_id, 0)
    assert (row["state"], row["attempts"], row["lost_attempts"]) == ("done", 4, 3)
    rows = stored(engine, job_id, 0)
    assert [r["status"] for r in rows] == ["failed"] * 4
    assert rows[0]["error"].startswith(
        "ShardGivenUp: gave up after 3 lost attempts (max_attempts 3); the last: "
        "attempt 3 on w3 was lost: no heartbeat since "
    )
    assert (rows[0]["worker"], rows[0]["temperature"]) == ("w4", 0.0)
    assert parquet_ids(out, job_id, 0) == ["q0", "q1", "q2", "q3"]
    job = db.get_job(engine, job_id)
    assert job["state"] == "failed" and db.sample_counts(engine, job_id) == {"ok": 6, "failed": 4}


def test_max_attempts_comes_from_the_job(engine, decoder, out):
    job_id = make_job(engine)
    db.update_job(engine, job_id, params={**PARAMS, "max_attempts": 1})
    with pytest.raises(Crash):
        process_shard(engine, crash_on_first_sample(decoder), job_id, 2, out, WORKER, lost_after=0)
    result = process_shard(engine, decoder, job_id, 2, out, WORKER, lost_after=0)
    assert (result.decoded, result.failed) == (0, 2)


def test_an_attempt_with_a_fresh_heartbeat_is_not_counted_lost(engine, decoder, out):
    """A Celery retry after a database error, or a redelivery while the first attempt
    still runs, finds the shard running and beating: not a loss."""
    job_id = make_job(engine)

    def connection_lost():
        raise OperationalError("INSERT ...", {}, ConnectionError("server closed the connection"))

    with pytest.raises(OperationalError):
        process_shard(engine, Decoder(decoder, 1, connection_lost), job_id, 0, out, WORKER)
    result = process_shard(engine, decoder, job_id, 0, out, WORKER)  # the stall limit: 60 s
    assert result.state == "done" and shard_row(engine, job_id, 0)["lost_attempts"] == 0


def test_the_heartbeat_beats_while_a_sample_takes_long(engine, decoder, out, monkeypatch):
    monkeypatch.setenv("EAGLE2_HEARTBEAT_S", "0.05")
    job_id = make_job(engine)
    beats = []

    def slow() -> None:  # one sample taking long, between two rows
        first = shard_row(engine, job_id, 1)["heartbeat_at"]
        time.sleep(0.5)
        beats.append((first, shard_row(engine, job_id, 1)["heartbeat_at"]))

    process_shard(engine, Decoder(decoder, after=1, action=slow), job_id, 1, out, WORKER)
    [(first, later)] = beats
    assert later > first  # stamped from the thread, no row flushed meanwhile
