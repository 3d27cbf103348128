"""Real workers: two `eagle2-batch worker --cpu 1` launchers on Redis (db 13) and a fresh
Postgres database decode jobs of a tiny model saved to disk; plus the launcher's plan."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import pairwise
from pathlib import Path

import pytest
import redis
import torch
from sqlalchemy import Engine, func, select, update

from eagle2_core import models
from eagle2_core.precision import dtype_name, resolve_dtype
from migrations import upgrade
from producer.status import format_status, job_status
from tests.workers.manifests import store_job
from tests.workers.test_decoding import save_tiny_model
from workers import db, launcher, tasks
from workers.celery_app import queue_for, visibility_timeout
from workers.head_versions import versions
from workers.launcher import LaunchError, plan_workers, select_gpus, visible_gpus
from workers.parquet_sink import read_job_parquet
from workers.request import Request
from workers.schema import utcnow
from workers.shards import RETRYABLE_DB_ERRORS

REDIS_DB = 13
BROKER_URL = f"redis://127.0.0.1:6379/{REDIS_DB}"
EAGLE2_BATCH = str(Path(sys.executable).parent / "eagle2-batch")
HOSTS = ("it-w1", "it-w2")
SHARD_SIZE = 5

# A producer process: enqueue "job:shard" pairs with the real helper; print the start time.
ENQUEUE = """
import sys, time
from workers.tasks import enqueue_shards
model, pairs = sys.argv[1], [p.rsplit(":", 1) for p in sys.argv[2:]]
print(time.time(), flush=True)
for job_id, shard in pairs:
    enqueue_shards(job_id, [int(shard)], model)
