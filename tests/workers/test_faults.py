"""Faults injected into real processes: killed and stopped workers, a restarted Redis, a
Postgres outage, forced redelivery, damaged input, bad checkpoints. Each job must end
with every sample stored exactly once, in Postgres and in Parquet (`eagle2-batch verify`).

Each test gets its own redis-server (a free port, restartable), its own Postgres database
and its own `eagle2-batch worker` launchers; nothing shared is stopped. Figures (samples,
faults, lost, duplicated, recovery time) are printed as `FAULT-REPORT {json}` lines and,
with EAGLE2_FAULT_REPORT=FILE, appended to FILE as JSON lines (RELIABILITY.md).
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from sqlalchemy import Engine, func, select

from eagle2_core.draft import save_draft
from migrations import upgrade
from producer.cli import main
from producer.creation import create_job
from producer.jobs import make_spec
from producer.tokenizer import context_check
from tests.eagle2_core.tiny import tiny_head, tiny_target
from tests.workers.test_decoding import save_tiny_model
from tests.workers.test_worker_integration import (
    EAGLE2_BATCH,
    Cluster,
    _children_of,
    shard_rows,
)
from workers import db
from workers.celery_app import queue_for
from workers.parquet_sink import read_job_parquet

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(600)]

# Samples per shard: more than workers/shards.py's write batch (8), so a shard cut off
# mid-way has some samples stored and some not.
SHARD_SIZE = 12
# Long enough answers that a shard takes seconds: faults land inside one.
PARAMS = {"max_new_tokens": 40, "tree_width": 4, "tree_depth": 4, "total_tokens": 16}
REPORT_ENV = "EAGLE2_FAULT_REPORT"
# Above the longest shard on a loaded 2-core machine (~9 s), so only the kill redelivers.
KILL_VISIBILITY_TIMEOUT = 12


# --------------------------------------------------------------------------- fault tools


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server on a free port, without persistence: a restart loses every
    queued and unacknowledged message, as a crashed broker without AOF does."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


class TcpProxy:
    """Forwards a local port to Postgres; `cut()` drops every connection and refuses new
    ones (accepted, then closed at once) until `restore()`: the database is unreachable
    while the shared server keeps running for everyone else."""

    def __init__(self, upstream: tuple[str, int] = ("127.0.0.1", 5432)) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.down = threading.Event()
        self.closed = threading.Event()
        self.lock = threading.Lock()
        self.sockets: set[socket.socket] = set()
        self.refused = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.down.is_set():
                self.refused += 1
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.sockets |= {client, server}
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                self._drop(s)

    def _drop(self, s: socket.socket) -> None:
        with self.lock:
            self.sockets.discard(s)
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def cut(self) -> None:
        self.down.set()
        with self.lock:
            live = list(self.sockets)
        for s in live:
            self._drop(s)

    def restore(self) -> None:
        self.down.clear()

    def close(self) -> None:
        self.closed.set()
        self.cut()
        self.listener.close()


# --------------------------------------------------------------------------- cluster


class FaultCluster(Cluster):
    """`Cluster` (test_worker_integration.py) whose launchers start and die at will."""

    root: Path
    broker: RedisServer
    dead: list[subprocess.Popen[bytes]]
    env_url: str  # the database as the test reaches it (never through the proxy)
    proxy: TcpProxy | None

    def launch(self, host: str, *extra: str, wait: bool = True) -> subprocess.Popen[bytes]:
        """Start `eagle2-batch worker --cpu 1` as `host`; by default wait until ready."""
        log = self.root / f"{host}-{len(self.logs)}.log"
        self.logs.append(log)
        argv = [EAGLE2_BATCH, "worker", "--cpu", "1", "--model", str(self.model)]
        # 4 at once, so a 12-sample shard stores its samples over several flushes (the
        # faults land between them); `extra` may say otherwise (the last value wins).
        argv += ["--hostname", host, "--batch-size", "4", *extra]
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                argv, env=self.env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.launchers.append(proc)
        if wait:
            self.wait(lambda: " ready." in log.read_text(), 600, f"worker {host} starts")
            self.children += _children_of(proc.pid)
        return proc

    def launch_all(self, *hosts: str, extra: tuple[str, ...] = ()) -> list[subprocess.Popen[bytes]]:
        """Start several launchers at once (start-up is the slow part); wait for all."""
        procs = [self.launch(h, *extra, wait=False) for h in hosts]
        logs = self.logs[-len(hosts) :]
        self.wait(lambda: all(" ready." in p.read_text() for p in logs), 600, "workers start")
        for proc in procs:
            self.children += _children_of(proc.pid)
        return procs

    def child_of(self, launcher: subprocess.Popen[bytes]) -> int:
        (pid,) = _children_of(launcher.pid)
        return pid

    def forget(self, launcher: subprocess.Popen[bytes], timeout: float = 60) -> int:
        """Wait for a launcher that must exit (its worker died); returns its exit code."""
        code = launcher.wait(timeout=timeout)
        self.launchers.remove(launcher)
        self.dead.append(launcher)
        return code

    def submit(self, lines: int, name: str = "prompts.jsonl", **spec: Any) -> str:
        """Write prompt lines and create the job as `submit` does, then enqueue it."""
        path = self.root / name
        path.write_text("".join(json.dumps(line) + "\n" for line in prompt_lines(lines)))
        return self.submit_file(path, **spec)

    def submit_file(self, path: Path, enqueue: bool = True, **spec: Any) -> str:
        options = {"draft": str(self.draft), "mode": "eagle2", "shard_size": SHARD_SIZE}
        job_spec = make_spec(model=str(self.model), **{**options, **PARAMS, **spec})
        job_id, _plan = create_job(self.engine, path, job_spec, context_check(str(self.model)))
        if enqueue:
            self.enqueue([(job_id, s) for s in shard_ids(self.engine, job_id)])
        return job_id


def prompt_lines(n: int) -> list[dict[str, Any]]:
    """n distinct prompts of the tiny model's words (t2..t95), some multi-turn."""
    lines = []
    for i in range(n):
        words = " ".join(f"t{3 + (i * 7 + k) % 90}" for k in range(4 + i % 5))
        if i % 9 == 4:
            lines.append({"question_id": f"p{i}", "turns": [words, "t11 t12"]})
        else:
            lines.append({"id": f"p{i}", "prompt": words})
    return lines


