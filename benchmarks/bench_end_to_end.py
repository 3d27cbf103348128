"""A job of many short samples end to end: `submit` into a fresh Postgres database and a
dedicated Redis database, drained by two real `eagle2-batch worker --cpu 1` processes.

The model is a tiny random Llama built from a config (no weights to fetch), decoding a
few tokens per prompt, so what is measured is the service around the engine: the queue,
the database, Parquet. Reports samples/s, where the workers' time went (decoding, the
rest of a shard: database and Parquet, and the gaps between shards: the queue), how
long `status`, `stats` and `verify` take on the finished job, and verify's counts.

    python benchmarks/bench_end_to_end.py [--samples 200000] [--shard-size 100]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
import redis
from psycopg import sql
from sqlalchemy import func, select

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from migrations import upgrade  # noqa: E402
from tests.producer.test_jobs import save_tiny_model  # noqa: E402
from workers import db  # noqa: E402

PG_ADMIN_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
REDIS_URL = "redis://127.0.0.1:6379/12"
EAGLE2_BATCH = str(Path(sys.executable).parent / "eagle2-batch")


def cli(env: dict[str, str], *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    start = time.perf_counter()
    done = subprocess.run([EAGLE2_BATCH, *args], env=env, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"eagle2-batch {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    args = parser.parse_args()

    name = f"eagle2_e2e_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    broker = redis.Redis.from_url(REDIS_URL)
    broker.flushdb()
    workers: list[subprocess.Popen[bytes]] = []
    try:
        url = PG_URL.format(name=name)
        upgrade(url)
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            model, _ = save_tiny_model(root, with_draft=False)
            env = {
                **os.environ,
                "EAGLE2_DATABASE_URL": url,
                "EAGLE2_BROKER_URL": REDIS_URL,
                "EAGLE2_OUTPUT_DIR": str(root / "out"),
                "OMP_NUM_THREADS": "1",
            }
            prompts = root / "prompts.jsonl"
            with prompts.open("w") as fh:
                for i in range(args.samples):
                    words = " ".join(f"t{3 + (i * 7 + k) % 90}" for k in range(3 + i % 5))
                    fh.write(json.dumps({"id": f"p{i}", "prompt": words}) + "\n")
            for host in ("e2e-a", "e2e-b"):
                log = open(root / f"{host}.log", "wb")  # noqa: SIM115 - lives with the worker
                argv = [EAGLE2_BATCH, "worker", "--cpu", "1", "--model", str(model)]
                argv += ["--hostname", host, "--loglevel", "WARNING"]
                workers.append(
                    subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
                )
            time.sleep(15)  # the workers load the model and connect before the clock starts

            submit_s, done = cli(
                env, "submit", str(prompts), "--model", str(model), "--mode", "vanilla",
                "--max-new-tokens", str(args.max_new_tokens),
                "--shard-size", str(args.shard_size), "--json",
            )  # fmt: skip
            job_id = json.loads(done.stdout.strip().splitlines()[-1])["job_id"]
            engine = db.make_engine(url)
            start = time.perf_counter() - submit_s
            while db.get_job(engine, job_id)["state"] not in ("completed", "failed"):
                if any(w.poll() is not None for w in workers):
                    raise SystemExit(f"a worker exited; see {root}/*.log")
                time.sleep(1)
            wall = time.perf_counter() - start

            shards = db.shards_t
            ran = func.extract("epoch", shards.c.finished_at - shards.c.started_at)
            with engine.connect() as conn:
                busy = conn.execute(select(func.sum(ran)).where(shards.c.job_id == job_id)).scalar()
                decode_ms = conn.execute(
                    select(func.sum(db.samples_t.c.total_ms)).where(db.samples_t.c.job_id == job_id)
                ).scalar()
            timings = {}
            for command in ("status", "stats"):
                timings[command], _ = cli(env, command, job_id)
            timings["verify"], verified = cli(env, "verify", job_id, "--json")
            report = json.loads(verified.stdout)
            worker_s = 2 * (wall - submit_s)
            decode_s = decode_ms / 1000
            print(f"{args.samples:,} samples, shards of {args.shard_size}, two CPU workers:")
            print(f"submit {submit_s:.1f} s; submit to completed {wall:.1f} s: "
                  f"{args.samples / wall:,.0f} samples/s ({args.samples / (wall - submit_s):,.0f} "
                  "after submit)")  # fmt: skip
            print(f"worker time {worker_s:.0f} s: decoding {decode_s / worker_s:.0%}, rest of the "
                  f"shards (database, Parquet) {(float(busy) - decode_s) / worker_s:.0%}, between "
                  f"shards (queue) {max(worker_s - float(busy), 0.0) / worker_s:.0%}")  # fmt: skip
            print(", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
            print(f"verify: ok {report['ok']}, manifest {report['manifest']:,}, database rows "
                  f"{report['database_rows']:,}, Parquet rows {report['parquet_rows']:,}, "
                  f"counts {report['counts']}")  # fmt: skip
            engine.dispose()
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            try:
                worker.wait(timeout=120)
            except subprocess.TimeoutExpired:
                worker.kill()
        broker.flushdb()
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


if __name__ == "__main__":
    main()