"""


# --------------------------------------------------------------------------- launcher plan


def test_default_model_constant_matches_the_engine():
    assert launcher.DEFAULT_MODEL == models.DEFAULT_MODEL


def test_queue_names():
    assert queue_for("smollm2-135m") == "eagle2.smollm2-135m"
    assert queue_for("meta-llama/Llama-3.1-8B") == "eagle2.meta-llama-Llama-3.1-8B"
    assert queue_for("/models/my model/") == "eagle2.models-my-model"
    with pytest.raises(ValueError):
        queue_for("///")


def test_visibility_timeout_from_environment(monkeypatch):
    monkeypatch.delenv("EAGLE2_VISIBILITY_TIMEOUT", raising=False)
    assert visibility_timeout() == 21600
    monkeypatch.setenv("EAGLE2_VISIBILITY_TIMEOUT", "54000")
    assert visibility_timeout() == 54000
    monkeypatch.setenv("EAGLE2_VISIBILITY_TIMEOUT", "6h")
    with pytest.raises(ValueError, match="EAGLE2_VISIBILITY_TIMEOUT"):
        visibility_timeout()


def test_celery_configuration():
    conf = tasks.app.conf
    assert (conf.task_serializer, conf.result_serializer, conf.accept_content) == (
        "json",
        "json",
        ["json"],
    )
    assert conf.task_acks_late and conf.task_reject_on_worker_lost and conf.task_ignore_result
    assert conf.worker_prefetch_multiplier == 1
    assert conf.broker_connection_max_retries is None  # a long broker outage is waited out
    assert conf.broker_transport_options["visibility_timeout"] == visibility_timeout()
    assert tasks.run_shard.name == "eagle2.run_shard"
    assert tasks.run_shard.autoretry_for == RETRYABLE_DB_ERRORS and tasks.run_shard.retry_backoff


def test_visible_gpus_without_touching_cuda():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3,5"}) == ["3", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == ["0"]
    assert select_gpus("all", ["3", "5"]) == ["3", "5"]
    assert select_gpus("1", ["3", "5"]) == ["5"]
    for bad in ("2", "0,0", "x"):
        with pytest.raises(LaunchError):
            select_gpus(bad, ["3", "5"])


def test_plan_one_solo_worker_per_gpu():
    specs = plan_workers(gpus=["0", "2"], hostname="h", model="m/x", draft="/d", batch_size=24)
    assert [s.name for s in specs] == ["gpu0@h", "gpu2@h"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "2"]
    argv = specs[0].argv
    assert argv[argv.index("--pool") + 1] == "solo"
    assert argv[argv.index("--queues") + 1] == "eagle2.m-x"
    assert specs[0].env[tasks.WORKER_MODEL_ENV] == "m/x"
    assert specs[0].env[tasks.WORKER_DRAFT_ENV] == "/d"
    assert specs[0].env[tasks.WORKER_DEVICE_ENV] == "cuda"
    assert specs[1].env[tasks.WORKER_BATCH_ENV] == "24"
    assert tasks.WORKER_DTYPE_ENV not in specs[0].env  # each job's own dtype
    (bf16,) = plan_workers(gpus=["0"], hostname="h", dtype="bf16")
    assert bf16.env[tasks.WORKER_DTYPE_ENV] == "bf16"


def test_a_worker_decodes_in_the_jobs_dtype_unless_the_host_sets_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, _ = save_tiny_model(tmp_path)
    monkeypatch.setattr(tasks, "_state", tasks._ProcessState())
    monkeypatch.setenv(tasks.WORKER_DEVICE_ENV, "cpu")
    monkeypatch.delenv(tasks.WORKER_DTYPE_ENV, raising=False)
    monkeypatch.delenv(tasks.WORKER_MODEL_ENV, raising=False)
    job = {"id": "j", "model": str(model_dir), "draft": None, "mode": "vanilla"}
    bf16 = tasks.decoder_for({**job, "params": {"dtype": "bf16"}})
    assert bf16.engine.target.dtype == torch.bfloat16 and bf16.device == "cpu bf16"
    assert tasks.decoder_for({**job, "params": {"dtype": "bf16"}}) is bf16  # kept
    fp32 = tasks.decoder_for({**job, "params": {"dtype": "fp32"}})  # the target reloaded
    assert fp32.engine.target.dtype == torch.float32
    monkeypatch.setenv(tasks.WORKER_DTYPE_ENV, "bf16")  # the host's --dtype wins
    assert tasks.decoder_for({**job, "params": {"dtype": "fp32"}}).engine.target.dtype == (
        torch.bfloat16
    )


def test_plan_cpu_workers_and_default_queue():
    specs = plan_workers(cpu=2, hostname="h", cpu_count=8)
    assert [s.name for s in specs] == ["cpu0@h", "cpu1@h"]
    env = specs[1].env
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env[tasks.WORKER_DEVICE_ENV] == "cpu"
    assert env[tasks.WORKER_MODEL_ENV] == models.DEFAULT_MODEL
    assert tasks.WORKER_BATCH_ENV not in env  # the device's default
    assert specs[0].argv[specs[0].argv.index("--queues") + 1] == "eagle2.smollm2-135m"
    # With explicit queues and no model, the first shard decides the model.
    (spec,) = plan_workers(cpu=1, hostname="h", queues=["eagle2.a", "eagle2.b"])
    assert tasks.WORKER_MODEL_ENV not in spec.env
    assert spec.argv[spec.argv.index("--queues") + 1] == "eagle2.a,eagle2.b"
    with pytest.raises(LaunchError):
        plan_workers(gpus=["0"], cpu=1)


# A stand-in worker: logs the signals it gets to a file. "warm" exits 0 on SIGTERM,
# "busy" keeps going until SIGQUIT (exit 3), "crash" exits 5 on its own.
FAKE_WORKER = """
import signal, sys, time
log, mode = sys.argv[1], sys.argv[2]
def note(text):
    with open(log, "a") as fh:
        fh.write(text + "\\n")
def on_signal(signum, _frame):
    note(signal.Signals(signum).name)
    if signum == signal.SIGQUIT or mode == "warm":
        sys.exit(3 if signum == signal.SIGQUIT else 0)
signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGQUIT, on_signal)
note("ready")
time.sleep(0.5 if mode == "crash" else 60)
sys.exit(5)
"""
RUN_WORKERS = """
import json, sys
from workers.launcher import WorkerSpec, run_workers
sys.exit(run_workers([WorkerSpec(n, a) for n, a in json.loads(sys.argv[1])], poll_s=0.05))
"""


def start_fake_launcher(tmp_path: Path, modes: list[str]) -> tuple[subprocess.Popen, list[Path]]:
    logs = [tmp_path / f"w{i}.log" for i in range(len(modes))]
    specs = [
        (f"w{i}", [sys.executable, "-c", FAKE_WORKER, str(log), mode])
        for i, (log, mode) in enumerate(zip(logs, modes, strict=True))
    ]
    proc = subprocess.Popen([sys.executable, "-c", RUN_WORKERS, json.dumps(specs)])
    deadline = time.monotonic() + 120
    while not all(log.exists() for log in logs) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return proc, logs


def test_launcher_turns_ctrl_c_into_warm_then_cold_shutdown(tmp_path):
    proc, logs = start_fake_launcher(tmp_path, ["warm", "warm"])
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    assert [log.read_text().split() for log in logs] == [["ready", "SIGTERM"]] * 2

    (tmp_path / "busy").mkdir()
    proc, (log,) = start_fake_launcher(tmp_path / "busy", ["busy"])
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None  # the running shard keeps going
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 3
    assert log.read_text().split() == ["ready", "SIGTERM", "SIGQUIT"]


def test_launcher_stops_all_when_one_worker_dies(tmp_path):
    proc, logs = start_fake_launcher(tmp_path, ["crash", "warm"])
    assert proc.wait(timeout=60) == 5
    assert logs[1].read_text().split() == ["ready", "SIGTERM"]


def test_unloadable_model_stops_the_worker_process(monkeypatch):
    monkeypatch.setenv(tasks.WORKER_MODEL_ENV, "/nonexistent/model")
    monkeypatch.setenv(tasks.WORKER_DEVICE_ENV, "cpu")
    with pytest.raises(SystemExit):
        tasks._preload_served_model()


# --------------------------------------------------------------------------- real workers


@dataclass
class Cluster:
    """Two running launchers and what the tests need to drive them."""

    engine: Engine
    env: dict[str, str]
    model: Path
    draft: Path
    out: Path
    logs: list[Path]
    launchers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    children: list[int] = field(default_factory=list)

    def tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.logs)

    def enqueue(self, pairs: list[tuple[str, int]]) -> float:
        """Enqueue from a separate producer process; returns the time it started sending."""
        out = subprocess.run(
            [sys.executable, "-c", ENQUEUE, str(self.model), *(f"{j}:{s}" for j, s in pairs)],
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        return float(out.stdout.split()[0])

    def wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            dead = [p.pid for p in self.launchers if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                pytest.fail(f"{what}: launchers exited {dead} or timed out\n{self.tail()}")
            time.sleep(0.2)

    def stop(self) -> list[int | None]:
        """SIGTERM the launchers (warm shutdown), then make sure no process is left."""
        for p in self.launchers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = []
        for p in self.launchers:
            try:
                codes.append(p.wait(timeout=180))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                codes.append(None)
        for pid in self.children:
            deadline = time.monotonic() + 30
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
                codes.append(None)
        return codes


def _children_of(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, make_pg_database) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("workers")
    model, draft = save_tiny_model(root)
    url = make_pg_database()
    upgrade(url)
    env = {
        **os.environ,
        "EAGLE2_DATABASE_URL": url,
        "EAGLE2_BROKER_URL": BROKER_URL,
        "EAGLE2_OUTPUT_DIR": str(root / "out"),
        # Two 1-thread workers on this 2-core machine: more threads only spin-wait.
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    c = Cluster(db.make_engine(url), env, model, draft, root / "out", [])
    try:
        for host in HOSTS:
            log = root / f"{host}.log"
            c.logs.append(log)
            argv = [EAGLE2_BATCH, "worker", "--cpu", "1", "--model", str(model)]
            argv += ["--draft", str(draft), "--hostname", host, "--batch-size", "3"]
            with open(log, "wb") as fh:
                c.launchers.append(
                    subprocess.Popen(
                        argv, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        c.wait(lambda: all(" ready." in p.read_text() for p in c.logs), 600, "workers start")
        c.children = [kid for p in c.launchers for kid in _children_of(p.pid)]
        assert len(c.children) == 2
        yield c
    finally:
        c.stop()
        c.engine.dispose()
        redis.Redis.from_url(BROKER_URL).flushdb()


PARAMS = {"max_new_tokens": 16, "tree_width": 4, "tree_depth": 4, "total_tokens": 16}


def create_job(
    engine: Engine, model: Path, draft: Path, requests: list[Request], params: dict = PARAMS
) -> str:
    """Job, manifest and shard rows, written before anything is enqueued (as `submit` does)."""
    return store_job(engine, requests, SHARD_SIZE, params, model=str(model), draft=str(draft))


def prompt_file(n: int) -> list[Request]:
    """n requests as read from one file: some multi-turn, some with per-line max_tokens."""
    requests = []
    for i in range(n):
        words = " ".join(f"t{3 + (i * 7 + k) % 90}" for k in range(4 + i % 5))
        requests.append(
            Request(
                sample_id=f"p{i}",
                line_no=i + 1,
                messages=[{"role": "user", "content": words}],
                followups=["t11 t12"] if i % 10 == 3 else [],
                overrides={"max_new_tokens": 6} if i % 7 == 2 else {},
            )
        )
    return requests


def job_done(engine: Engine, *job_ids: str) -> Callable[[], bool]:
    """Every sample stored AND every shard done: a job turns 'completed' when its last
    sample lands, which can be a Parquet write before that sample's shard is done."""

    def done() -> bool:
        return all(
            db.get_job(engine, j)["state"] in ("completed", "failed")
            and all(s["state"] == "done" for s in shard_rows(engine, j))
            for j in job_ids
        )

    return done


