"""Job creation, shared by `submit` (Celery) and `run` (embedded): one streaming pass
over the input that validates every line and writes the job row, then the manifest
(expected samples), the rejected lines and the shard rows, in batches.

Nothing is enqueued or decoded here: the caller does that only after `create_job`
returns, so a worker never sees a shard whose manifest is incomplete. A job whose
creation fails part-way is deleted again, never left half-written. Memory stays flat
in the number of lines: one shard and one write batch are held at a time, plus the
ids the validator keeps to refuse duplicates (and `skip_ids`, when given).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, delete, select, update

from eagle2_core.config import JOB_DECODE_KEYS, DecodeConfig
from eagle2_core.registry import (
    DraftUnavailableError,
    ModelLoadError,
    draft_source,
    encode_chat,
    resolve_model,
)
from producer.inputs import Rejected, Request, Shard, plan_shards, read_requests
from producer.validate import completions_count, stop_strings
from workers.db import (
    insert_job,
    insert_rejected_lines,
    insert_requests,
    insert_shards,
    update_job,
)
from workers.schema import SHARD_STATES, jobs_t, samples_t, shards_t

# How many rejected lines are quoted on stderr; all of them are stored.
SHOWN_REJECTED = 10
# Manifest rows per insert call: large enough to amortise a round trip, small enough
# that a write batch of long prompts stays a few MB.
_BATCH_ROWS = 5000

ContextCheck = tuple[Callable[[Request], int], int]


class JobError(Exception):
    """The job cannot be created as asked; the message is the one-line reason."""


def one_line(exc: BaseException) -> str:
    """An error's first line (its type's name if it has no message): a JobError's reason."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass(frozen=True)
class JobSpec:
    """What a job runs: stored in the job row, read back by every worker."""

    model: str
    draft: str | None
    mode: str
    params: dict[str, Any]
    shard_size: int
    system: str | None = None  # opens every conversation that has no system message
    n: int = 1  # completions of a line that does not say

    def stored_params(self, **extra: Any) -> dict[str, Any]:
        """The job row's params: decode settings, the shard size, the job's system prompt,
        its completions per line and any `extra` notes."""
        system = {"system": self.system} if self.system is not None else {}
        n = {"n": self.n} if self.n != 1 else {}
        return {**self.params, "shard_size": self.shard_size, **system, **n, **extra}

    def greedy(self, request: Request) -> bool:
        """Whether the request decodes greedily (temperature 0), its own or the job's."""
        temperature = request.overrides.get("temperature", self.params.get("temperature"))
        return not temperature


def _local_or_name(name: str) -> str:
    """An existing local path made absolute (workers have another working directory)."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def make_spec(
    *,
    model: str,
    draft: str | None,
    mode: str,
    shard_size: int,
    system: str | None = None,
    n: int = 1,
    **params: Any,
) -> JobSpec:
    """Check the options together; raises JobError with the reason.

    The model name is kept as given: workers pick their queue from the name they were
    started with (workers.celery_app.queue_for). A local draft directory is made absolute,
    since workers read it from the job row. `draft` None means the head shipped for the
    model alias; eagle1/eagle2 without one is refused here rather than by every worker.
    Vanilla decoding stores no draft.
    """
    unknown = params.keys() - set(JOB_DECODE_KEYS)
    if unknown:
        raise ValueError(f"unknown decode parameters {sorted(unknown)}")
    try:
        if params.get("stop"):
            params = {**params, "stop": stop_strings(params["stop"], "--stop")}
        given = {k: v for k, v in params.items() if v is not None}
        if "stop" in given:
            given["stop"] = tuple(given["stop"])
        DecodeConfig(mode=mode, **given)
    except ValueError as exc:
        raise JobError(str(exc)) from exc
    if shard_size < 1:
        raise JobError(f"--shard-size must be >= 1, got {shard_size}")
    if mode == "vanilla":
        draft = None
    elif draft is None:
        try:
            draft_source(model, draft)
        except DraftUnavailableError as exc:
            raise JobError(f"mode {mode}: {exc}") from None
    else:
        draft = _local_or_name(draft)
    if system is not None and not system.strip():
        raise JobError("--system: the system prompt is empty")
    try:
        completions_count(n, "--n")
    except ValueError as exc:
        raise JobError(str(exc)) from None
    return JobSpec(model, draft, mode, params, shard_size, system, n)


def context_check(model: str) -> ContextCheck:
    """(prompt token counter, context length) from the model's tokenizer and config only:
    the weights are never loaded by the producer."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        source = resolve_model(model)
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except (ModelLoadError, OSError, ValueError) as exc:
        raise JobError(f"cannot load the tokenizer of model {model!r}: {one_line(exc)}") from exc
    max_context = int(config.max_position_embeddings)
    return prompt_token_counter(tokenizer, max_context), max_context


