"""Bad input at scale, property-based, on Postgres and SQLite: any mix of lines (random
bytes, JSON-ish values, BOMs, blanks, a truncated last line, and objects drawing every
field a line may carry with hostile values: NUL, lone surrogates, ids too long for their
completions, generation controls out of range, unknown fields such as metadata) under any
job options (--n, --system,
--stop) becomes a job where every non-blank line is exactly one set of manifest rows or
one rejected line with its number, everything stored is storable, and nothing crashes."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select

from migrations import upgrade
from producer.creation import create_job
from producer.jobs import make_spec
from producer.storable import text_problem
from producer.tokenizer import ContextCheck, context_check
from producer.validate import MAX_ID_CHARS
from tests.producer.test_inputs import LINE
from tests.producer.test_jobs import CONTEXT, save_tiny_model
from workers import db
from workers.request import Request

pytestmark = [pytest.mark.faults, pytest.mark.integration]


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def fuzz_engine(
    request: pytest.FixtureRequest,
    make_pg_database: Callable[[], str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Engine]:
    """A database of this module's own, on each backend."""
    if request.param == "postgres":
        url = make_pg_database()
    else:
        url = f"sqlite:///{tmp_path_factory.mktemp('fuzz-db') / 'eagle2.db'}"
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


# Texts a user's file can hold: mostly the tiny model's words, sometimes empty, blank, NUL,
# lone surrogates (a JSON \udXXX escape), or long enough to crowd an id column.
WORDS = st.text(st.sampled_from("t5 6789"), min_size=1, max_size=12).filter(str.strip)
HOSTILE = st.sampled_from(["\x00", "a\x00b", "\ud800", "x\udfff", " ", "", "é✓", '"\\'])
TEXT = st.one_of(WORDS, WORDS, WORDS, HOSTILE, st.integers(240, 260).map("i".__mul__))


def mostly(good: st.SearchStrategy[Any], *bad: Any) -> st.SearchStrategy[Any]:
    """Good values seven times in eight, else one of `bad` (or null: not set)."""
    return st.one_of(*[good] * 7, st.sampled_from([None, *bad]))


MESSAGE = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["system", "assistant"]), "tool", "\x00"), "content": TEXT}
)
MESSAGES = st.tuples(st.lists(MESSAGE, max_size=3), TEXT).map(
    lambda parts: [*parts[0], {"role": "user", "content": parts[1]}]
)
SETTINGS = {
    "stop": mostly(st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=4)), [], ["a"] * 5, 3),
    "n": mostly(st.integers(1, 3), 0, 129, "2", 2.0),
    "max_tokens": mostly(st.integers(1, 64), 0, -1, 2**40, "8"),
    "temperature": mostly(st.floats(0, 2), -1, "hot"),
    "top_p": mostly(st.floats(0.01, 1), 0, 1.5),
    "seed": mostly(st.integers(0, 2**63 - 1), -1, 2**63),
    "top_k": mostly(st.integers(0, 10), -1, 2.5),
    "min_p": mostly(st.floats(0, 1), 1.5, "0.1"),
    "repetition_penalty": mostly(st.floats(0.5, 2), 0, -1),
    "presence_penalty": mostly(st.floats(-2, 2), 3),
    "frequency_penalty": mostly(st.floats(-2, 2), "x"),
    "logit_bias": mostly(
        st.dictionaries(st.integers(0, 95).map(str), st.floats(-100, 100), max_size=3),
        {"\udc80": 5},
        {"1": "\x00"},
        {"a\x00": 1},
        [1],
        {"7": 101},
    ),  # fmt: skip
    "stop_token_ids": mostly(st.lists(st.integers(0, 95), max_size=3), [-1], ["\x00"], "2"),
    "min_tokens": mostly(st.integers(0, 4), -1),
    "logprobs": mostly(st.booleans(), 1, "\ud800"),
    "top_logprobs": mostly(st.integers(0, 5), 21),
}
EXTRA = st.dictionaries(  # fields nothing reads: never stored, never a reason to refuse
    st.sampled_from(["model", "user", "metadata", "reference"]),
    st.one_of(TEXT, st.dictionaries(TEXT, st.integers(-100, 100), max_size=3)),
    max_size=2,
)
IDS = st.one_of(
    st.just({}),
    mostly(st.one_of(TEXT, st.integers(0, 10**6)), 1.5, []).map(lambda v: {"id": v}),
    st.integers(0, 50).map(lambda v: {"question_id": v}),
)
CONTENTS = st.one_of(
    TEXT.map(lambda text: {"prompt": text}),
    MESSAGES.map(lambda messages: {"messages": messages}),
    st.lists(TEXT, min_size=1, max_size=3).map(lambda turns: {"turns": turns}),
)
PLAIN = st.tuples(
    IDS,
    CONTENTS,
    st.fixed_dictionaries({}, optional={**SETTINGS, "category": TEXT}),
    EXTRA,
).map(lambda parts: {k: v for part in parts for k, v in part.items()})
OPENAI = st.tuples(
    mostly(TEXT, 7),
    st.fixed_dictionaries(
        {"messages": MESSAGES},
        optional={**SETTINGS, "max_completion_tokens": SETTINGS["max_tokens"], "metadata": EXTRA},
    ),
    st.fixed_dictionaries({}, optional={"n": SETTINGS["n"], "seed": SETTINGS["seed"]}),
    EXTRA,
).map(
    lambda parts: {
        **parts[3],
        **parts[2],
        "custom_id": parts[0],
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": parts[1],
    }
)
OBJECT_LINE = (PLAIN | OPENAI).map(lambda line: json.dumps(line).encode())

