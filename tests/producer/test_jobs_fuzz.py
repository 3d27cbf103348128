"""Bad input at scale, property-based: any mix of lines (random bytes, JSON-ish values,
BOMs, blanks, a truncated last line) becomes a job in Postgres where every non-blank line
is exactly one manifest row or one rejected line with its number, and nothing crashes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select

from migrations import upgrade
from producer.jobs import ContextCheck, context_check, make_spec
from producer.manifest import create_job
from tests.producer.test_inputs import LINE
from tests.producer.test_jobs import CONTEXT, save_tiny_model
from workers import db

pytestmark = [pytest.mark.faults, pytest.mark.integration]


@pytest.fixture(scope="module")
def pg_engine(make_pg_database: Callable[[], str]) -> Iterator[Engine]:
    """A Postgres database of this module's own."""
    url = make_pg_database()
    upgrade(url)
    engine = db.make_engine(url)
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ContextCheck]:
    path = save_tiny_model(tmp_path_factory.mktemp("fuzz-model"), with_draft=False)[0]
    return path, context_check(str(path))


def non_blank_lines(data: bytes) -> list[int]:
    """Line numbers a reader must account for: not empty or whitespace (after a BOM)."""
    physical = data.split(b"\n")
    if physical[-1] == b"":
        physical.pop()
    numbers = []
    for line_no, line in enumerate(physical, 1):
        if line_no == 1 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
        if line and not line.isspace():
            numbers.append(line_no)
    return numbers


# A line of more tokens than the tiny model's context, and one cut off mid-object.
OVER_CONTEXT = b'{"prompt": "' + b"t5 " * (2 * CONTEXT) + b'"}'
EXTRA = st.sampled_from([OVER_CONTEXT, b'{"prompt": "t5'])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lines=st.lists(LINE | EXTRA, max_size=25),
    final_newline=st.booleans(),
    shard_size=st.integers(1, 6),
)
def test_every_line_becomes_one_manifest_row_or_one_rejected_line(
    tmp_path_factory: pytest.TempPathFactory,
    pg_engine: Engine,
    model: tuple[Path, ContextCheck],
    lines: list[bytes],
    final_newline: bool,
    shard_size: int,
) -> None:
    data = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    path = tmp_path_factory.getbasetemp() / "fuzz.jsonl"
    path.write_bytes(data)
    model_dir, context = model
    spec = make_spec(model=str(model_dir), draft=None, mode="vanilla", shard_size=shard_size)

    job_id, plan = create_job(pg_engine, path, spec, context)

    with pg_engine.connect() as conn:
        requests = conn.execute(
            select(db.requests_t.c.line_no, db.requests_t.c.shard, db.requests_t.c.sample_id)
            .where(db.requests_t.c.job_id == job_id)
        ).all()  # fmt: skip
        rejected = conn.execute(
            select(db.rejected_lines_t.c.line_no, db.rejected_lines_t.c.reason).where(
                db.rejected_lines_t.c.job_id == job_id
            )
        ).all()
        shards = conn.execute(
            select(db.shards_t.c.shard, db.shards_t.c.n_samples).where(
                db.shards_t.c.job_id == job_id
            )
        ).all()
    good = [r.line_no for r in requests]
    bad = [r.line_no for r in rejected]
    assert sorted(good + bad) == non_blank_lines(data)  # each line once, by its number
    assert all(reason for _, reason in rejected)
    too_long = [n for n, line in enumerate(data.split(b"\n"), 1) if line == OVER_CONTEXT]
    assert all("context" in dict(rejected).get(n, "") for n in too_long)
    assert len({r.sample_id for r in requests}) == len(requests)
    assert all(r.shard == (r.line_no - 1) // shard_size for r in requests)
    assert dict(shards) == Counter(r.shard for r in requests)
    job = db.get_job(pg_engine, job_id)
    assert (job["n_expected"], job["n_rejected"], job["n_shards"]) == (
        len(requests),
        len(rejected),
        len(shards),
    )
    assert (plan.requests, plan.rejected) == (len(requests), len(rejected))