def prompt_token_counter(tokenizer: Any, max_context: int) -> Callable[[Request], int]:
    """count(request) = len(encode_chat(tokenizer, messages)), with one sound shortcut.

    Tokenizing costs ~5x rendering the chat template. When the tokenizer has no
    normalizer (so no text expansion), every token covers at least one byte of the
    rendered text, so its byte length plus the specials the tokenizer may add bounds the
    count; a bound below the context passes the check the same way the count would,
    and is returned instead. Anything near the limit is tokenized exactly.
    """

    def exact(request: Request) -> int:
        return len(encode_chat(tokenizer, request.messages))

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None or not tokenizer.chat_template:
        return exact
    # Post-processor specials (BOS/EOS) and a prefix space some pre-tokenizers insert.
    slack = len(backend.encode("").ids) + 1
    render = tokenizer.apply_chat_template

    def count(request: Request) -> int:
        text = render(request.messages, add_generation_prompt=True, tokenize=False)
        bound = len(text.encode("utf-8")) + slack
        return bound if bound < max_context else exact(request)

    return count


@dataclass
class Plan:
    """What one pass over the input found (the dry-run report and the job's counts)."""

    lines: int = 0  # non-blank lines
    requests: int = 0  # good lines with a completion to run
    completions: int = 0  # samples that will run: each request's n, less those skipped
    rejected: int = 0
    skipped: int = 0  # completions already done in the --resume-from job
    shards: int = 0  # shards with at least one request to run
    identical: int = 0  # requests of several completions decoded greedily: all the same
    examples: list[Rejected] = field(default_factory=list)

    def add(self, shard: Shard, keep: list[Request], spec: JobSpec) -> None:
        """Count one shard of `plan_shards` output, of whose completions `keep` run."""
        self.lines += len(shard.requests) + len(shard.rejected)
        self.requests += len({r.line_no for r in keep})
        self.completions += len(keep)
        self.skipped += sum(r.n for r in shard.requests) - len(keep)
        self.identical += sum(r.n > 1 and spec.greedy(r) for r in shard.requests)
        self.rejected += len(shard.rejected)
        self.shards += bool(keep)
        room = SHOWN_REJECTED - len(self.examples)
        if room > 0:
            self.examples.extend(shard.rejected[:room])

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready counts and the quoted rejections."""
        return {
            "lines": self.lines,
            "requests": self.requests,
            "completions": self.completions,
            "rejected": self.rejected,
            "skipped": self.skipped,
            "shards": self.shards,
            "identical": self.identical,
            "rejected_examples": [str(r) for r in self.examples],
        }


def _scan(
    input_path: Path,
    spec: JobSpec,
    context: ContextCheck,
    skip_ids: Collection[str],
    plan: Plan,
    on_lines: Callable[[int], None] | None,
) -> Iterator[tuple[Shard, list[Request]]]:
    count, max_context = context
    items = read_requests(
        input_path,
        count_prompt_tokens=count,
        max_context=max_context,
        system=spec.system,
        n=spec.n,
    )
    seed = spec.params.get("seed")
    for shard in plan_shards(items, spec.shard_size):
        completions = (c for r in shard.requests for c in r.completions(seed))
        keep = [c for c in completions if c.sample_id not in skip_ids]
        plan.add(shard, keep, spec)
        if on_lines is not None:
            on_lines(len(shard.requests) + len(shard.rejected))
        yield shard, keep


def plan_job(
    input_path: Path,
    spec: JobSpec,
    context: ContextCheck,
    *,
    skip_ids: Collection[str] = frozenset(),
    on_lines: Callable[[int], None] | None = None,
) -> Plan:
    """Validate the whole input and count what a job would hold; writes nothing."""
    plan = Plan()
    for _ in _scan(input_path, spec, context, skip_ids, plan, on_lines):
        pass
    return plan


def create_job(
    engine: Engine,
    input_path: Path,
    spec: JobSpec,
    context: ContextCheck,
    *,
    skip_ids: Collection[str] = frozenset(),
    strict: bool = False,
    extra_params: dict[str, Any] | None = None,
    on_lines: Callable[[int], None] | None = None,
) -> tuple[str, Plan]:
    """Write a job: its row, then manifest, rejected lines and shard rows, in batches.

    Returns (job id, plan). Each completion of a request is a manifest row of its own
    (workers.request.Request.completions). `skip_ids` are sample ids left out of the
    manifest (already done elsewhere). With `strict`, a bad line aborts (JobError) and
    the job is deleted: callers validate first (`plan_job`) so that normally nothing is
    written at all.
    """
    input_path = Path(input_path).resolve()
    job_id = insert_job(
        engine,
        input_path=str(input_path),
        model=spec.model,
        draft=spec.draft,
        mode=spec.mode,
        params=spec.stored_params(**input_fingerprint(input_path), **(extra_params or {})),
    )
    plan = Plan()
    try:
        requests: list[dict[str, Any]] = []
        rejected: list[dict[str, Any]] = []
        shards: list[dict[str, Any]] = []

        def flush() -> None:
            insert_requests(engine, requests)
            insert_rejected_lines(engine, rejected)
            insert_shards(engine, shards)
            requests.clear()
            rejected.clear()
            shards.clear()

        for shard, keep in _scan(input_path, spec, context, skip_ids, plan, on_lines):
            if strict and shard.rejected:
                raise JobError(f"--strict: {shard.rejected[0]} (the input changed?)")
            requests.extend(
                {
                    "job_id": job_id,
                    "sample_id": r.sample_id,
                    "line_no": r.line_no,
                    "shard": shard.index,
                    "payload": r.to_payload(),
                }
                for r in keep
            )
            rejected.extend(
                {
                    "job_id": job_id,
                    "line_no": r.line_no,
                    "sample_id": r.sample_id,
                    "reason": r.reason,
                }
                for r in shard.rejected
            )
            if keep:
                shards.append(
                    {
                        "job_id": job_id,
                        "shard": shard.index,
                        "line_start": shard.first_line,
                        "line_end": _last_line(shard),
                        "n_samples": len(keep),
                    }
                )
            if len(requests) + len(rejected) >= _BATCH_ROWS:
                flush()
        flush()
        update_job(
            engine,
            job_id,
            n_expected=plan.completions,
            n_rejected=plan.rejected,
            n_shards=plan.shards,
        )
    except BaseException:
        delete_job(engine, job_id)
        raise
    return job_id, plan


def _last_line(shard: Shard) -> int:
    """The shard's last non-blank line (its nominal range may run past the file's end)."""
    return max(items[-1].line_no for items in (shard.requests, shard.rejected) if items)


def delete_job(engine: Engine, job_id: str) -> None:
    """Remove a job and (cascading) everything stored under it."""
    with engine.begin() as conn:
        conn.execute(delete(jobs_t).where(jobs_t.c.id == job_id))


def shard_ids(engine: Engine, job_id: str) -> list[int]:
    """Every shard of a job, in order (what `submit` enqueues)."""
    stmt = select(shards_t.c.shard).where(shards_t.c.job_id == job_id).order_by(shards_t.c.shard)
    with engine.connect() as conn:
        return list(conn.execute(stmt).scalars())


def ok_sample_ids(engine: Engine, job_id: str) -> set[str]:
    """Ids of a job's successful samples: what `--resume-from` skips (failed ones rerun)."""
    stmt = select(samples_t.c.sample_id).where(
        samples_t.c.job_id == job_id, samples_t.c.status == "ok"
    )
    with engine.connect() as conn:
        return set(conn.execute(stmt).scalars())


