"""Shared fixtures: real databases (a throwaway Postgres database, SQLite files) and
a builder of jobs whose rows carry internally consistent acceptance statistics."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import Engine

from eagle2_core.registry import cache_root
from migrations import upgrade
from workers.db import insert_job, insert_requests, make_engine

PG_ADMIN_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
PG_URL_TEMPLATE = "postgresql+psycopg://postgres@127.0.0.1:5432/{name}"


_CACHE_BEFORE = pytest.StashKey[tuple[str, str | None]]()


def pytest_configure(config: pytest.Config) -> None:
    """Cost tables of this test run's own: a table measured on a loaded machine by an
    earlier run must not steer this one. Its xdist workers, started after this with its
    environment, share the folder, so a run measures each table once (the second process
    to need it waits for the first's: cost.load_or_measure). The cache's other entries
    (dequantised GGUF weights: slow to make, never changed) are linked in from the usual
    cache."""
    if hasattr(config, "workerinput"):  # an xdist worker: its controller made the folder
        return
    path = tempfile.mkdtemp(prefix="eagle2-test-cache-")
    shared = cache_root()
    if shared.is_dir():
        for entry in shared.iterdir():
            if entry.name != "costs":
                os.symlink(entry, os.path.join(path, entry.name))
    config.stash[_CACHE_BEFORE] = (path, os.environ.get("EAGLE2_CACHE_DIR"))
    os.environ["EAGLE2_CACHE_DIR"] = path


def pytest_unconfigure(config: pytest.Config) -> None:
    if _CACHE_BEFORE not in config.stash:
        return
    path, before = config.stash[_CACHE_BEFORE]
    if before is None:
        os.environ.pop("EAGLE2_CACHE_DIR", None)
    else:
        os.environ["EAGLE2_CACHE_DIR"] = before
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_xdist_worker() -> None:
    """Under `pytest -n N` the N test processes already fill the cores: a torch process
    that also spins up a thread per core makes them wait on each other (the SmolLM2 tests
    took 10 minutes beside a busy neighbour instead of 30 s)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models on a busy 2-core machine: 2 threads spin-wait, 20-50x slower than 1."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def make_pg_database() -> Iterator[Callable[[], str]]:
    """Factory of fresh, empty, uniquely named Postgres databases; all dropped at the end."""
    created: list[str] = []

    def make() -> str:
        name = f"eagle2_test_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        created.append(name)
        return PG_URL_TEMPLATE.format(name=name)

    yield make
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        for name in created:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture(scope="session")
def postgres_url(make_pg_database: Callable[[], str]) -> str:
    """A Postgres database migrated to head, shared by the test run (use fresh job ids)."""
    url = make_pg_database()
    upgrade(url)
    return url


@pytest.fixture
def sqlite_url(tmp_path: Any) -> str:
    """A SQLite file migrated to head, private to the test."""
    url = f"sqlite:///{tmp_path / 'eagle2.db'}"
    upgrade(url)
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.integration)])
def db_url(request: pytest.FixtureRequest) -> str:
    """A migrated database URL; tests using it run once per backend."""
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """An engine on `db_url`, disposed after the test."""
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


def _identity(request_row: dict[str, Any]) -> dict[str, Any]:
    """The fields of an output row that come from its manifest row and the job."""
    payload = request_row["payload"]
    return {
        "job_id": request_row["job_id"],
        "sample_id": request_row["sample_id"],
        "request_id": payload.get("request_id") or request_row["sample_id"],
        "choice_index": payload.get("choice_index", 0),
        "line_no": request_row["line_no"],
        "shard": request_row["shard"],
        "custom_id": payload.get("custom_id"),
        "category": payload.get("category"),
        "mode": "eagle2",
        "model": "tiny-llama",
        "draft": "tiny-eagle",
        "head_version": 0,
        "temperature": 0.0,
        "top_p": 1.0,
    }