# A good line with one field made hostile, and the field its rejection must name.
GOOD = {"id": "ok", "prompt": "t5 t6"}
POISONED = st.one_of(
    HOSTILE.filter(text_problem).map(lambda t: ({**GOOD, "stop": t}, 'field "stop"')),
    HOSTILE.filter(text_problem).map(lambda t: ({**GOOD, "stop": ["t9", t]}, 'field "stop[1]"')),
    HOSTILE.filter(text_problem).map(lambda t: ({**GOOD, "prompt": t}, 'field "prompt"')),
    HOSTILE.filter(text_problem).map(lambda t: ({**GOOD, "category": t}, 'field "category"')),
    HOSTILE.filter(text_problem).map(
        lambda t: ({**GOOD, "logit_bias": {"5": 1, t: 2}}, 'field "logit_bias"')
    ),
    st.just(({"id": "i" * 254, "prompt": "t5", "n": 2}, 'field "id"')),
    HOSTILE.filter(text_problem).map(
        lambda t: (
            {
                "custom_id": "c",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "t5"}], "stop": t},
            },
            'field "body.stop"',
        )  # fmt: skip
    ),
)

# A line of more tokens than the tiny model's context, and one cut off mid-object.
OVER_CONTEXT = b'{"prompt": "' + b"t5 " * (2 * CONTEXT) + b'"}'
CUT = st.sampled_from([OVER_CONTEXT, b'{"prompt": "t5'])
JOB_OPTIONS = st.fixed_dictionaries(
    {},
    optional={
        "n": st.integers(1, 3),
        "system": st.sampled_from(["Be brief.", "t7 t8"]),
        "stop": st.lists(st.sampled_from(["t9", "\n\n", "END"]), min_size=1, max_size=4),
    },
)


def strings_in(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from strings_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings_in(item)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lines=st.lists(LINE | OBJECT_LINE | CUT, max_size=25),
    poisoned=st.lists(POISONED, max_size=3),
    final_newline=st.booleans(),
    shard_size=st.integers(1, 6),
    options=JOB_OPTIONS,
)
def test_every_line_becomes_its_manifest_rows_or_one_rejected_line(
    tmp_path_factory: pytest.TempPathFactory,
    fuzz_engine: Engine,
    model: tuple[Path, ContextCheck],
    lines: list[bytes],
    poisoned: list[tuple[dict[str, Any], str]],
    final_newline: bool,
    shard_size: int,
    options: dict[str, Any],
) -> None:
    engine = fuzz_engine
    lines = list(lines)
    fields: list[str | None] = [None] * len(lines)
    for i, (line, field) in enumerate(poisoned):
        at = min(len(lines), 2 * i + 1)
        lines.insert(at, json.dumps(line).encode())
        fields.insert(at, field)
    # Each poisoned line's number (generated lines may hold newlines): the field its
    # rejection must name.
    named, line_no = {}, 1
    for raw, field in zip(lines, fields, strict=True):
        if field is not None:
            named[line_no] = field
        line_no += raw.count(b"\n") + 1
    data = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    path = tmp_path_factory.getbasetemp() / "fuzz.jsonl"
    path.write_bytes(data)
    model_dir, context = model
    spec = make_spec(
        model=str(model_dir), draft=None, mode="vanilla", shard_size=shard_size, **options
    )

    job_id, plan = create_job(engine, path, spec, context)

    with engine.connect() as conn:
        requests = conn.execute(
            select(db.requests_t.c.line_no, db.requests_t.c.shard, db.requests_t.c.sample_id,
                   db.requests_t.c.payload).where(db.requests_t.c.job_id == job_id)
        ).all()  # fmt: skip
        rejected = dict(
            conn.execute(
                select(db.rejected_lines_t.c.line_no, db.rejected_lines_t.c.reason).where(
                    db.rejected_lines_t.c.job_id == job_id
                )
            ).all()
        )
        shards = conn.execute(
            select(db.shards_t.c.shard, db.shards_t.c.n_samples).where(
                db.shards_t.c.job_id == job_id
            )
        ).all()
    good = sorted({r.line_no for r in requests})
    assert sorted(good + list(rejected)) == non_blank_lines(data)  # each line once, by number
    assert not set(good) & set(rejected)
    assert all(reason for reason in rejected.values())
    for line_no, field in named.items():  # a hostile text is named by its line and field
        assert rejected[line_no].startswith(field), (line_no, rejected[line_no])
    too_long = [n for n, line in enumerate(data.split(b"\n"), 1) if line == OVER_CONTEXT]
    assert all("context" in rejected.get(n, "") for n in too_long)
    ids = [r.sample_id for r in requests]
    assert len(set(ids)) == len(ids) and max(map(len, ids), default=0) <= MAX_ID_CHARS
    assert all(r.shard == (r.line_no - 1) // shard_size for r in requests)
    assert dict(shards) == Counter(r.shard for r in requests)
    per_line = Counter(r.line_no for r in requests)
    pending = [row for s, _ in shards for row in db.pending_requests(engine, job_id, s)]
    assert len(pending) == len(requests)
    for row in pending:  # what a worker decodes: storable, and the line's n completions
        payload = {**row["payload"], "sample_id": row["sample_id"], "line_no": row["line_no"]}
        assert all(text_problem(text) is None for text in strings_in(payload))
        request = Request.from_payload(payload)
        assert request.messages[-1]["role"] == "user"
        assert per_line[row["line_no"]] == request.n
        if options.get("system"):  # it opens every conversation without a system message
            assert request.messages[0]["role"] == "system"
    job = db.get_job(engine, job_id)
    assert (job["n_expected"], job["n_rejected"], job["n_shards"]) == (
        len(requests),
        len(rejected),
        len(shards),
    )
    assert (plan.completions, plan.rejected) == (len(requests), len(rejected))