def set_shards_state(
    engine: Engine,
    job_id: str,
    state: str,
    *,
    shards: list[int] | None = None,
    expect: Collection[str] | None = None,
) -> int:
    """Move many shards of a job to `state` at once (cancel, resume); returns how many.

    'queued' clears the previous attempt's finish time and error; other states stamp
    finished_at.
    """
    if state not in SHARD_STATES:
        raise ValueError(f"unknown shard state {state!r}")
    values: dict[str, Any] = {"state": state, "finished_at": None, "error": None}
    if state != "queued":
        values = {"state": state, "finished_at": datetime.now(UTC)}
    chunks: list[list[int] | None] = [None]
    if shards is not None:
        chunks = [shards[i : i + 1000] for i in range(0, len(shards), 1000)]
    total = 0
    with engine.begin() as conn:
        for chunk in chunks:
            stmt = update(shards_t).where(shards_t.c.job_id == job_id).values(**values)
            if chunk is not None:
                stmt = stmt.where(shards_t.c.shard.in_(chunk))
            if expect is not None:
                stmt = stmt.where(shards_t.c.state.in_(list(expect)))
            total += conn.execute(stmt).rowcount
    return total


def input_fingerprint(path: Path) -> dict[str, int]:
    """Size and modification time: enough for `run` to tell an edited input from the same one."""
    stat = os.stat(path)
    return {"input_size": stat.st_size, "input_mtime_ns": stat.st_mtime_ns}