def shard_rows(engine: Engine, job_id: str) -> list[dict]:
    stmt = select(db.shards_t).where(db.shards_t.c.job_id == job_id).order_by(db.shards_t.c.shard)
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(stmt).mappings()]


@pytest.mark.integration
def test_forty_prompts_in_eight_shards_on_two_workers(cluster: Cluster):
    requests = prompt_file(40)
    job_id = create_job(cluster.engine, cluster.model, cluster.draft, requests)
    t0 = cluster.enqueue([(job_id, s) for s in range(8)])
    cluster.wait(job_done(cluster.engine, job_id), 600, "job")
    job = db.get_job(cluster.engine, job_id)
    assert job["state"] == "completed"
    expected = sorted(r.sample_id for r in requests)

    rows = list(db.iter_samples(cluster.engine, job_id))
    assert sorted(r["sample_id"] for r in rows) == expected  # every sample, exactly once
    assert {r["status"] for r in rows} == {"ok"}
    assert {(r["model"], r["draft"], r["device"]) for r in rows} == {
        (str(cluster.model), str(cluster.draft), f"cpu {dtype_name(resolve_dtype('auto', 'cpu'))}")
    }  # the workers decode at the job's --dtype auto: bf16 where this CPU computes it natively
    assert {r["worker"] for r in rows} == {f"cpu0@{h}" for h in HOSTS}  # both took shards
    table = read_job_parquet(cluster.out, job_id)
    assert sorted(table.column("sample_id").to_pylist()) == expected
    assert table.column("output_text").to_pylist() == [r["output_text"] for r in rows]
    multi = next(r for r in rows if r["sample_id"] == "p3")
    assert len(multi["turn_outputs"]) == 2
    assert next(r for r in rows if r["sample_id"] == "p2")["completion_tokens"] <= 6

    shards = shard_rows(cluster.engine, job_id)
    assert [(s["state"], s["attempts"]) for s in shards] == [("done", 1)] * 8
    # Where the wall time goes (all timestamps from this machine's clock).
    by_worker: dict[str, list[dict]] = {}
    for s in shards:
        by_worker.setdefault(s["worker"], []).append(s)
    busy = gaps = 0.0
    for runs in by_worker.values():
        runs.sort(key=lambda s: s["started_at"])
        busy += sum((s["finished_at"] - s["started_at"]).total_seconds() for s in runs)
        gaps += sum((b["started_at"] - a["finished_at"]).total_seconds() for a, b in pairwise(runs))
    last = max(job["finished_at"], *(s["finished_at"] for s in shards))
    wall = last.timestamp() - t0
    decode = sum(r["total_ms"] for r in rows) / 1000
    report = {
        "samples": len(rows),
        "tokens": sum(r["completion_tokens"] for r in rows),
        "wall_s": wall,
        "decode_sum_s": decode,
        "ideal_wall_s": decode / len(HOSTS),
        "in_shard_overhead_s": busy - decode,
        "first_start_s": min(s["started_at"] for s in shards).timestamp() - t0,
        "between_shards_s": gaps,
    }
    report = {k: round(v, 3) for k, v in report.items()}
    print("\nWORKERS-BENCH", json.dumps(report))


