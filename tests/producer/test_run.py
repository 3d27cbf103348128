"""`eagle2-batch run` end to end through the real console script: a tiny random Llama and
a random draft head saved to disk, SQLite and Parquet under --out, no Redis, no Postgres;
vanilla and EAGLE-2, an interrupted run resumed by running it again."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from eagle2_core.engine import Engine
from producer.cli import main
from producer.jobs import JobSpec
from producer.local_run import _rows_line
from tests.eagle2_core.tiny import device_costs, tiny_head, tiny_target
from tests.producer.test_jobs import save_tiny_model
from workers import db
from workers.decoding import SampleDecoder
from workers.job_settings import JobSettings
from workers.parquet_sink import read_job_parquet

EAGLE2_BATCH = str(Path(sys.executable).parent / "eagle2-batch")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    model, head = save_tiny_model(tmp_path_factory.mktemp("tiny"))
    assert head is not None
    return model, head


def write_prompts(path: Path, n: int, bad: bool = True) -> Path:
    lines = [
        json.dumps({"id": f"p{i}", "prompt": f"t{5 + i % 50} t{7 + i % 30}"}) for i in range(n)
    ]
    if bad:
        lines.insert(2, '{"id": "broken", "prompt": ')
    path.write_text("\n".join(lines) + "\n")
    return path


def run_env() -> dict[str, str]:
    """The embedded default: no database or output settings from the environment."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("EAGLE2_") or k == "EAGLE2_CACHE_DIR"
    }
    env["OMP_NUM_THREADS"] = "1"  # tiny models: 2 threads spin-wait on a busy machine
    return env


def stored_samples(database_file: Path) -> int | str:
    """Rows in `samples`, read on a connection of its own (nothing pooled in this process);
    the error's text while `run` has not created the file or the table yet."""
    if not database_file.exists():
        return "no file"  # connecting first would create the file `run` sets up
    try:
        with closing(sqlite3.connect(database_file, timeout=10)) as conn:
            return conn.execute("SELECT count(*) FROM samples").fetchone()[0]
    except sqlite3.Error as exc:
        return str(exc)


