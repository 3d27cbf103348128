"""Storage throughput: write N output rows to a database the way workers do, report seconds.

Creates a job and its manifest, then times `insert_samples` over shard-sized batches,
then times the same batches again (every row a conflict: what a redelivery costs).

    python benchmarks/bench_storage.py --url postgresql+psycopg://postgres@127.0.0.1:5432/eagle2_bench

Without --url a throwaway Postgres database is created on 127.0.0.1:5432 and dropped.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import click
import psycopg
from psycopg import sql

from migrations import upgrade
from workers.db import insert_job, insert_requests, insert_samples, make_engine

PG_ADMIN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"


@contextmanager
def _scratch_postgres() -> Iterator[str]:
    name = f"eagle2_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def _row(job_id: str, i: int, shard_size: int, rng: random.Random) -> dict:
    n_cycles = rng.randint(20, 80)
    hist = [rng.randint(0, n_cycles) for _ in range(7)]
    return {
        "job_id": job_id,
        "sample_id": f"s{i}",
        "line_no": i,
        "shard": i // shard_size,
        "category": rng.choice(["writing", "math", "coding", "reasoning"]),
        "output_text": "lorem ipsum " * rng.randint(20, 200),
        "turn_outputs": ["lorem ipsum"],
        "prompt_tokens": rng.randint(10, 400),
        "completion_tokens": rng.randint(50, 512),
        "finish_reason": "stop",
        "mode": "eagle2",
        "model": "smollm2-135m",
        "draft": "smollm2-135m-eagle",
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": 0,
        "n_cycles": n_cycles,
        "mean_accept_length": rng.uniform(1.5, 4.5),
        "accept_hist": hist,
        "depth_attempts": hist[1:],
        "depth_accepts": hist[2:],
        "draft_ms": rng.uniform(10, 500),
        "verify_ms": rng.uniform(10, 500),
        "total_ms": rng.uniform(100, 2000),
        "tokens_per_s": rng.uniform(20, 90),
        "worker": "bench@host",
        "device": "cpu",
        "status": "ok",
    }


def _bench(url: str, n: int, shard_size: int) -> None:
    engine = make_engine(url)
    upgrade(url)
    job_id = insert_job(engine, input_path="bench.jsonl", model="smollm2-135m", mode="eagle2")
    rng = random.Random(0)
    rows = [_row(job_id, i, shard_size, rng) for i in range(n)]
    insert_requests(
        engine,
        [
            {
                "job_id": job_id,
                "sample_id": r["sample_id"],
                "line_no": r["line_no"],
                "shard": r["shard"],
                "payload": {"prompt": "x"},
            }
            for r in rows
        ],
    )
    batches = [rows[i : i + shard_size] for i in range(0, n, shard_size)]
    for label in ("insert", "re-insert (all conflicts)"):
        start = time.perf_counter()
        stored = sum(insert_samples(engine, batch) for batch in batches)
        elapsed = time.perf_counter() - start
        click.echo(
            f"{label}: {n} rows in {len(batches)} batches of {shard_size}: "
            f"{elapsed:.2f} s ({n / elapsed:,.0f} rows/s), {stored} stored"
        )
    engine.dispose()


@click.command()
@click.option("--url", default=None, help="Database URL (default: a scratch Postgres DB).")
@click.option("-n", "--rows", "n", default=10_000, show_default=True)
@click.option("--batch", "shard_size", default=500, show_default=True, help="Rows per batch.")
def main(url: str | None, n: int, shard_size: int) -> None:
    """Time writing output rows to the database in shard-sized batches."""
    if url is not None:
        _bench(url, n, shard_size)
        return
    with _scratch_postgres() as scratch:
        _bench(scratch, n, shard_size)


if __name__ == "__main__":
    main()