@pytest.mark.integration
def test_same_file_twice_makes_two_separate_jobs(cluster: Cluster):
    requests = prompt_file(10)
    first = create_job(cluster.engine, cluster.model, cluster.draft, requests)
    second = create_job(cluster.engine, cluster.model, cluster.draft, requests)
    cluster.enqueue([(j, s) for s in range(2) for j in (first, second)])
    cluster.wait(job_done(cluster.engine, first, second), 600, "jobs")
    outputs = {}
    for job_id in (first, second):
        assert db.get_job(cluster.engine, job_id)["state"] == "completed"
        rows = list(db.iter_samples(cluster.engine, job_id))
        assert [r["sample_id"] for r in rows] == [r.sample_id for r in requests]
        assert {r["job_id"] for r in rows} == {job_id}
        table = read_job_parquet(cluster.out, job_id)
        assert set(table.column("job_id").to_pylist()) == {job_id}
        assert table.column("sample_id").to_pylist() == [r.sample_id for r in requests]
        outputs[job_id] = [r["output_text"] for r in rows]
    assert outputs[first] == outputs[second]  # greedy: the same answers, stored twice
    with cluster.engine.connect() as conn:
        count = select(func.count()).where(db.samples_t.c.job_id.in_([first, second]))
        assert conn.execute(count).scalar() == 20


@pytest.mark.integration
def test_shard_for_another_model_fails_visibly(cluster: Cluster):
    job_id = create_job(cluster.engine, Path("some-other-model"), cluster.draft, prompt_file(3))
    cluster.enqueue([(job_id, 0)])  # routed to our workers' queue by mistake
    cluster.wait(
        lambda: shard_rows(cluster.engine, job_id)[0]["state"] == "failed", 120, "wrong model"
    )
    error = shard_rows(cluster.engine, job_id)[0]["error"]
    assert error.startswith("WrongModelError") and "some-other-model" in error
    assert all(p.poll() is None for p in cluster.launchers)  # the workers carry on