def _fake_sample(
    request_row: dict[str, Any], rng: random.Random, depth: int = 5, **overrides: Any
) -> dict[str, Any]:
    """An output row for a manifest row, with consistent acceptance statistics.

    Each verify cycle accepts k in 0..depth drafted tokens plus one token from the target,
    so completion_tokens = sum(k * hist[k]) + n_cycles and tau = completion / n_cycles;
    a cycle that accepted k tokens attempted depths 1..min(k+1, depth) and accepted 1..k.
    """
    n_cycles = rng.randint(1, 30)
    hist = [0] * (depth + 1)
    for _ in range(n_cycles):
        hist[rng.choice([0, 1, 1, 2, 2, 3, 4, depth])] += 1
    completion = sum(k * c for k, c in enumerate(hist)) + n_cycles
    attempts = [sum(c for k, c in enumerate(hist) if k >= d - 1) for d in range(1, depth + 1)]
    accepts = [sum(c for k, c in enumerate(hist) if k >= d) for d in range(1, depth + 1)]
    draft_ms = rng.uniform(5, 200)
    verify_ms = rng.uniform(5, 300)
    total_ms = draft_ms + verify_ms + rng.uniform(1, 50)
    row = {
        **_identity(request_row),
        "output_text": f"answer {request_row['sample_id']}",
        "turn_outputs": [f"answer {request_row['sample_id']}"],
        "prompt_tokens": rng.randint(5, 100),
        "completion_tokens": completion,
        "finish_reason": rng.choice(["stop", "length"]),
        "logprobs": None,
        "seed": 7,
        "n_cycles": n_cycles,
        "mean_accept_length": completion / n_cycles,
        "mean_tree_size": rng.choice([1.0, 4.5, 8.0]),
        "accept_hist": hist,
        "depth_attempts": attempts,
        "depth_accepts": accepts,
        "draft_ms": draft_ms,
        "verify_ms": verify_ms,
        "total_ms": total_ms,
        "tokens_per_s": completion / total_ms * 1000,
        "worker": "w1@test",
        "device": "cpu",
        "status": "ok",
        "error": None,
    }
    row.update(overrides)
    return row


def _failed_sample(request_row: dict[str, Any], error: str = "boom") -> dict[str, Any]:
    """A failed output row: identity and settings only, no measurements."""
    return {
        **_identity(request_row),
        "worker": "w1@test",
        "device": "cpu",
        "status": "failed",
        "error": error,
    }


@pytest.fixture
def fake_sample() -> Callable[..., dict[str, Any]]:
    """Builder of ok output rows: fake_sample(request_row, rng, depth=5, **overrides)."""
    return _fake_sample


@pytest.fixture
def failed_sample() -> Callable[..., dict[str, Any]]:
    """Builder of failed output rows: failed_sample(request_row, error="boom")."""
    return _failed_sample


@pytest.fixture
def make_job() -> Callable[..., tuple[str, list[dict[str, Any]]]]:
    """Factory: a job of `n` lines over shards of `shard_size` lines, each line asking for
    `completions` samples (ids q<i>, or q<i>#<k> with several).

    Returns (job_id, manifest rows). Categories cycle through `categories`; every
    third line gets a custom_id so exports can be checked both ways.
    """

    def make(
        engine: Engine,
        n: int = 10,
        shard_size: int = 4,
        categories: tuple[str | None, ...] = ("writing", "math", None),
        completions: int = 1,
    ) -> tuple[str, list[dict[str, Any]]]:
        job_id = insert_job(
            engine,
            input_path="prompts.jsonl",
            model="tiny-llama",
            draft="tiny-eagle",
            mode="eagle2",
            params={"max_new_tokens": 32, "tree_depth": 5, "tree_width": 8, "total_tokens": 60},
            n_expected=n * completions,
            n_shards=(n + shard_size - 1) // shard_size,
        )
        requests = [
            {
                "job_id": job_id,
                "sample_id": f"q{i}" if completions == 1 else f"q{i}#{k}",
                "line_no": i + 1,
                "shard": i // shard_size,
                "payload": {
                    "prompt": f"question {i}",
                    "category": categories[i % len(categories)],
                    "custom_id": f"req-{i}" if i % 3 == 0 else None,
                    "request_id": f"q{i}",
                    "choice_index": k,
                },
            }
            for i in range(n)
            for k in range(completions)
        ]
        insert_requests(engine, requests)
        return job_id, requests

    return make
