"""`submit`, `status`, `cancel`, `resume`, `verify` through the CLI against real databases.

Commands that enqueue run as real `eagle2-batch` processes against a fresh Postgres
database and a dedicated Redis database (14, flushed by these tests only), so the
queue can be read back exactly; the others run in-process with click's CliRunner.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result
from sqlalchemy import Engine, delete, func, select, update

from migrations import upgrade
from producer.cli import main
from tests.producer.test_jobs import save_tiny_model
from workers import db
from workers.celery_app import queue_for
from workers.parquet_sink import shard_path, write_shard_parquet

BROKER_URL = "redis://127.0.0.1:6379/14"
EAGLE2_BATCH = str(Path(sys.executable).parent / "eagle2-batch")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("model"), with_draft=False)[0]


@pytest.fixture
def broker() -> Iterator[redis.Redis]:
    """Redis database 14, empty before and after the test."""
    client = redis.Redis.from_url(BROKER_URL)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def pg_url(make_pg_database: Callable[[], str]) -> str:
    url = make_pg_database()
    upgrade(url)
    return url


def write_input(path: Path, n_good: int, bad_at: tuple[int, ...] = ()) -> Path:
    """n_good prompt lines s0.. with a bad line inserted at each (1-based) line of bad_at."""
    lines = [json.dumps({"id": f"s{i}", "prompt": "t5 t6"}) for i in range(n_good)]
    for line_no in sorted(bad_at):
        lines.insert(line_no - 1, json.dumps({"id": f"bad{line_no}", "prompt": ""}))
    path.write_text("\n".join(lines) + "\n")
    return path


def cli(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def cli_process(
    *args: str, db_url: str, cwd: Path, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """The real console script, with its own environment (broker on Redis db 14)."""
    env = {
        **os.environ,
        "EAGLE2_DATABASE_URL": db_url,
        "EAGLE2_BROKER_URL": BROKER_URL,
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [EAGLE2_BATCH, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def queued_shards(client: redis.Redis, queue: str) -> list[tuple[str, int]]:
    """(job id, shard) of every task message waiting in a queue."""
    out = []
    for raw in client.lrange(queue, 0, -1):
        message = json.loads(raw)
        assert message["headers"]["task"] == "eagle2.run_shard"
        args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        out.append((args[0], args[1]))
    return sorted(out)


def count(engine: Engine, table: Any, job_id: str | None = None) -> int:
    stmt = select(func.count()).select_from(table)
    if job_id is not None:
        stmt = stmt.where(table.c.job_id == job_id)
    with engine.connect() as conn:
        return conn.execute(stmt).scalar_one()


def manifest(engine: Engine, job_id: str) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        rows = conn.execute(
            select(db.requests_t)
            .where(db.requests_t.c.job_id == job_id)
            .order_by(db.requests_t.c.line_no)
        )
        return [dict(r) for r in rows.mappings()]


def store(engine: Engine, fake_sample: Callable[..., dict], rows: list[dict[str, Any]]) -> None:
    """What workers would store for these manifest rows."""
    rng = random.Random(0)
    db.insert_samples(engine, [fake_sample(r, rng) for r in rows])


# --------------------------------------------------------------------------- dry run, strict


def test_help_of_every_command_has_an_example() -> None:
    for command in ("submit", "status", "cancel", "resume", "verify", "run"):
        result = cli(command, "--help")
        assert result.exit_code == 0
        assert "Example" in result.output and f"eagle2-batch {command}" in result.output
    shared = cli("submit", "--help").output
    for option in (
        "--model",
        "--draft",
        "--mode",
        "--max-new-tokens",
        "--temperature",
        "--top-p",
        "--seed",
        "--total-tokens",
        "--tree-depth",
        "--tree-width",
        "--top-k",
        "--min-p",
        "--repetition-penalty",
        "--presence-penalty",
        "--frequency-penalty",
        "--logit-bias",
        "--stop-token-id",
        "--min-tokens",
        "--logprobs",
        "--response-format",
        "--shard-size",
        "--strict",
        "--dry-run",
        "--db-url",
        "--out",
    ):
        assert option in shared and option in cli("run", "--help").output


@pytest.mark.parametrize("value", ["0", "-3", "many", "2.5"])
def test_total_tokens_takes_auto_or_a_positive_count(
    sqlite_url: str, tiny_model: Path, tmp_path: Path, value: str
) -> None:
    path = write_input(tmp_path / "in.jsonl", 3)
    args = ["submit", str(path), "--model", str(tiny_model), "--mode", "vanilla", "--dry-run"]
    args += ["--db-url", sqlite_url]
    assert "[default: auto]" in cli("submit", "--help").output
    assert cli(*args, "--total-tokens", "auto").exit_code == 0
    assert cli(*args, "--total-tokens", "12").exit_code == 0
    bad = cli(*args, "--total-tokens", value)
    assert bad.exit_code == 2
    assert f"Invalid value for '--total-tokens': {value!r} is neither 'auto'" in bad.output


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("{", "Invalid value for '--response-format': not JSON:"),
        ('{"type": "xml"}', "type: expected one of text, json_object, json_schema"),
        ('{"type": "regex", "regex": "(a"}', "regex: expected a regular expression that compiles"),
        ('{"type": "regex", "regex": "a\\u0000"}', '"--response-format.regex": expected text'),
    ],
)
def test_response_format_is_checked_as_a_lines_is(
    sqlite_url: str, tiny_model: Path, tmp_path: Path, value: str, why: str
) -> None:
    path = write_input(tmp_path / "in.jsonl", 2)
    args = ["submit", str(path), "--model", str(tiny_model), "--mode", "vanilla", "--dry-run"]
    args += ["--db-url", sqlite_url]
    good = cli(*args, "--response-format", '{"type": "json_object"}')
    assert good.exit_code == 0, good.output
    bad = cli(*args, "--response-format", value)
    assert bad.exit_code == 2 and why in bad.output, bad.output


@pytest.mark.parametrize("as_json", [False, True])
def test_dry_run_prints_the_plan_and_writes_nothing(
    sqlite_url: str, tiny_model: Path, tmp_path: Path, as_json: bool
) -> None:
    path = write_input(tmp_path / "in.jsonl", 12, bad_at=(3, 9))
    args = ["submit", str(path), "--model", str(tiny_model), "--mode", "vanilla"]
    args += ["--shard-size", "5", "--dry-run", "--db-url", sqlite_url]
    result = cli(*args, *(["--json"] if as_json else []))
    assert result.exit_code == 0, result.output
    if as_json:
        plan = json.loads(result.stdout)
        assert (plan["lines"], plan["requests"], plan["rejected"], plan["shards"]) == (14, 12, 2, 3)
        assert plan["dry_run"] is True
    else:
        assert "lines     14\ngood      12\nrejected  2\nshards    3" in result.stdout
        assert "nothing was written or enqueued" in result.stdout
    assert "2 bad lines (nothing stored)" in result.stderr
    assert 'line 3: field "prompt"' in result.stderr and "line 9:" in result.stderr
    engine = db.make_engine(sqlite_url)
    assert count(engine, db.jobs_t) == 0
    engine.dispose()


def test_system_file_counts_in_the_length_check_and_excludes_system(
    sqlite_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    path = write_input(tmp_path / "in.jsonl", 4, bad_at=())
    args = ["submit", str(path), "--model", str(tiny_model), "--mode", "vanilla", "--dry-run"]
    args += ["--db-url", sqlite_url, "--json"]
    system = tmp_path / "system.txt"
    system.write_text("t5 " * 600, encoding="utf-8")  # longer than the tiny context
    result = cli(*args, "--system-file", str(system))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["rejected"] == 4  # every prompt now overflows
    assert "leaves no room to generate" in result.stderr
    both = cli(*args, "--system-file", str(system), "--system", "Hi")
    assert both.exit_code == 2 and "give --system or --system-file, not both" in both.output


def test_job_texts_that_cannot_be_stored_are_usage_errors(
    sqlite_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    """A command-line byte that is not UTF-8 reaches Python as a lone surrogate; a system
    file may be no UTF-8 at all. Either is a one-line usage error, before anything runs."""
    path = write_input(tmp_path / "in.jsonl", 2)
    args = ["submit", str(path), "--model", str(tiny_model), "--mode", "vanilla", "--dry-run"]
    args += ["--db-url", sqlite_url]
    for option, value, why in [
        ("--stop", "end\udcff", "--stop: expected valid Unicode text, got a lone surrogate"),
        ("--system", "\udce9t\udce9", "--system: expected valid Unicode text"),
    ]:
        result = cli(*args, option, value)
        assert result.exit_code == 2 and why in result.output, result.output
    system = tmp_path / "system.txt"
    system.write_bytes(b"caf\xe9")
    result = cli(*args, "--system-file", str(system))
    assert result.exit_code == 2
    assert f"--system-file {system}: invalid UTF-8 at byte 4 (0xe9)" in result.output
    assert "Traceback" not in result.output


@pytest.mark.integration
def test_strict_fails_before_anything_is_written_or_enqueued(
    pg_url: str, broker: redis.Redis, tiny_model: Path, tmp_path: Path
) -> None:
    path = write_input(tmp_path / "in.jsonl", 30, bad_at=(4, 17, 25))
    done = cli_process(
        "submit", str(path), "--model", str(tiny_model), "--mode", "vanilla", "--strict",
        db_url=pg_url, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1
    assert (
        "--strict: 3 bad lines" in done.stderr and "nothing was written or enqueued" in done.stderr
    )
    for line_no in (4, 17, 25):
        assert f"line {line_no}: " in done.stderr
    assert done.stdout == ""
    engine = db.make_engine(pg_url)
    for table in (db.jobs_t, db.requests_t, db.shards_t, db.rejected_lines_t):
        assert count(engine, table) == 0
    engine.dispose()
    assert broker.dbsize() == 0


# --------------------------------------------------------------------------- submit, cancel, resume


@pytest.mark.integration
def test_submit_enqueues_each_shard_and_resume_exactly_the_missing_ones(
    pg_url: str,
    broker: redis.Redis,
    tiny_model: Path,
    tmp_path: Path,
    fake_sample: Callable[..., dict],
) -> None:
    path = write_input(tmp_path / "in.jsonl", 23, bad_at=(2, 11))  # 25 lines, 5 shards of 5
    queue = queue_for(str(tiny_model))
    done = cli_process(
        "submit", str(path), "--model", str(tiny_model), "--mode", "vanilla",
        "--shard-size", "5", "--strict", db_url=pg_url, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1 and broker.dbsize() == 0  # strict: two bad lines

    done = cli_process(
        "submit", str(path), "--model", str(tiny_model), "--mode", "vanilla",
        "--shard-size", "5", db_url=pg_url, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip().splitlines()[-1]
    assert queued_shards(broker, queue) == [(job_id, s) for s in range(5)]
    assert "2 bad lines (all stored" in done.stderr and "line 11:" in done.stderr
    assert f"23 samples in 5 shards queued on {queue}" in done.stderr

    engine = db.make_engine(pg_url)
    rows = manifest(engine, job_id)
    assert len(rows) == 23 and count(engine, db.rejected_lines_t, job_id) == 2
    broker.flushdb()
    # Workers finished shards 0 and 1 and stored 2 samples of shard 3, then the job stopped.
    by_shard = {s: [r for r in rows if r["shard"] == s] for s in range(5)}
    store(engine, fake_sample, by_shard[0] + by_shard[1] + by_shard[3][:2])
    for s in (0, 1):
        db.set_shard_state(engine, job_id, s, "done")
    db.set_shard_state(engine, job_id, 3, "running")

    result = cli("cancel", job_id, "--db-url", pg_url)
    assert result.exit_code == 0, result.output
    assert f"cancelled job {job_id} (3 unfinished shards)" in result.output
    status = json.loads(cli("status", job_id, "--json", "--db-url", pg_url).output)
    states = {s["shard"]: s["state"] for s in status["shards"]}
    assert states == {0: "done", 1: "done", 2: "cancelled", 3: "cancelled", 4: "cancelled"}
    assert db.get_job(engine, job_id)["state"] == "cancelled"  # type: ignore[index]
    again = cli("cancel", job_id, "--db-url", pg_url)
    assert again.exit_code == 1 and "is cancelled: nothing to cancel" in again.output

    done = cli_process("resume", job_id, db_url=pg_url, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"re-enqueued 3 shards on {queue}" in done.stdout
    assert queued_shards(broker, queue) == [(job_id, 2), (job_id, 3), (job_id, 4)]
    status = json.loads(cli("status", job_id, "--json", "--db-url", pg_url).output)
    assert status["state"] == "queued"
    assert {s["shard"]: s["state"] for s in status["shards"]} == {
        0: "done", 1: "done", 2: "queued", 3: "queued", 4: "queued"
    }  # fmt: skip
    assert count(engine, db.samples_t, job_id) == 4 + 5 + 2  # nothing stored was touched

    broker.flushdb()
    store(engine, fake_sample, by_shard[2] + by_shard[3][2:] + by_shard[4])
    for s in (2, 3, 4):  # the workers finished these shards (Parquet written)
        db.set_shard_state(engine, job_id, s, "done")
    done = cli_process("resume", job_id, db_url=pg_url, cwd=tmp_path)
    assert done.returncode == 0 and "nothing to do" in done.stdout
    assert broker.dbsize() == 0
    assert db.get_job(engine, job_id)["state"] == "completed"  # type: ignore[index]
    engine.dispose()


@pytest.mark.integration
def test_status_shows_a_stalled_shard_and_resume_reclaims_it(
    pg_url: str, broker: redis.Redis, tiny_model: Path, tmp_path: Path
) -> None:
    path = write_input(tmp_path / "in.jsonl", 10)
    done = cli_process(
        "submit", str(path), "--model", str(tiny_model), "--mode", "vanilla",
        "--shard-size", "5", "--max-attempts", "5", db_url=pg_url, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip().splitlines()[-1]
    broker.flushdb()  # both messages taken; shard 1's worker died, its heartbeat went quiet
    engine = db.make_engine(pg_url)
    assert db.get_job(engine, job_id)["params"]["max_attempts"] == 5  # type: ignore[index]
    db.set_shard_state(engine, job_id, 1, "running", worker="cpu0@gone")
    with engine.begin() as conn:
        conn.execute(
            update(db.shards_t)
            .where(db.shards_t.c.job_id == job_id, db.shards_t.c.shard == 1)
            .values(heartbeat_at=datetime.now(UTC) - timedelta(minutes=5))
        )
    text = cli("status", job_id, "--db-url", pg_url).output
    assert "shards: 1 queued, 1 stalled" in text
    assert "1 stalled: running with no heartbeat for over 60 s" in text
    assert "eagle2-batch resume" in text

    done = cli_process("resume", job_id, db_url=pg_url, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    queue = queue_for(str(tiny_model))
    assert f"re-enqueued 2 shards on {queue} (1 had stalled" in done.stdout
    assert queued_shards(broker, queue) == [(job_id, 0), (job_id, 1)]
    status = json.loads(cli("status", job_id, "--json", "--db-url", pg_url).output)
    stalled = status["shards"][1]
    assert (stalled["state"], stalled["lost_attempts"]) == ("queued", 1)
    assert stalled["error"].startswith("attempt 1 on cpu0@gone was lost: no heartbeat since")
    engine.dispose()


@pytest.mark.integration
def test_resume_from_skips_what_the_old_job_did(
    pg_url: str,
    broker: redis.Redis,
    tiny_model: Path,
    tmp_path: Path,
    make_job: Callable[..., tuple[str, list[dict[str, Any]]]],
    fake_sample: Callable[..., dict],
    failed_sample: Callable[..., dict],
) -> None:
    engine = db.make_engine(pg_url)
    old_job, old_rows = make_job(engine, n=10, shard_size=4)  # sample ids q0..q9
    rng = random.Random(1)
    db.insert_samples(
        engine,
        [fake_sample(r, rng) for r in old_rows[:6]] + [failed_sample(old_rows[6])],
    )
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": "t5"}) + "\n" for i in range(10)))
    done = cli_process(
        "submit", str(path), "--model", str(tiny_model), "--mode", "vanilla",
        "--shard-size", "3", "--resume-from", old_job, "--json", db_url=pg_url, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["requests"], result["skipped"], result["shards"]) == (4, 6, 2)
    job_id = result["job_id"]
    assert [r["sample_id"] for r in manifest(engine, job_id)] == ["q6", "q7", "q8", "q9"]
    assert queued_shards(broker, result["queue"]) == [(job_id, 2), (job_id, 3)]
    assert db.get_job(engine, job_id)["params"]["resume_from"] == old_job  # type: ignore[index]
    engine.dispose()


@pytest.mark.integration
def test_submit_wait_follows_the_job_and_fails_on_failed_samples(
    pg_url: str,
    broker: redis.Redis,
    tiny_model: Path,
    tmp_path: Path,
    fake_sample: Callable[..., dict],
    failed_sample: Callable[..., dict],
) -> None:
    path = write_input(tmp_path / "in.jsonl", 8)
    env = {**os.environ, "EAGLE2_DATABASE_URL": pg_url, "EAGLE2_BROKER_URL": BROKER_URL}
    args = [EAGLE2_BATCH, "submit", str(path), "--model", str(tiny_model), "--mode", "vanilla"]
    process = subprocess.Popen(
        [*args, "--shard-size", "4", "--wait"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    engine = db.make_engine(pg_url)
    try:
        deadline = time.monotonic() + 240
        while not broker.llen(queue_for(str(tiny_model))) == 2:  # enqueued: now waiting
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.5)
        job_id = db.latest_job_id(engine)
        assert job_id is not None
        rows = manifest(engine, job_id)
        time.sleep(3)
        assert process.poll() is None  # still waiting for the workers
        rng = random.Random(2)
        db.insert_samples(engine, [fake_sample(r, rng) for r in rows[:7]])
        db.insert_samples(engine, [failed_sample(rows[7], "ValueError: boom")])
        for s in (0, 1):  # as the workers would, once their Parquet files are written
            db.set_shard_state(engine, job_id, s, "done")
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
        engine.dispose()
    assert process.returncode == 1
    assert stdout.strip().splitlines()[-1] == job_id
    assert f"1 of 8 samples failed in job {job_id}" in stderr
    assert "8/8" in stderr  # the progress bar reached the end


# --------------------------------------------------------------------------- status, verify


def test_status_counts_throughput_and_shards(
    engine: Engine,
    db_url: str,
    make_job: Callable[..., tuple[str, list[dict[str, Any]]]],
    fake_sample: Callable[..., dict],
    failed_sample: Callable[..., dict],
) -> None:
    job_id, rows = make_job(engine, n=10, shard_size=4)  # shards 0..2
    db.insert_shards(
        engine,
        [
            {"job_id": job_id, "shard": s, "line_start": 4 * s + 1, "line_end": 4 * s + 4,
             "n_samples": len([r for r in rows if r["shard"] == s])}
            for s in range(3)
        ],
    )  # fmt: skip
    db.insert_rejected_lines(
        engine, [{"job_id": job_id, "line_no": 11, "sample_id": None, "reason": "invalid JSON"}]
    )
    db.update_job(engine, job_id, n_rejected=1)
    db.set_shard_state(engine, job_id, 0, "running", worker="w1@host")
    db.set_shard_state(engine, job_id, 0, "done", worker="w1@host")
    db.set_shard_state(engine, job_id, 1, "running", worker="w2@host")
    db.set_job_state(engine, job_id, "running")
    rng = random.Random(0)
    db.insert_samples(
        engine,
        [fake_sample(r, rng) for r in rows[:5]] + [failed_sample(rows[5])],
    )

    result = cli("status", job_id, "--json", "--db-url", db_url)
    assert result.exit_code == 0, result.output
    status = json.loads(result.output)
    assert (status["expected"], status["done"], status["ok"], status["failed"]) == (10, 6, 5, 1)
    assert (status["remaining"], status["rejected"], status["state"]) == (4, 1, "running")
    assert status["samples_per_s"] > 0 and status["eta_s"] > 0 and status["tokens_per_s"] > 0
    assert status["shard_states"] == {"done": 1, "running": 1, "queued": 1}
    assert [(s["shard"], s["stored"], s["samples"]) for s in status["shards"]] == [
        (0, 4, 4),
        (1, 2, 4),
        (2, 0, 2),
    ]

    by_prefix = json.loads(cli("status", job_id[:6], "--json", "--db-url", db_url).output)
    assert (by_prefix["job_id"], by_prefix["done"]) == (job_id, 6)
    text = cli("status", "--db-url", db_url).output  # default: the latest job
    assert f"job {job_id}  running" in text
    assert "expected 10  done 6 (ok 5, failed 1)  remaining 4  rejected lines 1" in text
    assert "samples/s" in text and "ETA" in text
    assert "1 done, 1 queued, 1 running" in text
    assert "      1  running    5-8                      2/4      1     0  w2@host" in text
    rejected = cli("status", job_id, "--rejected", "--db-url", db_url)
    assert rejected.output == "line 11: invalid JSON\n"

    db.insert_samples(engine, [fake_sample(r, rng) for r in rows[6:]])
    for s in (1, 2):  # the workers finished their shards
        db.set_shard_state(engine, job_id, s, "done")
    watched = cli("status", job_id, "--watch", "--interval", "0.1", "--db-url", db_url)
    assert watched.exit_code == 0 and f"job {job_id}  failed" in watched.output  # ends at once
    assert cli("status", "nope", "--db-url", db_url).exit_code == 1


def test_status_on_an_empty_or_unmigrated_database(tmp_path: Path, sqlite_url: str) -> None:
    result = cli("status", "--db-url", sqlite_url)
    assert result.exit_code == 1 and "no jobs yet" in result.output
    bare = f"sqlite:///{tmp_path / 'bare.db'}"
    result = cli("status", "--db-url", bare)
    assert result.exit_code == 1 and "eagle2-batch db upgrade" in result.output


def _write_parquet(engine: Engine, out: Path, job_id: str, shards: list[int]) -> None:
    for s in shards:
        write_shard_parquet(out, job_id, s, db.iter_samples(engine, job_id, shard=s), {})


def test_verify_finds_missing_duplicate_and_extra_rows(
    engine: Engine,
    db_url: str,
    make_job: Callable[..., tuple[str, list[dict[str, Any]]]],
    fake_sample: Callable[..., dict],
    tmp_path: Path,
) -> None:
    job_id, rows = make_job(engine, n=10, shard_size=4)
    store(engine, fake_sample, rows)
    out = tmp_path / "out"
    _write_parquet(engine, out, job_id, [0, 1, 2])
    args = ["verify", job_id, "--out", str(out), "--db-url", db_url]

    result = cli(*args)
    assert result.exit_code == 0, result.output
    assert "manifest 10, database rows 10, Parquet rows 10 in 3 files" in result.output

    # A shard file written twice under another name, a lost row, a foreign sample.
    shutil.copy(shard_path(out, job_id, 1), shard_path(out, job_id, 7))
    with engine.begin() as conn:
        conn.execute(
            delete(db.samples_t).where(
                db.samples_t.c.job_id == job_id, db.samples_t.c.sample_id == "q9"
            )
        )
    stranger = fake_sample({**rows[0], "sample_id": "zz"}, random.Random(0))
    stranger["created_at"] = datetime.now(UTC)
    write_shard_parquet(out, job_id, 8, [stranger], {})
    result = cli(*args, "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False
    assert report["counts"] == {
        "missing_in_database": 1,
        "missing_in_parquet": 0,
        "duplicates_in_database": 0,
        "duplicates_in_parquet": 4,
        "extra_in_database": 0,
        "extra_in_parquet": 1,
    }
    assert report["examples"]["missing_in_database"] == ["q9"]
    assert report["examples"]["duplicates_in_parquet"] == ["q4", "q5", "q6", "q7"]
    assert report["examples"]["extra_in_parquet"] == ["zz"]
    assert "verify failed: 1 missing in database, 4 duplicates in parquet" in result.stderr

    shard_path(out, job_id, 2).unlink()
    text = cli(*args).output
    assert "missing in parquet: 2 (e.g. q8, q9)" in text


def test_verify_finds_files_where_workers_recorded_them(
    sqlite_url: str,
    make_job: Callable[..., tuple[str, list[dict[str, Any]]]],
    fake_sample: Callable[..., dict],
    tmp_path: Path,
) -> None:
    engine = db.make_engine(sqlite_url)
    job_id, rows = make_job(engine, n=4, shard_size=4)
    db.insert_shards(
        engine, [{"job_id": job_id, "shard": 0, "line_start": 1, "line_end": 4, "n_samples": 4}]
    )
    store(engine, fake_sample, rows)
    path = write_shard_parquet(
        tmp_path / "elsewhere", job_id, 0, db.iter_samples(engine, job_id, shard=0), {}
    )
    db.set_shard_state(engine, job_id, 0, "done", parquet_path=str(path))
    result = cli("verify", "--db-url", sqlite_url)
    assert result.exit_code == 0, result.output
    assert str(tmp_path / "elsewhere") in result.output
    engine.dispose()