def run_cli(*args: str, cwd: Path, cache: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = run_env()
    if cache is not None:
        env["EAGLE2_CACHE_DIR"] = str(cache)
    return subprocess.run(
        [EAGLE2_BATCH, "run", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def start_run(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    """`eagle2-batch run ARGS` in the background, output piped, Ctrl-C as a terminal's."""
    return subprocess.Popen(
        [EAGLE2_BATCH, "run", *args],
        env=run_env(),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell starts background jobs (`.ci/run &`) with SIGINT ignored, and Python
        # keeps it ignored: give `run` the default, as a terminal's Ctrl-C would find it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def verify(out: Path, job_id: str) -> dict:
    result = CliRunner().invoke(
        main,
        [
            "verify",
            job_id,
            "--out",
            str(out),
            "--db-url",
            f"sqlite:///{out / 'eagle2.db'}",
            "--json",
        ],
    )
    report = json.loads(result.stdout)
    assert result.exit_code == (0 if report["ok"] else 1)
    return report


def test_run_vanilla_then_again_resumes_nothing_and_new_job_starts_over(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model, _ = tiny
    prompts = write_prompts(tmp_path / "prompts.jsonl", 7)
    out = tmp_path / "out"
    args = [str(prompts), "--out", str(out), "--model", str(model), "--mode", "vanilla"]
    args += ["--max-new-tokens", "4", "--shard-size", "3"]

    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip().splitlines()[-1]
    assert f"job {job_id}  state=completed" in done.stdout
    assert "expected 7  stored 7  rejected lines 1" in done.stdout
    assert "line 3: invalid JSON" in done.stderr
    assert f"Parquet: {out / f'job={job_id}'}" in done.stdout

    table = read_job_parquet(out, job_id)
    assert sorted(table.column("sample_id").to_pylist()) == [f"p{i}" for i in range(7)]
    assert set(table.column("mode").to_pylist()) == {"vanilla"}
    assert set(table.column("status").to_pylist()) == {"ok"}
    assert all(0 < n <= 4 for n in table.column("completion_tokens").to_pylist())
    assert len(list((out / f"job={job_id}").glob("shard=*.parquet"))) == 3
    assert verify(out, job_id)["ok"]

    again = run_cli(*args, cwd=tmp_path)  # a finished job is not resumed: a new one runs
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip().splitlines()[-1] != job_id
    assert "resuming" not in again.stderr


def test_run_eagle2_with_a_draft_head(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    model, head = tiny
    prompts = write_prompts(tmp_path / "prompts.jsonl", 4, bad=False)
    out = tmp_path / "out"
    done = run_cli(
        str(prompts), "--out", str(out), "--model", str(model), "--draft", str(head),
        "--max-new-tokens", "5", "--total-tokens", "8", "--tree-depth", "3", "--tree-width", "3",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip().splitlines()[-1]
    assert f"draft={head}  mode=eagle2" in done.stdout
    assert "verify cycles by drafted tokens accepted" in done.stdout
    table = read_job_parquet(out, job_id)
    assert table.num_rows == 4
    assert set(table.column("mode").to_pylist()) == {"eagle2"}
    assert set(table.column("draft").to_pylist()) == {str(head)}
    assert sum(table.column("n_cycles").to_pylist()) > 0  # draft + verify cycles ran
    meta = pq.read_schema(next((out / f"job={job_id}").glob("*.parquet"))).metadata
    assert json.loads(meta[b"params"])["total_tokens"] == 8


def test_run_in_bf16_is_stored_with_the_job_and_on_every_row(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model, head = tiny
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3, bad=False)
    out = tmp_path / "out"
    done = run_cli(
        str(prompts), "--out", str(out), "--model", str(model), "--draft", str(head),
        "--max-new-tokens", "5", "--total-tokens", "6", "--dtype", "bf16", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "sequences at once" in done.stderr  # --batch-size auto, from the cost table
    job_id = done.stdout.strip().splitlines()[-1]
    table = read_job_parquet(out, job_id)
    assert set(table.column("device").to_pylist()) == {"cpu bf16"}
    assert set(table.column("status").to_pylist()) == {"ok"}
    meta = pq.read_schema(next((out / f"job={job_id}").glob("*.parquet"))).metadata
    assert json.loads(meta[b"params"])["dtype"] == "bf16"


def test_auto_trees_measure_the_machine_once_and_say_so(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model, head = tiny
    cache = tmp_path / "cache"
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3, bad=False)
    args = [str(prompts), "--model", str(model), "--draft", str(head), "--max-new-tokens", "4"]
    first = run_cli(*args, "--out", str(tmp_path / "a"), cwd=tmp_path, cache=cache)
    assert first.returncode == 0, first.stderr
    assert "measuring this machine's forward costs" in first.stderr
    assert len(list((cache / "costs").glob("*.json"))) == 1
    second = run_cli(*args, "--out", str(tmp_path / "b"), cwd=tmp_path, cache=cache)
    assert second.returncode == 0, second.stderr
    assert "measuring" not in second.stderr  # read from the cache


def test_interrupted_run_resumes_where_it_stopped(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    model, _ = tiny
    # One sample at a time and enough of them that the interrupt lands mid-job.
    prompts = write_prompts(tmp_path / "prompts.jsonl", 120)
    out = tmp_path / "out"
    args = [str(prompts), "--out", str(out), "--model", str(model), "--mode", "vanilla"]
    args += ["--max-new-tokens", "24", "--shard-size", "5", "--batch-size", "1"]
    process = start_run(args, cwd=tmp_path)
    database_file = out / "eagle2.db"
    engine = db.make_engine(f"sqlite:///{database_file}")
    try:
        deadline = time.monotonic() + 300
        polls: list[int | str] = []
        # Until the first shard (5 samples, written together) is stored.
        while not (polls and isinstance(polls[-1], int) and polls[-1] >= 5):
            assert process.poll() is None, (polls[-20:], process.communicate()[1][-2000:])
            assert time.monotonic() < deadline, polls[-20:]
            time.sleep(0.1)
            polls.append(stored_samples(database_file))
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 130, stderr
        assert "interrupted: run the same command to resume job" in stderr
        job_id = db.latest_job_id(engine)
        assert job_id is not None
        job = db.get_job(engine, job_id)
        assert job is not None and job["state"] == "running"
        left = db.missing_shards(engine, job_id)
        assert left and 0 not in left

        done = run_cli(*args, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert f"resuming job {job_id}: " in done.stderr
        assert done.stdout.strip().splitlines()[-1] == job_id
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(db.jobs_t)).scalar() == 1
        report = verify(out, job_id)
        assert report["ok"] and report["database_rows"] == report["parquet_rows"] == 120
    finally:
        if process.poll() is None:
            process.kill()
        engine.dispose()


def test_run_dry_run_and_strict_write_nothing(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    model, _ = tiny
    prompts = write_prompts(tmp_path / "prompts.jsonl", 5)
    out = tmp_path / "out"
    base = ["run", str(prompts), "--out", str(out), "--model", str(model), "--mode", "vanilla"]
    unset: dict[str, str | None] = {"EAGLE2_DATABASE_URL": None, "EAGLE2_OUTPUT_DIR": None}
    result = CliRunner().invoke(main, [*base, "--dry-run"], env=unset)
    assert result.exit_code == 0, result.output
    assert "lines     6\ngood      5\nrejected  1\nshards    1" in result.stdout
    result = CliRunner().invoke(main, [*base, "--strict"], env=unset)
    assert result.exit_code == 1 and "--strict: 1 bad line in" in result.stderr
    assert not out.exists() or not any(out.glob("job=*"))


def test_stop_strings_per_line_and_per_job_cut_the_stored_answers(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model, head = tiny
    prompts = write_prompts(tmp_path / "prompts.jsonl", 12, bad=False)
    base = ["--model", str(model), "--draft", str(head), "--max-new-tokens", "12"]
    full = run_cli(str(prompts), "--out", str(tmp_path / "full"), *base, cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    rows = read_job_parquet(tmp_path / "full", full.stdout.split()[-1]).to_pylist()
    texts = {r["sample_id"]: r["output_text"] for r in rows if len(r["output_text"].split()) > 1}
    assert len(texts) >= 3
    # a stop across the first token boundary of each answer ("8 t6" in "t58 t66 ..")
    stops = {i: t.split()[0][-1] + " " + t.split()[1][:2] for i, t in texts.items()}
    p0, p1, p2 = sorted(texts)[:3]
    lines = [json.loads(line) for line in prompts.read_text().splitlines()]
    lines = [line for line in lines if line["id"] in (p0, p1, p2)]
    lines[0]["stop"] = stops[p0]  # a line's own stop
    lines[1]["stop"] = ["never", stops[p1]]
    lines.append({"id": "bad", "prompt": "t5", "stop": ["a", "b", "c", "d", "e"]})
    (tmp_path / "stops.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    job = ["--out", str(out), *base, "--stop", stops[p2]]  # the third takes the job's
    done = run_cli(str(tmp_path / "stops.jsonl"), *job, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert 'line 4: field "stop": expected a non-empty string or a list of 1 to 4' in done.stderr
    stored = {r["sample_id"]: r for r in read_job_parquet(out, done.stdout.split()[-1]).to_pylist()}
    assert sorted(stored) == [p0, p1, p2]
    for sample_id, row in stored.items():
        text = texts[sample_id]
        assert row["output_text"] == text[: text.index(stops[sample_id])]
        assert row["finish_reason"] == "stop"
    five = [x for s in "abcde" for x in ("--stop", s)]
    too_many = run_cli(str(prompts), "--out", str(out), *base, *five, cwd=tmp_path)
    assert too_many.returncode == 2
    assert "--stop: expected a non-empty string or a list of 1 to 4" in too_many.stderr


def test_n_completions_per_line_and_per_job_are_seeded_and_reproducible(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    model, head = tiny
    lines = [
        {"id": "a", "prompt": "t5 t7", "n": 3},
        {"id": "b", "prompt": "t9 t11"},  # the job's --n 2
        {"id": "c", "prompt": "t13", "n": 1, "seed": 4},
        {"id": "zero", "prompt": "t5", "n": 0},
        {"id": "neg", "prompt": "t5", "n": -1},
        {"id": "big", "prompt": "t5", "n": 1000},
        {"id": "float", "prompt": "t5", "n": 2.5},
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = [str(prompts), "--model", str(model), "--draft", str(head), "--max-new-tokens", "8"]
    args += ["--temperature", "1", "--seed", "11", "--n", "2", "--shard-size", "2"]
    first = run_cli(*args, "--out", str(tmp_path / "one"), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    for line_no, got in ((4, "0"), (5, "-1"), (6, "1000"), (7, "2.5")):
        assert f'line {line_no}: field "n": expected an integer from 1 to 128, got {got}' in (
            first.stderr
        )
    assert "expected 6  stored 6 (completions of 3 requests)  rejected lines 4" in first.stdout
    job_id = first.stdout.split()[-1]
    rows = read_job_parquet(tmp_path / "one", job_id).to_pylist()
    ids = ["a#0", "a#1", "a#2", "b#0", "b#1", "c"]
    assert sorted(r["sample_id"] for r in rows) == ids
    by_id = {r["sample_id"]: r for r in rows}
    assert [(by_id[i]["request_id"], by_id[i]["choice_index"]) for i in ids] == [
        ("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("c", 0)
    ]  # fmt: skip
    seeds = [by_id[i]["seed"] for i in ids]
    assert seeds[0] == seeds[3] == 11 and seeds[5] == 4  # the first keeps the seed
    assert len(set(seeds[:3])) == 3 and seeds[1] == seeds[4]  # then derived from seed and k
    assert len({by_id[i]["output_text"] for i in ids[:3]}) == 3  # three different samples
    assert verify(tmp_path / "one", job_id)["manifest"] == 6

    again = run_cli(*args, "--out", str(tmp_path / "two"), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    rerun = read_job_parquet(tmp_path / "two", again.stdout.split()[-1]).to_pylist()
    assert {r["sample_id"]: r["output_text"] for r in rerun} == {
        i: by_id[i]["output_text"] for i in ids
    }  # every completion reproduced

    greedy = run_cli(
        str(prompts), "--model", str(model), "--mode", "vanilla", "--n", "2", "--dry-run",
        cwd=tmp_path,
    )  # fmt: skip
    assert greedy.returncode == 0, greedy.stderr
    assert "note: 2 requests with n > 1 decode greedily" in greedy.stderr
    assert "samples   6 (completions: n per request)" in greedy.stdout


@pytest.mark.faults
def test_ctrl_c_at_random_moments_loses_and_duplicates_nothing(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """Ctrl-C at random moments of `run` (starting, creating the job, decoding, storing),
    each time followed by the same command: every interrupt ends cleanly, and the job that
    finally completes holds every sample once."""
    model, _ = tiny
    prompts = write_prompts(tmp_path / "prompts.jsonl", 1000)
    out = tmp_path / "out"
    args = [str(prompts), "--out", str(out), "--model", str(model), "--mode", "vanilla"]
    args += ["--max-new-tokens", "32", "--shard-size", "1", "--batch-size", "1"]
    rng = random.Random(0)
    endings: list[tuple[float, int, str]] = []
    job_id = None
    for _ in range(10):
        process = start_run(args, cwd=tmp_path)
        delay = rng.uniform(0.3, 3.5)  # decoding starts after about 1.5 s
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
        if process.returncode == 0:  # a fast machine finished the job before the signal
            job_id = stdout.strip().splitlines()[-1]
            break
        endings.append((round(delay, 2), process.returncode, stderr.strip().splitlines()[-1]))
    print(*endings, sep="\n")
    resumable = "interrupted: run the same command to resume job"
    for _delay, code, last in endings:  # in the imports, before run_job: click's own ending
        assert (code == 130 and last.startswith(resumable)) or (code, last) == (1, "Aborted!")
    if job_id is None:
        done = run_cli(*args, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        job_id = done.stdout.strip().splitlines()[-1]
    report = verify(out, job_id)
    assert report["ok"] and report["database_rows"] == report["parquet_rows"] == 1000
    engine = db.make_engine(f"sqlite:///{out / 'eagle2.db'}")
    with engine.connect() as conn:
        jobs = conn.execute(select(db.jobs_t.c.id, db.jobs_t.c.state)).all()
    engine.dispose()
    assert jobs == [(job_id, "completed")]


def test_run_says_where_no_draft_tree_could_pay_at_its_batch() -> None:
    """A node costs 4 ms on a 10 ms forward: one row drafts, sixteen decode plain, and
    `run` says so before decoding (their stats will show tau 1.00). Fixed trees draft."""
    target = tiny_target(eos=None)
    engine = Engine(target, tiny_head(target))
    engine._costs = device_costs(verify_per_node_ms=4.0, draft_ms=1.0)
    decoder = SampleDecoder(engine, model="tiny", draft="random")
    auto = JobSpec("tiny", "random", "eagle2", JobSettings())
    assert _rows_line(decoder, auto, 1) == "decoding up to 1 sequences at once"
    assert _rows_line(decoder, auto, 16) == (
        "decoding up to 16 sequences at once, plain: no draft tree could pay at 16 rows on "
        "this machine"
    )
    fixed = JobSpec("tiny", "random", "eagle2", JobSettings({"total_tokens": 8}))
    assert _rows_line(decoder, fixed, 16) == "decoding up to 16 sequences at once"