def shard_ids(engine: Engine, job_id: str) -> list[int]:
    return [s["shard"] for s in shard_rows(engine, job_id)]


def stored_per_shard(engine: Engine, job_id: str) -> dict[int, int]:
    stmt = (
        select(db.samples_t.c.shard, func.count())
        .where(db.samples_t.c.job_id == job_id)
        .group_by(db.samples_t.c.shard)
    )
    with engine.connect() as conn:
        return dict(conn.execute(stmt).all())


def finished(engine: Engine, job_id: str) -> Callable[[], bool]:
    """Job completed (or failed) and every shard done: Parquet files written too."""

    def check() -> bool:
        job = db.get_job(engine, job_id)
        shards = shard_rows(engine, job_id)
        return job["state"] in ("completed", "failed") and all(s["state"] == "done" for s in shards)

    return check


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out: {what}")
        time.sleep(0.05)


def verify(c: FaultCluster, job_id: str, db_url: str | None = None) -> dict[str, Any]:
    """`eagle2-batch verify JOB --json` (must pass), plus exact row counts both ways."""
    result = CliRunner().invoke(
        main,
        ["verify", job_id, "--json", "--out", str(c.out), "--db-url", db_url or c.env_url],
        catch_exceptions=False,
    )
    report = json.loads(result.stdout)
    with c.engine.connect() as conn:
        rows, distinct = conn.execute(
            select(func.count(), func.count(func.distinct(db.samples_t.c.sample_id))).where(
                db.samples_t.c.job_id == job_id
            )
        ).one()
    table = read_job_parquet(c.out, job_id)
    ids = table.column("sample_id").to_pylist()
    report.update(
        pg_rows=rows,
        pg_distinct=distinct,
        parquet_distinct=len(set(ids)),
        lost=report["manifest"] - distinct,
        duplicated=(rows - distinct) + (len(ids) - len(set(ids))),
    )
    assert result.exit_code == 0, result.output
    return report


def check_exactly_once(c: FaultCluster, job_id: str, expected: int) -> dict[str, Any]:
    """The closing assertions of every scenario; returns the verify report."""
    assert db.get_job(c.engine, job_id)["state"] == "completed", c.tail()
    report = verify(c, job_id)
    assert report["ok"] and report["job_state"] == "completed", report
    assert report["manifest"] == expected
    assert report["pg_rows"] == report["pg_distinct"] == expected
    assert report["parquet_rows"] == report["parquet_distinct"] == expected
    assert (report["lost"], report["duplicated"]) == (0, 0)
    return report


def record(scenario: str, **figures: Any) -> None:
    """Print the scenario's figures; append them to $EAGLE2_FAULT_REPORT when set."""
    line = json.dumps({"scenario": scenario, **figures})
    print(f"\nFAULT-REPORT {line}")
    if os.environ.get(REPORT_ENV):
        with open(os.environ[REPORT_ENV], "a") as fh:
            fh.write(line + "\n")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_tiny_model(tmp_path_factory.mktemp("faults-model"))


