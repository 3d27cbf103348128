"""Job creation (producer/creation.py) against real databases: a generated file of mixed good
and bad lines ends up exactly as manifest + rejected lines + shards, nothing else;
--strict, skipped ids, a failure part-way, and the prompt-length shortcut."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, select

from eagle2_core.draft import new_draft_head, save_draft
from producer import creation, tokenizer
from producer.creation import create_job, plan_job
from producer.inputs import Request, read_requests, shard_of
from producer.jobs import JobError, JobSpec, make_spec
from tests.eagle2_core.tiny import tiny_target
from workers import db

CONTEXT = 128
CHAT_TEMPLATE = (
    "{% for m in messages %}t2 {{ m['content'] }} t3 {% endfor %}"
    "{% if add_generation_prompt %}t4{% endif %}"
)


def save_tiny_model(root: Path, with_draft: bool = True) -> tuple[Path, Path | None]:
    """A tiny random Llama (context CONTEXT tokens) with a chat-template tokenizer, and a
    random draft head for it, saved as a user would point --model and --draft at them."""
    target = tiny_target(max_positions=CONTEXT)
    target.tokenizer.chat_template = CHAT_TEMPLATE
    model_dir = root / "tiny-model"
    target.model.save_pretrained(model_dir)
    target.tokenizer.save_pretrained(model_dir)
    if not with_draft:
        return model_dir, None
    return model_dir, save_draft(new_draft_head(target.model.config), root / "tiny-head")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("model"), with_draft=False)[0]


def spec(model: Path | str, shard_size: int = 7, **params: Any) -> JobSpec:
    return make_spec(model=str(model), draft=None, mode="vanilla", shard_size=shard_size, **params)


# ------------------------------------------------------------- a file of known lines


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"t{rng.randrange(5, 96)}" for _ in range(n))


def mixed_lines(rng: random.Random, n: int) -> tuple[list[str], dict[int, str], set[int]]:
    """(file lines, good line -> sample id, bad line numbers); blank lines count as lines
    of the file but are neither good nor bad."""
    lines: list[str] = []
    good: dict[int, str] = {}
    bad: set[int] = set()
    for i in range(n):
        line_no = len(lines) + 1
        kind = rng.choice(
            ["prompt", "prompt", "noid", "messages", "turns", "openai", "medium"]
            + ["blank", "badjson", "empty", "role", "dup", "long", "array", "temp"]
        )
        sid = f"id-{i}"
        if kind == "prompt":
            obj: Any = {"id": sid, "prompt": _words(rng, 3), "max_tokens": 4}
        elif kind == "noid":
            obj, sid = {"prompt": _words(rng, 2)}, f"line-{line_no}"
        elif kind == "messages":
            obj = {
                "id": sid,
                "messages": [
                    {"role": "system", "content": "t9"},
                    {"role": "user", "content": _words(rng, 2)},
                ],
            }
        elif kind == "turns":
            obj, sid = {"question_id": 10_000 + i, "turns": ["t5 t6", "t7"]}, str(10_000 + i)
        elif kind == "openai":
            body = {"messages": [{"role": "user", "content": "t8"}], "max_tokens": 3}
            obj = {"custom_id": sid, "method": "POST", "url": "/v1/chat/completions", "body": body}
        elif kind == "medium":  # over the byte bound, under the context: tokenized exactly
            obj = {"id": sid, "prompt": _words(rng, 40)}
        elif kind == "blank":
            lines.append("   ")
            continue
        elif kind == "dup" and good:
            obj = {"id": rng.choice(list(good.values())), "prompt": "t5"}
        else:
            obj = {
                "badjson": '{"id": "x", "prompt": ',
                "empty": {"id": sid, "prompt": ""},
                "role": {"id": sid, "messages": [{"role": "robot", "content": "t5"}]},
                "dup": {"id": sid, "prompt": "", "note": "no good id yet"},
                "long": {"id": sid, "prompt": _words(rng, CONTEXT + 5)},
                "array": ["not", "an", "object"],
                "temp": {"id": sid, "prompt": "t5", "temperature": -1},
            }[kind]
            lines.append(obj if isinstance(obj, str) else json.dumps(obj))
            bad.add(line_no)
            continue
        if kind == "dup":
            bad.add(line_no)
        else:
            good[line_no] = sid
        lines.append(json.dumps(obj))
    return lines, good, bad


def _rows(engine: Engine, table: Any, job_id: str) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        result = conn.execute(select(table).where(table.c.job_id == job_id))
        return [dict(r) for r in result.mappings()]


@pytest.mark.parametrize("seed", [0, 1])
def test_fuzz_file_becomes_exactly_manifest_rejected_and_shards(
    engine: Engine, tiny_model: Path, tmp_path: Path, seed: int
) -> None:
    lines, good, bad = mixed_lines(random.Random(seed), 300)
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    job_spec = spec(tiny_model, shard_size=7)
    context = tokenizer.context_check(str(tiny_model))
    assert context[1] == CONTEXT

    job_id, plan = create_job(engine, path, job_spec, context)

    requests = _rows(engine, db.requests_t, job_id)
    assert {r["line_no"]: r["sample_id"] for r in requests} == good
    assert all(r["shard"] == shard_of(r["line_no"], 7) for r in requests)
    for r in requests:
        assert Request.from_payload(r["payload"]).sample_id == r["sample_id"]
    rejected = _rows(engine, db.rejected_lines_t, job_id)
    assert {r["line_no"] for r in rejected} == bad
    assert all(r["reason"] for r in rejected)
    long_lines = [r for r in rejected if "leaves no room to generate" in r["reason"]]
    assert long_lines and all(f"context is {CONTEXT} tokens" in r["reason"] for r in long_lines)

    shards = _rows(engine, db.shards_t, job_id)
    want = sorted({shard_of(n, 7) for n in good})
    assert sorted(s["shard"] for s in shards) == want
    for s in shards:
        members = [n for n in good if shard_of(n, 7) == s["shard"]]
        assert s["n_samples"] == len(members) and s["state"] == "queued"
        assert s["line_start"] == s["shard"] * 7 + 1 <= min(members)
        assert max(members) <= s["line_end"] <= s["line_start"] + 6
    assert _rows(engine, db.samples_t, job_id) == []

    job = db.get_job(engine, job_id)
    assert job is not None
    assert (job["n_expected"], job["n_rejected"], job["n_shards"]) == (
        len(good),
        len(bad),
        len(want),
    )
    assert job["state"] == "queued" and job["mode"] == "vanilla" and job["draft"] is None
    assert job["params"]["shard_size"] == 7 and job["params"]["input_size"] == path.stat().st_size
    assert plan.as_dict()["lines"] == len(good) + len(bad)
    assert plan.rejected == len(bad) and plan.shards == len(want)
    assert plan.examples == sorted(plan.examples, key=lambda r: r.line_no)
    assert len(plan.examples) == min(len(bad), creation.SHOWN_REJECTED)


def test_plan_writes_nothing_and_counts_like_create(
    sqlite_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    lines, good, bad = mixed_lines(random.Random(5), 120)
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    context = tokenizer.context_check(str(tiny_model))
    seen: list[int] = []
    plan = plan_job(path, spec(tiny_model), context, on_lines=seen.append)
    assert (plan.requests, plan.rejected, plan.lines) == (len(good), len(bad), sum(seen))
    engine = db.make_engine(sqlite_url)
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(db.jobs_t)).scalar() == 0
    job_id, created = create_job(engine, path, spec(tiny_model), context)
    assert created.as_dict() == plan.as_dict()
    engine.dispose()


def test_skip_ids_leave_samples_out_and_count_them(
    sqlite_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": f"s{i}", "prompt": "t5"}) + "\n" for i in range(10)))
    engine = db.make_engine(sqlite_url)
    skip = {"s0", "s1", "s2", "s7"}  # shard 0 (lines 1-3) is then empty: no shard row
    job_id, plan = create_job(
        engine,
        path,
        spec(tiny_model, shard_size=3),
        tokenizer.context_check(str(tiny_model)),
        skip_ids=skip,
        extra_params={"resume_from": "old"},
    )
    assert {r["sample_id"] for r in _rows(engine, db.requests_t, job_id)} == {
        f"s{i}" for i in range(10)
    } - skip
    assert (plan.requests, plan.skipped, plan.shards) == (6, 4, 3)
    assert [s["shard"] for s in _rows(engine, db.shards_t, job_id)] == [1, 2, 3]
    assert db.get_job(engine, job_id)["params"]["resume_from"] == "old"  # type: ignore[index]
    engine.dispose()


def test_strict_create_deletes_the_job_on_a_bad_line(
    sqlite_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    path = tmp_path / "in.jsonl"
    good = [json.dumps({"id": f"s{i}", "prompt": "t5"}) for i in range(20)]
    path.write_text("\n".join([*good, "{oops"]) + "\n")
    engine = db.make_engine(sqlite_url)
    with pytest.raises(JobError, match="line 21: invalid JSON"):
        create_job(
            engine, path, spec(tiny_model, 3), tokenizer.context_check(str(tiny_model)), strict=True
        )
    for table in (db.jobs_t, db.requests_t, db.shards_t, db.rejected_lines_t):
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(table)).scalar() == 0
    engine.dispose()


def test_an_unreadable_input_fails_in_the_reading_process_and_leaves_no_job(
    sqlite_url: str, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from producer.inputs import InputFileError

    bad = tmp_path / "in.parquet"
    bad.write_bytes(b"PAR1 not really")
    engine = db.make_engine(sqlite_url)
    context = tokenizer.context_check(str(tiny_model))
    with pytest.raises(InputFileError, match="not a readable Parquet file"):
        create_job(engine, bad, spec(tiny_model, 5), context)
    good = tmp_path / "in.jsonl"
    good.write_text(json.dumps({"prompt": "t5"}) + "\n")
    monkeypatch.setattr(creation, "_scan", lambda *args: os._exit(3))  # the reader dies
    with pytest.raises(JobError, match="reading the input stopped: its process exited with code 3"):
        create_job(engine, good, spec(tiny_model, 5), context)
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(db.jobs_t)).scalar() == 0
    engine.dispose()


def test_failure_part_way_deletes_the_job(
    sqlite_url: str, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": "t5"}) + "\n" for _ in range(50)))
    monkeypatch.setattr(creation, "_BATCH_ROWS", 10)  # the reading process inherits it
    calls = 0

    def flaky_insert(engine: Engine, rows: Any) -> int:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt  # Ctrl-C while the manifest is being written
        return db.insert_shards(engine, rows)

    monkeypatch.setattr(creation, "insert_shards", flaky_insert)
    engine = db.make_engine(sqlite_url)
    with pytest.raises(KeyboardInterrupt):
        create_job(engine, path, spec(tiny_model, 5), tokenizer.context_check(str(tiny_model)))
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(db.jobs_t)).scalar() == 0
        assert conn.execute(select(func.count()).select_from(db.requests_t)).scalar() == 0
    engine.dispose()


def test_spec_checks(tmp_path: Path) -> None:
    head = save_draft(new_draft_head(tiny_target().model.config), tmp_path / "head")
    with pytest.raises(JobError, match="no EAGLE draft head ships for model"):
        make_spec(model="no-such-alias", draft=None, mode="eagle2", shard_size=10)
    with pytest.raises(JobError, match="total_tokens"):
        make_spec(model="m", draft=None, mode="vanilla", shard_size=10, total_tokens=0)
    vanilla = make_spec(model="m", draft=str(head), mode="vanilla", shard_size=10)
    assert vanilla.draft is None
    rel = make_spec(model="m", draft=str(head.relative_to(tmp_path)), mode="eagle1", shard_size=1)
    assert rel.draft == str(head.relative_to(tmp_path))  # not a path from here: kept as given
    assert make_spec(model="m", draft=str(head), mode="eagle2", shard_size=1).draft == str(head)
    with pytest.raises(JobError, match="--adapt-draft trains the draft head"):
        make_spec(model="m", draft=None, mode="vanilla", shard_size=1, adapt_draft=True)
    with pytest.raises(JobError, match="pass --adapt-draft too"):
        make_spec(model="m", draft=str(head), mode="eagle2", shard_size=1, adapt_after=5)
    adapting = make_spec(
        model="m", draft=str(head), mode="eagle2", shard_size=1, adapt_draft=True, adapt_after=5
    )
    assert adapting.settings.adapt_draft and adapting.settings.adapt_after == 5
    with pytest.raises(JobError, match="cannot load the tokenizer"):
        tokenizer.context_check(str(tmp_path / "missing-model"))


def test_a_job_system_prompt_opens_conversations_without_one(
    engine: Engine, tiny_model: Path, tmp_path: Path
) -> None:
    path = tmp_path / "in.jsonl"
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "t6"}]
    lines = [{"id": "a", "prompt": "t5"}, {"id": "b", "messages": own}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    job_spec = make_spec(model=str(tiny_model), draft=None, mode="vanilla", shard_size=5,
                         system="Be brief.")  # fmt: skip
    job_id, plan = create_job(engine, path, job_spec, tokenizer.context_check(str(tiny_model)))
    payloads = {r["sample_id"]: r["payload"] for r in _rows(engine, db.requests_t, job_id)}
    assert payloads["a"]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "t5"},
    ]
    assert payloads["b"]["messages"] == own  # its own system message stays alone
    assert db.get_job(engine, job_id)["params"]["system"] == "Be brief."
    with pytest.raises(JobError, match="--system: the system prompt is empty"):
        make_spec(model=str(tiny_model), draft=None, mode="vanilla", shard_size=5, system=" ")


def test_a_request_of_n_completions_stores_its_conversation_once(
    engine: Engine, tiny_model: Path, tmp_path: Path
) -> None:
    words = _words(random.Random(2), 60)
    lines = [
        {"id": "many", "prompt": words, "n": 4},
        {"id": "one", "prompt": "t5"},
        {"id": "chat", "turns": ["t6 t7", "t8"], "n": 3},
        {"id": "done", "prompt": "t9", "n": 2},  # every completion skipped: nothing stored
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    skip = {"many#0", "done#0", "done#1"}
    context = tokenizer.context_check(str(tiny_model))
    job_id, plan = create_job(engine, path, spec(tiny_model, 10), context, skip_ids=skip)
    assert plan.completions == 3 + 1 + 3
    prompts = {r["request_id"]: r["payload"] for r in _rows(engine, db.prompts_t, job_id)}
    assert prompts == {
        "many": {"messages": [{"role": "user", "content": words}]},
        "chat": {"messages": [{"role": "user", "content": "t6 t7"}], "followups": ["t8"]},
    }
    manifest_rows = _rows(engine, db.requests_t, job_id)
    for row in manifest_rows:
        assert ("messages" in row["payload"]) == (row["sample_id"] == "one")
        assert words not in json.dumps(row["payload"])  # the long prompt is stored once
    # What a worker decodes: every completion with its whole conversation.
    pending = db.pending_requests(engine, job_id, 0)
    decoded = [Request.from_payload({**r["payload"], "sample_id": r["sample_id"]}) for r in pending]
    read = [
        c
        for r in read_requests(path)
        if isinstance(r, Request)
        for c in r.completions()
        if c.sample_id not in skip
    ]
    assert sorted(decoded, key=lambda r: r.sample_id) == sorted(read, key=lambda r: r.sample_id)
