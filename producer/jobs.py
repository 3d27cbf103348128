"""A job's settings and its rows, shared by `submit` (Celery) and `run` (embedded):
the spec checked and stored with the job, the prompt-length check's tokenizer, and the
shard and job-row helpers of cancel, resume and --resume-from. Reading the input into
the manifest is producer/manifest.py.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, delete, select, update

from eagle2_core.config import DTYPES, JOB_DECODE_KEYS, DecodeConfig
from eagle2_core.registry import (
    DraftUnavailableError,
    ModelLoadError,
    draft_source,
    resolve_model,
)
from producer.inputs import Request
from producer.prompt_length import TokenCounter, prompt_token_counter
from producer.storable import text_problem
from producer.validate import MAX_ID_CHARS, completions_count, stop_strings
from workers.schema import (
    SHARD_STATES,
    jobs_t,
    samples_t,
    shards_t,
)
from workers.settings import DEFAULT_MAX_ATTEMPTS

ContextCheck = tuple[TokenCounter, int]
# The jobs table's model and draft are String(255) columns, like the ids.
MAX_NAME_CHARS = MAX_ID_CHARS


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
    dtype: str = "auto"  # the number format workers decode in (auto: each device's best)
    max_attempts: int = DEFAULT_MAX_ATTEMPTS  # lost attempts before a shard is given up

    def stored_params(self, **extra: Any) -> dict[str, Any]:
        """The job row's params: decode settings, the shard size, the job's system prompt,
        its completions per line, its dtype, its max attempts and any `extra` notes (those
        at their defaults are left out, so older jobs still match: `run` resumes them)."""
        system = {"system": self.system} if self.system is not None else {}
        n = {"n": self.n} if self.n != 1 else {}
        dtype = {"dtype": self.dtype} if self.dtype != "auto" else {}
        attempts = (
            {"max_attempts": self.max_attempts} if self.max_attempts != DEFAULT_MAX_ATTEMPTS else {}
        )
        return {
            **self.params,
            "shard_size": self.shard_size,
            **system,
            **n,
            **dtype,
            **attempts,
            **extra,
        }

    def greedy(self, request: Request) -> bool:
        """Whether the request decodes greedily (temperature 0), its own or the job's."""
        temperature = request.overrides.get("temperature", self.params.get("temperature"))
        return not temperature


def storable_option(value: str, option: str, max_chars: int | None = None) -> None:
    """Raise JobError naming the option when its text cannot be stored with the job (a NUL,
    a command-line byte that is not UTF-8, longer than its column)."""
    problem = text_problem(value)
    if problem is None and max_chars is not None and len(value) > max_chars:
        problem = f"expected at most {max_chars} characters, got {len(value)}"
    if problem is not None:
        raise JobError(f"{option}: {problem}")


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
    dtype: str = "auto",
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
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
        DecodeConfig.from_settings(mode, {k: v for k, v in params.items() if v is not None})
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
    for option, value, limit in (
        ("--model", model, MAX_NAME_CHARS),
        ("--draft", draft, MAX_NAME_CHARS),
        ("--system", system, None),
    ):
        if value is not None:
            storable_option(value, option, limit)
    try:
        completions_count(n, "--n")
    except ValueError as exc:
        raise JobError(str(exc)) from None
    if dtype not in DTYPES:
        raise JobError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if max_attempts < 1:
        raise JobError(f"--max-attempts must be >= 1, got {max_attempts}")
    return JobSpec(model, draft, mode, params, shard_size, system, n, dtype, max_attempts)


def _tokenizer_and_config(model: str) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoTokenizer

    try:
        source = resolve_model(model)
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except (ModelLoadError, OSError, ValueError) as exc:
        raise JobError(f"cannot load the tokenizer of model {model!r}: {one_line(exc)}") from exc
    return tokenizer, config


def model_tokenizer(model: str) -> Any:
    """The model's tokenizer (its files only: the producer never loads weights)."""
    return _tokenizer_and_config(model)[0]


def context_check(model: str) -> ContextCheck:
    """(prompt token counter, context length) from the model's tokenizer and config only:
    the weights are never loaded by the producer."""
    tokenizer, config = _tokenizer_and_config(model)
    max_context = int(config.max_position_embeddings)
    return prompt_token_counter(tokenizer, max_context), max_context


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