@pytest.fixture
def make_cluster(
    tmp_path: Path, tiny_model: tuple[Path, Path], make_pg_database: Callable[[], str]
) -> Iterator[Callable[..., FaultCluster]]:
    """Factory: a FaultCluster on a private redis-server and a fresh Postgres database,
    reached directly or through a TcpProxy (`proxy=True`), its workers' environment with
    `env` on top. Everything is stopped after."""
    made: list[tuple[FaultCluster, TcpProxy | None]] = []

    def make(
        visibility_timeout: int = 60, proxy: bool = False, env: dict[str, str] | None = None
    ) -> FaultCluster:
        url = make_pg_database()
        upgrade(url)
        broker = RedisServer(tmp_path / "redis.log")
        broker.start()
        tcp = TcpProxy() if proxy else None
        worker_url = url.replace(":5432/", f":{tcp.port}/") if tcp else url
        settings = env or {}
        env = {
            **os.environ,
            **settings,
            "EAGLE2_DATABASE_URL": worker_url,
            "EAGLE2_BROKER_URL": broker.url,
            "EAGLE2_OUTPUT_DIR": str(tmp_path / "out"),
            "EAGLE2_VISIBILITY_TIMEOUT": str(visibility_timeout),
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        model, draft = tiny_model
        c = FaultCluster(db.make_engine(url), env, model, draft, tmp_path / "out", [])
        c.root, c.broker, c.dead, c.env_url, c.proxy = tmp_path, broker, [], url, tcp
        made.append((c, tcp))
        return c

    yield make
    for c, tcp in made:
        try:
            if tcp is not None:
                tcp.restore()
            c.stop()
        finally:
            for p in c.dead + c.launchers:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            c.broker.kill()
            if tcp is not None:
                tcp.close()
            c.engine.dispose()


def running_shard(c: FaultCluster, job_id: str, min_stored: int = 0) -> dict[str, Any] | None:
    """A running shard with at least `min_stored` samples stored (and not all)."""
    stored = stored_per_shard(c.engine, job_id)
    for s in shard_rows(c.engine, job_id):
        if s["state"] == "running" and min_stored <= stored.get(s["shard"], 0) < s["n_samples"]:
            return s
    return None


# --------------------------------------------------------------------------- scenarios


def test_kill_9_mid_shard_another_worker_finishes(make_cluster: Callable[..., FaultCluster]):
    """SIGKILL a worker process with part of its shard stored: its message stays unacked in
    Redis until the visibility timeout; the other worker then redoes only the rest."""
    c = make_cluster(visibility_timeout=KILL_VISIBILITY_TIMEOUT)
    a, b = c.launch_all("kill-a", "kill-b")
    n = 4 * SHARD_SIZE
    job_id = c.submit(n)
    holder: dict[str, Any] = {}

    def partial() -> bool:
        holder["shard"] = running_shard(c, job_id, min_stored=1)
        return holder["shard"] is not None

    wait_until(partial, 300, "a shard with some samples stored")
    victim = holder["shard"]
    launcher = a if victim["worker"].endswith("@kill-a") else b
    pid = c.child_of(launcher)
    stored_before = stored_per_shard(c.engine, job_id)[victim["shard"]]
    os.kill(pid, signal.SIGKILL)
    t_fault = time.monotonic()
    assert c.forget(launcher) == 128 + signal.SIGKILL  # the launcher reports the death
    c.children.remove(pid)
    c.wait(finished(c.engine, job_id), 300, "job after kill -9")
    recovery = time.monotonic() - t_fault
    report = check_exactly_once(c, job_id, n)
    after = next(s for s in shard_rows(c.engine, job_id) if s["shard"] == victim["shard"])
    assert after["attempts"] >= 2 and after["worker"] != victim["worker"]
    record(
        "kill -9 mid-shard",
        samples=n,
        faults=f"SIGKILL of {victim['worker']} with {stored_before}/{SHARD_SIZE} stored",
        lost=report["lost"],
        duplicated=report["duplicated"],
        recovery_s=round(recovery, 1),
        visibility_timeout_s=KILL_VISIBILITY_TIMEOUT,
    )


def test_sigterm_mid_shard_then_restart(make_cluster: Callable[..., FaultCluster]):
    """SIGTERM (docker stop) mid-shard: the running shard is finished, the others stay in
    Redis; a restarted worker does them. Nothing is decoded twice."""
    c = make_cluster()
    (launcher,) = c.launch_all("term")
    n = 3 * SHARD_SIZE
    job_id = c.submit(n)
    wait_until(lambda: running_shard(c, job_id) is not None, 300, "a shard starts")
    victim = running_shard(c, job_id)
    launcher.send_signal(signal.SIGTERM)
    t_fault = time.monotonic()
    assert c.forget(launcher, timeout=120) == 0  # a warm shutdown
    shutdown = time.monotonic() - t_fault
    shards = {s["shard"]: s for s in shard_rows(c.engine, job_id)}
    assert shards[victim["shard"]]["state"] == "done"  # finished, not cut off
    queued = [s for s in shards.values() if s["state"] == "queued"]
    assert queued, "the job ended before the restart: make shards longer"
    assert c.broker.client().llen(queue_for(str(c.model))) == len(queued)
    c.launch_all("term")
    c.wait(finished(c.engine, job_id), 300, "job after restart")
    recovery = time.monotonic() - t_fault
    report = check_exactly_once(c, job_id, n)
    assert [s["attempts"] for s in shard_rows(c.engine, job_id)] == [1] * len(shards)
    record(
        "SIGTERM mid-shard, restart",
        samples=n,
        faults=f"SIGTERM to the launcher during shard {victim['shard']}; "
        f"{len(queued)} shards left queued",
        lost=report["lost"],
        duplicated=report["duplicated"],
        shutdown_s=round(shutdown, 1),
        recovery_s=round(recovery, 1),
    )


def test_redis_restart_mid_job(make_cluster: Callable[..., FaultCluster]):
    """The broker dies without persistence mid-shard and comes back empty: the worker
    reconnects, `resume` re-enqueues what the lost messages held."""
    c = make_cluster()
    c.launch_all("redis-a", "redis-b")
    n = 4 * SHARD_SIZE
    job_id = c.submit(n)
    wait_until(lambda: running_shard(c, job_id) is not None, 300, "a shard starts")
    c.broker.kill()
    t_fault = time.monotonic()
    time.sleep(2)
    c.broker.start()
    assert c.broker.client().dbsize() == 0  # every queued and unacked message is gone
    # The workers reconnect by themselves (their logs say so), then `resume` recovers.
    c.wait(
        lambda: all(p.read_text().count("Connected to redis://") >= 2 for p in c.logs[-2:]),
        120,
        "workers reconnect",
    )
    reconnect = time.monotonic() - t_fault
    resume = subprocess.run(
        [EAGLE2_BATCH, "resume", job_id, "--db-url", c.env_url],
        env=c.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resume.returncode == 0, resume.stderr
    assert f"job {job_id}: re-enqueued" in resume.stdout
    c.wait(finished(c.engine, job_id), 300, "job after the broker restart")
    recovery = time.monotonic() - t_fault
    report = check_exactly_once(c, job_id, n)
    record(
        "Redis restarted mid-job",
        samples=n,
        faults="redis-server SIGKILLed mid-shard, restarted empty after 2 s",
        lost=report["lost"],
        duplicated=report["duplicated"],
        reconnect_s=round(reconnect, 1),
        recovery_s=round(recovery, 1),
        resume=resume.stdout.strip(),
    )


def test_postgres_unreachable_for_ten_seconds(make_cluster: Callable[..., FaultCluster]):
    """Every worker connection to Postgres is cut and refused for 10 s mid-shard: the
    writes fail and retry (in place, or the task through Celery), and once the database
    is back the job completes without losing a sample."""
    c = make_cluster(proxy=True)
    c.launch_all("pg-a", "pg-b")
    n = 4 * SHARD_SIZE
    job_id = c.submit(n)
    wait_until(lambda: running_shard(c, job_id, min_stored=1) is not None, 300, "mid-shard")
    assert c.proxy is not None
    c.proxy.cut()
    t_fault = time.monotonic()
    time.sleep(10)
    c.proxy.restore()
    t_back = time.monotonic()
    c.wait(finished(c.engine, job_id), 300, "job after the outage")
    done = time.monotonic()
    report = check_exactly_once(c, job_id, n)
    retried = sum(p.read_text().count("Retry in") for p in c.logs)
    # Writes retry in place (process_shard) and whole tasks through Celery; either may
    # absorb the outage, so only the outage itself is asserted.
    assert c.proxy.refused >= 1, c.tail()
    record(
        "Postgres unreachable 10 s",
        samples=n,
        faults=f"all worker connections cut, {c.proxy.refused} connection attempts "
        "refused during 10 s",
        task_retries=retried,
        lost=report["lost"],
        duplicated=report["duplicated"],
        recovery_s=round(done - t_back, 1),
        fault_to_complete_s=round(done - t_fault, 1),
    )


def task_runs(c: FaultCluster) -> list[dict[str, Any]]:
    """Every run_shard execution in the workers' logs: worker, task id, start, end, and
    the returned summary (decoded, skipped)."""
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    pattern = re.compile(
        r"^\[(\S+ \S+): INFO/(\S+)\] Task eagle2\.run_shard\[(\S+)\] (received|succeeded)(.*)$"
    )
    for log in c.logs:
        for line in log.read_text().splitlines():
            m = pattern.match(line)
            if not m:
                continue
            stamp, worker, task, event, rest = m.groups()
            at = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            key = (worker, task)
            if event == "received":
                runs[key] = {"worker": worker, "task": task, "start": at, "end": None}
            elif key in runs:
                summary = ast.literal_eval(rest.split(": ", 1)[1])
                runs[key].update(end=at, **summary)
                runs[(worker, f"{task}@{at}")] = runs.pop(key)  # a later run is a new one
    return list(runs.values())


def test_visibility_timeout_shorter_than_a_shard(make_cluster: Callable[..., FaultCluster]):
    """A 2 s visibility timeout and a shard of several seconds: Redis hands the running
    shard to the idle worker too, so both decode it at once. Rows stay unique, each of
    a line's completions stored once."""
    c = make_cluster(visibility_timeout=2)
    # One sample at a time and a shard of 16 lines x 3 completions: it must outlast the
    # 2 s timeout, the 0.5 s restore sweep and the other worker's start on it (12 samples
    # took ~4 s: too close; 12 x 3 sampled ones, which stop early, were too close too).
    # Greedy: every completion runs its full 40 tokens.
    c.launch_all("vt-a", "vt-b", extra=("--batch-size", "1"))
    lines = 16
    n = 3 * lines
    job_id = c.submit(lines, shard_size=lines, n=3)
    t0 = time.monotonic()
    c.wait(finished(c.engine, job_id), 300, "job with redeliveries")
    # Redeliveries can go on briefly after the job completed: let them start, then end
    # (a run still open when the job completes is one of the two at once).
    time.sleep(3)
    wait_until(
        lambda: all(r["end"] is not None for r in task_runs(c)), 60, "redelivered runs to end"
    )
    report = check_exactly_once(c, job_id, n)
    runs = task_runs(c)
    workers = {r["worker"] for r in runs}
    overlap = any(
        a["worker"] != b["worker"] and a["start"] < b["end"] and b["start"] < a["end"]
        for a in runs
        for b in runs
    )
    decoded = sum(r["decoded"] for r in runs)
    (shard,) = shard_rows(c.engine, job_id)
    assert len(workers) == 2 and overlap, runs  # the same shard ran twice at once
    assert decoded > n and shard["attempts"] == len(runs) >= 2
    record(
        "visibility timeout < shard (forced redelivery)",
        samples=n,
        faults="visibility timeout 2 s, one shard of 16 lines x 3 completions on two idle workers",
        runs_of_the_shard=len(runs),
        decoded=decoded,
        decoded_twice=decoded - n,
        lost=report["lost"],
        duplicated=report["duplicated"],
        job_s=round(time.monotonic() - t0, 1),
    )


def damaged_file(path: Path, n_good: int) -> dict[int, str]:
    """Good prompt lines mixed with garbage, invalid UTF-8, a 10 MB line and a truncated
    last line; returns {line number: what the reason must contain} for the bad ones."""
    rng = random.Random(7)
    lines = [json.dumps(line).encode() for line in prompt_lines(n_good)]
    bad = {
        3: (b'{"id": "utf", "prompt": "caf\xe9"}', "invalid UTF-8 at byte 29"),
        6: (rng.randbytes(4000).replace(b"\n", b"") + b"\xff", "invalid"),
        9: (json.dumps({"id": "big", "prompt": "t5 " * 3_500_000}).encode(), "context"),
        12: (b"[1, 2]", "expected a JSON object"),
    }
    for line_no in sorted(bad):
        lines.insert(line_no - 1, bad[line_no][0])
    lines.append(b'{"id": "cut", "prompt": "t5 t')  # the writer died mid-line
    path.write_bytes(b"\n".join(lines))
    reasons = {n: why for n, (_, why) in bad.items()}
    reasons[len(lines)] = "is the file truncated?"
    return reasons


def test_damaged_input_file_end_to_end(make_cluster: Callable[..., FaultCluster]):
    """`submit --wait` of a damaged file: each bad line reported by number and stored as
    rejected, every good line decoded and stored once, no crash anywhere."""
    c = make_cluster()
    c.launch_all("bad-input")
    n_good = 20
    path = c.root / "damaged.jsonl"
    reasons = damaged_file(path, n_good)
    assert path.stat().st_size > 10_000_000
    t0 = time.monotonic()
    argv = [EAGLE2_BATCH, "submit", str(path), "--model", str(c.model), "--draft", str(c.draft)]
    argv += ["--shard-size", str(SHARD_SIZE), "--max-new-tokens", "8", "--wait", "--json"]
    result = subprocess.run(argv, env=c.env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.splitlines()[-1])
    assert (summary["requests"], summary["rejected"], summary["state"]) == (
        n_good,
        len(reasons),
        "completed",
    )
    for line_no in reasons:
        assert f"line {line_no}: " in result.stderr  # quoted on stderr by number
    with c.engine.connect() as conn:
        stored = dict(
            conn.execute(
                select(db.rejected_lines_t.c.line_no, db.rejected_lines_t.c.reason).where(
                    db.rejected_lines_t.c.job_id == summary["job_id"]
                )
            ).all()
        )
    assert stored.keys() == reasons.keys()
    for line_no, why in reasons.items():
        assert why in stored[line_no], (line_no, stored[line_no])
    report = check_exactly_once(c, summary["job_id"], n_good)
    record(
        "damaged input file",
        samples=n_good,
        faults=f"{len(reasons)} bad lines: invalid UTF-8, 4 KB of binary garbage, a 10 MB "
        "line (over the context), a JSON array, a truncated last line",
        rejected_by_line=sorted(stored),
        lost=report["lost"],
        duplicated=report["duplicated"],
        submit_to_complete_s=round(time.monotonic() - t0, 1),
    )


def broken_heads(root: Path, model: Path, draft: Path) -> dict[str, Path]:
    """A head with unreadable weights, and a head trained for another (wider) model."""
    corrupt = root / "corrupt-head"
    shutil.copytree(draft, corrupt)
    for weights in corrupt.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:100] + b"\x00garbage")
    other = tiny_target(hidden=32)
    mismatched = save_draft(tiny_head(other), root / "other-model-head")
    return {"corrupt": corrupt, "mismatched": mismatched}


