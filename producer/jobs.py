"""A job's spec, shared by `submit` (Celery) and `run` (embedded): the options checked
together and stored with the job, and JobError, the one-line reason a job cannot be made
as asked. Reading the input into a job is producer/creation.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle2_core.config import AUTO, DTYPES, JOB_DECODE_KEYS, DecodeConfig
from eagle2_core.registry import DraftUnavailableError, draft_source
from producer.storable import text_problem
from producer.validate import MAX_ID_CHARS, completions_count, stop_strings
from workers.job_settings import DEFAULT_DTYPE, DEFAULT_MAX_ATTEMPTS, JobSettings

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
    """What a job runs: its model, draft and mode (the job row's columns) and its settings
    (its params, read back by every worker)."""

    model: str
    draft: str | None
    mode: str
    settings: JobSettings

    @property
    def auto_tree(self) -> bool:
        """Whether every EAGLE-2 round sizes its tree by this device's costs (plan.py)."""
        return self.mode == "eagle2" and self.settings.decode_for({})["total_tokens"] == AUTO


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
    dtype: str = DEFAULT_DTYPE,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    adapt_draft: bool = False,
    adapt_after: int | None = None,
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
    if adapt_draft and mode == "vanilla":
        raise JobError("--adapt-draft trains the draft head: it needs --mode eagle2 or eagle1")
    if adapt_after is not None and not adapt_draft:
        raise JobError("--adapt-after sets when --adapt-draft starts: pass --adapt-draft too")
    if adapt_after is not None and adapt_after < 1:
        raise JobError(f"--adapt-after must be >= 1, got {adapt_after}")
    settings = JobSettings(
        params, shard_size, system, n, dtype, max_attempts, adapt_draft, adapt_after
    )
    return JobSpec(model, draft, mode, settings)