def cli(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    """The real console script against the cluster's Postgres and Redis."""
    return subprocess.run(
        [EAGLE2_BATCH, *args], env=cluster.env, capture_output=True, text=True, timeout=600
    )


def submit_lines(cluster: Cluster, path: Path, lines: list[dict], *options: str) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = cli(
        cluster, "submit", str(path), "--model", str(cluster.model), "--draft",
        str(cluster.draft), "--max-new-tokens", "10", "--shard-size", "2", "--wait", *options,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + cluster.tail()
    return done.stdout.split()[-1]


@pytest.mark.integration
def test_n_completions_and_stop_strings_through_submit(cluster: Cluster, tmp_path: Path):
    """`submit --n` with per-line n and stop on Postgres and two real workers (batches of
    3, so a request's completions share their prefill): one row per completion, seeds
    derived from the job's, reruns reproduce them, stops cut as plain decoding does."""
    lines = [
        {"id": "a", "prompt": "t5 t7 t9", "n": 3},
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "t20 t21"}]}},  # the job's n
        {"id": "c", "prompt": "t30 t31", "n": 1, "temperature": 0},
        {"id": "bad", "prompt": "t5", "n": 0},
    ]  # fmt: skip
    # fp32: a seed reproduces its tokens across batch shapes only there (c's stop below
    # changes which rows decode together; bf16 rounds a different batch differently).
    sampled = ("--temperature", "1", "--seed", "5", "--n", "2", "--dtype", "fp32")
    first = submit_lines(cluster, tmp_path / "one.jsonl", lines, *sampled)
    rows = {r["sample_id"]: r for r in db.iter_samples(cluster.engine, first)}
    assert sorted(rows) == ["a#0", "a#1", "a#2", "b#0", "b#1", "c"]
    assert {r["status"] for r in rows.values()} == {"ok"}
    assert len({rows[f"a#{k}"]["seed"] for k in range(3)}) == 3
    assert len({rows[f"a#{k}"]["output_text"] for k in range(3)}) == 3
    report = json.loads(cli(cluster, "verify", first, "--json").stdout)
    assert report["ok"] and report["manifest"] == 6, report
    assert report["database_rows"] == report["parquet_rows"] == 6

    out = tmp_path / "batch_output.jsonl"
    assert cli(cluster, "export", first, "--format", "openai", "--out", str(out)).returncode == 0
    exported = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["custom_id"], len(x["response"]["body"]["choices"])) for x in exported] == [
        ("a", 3), ("b", 2), ("c", 1)
    ]  # fmt: skip
    stats = cli(cluster, "stats", first)
    assert "expected 6  stored 6 (completions of 3 requests)" in stats.stdout

    # Again, with a stop across the first token boundary of c's greedy answer.
    text = rows["c"]["output_text"]
    words = text.split()
    assert len(words) > 1, text
    stop = words[0][-1] + " " + words[1][:2]
    lines[2]["stop"] = stop
    again = submit_lines(cluster, tmp_path / "two.jsonl", lines, *sampled)
    rerun = {r["sample_id"]: r for r in db.iter_samples(cluster.engine, again)}
    assert {k: r["output_text"] for k, r in rerun.items() if k != "c"} == {
        k: r["output_text"] for k, r in rows.items() if k != "c"
    }  # every sampled completion reproduced
    assert rerun["c"]["output_text"] == text[: text.index(stop)]
    assert rerun["c"]["finish_reason"] == "stop"


@pytest.mark.integration
def test_a_shard_left_running_by_a_lost_acknowledgement_is_re_enqueued(cluster: Cluster):
    """What an attempt that gave up on the database once Celery's retries ran out leaves:
    the shard running in the database, no heartbeat, no message anywhere. `status` calls it
    stalled; the workers' watchdog sends it again (within a sweep, 30 s) and it completes."""
    requests = prompt_file(SHARD_SIZE)
    job_id = create_job(cluster.engine, cluster.model, cluster.draft, requests)
    db.set_shard_state(cluster.engine, job_id, 0, "running", worker="cpu0@gone")
    with cluster.engine.begin() as conn:  # its last heartbeat, an hour ago
        conn.execute(
            update(db.shards_t)
            .where(db.shards_t.c.job_id == job_id)
            .values(heartbeat_at=utcnow() - timedelta(hours=1))
        )
    before = job_status(cluster.engine, job_id)
    assert before["shard_states"] == {"stalled": 1}
    assert "1 stalled: running with no heartbeat for over 60 s" in format_status(before)
    t0 = time.monotonic()
    cluster.wait(job_done(cluster.engine, job_id), 300, "the watchdog re-enqueues the shard")
    [shard] = shard_rows(cluster.engine, job_id)
    assert (shard["attempts"], shard["lost_attempts"]) == (2, 1)
    assert sorted(r["sample_id"] for r in db.iter_samples(cluster.engine, job_id)) == sorted(
        r.sample_id for r in requests
    )
    logs = "".join(p.read_text() for p in cluster.logs)
    assert f"watchdog: shard 0 of job {job_id} stalled (running on cpu0@gone" in logs
    assert time.monotonic() - t0 < 90