def test_bad_checkpoints_are_refused(make_cluster: Callable[..., FaultCluster]):
    """Nothing is decoded without its draft: a worker started with a bad head or a missing
    model refuses to start (its shards stay queued); a job naming a bad head fails its
    shard visibly; the worker goes on with the next, good job."""
    c = make_cluster()
    heads = broken_heads(c.root, c.model, c.draft)
    job_id = c.submit(SHARD_SIZE)
    queue = queue_for(str(c.model))
    missing = c.root / "no-such-model"
    refusing = {  # started together: start-up is the slow part
        name: (c.launch(f"refuse-{name}", "--draft", str(head), wait=False), c.logs[-1])
        for name, head in heads.items()
    }
    model_launcher = c.launch("refuse-model", "--model", str(missing), wait=False)
    refusals = {}
    for name, (launcher, log_path) in refusing.items():
        code = c.forget(launcher, timeout=300)
        log = log_path.read_text()
        assert code != 0 and f"cannot use draft head {heads[name]}: DraftCheckpointError" in log
        refusals[name] = log.split("DraftCheckpointError: ", 1)[1].splitlines()[0]
    assert c.forget(model_launcher, timeout=300) != 0
    assert f"cannot load model {missing}" in c.logs[-1].read_text()
    # None of them took the shard: it is still queued, nothing was decoded.
    assert c.broker.client().llen(queue) == 1
    assert shard_rows(c.engine, job_id)[0]["attempts"] == 0
    assert stored_per_shard(c.engine, job_id) == {}

    # A healthy worker (no --draft: the job's head) runs it; jobs naming a bad head fail.
    bad_jobs = {
        name: c.submit(SHARD_SIZE, name=f"{name}.jsonl", draft=str(head))
        for name, head in heads.items()
    }
    c.launch_all("healthy")
    c.wait(finished(c.engine, job_id), 300, "the good job")
    for name, bad_job in bad_jobs.items():
        c.wait(lambda j=bad_job: shard_rows(c.engine, j)[0]["state"] == "failed", 120, name)
        error = shard_rows(c.engine, bad_job)[0]["error"]
        assert error.startswith("DraftCheckpointError") and str(heads[name]) in error
        assert stored_per_shard(c.engine, bad_job) == {}  # nothing decoded without it
        assert db.get_job(c.engine, bad_job)["state"] != "completed"
    report = check_exactly_once(c, job_id, SHARD_SIZE)
    record(
        "corrupt / mismatched draft, missing model",
        samples=SHARD_SIZE,
        faults="workers started with a corrupt head, a head of another model, a missing "
        "model; two jobs naming those heads",
        refused_at_start=refusals,
        bad_job_shards="failed, 0 samples decoded",
        lost=report["lost"],
        duplicated=report["duplicated"],
    )


def hostile_file(path: Path, n_good: int) -> tuple[dict[int, str], str]:
    """Good prompt lines with, between them, the single lines that crashed job creation on
    Postgres and those like them; returns {line number: the field its rejection names} and
    a 253-character id asked for 2 completions ("<id>#1" is 255: it must be stored)."""
    body = {"messages": [{"role": "user", "content": "t5 t6"}], "stop": "\ud800"}
    long_id = "L" * 253
    bad = [
        ({"id": "x" * 254, "prompt": "t5 t6", "n": 2}, 'field "id"'),
        ({"id": "s1", "prompt": "t5 t6", "stop": "\ud800"}, 'field "stop"'),
        (
            {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": body},
            'field "body.stop"',
        ),  # fmt: skip
        ({"id": "s2", "prompt": "t5", "stop": ["t9", "a\x00b"]}, 'field "stop[1]"'),
        ({"id": "s3", "prompt": "t5 \x00 t6"}, 'field "prompt"'),
        (
            {
                "id": "s4",
                "messages": [
                    {"role": "system", "content": "\udc80"},
                    {"role": "user", "content": "t5"},
                ],
            },
            'field "messages[0].content"',
        ),  # fmt: skip
        ({"id": "s5", "prompt": "t5", "category": "c\x00"}, 'field "category"'),
    ]
    lines: list[str] = []
    fields = {}
    for i, good in enumerate(prompt_lines(n_good)):
        lines.append(json.dumps(good))
        if i == 4:
            lines.append(json.dumps({"id": long_id, "prompt": "t5 t6 t7", "n": 2}))
        if i % 2 and bad:  # a good line or two between the bad ones
            line, field = bad.pop(0)
            lines.append(json.dumps(line))
            fields[len(lines)] = field
    path.write_text("\n".join(lines) + "\n")
    return fields, long_id


def test_lines_that_cannot_be_stored_are_named_and_the_rest_runs(
    make_cluster: Callable[..., FaultCluster],
):
    """`submit --wait` of a file of lines that each crashed job creation on a fresh Postgres
    database (an id too long for its completions, a lone surrogate or a NUL in stop, in a
    plain line or an OpenAI body, and in the other fields): no traceback, exit 0, every bad
    line named by number and field, every good line decoded and stored once, the long id
    that fits stored with both of its completions."""
    c = make_cluster()
    c.launch_all("hostile")
    n_good = 20
    path = c.root / "hostile.jsonl"
    fields, long_id = hostile_file(path, n_good)
    t0 = time.monotonic()
    argv = [EAGLE2_BATCH, "submit", str(path), "--model", str(c.model), "--draft", str(c.draft)]
    argv += ["--shard-size", str(SHARD_SIZE), "--max-new-tokens", "8", "--wait", "--json"]
    result = subprocess.run(argv, env=c.env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    summary = json.loads(result.stdout.splitlines()[-1])
    assert (summary["requests"], summary["rejected"], summary["state"]) == (
        n_good + 1,
        len(fields),
        "completed",
    )
    for line_no, field in fields.items():
        assert f"line {line_no}: {field}: expected" in result.stderr, (line_no, field)
    job_id = summary["job_id"]
    with c.engine.connect() as conn:
        stored = dict(
            conn.execute(
                select(db.rejected_lines_t.c.line_no, db.rejected_lines_t.c.reason).where(
                    db.rejected_lines_t.c.job_id == job_id
                )
            ).all()
        )
    assert {n: reason.split(":")[0] for n, reason in stored.items()} == fields
    report = check_exactly_once(c, job_id, n_good + 2)
    ids = {r["sample_id"] for r in db.iter_samples(c.engine, job_id)}
    assert {f"{long_id}#0", f"{long_id}#1"} <= ids
    record(
        "lines that cannot be stored",
        samples=n_good + 2,
        faults=f"{len(fields)} bad lines: an id of 254 characters with n = 2, lone surrogates "
        "and NULs in stop (plain and in an OpenAI body), prompt, message and category; and "
        "an id of 253 with n = 2 (fits)",
        rejected_by_line=sorted(stored),
        lost=report["lost"],
        duplicated=report["duplicated"],
        submit_to_complete_s=round(time.monotonic() - t0, 1),
    )


# Heartbeats every half second: a shard without one for 3 s has stalled, and each worker's
# watchdog sweeps every 1.5 s. The visibility timeout is out of the way: the watchdog, not
# Redis, brings lost shards back.
QUICK_HEARTBEAT = {"EAGLE2_HEARTBEAT_S": "0.5"}
LONG_VISIBILITY_TIMEOUT = 600


def test_a_shard_that_kills_its_workers_is_given_up(make_cluster: Callable[..., FaultCluster]):
    """A poison shard: every attempt at it kills its worker process (SIGKILL, as the OOM
    killer or a segfault would). Each loss is found by the workers' watchdog and counted;
    after --max-attempts (3) the next delivery decodes nothing, stores the shard's samples as
    failed with the last loss as their error, and the job ends with them counted."""
    c = make_cluster(visibility_timeout=LONG_VISIBILITY_TIMEOUT, env=QUICK_HEARTBEAT)
    hosts = ["poison-a", "poison-b", "poison-c", "poison-d"]
    launchers = dict(zip(hosts, c.launch_all(*hosts), strict=True))
    n = 2 * SHARD_SIZE
    job_id = c.submit(n)
    back_after = []  # seconds from each kill to the shard's next attempt
    killed = []
    for attempt in range(1, 4):
        shard = {}

        def started(attempt: int = attempt, shard: dict = shard) -> bool:
            row = shard_rows(c.engine, job_id)[0]
            shard.update(row)
            return row["state"] == "running" and row["attempts"] >= attempt

        wait_until(started, 300, f"attempt {attempt} of shard 0")
        if killed:
            back_after.append(round(time.monotonic() - killed[-1][0], 1))
        host = shard["worker"].split("@", 1)[1]
        launcher = launchers.pop(host)
        pid = c.child_of(launcher)
        os.kill(pid, signal.SIGKILL)
        killed.append((time.monotonic(), host))
        assert c.forget(launcher) == 128 + signal.SIGKILL
        c.children.remove(pid)
    c.wait(finished(c.engine, job_id), 300, "the poison shard given up")
    given_up = time.monotonic() - killed[-1][0]
    shard = shard_rows(c.engine, job_id)[0]
    assert (shard["state"], shard["attempts"], shard["lost_attempts"]) == ("done", 4, 3)
    rows = [r for r in db.iter_samples(c.engine, job_id) if r["shard"] == 0]
    assert len(rows) == SHARD_SIZE and {r["status"] for r in rows} == {"failed"}
    assert rows[0]["error"].startswith(
        "ShardGivenUp: gave up after 3 lost attempts (max_attempts 3); the last: attempt 3 on "
        f"cpu0@{killed[-1][1]} was lost: no heartbeat since"
    )
    assert db.get_job(c.engine, job_id)["state"] == "failed"
    assert db.sample_counts(c.engine, job_id) == {"ok": SHARD_SIZE, "failed": SHARD_SIZE}
    report = verify(c, job_id)  # each sample stored once, failed or not, in both stores
    assert report["ok"] and (report["lost"], report["duplicated"]) == (0, 0)
    watchdog = sum(p.read_text().count("watchdog: shard 0 of job") for p in c.logs)
    assert watchdog == 3
    record(
        "poison shard (kills every worker that takes it)",
        samples=n,
        faults="SIGKILL of the worker process running shard 0, at each of its first 3 attempts",
        workers_killed=len(killed),
        next_attempt_after_kill_s=back_after,
        given_up_after_third_kill_s=round(given_up, 1),
        failed_samples=SHARD_SIZE,
        lost=report["lost"],
        duplicated=report["duplicated"],
    )


def test_postgres_unreachable_longer_than_the_retries(make_cluster: Callable[..., FaultCluster]):
    """Postgres cut mid-shard for 30 s: longer than the running shards' writes retry in
    place (EAGLE2_DB_WRITE_RETRY_S=10 here; 60 by default) and than their Celery retries
    (EAGLE2_DB_RETRIES=0 here, so any outage outlasts them). Those tasks give up and are
    acknowledged, their shards left running with no heartbeat; the queued shards wait for
    Postgres at their start instead of spending their retries and being dropped. Once it is
    back, the workers' watchdog re-enqueues the stalled shards and the job completes, every
    sample stored once."""
    env = {**QUICK_HEARTBEAT, "EAGLE2_DB_RETRIES": "0", "EAGLE2_DB_WRITE_RETRY_S": "10"}
    c = make_cluster(visibility_timeout=LONG_VISIBILITY_TIMEOUT, proxy=True, env=env)
    c.launch_all("long-a", "long-b")
    n = 4 * SHARD_SIZE
    job_id = c.submit(n)
    wait_until(lambda: running_shard(c, job_id, min_stored=1) is not None, 300, "mid-shard")
    assert c.proxy is not None
    c.proxy.cut()
    t_fault = time.monotonic()
    time.sleep(30)
    shards = shard_rows(c.engine, job_id)  # the test reaches Postgres directly
    stalled = [s["shard"] for s in shards if s["state"] == "running"]
    queued = [s["shard"] for s in shards if s["state"] == "queued"]
    gave_up = sum(p.read_text().count("raised unexpected: OperationalError") for p in c.logs)
    assert stalled and gave_up >= len(stalled), c.tail()
    c.proxy.restore()
    t_back = time.monotonic()
    reclaimed: dict[str, float] = {}

    def done() -> bool:
        if not reclaimed and any(s["lost_attempts"] for s in shard_rows(c.engine, job_id)):
            reclaimed["s"] = time.monotonic() - t_back
        return finished(c.engine, job_id)()

    c.wait(done, 300, "job after the long outage")
    complete = time.monotonic()
    report = check_exactly_once(c, job_id, n)
    lost = {s["shard"]: s["lost_attempts"] for s in shard_rows(c.engine, job_id)}
    assert all(lost[s] == 1 for s in stalled) and not any(lost[s] for s in queued)
    waited = sum(p.read_text().count("database unreachable, retrying in") for p in c.logs)
    record(
        "Postgres unreachable 30 s, longer than the retries",
        samples=n,
        faults=f"all worker connections cut for 30 s ({c.proxy.refused} connection attempts "
        "refused), EAGLE2_DB_WRITE_RETRY_S=10, EAGLE2_DB_RETRIES=0",
        tasks_given_up=gave_up,
        shards_stalled=stalled,
        shards_waiting_queued=queued,
        waits_for_the_database_logged=waited,
        reclaimed_after_restore_s=round(reclaimed.get("s", float("nan")), 1),
        lost=report["lost"],
        duplicated=report["duplicated"],
        recovery_s=round(complete - t_back, 1),
        fault_to_complete_s=round(complete - t_fault, 1),
    )