@pytest.mark.integration
def test_adapt_beside_two_real_workers_switches_heads_at_a_shard_start_and_no_output(
    cluster: Cluster, tmp_path: Path
):
    """`eagle2-batch adapt JOB` as its own process beside the two Celery workers: shards
    that start after it publishes a head draft with it, earlier ones kept theirs, and every
    output equals the same job's without adaptation (fp32 greedy)."""
    from tests.producer.test_adapt import VALIDATION_IDS

    ids = [f"alpaca-{i:05d}" for i in range(36)] + VALIDATION_IDS  # as test_adapt's job
    requests = [
        Request(sample_id=i, line_no=n + 1, messages=[
            {"role": "user", "content": f"t{7 + n % 40} t{20 + n % 50} t{5 + n % 7}"}])
        for n, i in enumerate(ids)
    ]  # fmt: skip
    params = {**PARAMS, "max_new_tokens": 12, "dtype": "fp32"}
    jobs = [
        store_job(cluster.engine, requests, 13, p, str(cluster.model), str(cluster.draft))
        for p in ({**params, "adapt_draft": True, "adapt_after": 10}, params)
    ]
    adapting, plain = jobs
    cluster.enqueue([(adapting, 0), *((plain, s) for s in range(3))])
    cluster.wait(job_done(cluster.engine, plain), 300, "the plain job")
    argv = [EAGLE2_BATCH, "adapt", adapting, "--interval", "1", "--work", str(tmp_path / "w")]
    trainer = subprocess.Popen(argv, env=cluster.env, stdout=subprocess.PIPE, text=True)
    try:
        cluster.wait(lambda: versions(cluster.engine, adapting), 300, "the first round")
        cluster.enqueue([(adapting, 1), (adapting, 2)])
        cluster.wait(job_done(cluster.engine, adapting), 300, "the adapting job")
        said, _ = trainer.communicate(timeout=60)  # it returns once the job has ended
    finally:
        trainer.kill()
    assert trainer.returncode == 0
    [attempt] = versions(cluster.engine, adapting)
    assert "draft head v1 from v0 on 13 completions" in said and attempt["published"], said
    rows = list(db.iter_samples(cluster.engine, adapting))
    assert {(r["shard"], r["head_version"]) for r in rows} == {(0, 0), (1, 1), (2, 1)}
    plain_rows = list(db.iter_samples(cluster.engine, plain))
    assert {r["head_version"] for r in plain_rows} == {0}
    assert {r["sample_id"]: r["output_text"] for r in rows} == {
        r["sample_id"]: r["output_text"] for r in plain_rows
    }


@pytest.mark.integration
def test_warm_shutdown_finishes_running_shards_and_leaves_the_rest_queued(cluster: Cluster):
    requests = prompt_file(20)
    # Long answers: a shard must stay running for seconds, not the 0.3 s of 16 tokens.
    params = {**PARAMS, "max_new_tokens": 400}
    job_id = create_job(cluster.engine, cluster.model, cluster.draft, requests, params)
    cluster.enqueue([(job_id, s) for s in range(4)])
    cluster.wait(
        lambda: any(s["state"] == "running" for s in shard_rows(cluster.engine, job_id)),
        120,
        "a shard starts",
    )
    codes = cluster.stop()
    assert codes == [0, 0]  # both launchers and their workers exited cleanly
    assert all(not Path(f"/proc/{pid}").exists() for pid in cluster.children)
    states = [s["state"] for s in shard_rows(cluster.engine, job_id)]
    assert "running" not in states and "done" in states  # started shards were finished
    assert set(states) <= {"done", "queued"}
    # The shards not started stay in Redis for the next worker (acks_late, prefetch 1).
    client = redis.Redis.from_url(BROKER_URL)
    assert client.llen(queue_for(str(cluster.model))) == states.count("queued")
