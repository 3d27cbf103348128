"""`eagle2-batch submit | status | cancel | resume | verify`: a job's life on the cluster.

`submit` streams the input into a job (producer/jobs.py) and only then enqueues one
Celery task per shard; the other commands read or steer a job through the database,
which is the truth about it (workers/db.py). The job options and the creation step are
shared with the embedded `run` (producer/run_cli.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
from sqlalchemy import Engine, func, inspect, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from tqdm import tqdm

from eagle2_core.config import MODES, DecodeConfig
from eagle2_core.registry import DEFAULT_MODEL, draft_label
from producer.inputs import InputFileError
from producer.jobs import (
    JobError,
    JobSpec,
    Plan,
    context_check,
    create_job,
    make_spec,
    ok_sample_ids,
    plan_job,
    set_shards_state,
    shard_ids,
)
from producer.options import TREE_SIZE_HELP, TreeSize
from producer.validate import MAX_SEED
from workers.db import (
    get_job,
    jobs_t,
    latest_job_id,
    make_engine,
    missing_shards,
    refresh_job_state,
    rejected_lines_t,
    requests_t,
    sample_counts,
    samples_t,
    set_job_state,
    shards_t,
)
from workers.parquet_sink import job_dir
from workers.settings import Settings, load_settings

TERMINAL_STATES = ("completed", "failed", "cancelled")
SHOWN_SHARDS = 20
SHOWN_IDS = 10
_DEFAULTS = DecodeConfig()


# --------------------------------------------------------------------------- options


db_url_option = click.option(
    "--db-url",
    "--url",
    "db_url",
    metavar="URL",
    default=None,
    help="Database URL, e.g. postgresql+psycopg://user@host/db "
    "(default: EAGLE2_DATABASE_URL, else OUT/eagle2.db).",
)


def job_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The options every job-creating command takes (submit, run), in --help order."""
    options = [
        click.option(
            "--model",
            default=DEFAULT_MODEL,
            show_default=True,
            help="Target model: a built-in alias (see `eagle2-batch models`), a local "
            "Hugging Face model directory or a .gguf file.",
        ),
        click.option(
            "--draft",
            metavar="DIR",
            default=None,
            help="EAGLE draft head directory (config.json + model.safetensors). "
            "Default: the head shipped for the model alias. Ignored with --mode vanilla.",
        ),
        click.option(
            "--mode",
            type=click.Choice(MODES),
            default="eagle2",
            show_default=True,
            help="eagle2: dynamic draft tree; eagle1: static tree; vanilla: plain "
            "decoding without a draft (the baseline).",
        ),
        click.option(
            "--max-new-tokens",
            type=click.IntRange(min=1),
            default=_DEFAULTS.max_new_tokens,
            show_default=True,
            help="Tokens to generate per answer (a line's max_tokens overrides it).",
        ),
        click.option(
            "--temperature",
            type=click.FloatRange(min=0),
            default=_DEFAULTS.temperature,
            show_default=True,
            help="0 is greedy; above 0 samples (output distribution unchanged by EAGLE).",
        ),
        click.option(
            "--top-p",
            type=click.FloatRange(0, 1, min_open=True),
            default=_DEFAULTS.top_p,
            show_default=True,
            help="Nucleus sampling mass (with --temperature > 0).",
        ),
        click.option(
            "--seed",
            type=click.IntRange(0, MAX_SEED),
            default=None,
            help="Sampling seed for reproducible outputs (a line's seed overrides it).",
        ),
        click.option(
            "--total-tokens",
            type=TreeSize(),
            default=_DEFAULTS.total_tokens,
            show_default=True,
            help=TREE_SIZE_HELP,
        ),
        click.option(
            "--depth",
            type=click.IntRange(min=1),
            default=_DEFAULTS.depth,
            show_default=True,
            help="Draft tree depth: most drafted tokens a cycle can accept (with "
            "--total-tokens auto, the most draft steps a round may take).",
        ),
        click.option(
            "--top-k",
            type=click.IntRange(min=1),
            default=_DEFAULTS.top_k,
            show_default=True,
            help="Children expanded per draft tree node (with --total-tokens auto, "
            "the widest a level may be).",
        ),
        click.option(
            "--shard-size",
            type=click.IntRange(min=1),
            default=100,
            show_default=True,
            help="Input lines per shard, the unit a worker takes and a resume redoes.",
        ),
        click.option(
            "--strict",
            is_flag=True,
            help="Fail if any line is bad, before anything is written or run "
            "(default: store the bad lines, run the good ones).",
        ),
        click.option(
            "--dry-run",
            is_flag=True,
            help="Only validate INPUT and print the plan (lines, good, rejected, shards).",
        ),
        db_url_option,
        click.option(
            "--out",
            type=click.Path(file_okay=False, path_type=Path),
            default=None,
            help="Output folder: Parquet files and the default SQLite database "
            "(default: EAGLE2_OUTPUT_DIR, else ./eagle2-out).",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def settings_for(db_url: str | None, out: Path | None) -> Settings:
    """Settings from the environment with the command line's --db-url and --out on top
    (--out also moves the default SQLite database, unless a URL is given)."""
    env = dict(os.environ)
    if out is not None:
        env["EAGLE2_OUTPUT_DIR"] = str(out)
    settings = load_settings(env)
    return replace(settings, database_url=db_url) if db_url else settings


def spec_from_options(options: dict[str, Any]) -> JobSpec:
    """The job spec from the parsed job options (raises click errors)."""
    try:
        return make_spec(
            model=options["model"],
            draft=options["draft"],
            mode=options["mode"],
            shard_size=options["shard_size"],
            max_new_tokens=options["max_new_tokens"],
            temperature=options["temperature"],
            top_p=options["top_p"],
            seed=options["seed"],
            top_k=options["top_k"],
            depth=options["depth"],
            total_tokens=options["total_tokens"],
        )
    except JobError as exc:
        raise click.UsageError(str(exc)) from exc


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def safe_url(url: str) -> str:
    """A database URL fit to print (password hidden)."""
    return make_url(url).render_as_string(hide_password=True)


@contextmanager
def database(url: str) -> Iterator[Engine]:
    """An engine on a migrated database; database errors become one-line CLI errors."""
    engine = make_engine(url)
    try:
        if not inspect(engine).has_table("jobs"):
            raise click.ClickException(
                f"{safe_url(url)} holds no eagle2-batch schema: run "
                f"`eagle2-batch db upgrade --url {safe_url(url)}` first"
            )
        yield engine
    except SQLAlchemyError as exc:
        raise click.ClickException(f"database error ({safe_url(url)}): {_one_line(exc)}") from exc
    finally:
        engine.dispose()


def find_job(engine: Engine, job: str | None) -> dict[str, Any]:
    """The job row of JOB (its id, or a unique prefix of at least 4 characters), or of
    the latest job when JOB is omitted."""
    job_id = job or latest_job_id(engine)
    if job_id is None:
        raise click.ClickException("no jobs yet")
    row = get_job(engine, job_id)
    if row is None and len(job_id) >= 4:
        pattern = job_id.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        with engine.connect() as conn:
            ids = (
                conn.execute(
                    select(jobs_t.c.id).where(jobs_t.c.id.like(pattern, escape="\\")).limit(2)
                )
                .scalars()
                .all()
            )
        if len(ids) > 1:
            raise click.ClickException(f"job prefix {job_id!r} matches several jobs")
        row = get_job(engine, ids[0]) if ids else None
    if row is None:
        raise click.ClickException(f"no job {job_id!r}")
    return row


# --------------------------------------------------------------------------- creation


def _report_rejected(plan: Plan, job_id: str | None) -> None:
    if not plan.rejected:
        return
    where = f"all stored: `eagle2-batch status {job_id} --rejected`" if job_id else "nothing stored"
    first = f"; the first {len(plan.examples)}" if len(plan.examples) < plan.rejected else ""
    click.echo(f"{plan.rejected} bad line{'s' * (plan.rejected != 1)} ({where}{first}):", err=True)
    for rejected in plan.examples:
        click.echo(f"  {rejected}", err=True)


def _print_plan(input_path: Path, spec: JobSpec, plan: Plan, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"input": str(input_path), "dry_run": True, **plan.as_dict()}))
        return
    click.echo(f"input     {input_path}")
    click.echo(f"lines     {plan.lines}")
    click.echo(f"good      {plan.requests}")
    if plan.skipped:
        click.echo(f"skipped   {plan.skipped} (already done in the --resume-from job)")
    click.echo(f"rejected  {plan.rejected}")
    click.echo(f"shards    {plan.shards} (up to {spec.shard_size} lines each)")
    click.echo("dry run: nothing was written or enqueued")


def build_job(
    engine: Engine | None,
    input_path: Path,
    spec: JobSpec,
    *,
    strict: bool,
    skip_ids: set[str] | None = None,
    extra_params: dict[str, Any] | None = None,
    as_json: bool = False,
) -> tuple[str | None, Plan]:
    """Validate INPUT and write the job; (job id, plan). With no engine (--dry-run) only
    print the plan; the job id is then None.

    --strict and --dry-run read the input once without writing; --strict then reads it
    again to write. Bad lines are quoted on stderr at the end.
    """
    skip = skip_ids or set()
    try:
        context = context_check(spec.model)
        with tqdm(desc="reading", unit=" lines", file=sys.stderr, disable=None) as bar:
            if strict or engine is None:
                plan = plan_job(input_path, spec, context, skip_ids=skip, on_lines=bar.update)
                if engine is None:
                    bar.close()
                    _report_rejected(plan, None)
                    _print_plan(input_path, spec, plan, as_json)
                    return None, plan
                if plan.rejected:
                    bar.close()
                    _report_rejected(plan, None)
                    raise click.ClickException(
                        f"--strict: {plan.rejected} bad line{'s' * (plan.rejected != 1)} "
                        f"in {input_path}; nothing was written or enqueued"
                    )
                bar.reset()
            job_id, plan = create_job(
                engine,
                input_path,
                spec,
                context,
                skip_ids=skip,
                strict=strict,
                extra_params=extra_params,
                on_lines=bar.update,
            )
    except (JobError, InputFileError) as exc:
        raise click.ClickException(str(exc)) from exc
    _report_rejected(plan, job_id)
    if not plan.requests:
        refresh_job_state(engine, job_id)
        why = f"all {plan.skipped} good lines were already done" if plan.skipped else "no good line"
        raise click.ClickException(
            f"nothing to run in {input_path}: {why} ({plan.rejected} rejected); job {job_id}"
        )
    return job_id, plan


def _enqueue(engine: Engine, job_id: str, model: str, shards: list[int]) -> str:
    """Send the shards to the model's queue; returns the queue name."""
    from workers.celery_app import queue_for
    from workers.tasks import enqueue_shard

    try:
        for shard in shards:
            enqueue_shard(job_id, shard, model)
    except Exception as exc:  # kombu raises its own and the socket's errors
        raise click.ClickException(
            f"cannot reach the broker ({_one_line(exc)}); job {job_id} is stored: "
            f"`eagle2-batch resume {job_id}` enqueues it once the broker is up"
        ) from exc
    return queue_for(model)


def wait_for(engine: Engine, job_id: str, interval: float = 2.0) -> dict[str, Any]:
    """Block until the job ends, with a progress bar on stderr; returns its status."""
    job = find_job(engine, job_id)
    counts = sample_counts(engine, job_id)
    with tqdm(
        total=job["n_expected"],
        initial=counts["ok"] + counts["failed"],
        desc=f"job {job_id[:12]}",
        unit=" samples",
        file=sys.stderr,
    ) as bar:
        while True:
            state = refresh_job_state(engine, job_id)
            counts = sample_counts(engine, job_id)
            bar.update(counts["ok"] + counts["failed"] - bar.n)
            bar.set_postfix(state=state, failed=counts["failed"], refresh=False)
            if state in TERMINAL_STATES:
                break
            time.sleep(interval)
    return job_status(engine, job_id)


def exit_for(status: dict[str, Any]) -> None:
    """Exit non-zero with the reason when a finished job did not fully succeed."""
    if status["state"] == "cancelled":
        raise click.ClickException(f"job {status['job_id']} was cancelled")
    if status["failed"]:
        raise click.ClickException(
            f"{status['failed']} of {status['expected']} samples failed in job "
            f"{status['job_id']} (errors: `eagle2-batch export {status['job_id']}`)"
        )


@click.command()
@click.argument(
    "input_path", metavar="INPUT", type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@job_options
@click.option(
    "--resume-from",
    metavar="JOB",
    default=None,
    help="Leave out sample ids already done (status ok) in JOB; its failed ones run again.",
)
@click.option("--wait", is_flag=True, help="Block with a progress bar until the job ends.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def submit(
    input_path: Path, resume_from: str | None, wait: bool, as_json: bool, **options: Any
) -> None:
    """Validate INPUT and queue it as a job for the Celery workers.

    INPUT is JSON Lines (prompt / messages / turns / OpenAI Batch lines) or Parquet.
    The file is streamed: the job, its manifest of expected samples, the rejected lines
    and the shards are stored first, then one task per shard goes to the model's queue
    (EAGLE2_BROKER_URL). Bad lines do not stop the job; they are counted, the first
    few quoted on stderr and all stored. The job id is the last line of stdout.

    \b
    Examples:
      eagle2-batch submit prompts.jsonl --max-new-tokens 256
      eagle2-batch submit prompts.jsonl --dry-run        # validate and plan only
      JOB=$(eagle2-batch submit prompts.jsonl) && eagle2-batch status $JOB --watch
    """
    spec = spec_from_options(options)
    settings = settings_for(options["db_url"], options["out"])
    if options["dry_run"] and not resume_from:
        build_job(None, input_path, spec, strict=options["strict"], as_json=as_json)
        return
    with database(settings.database_url) as engine:
        skip = ok_sample_ids(engine, find_job(engine, resume_from)["id"]) if resume_from else None
        extra = {"resume_from": resume_from} if resume_from else None
        job_id, plan = build_job(
            None if options["dry_run"] else engine,
            input_path,
            spec,
            strict=options["strict"],
            skip_ids=skip,
            extra_params=extra,
            as_json=as_json,
        )
        if job_id is None:
            return
        queue = _enqueue(engine, job_id, spec.model, shard_ids(engine, job_id))
        click.echo(
            f"job {job_id}: {plan.requests} samples in {plan.shards} shards queued on {queue}"
            + (f", {plan.skipped} already done in {resume_from}" if plan.skipped else ""),
            err=True,
        )
        result: dict[str, Any] = {"job_id": job_id, "queue": queue, **plan.as_dict()}
        final = wait_for(engine, job_id) if wait else None
        if final is not None:
            result.update(state=final["state"], ok=final["ok"], failed=final["failed"])
    click.echo(json.dumps(result) if as_json else job_id)
    if final is not None:
        exit_for(final)


# --------------------------------------------------------------------------- status


def _utc(value: datetime | None) -> datetime | None:
    # SQLite hands timestamps back naive; they were stored as UTC.
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return (
        f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"
    )


def job_status(engine: Engine, job_id: str) -> dict[str, Any]:
    """Everything `status` shows, JSON-ready: counts, throughput, ETA and every shard.

    Throughput is stored samples (and tokens) over the time since the first shard
    started; the ETA assumes that rate goes on.
    """
    state = refresh_job_state(engine, job_id)
    job = find_job(engine, job_id)
    counts = sample_counts(engine, job_id)
    with engine.connect() as conn:
        per_shard = dict(
            conn.execute(
                select(samples_t.c.shard, func.count())
                .where(samples_t.c.job_id == job_id)
                .group_by(samples_t.c.shard)
            ).all()
        )
        tokens = conn.execute(
            select(func.coalesce(func.sum(samples_t.c.completion_tokens), 0)).where(
                samples_t.c.job_id == job_id
            )
        ).scalar_one()
        shard_rows = conn.execute(
            select(shards_t).where(shards_t.c.job_id == job_id).order_by(shards_t.c.shard)
        ).mappings()
        shards = [
            {
                "shard": row["shard"],
                "state": row["state"],
                "lines": [row["line_start"], row["line_end"]],
                "samples": row["n_samples"],
                "stored": per_shard.get(row["shard"], 0),
                "attempts": row["attempts"],
                "worker": row["worker"],
                "started_at": _utc(row["started_at"]),
                "error": row["error"],
            }
            for row in shard_rows
        ]
    stored = counts["ok"] + counts["failed"]
    starts = [s["started_at"] for s in shards if s["started_at"] is not None]
    end = _utc(job["finished_at"]) or datetime.now(UTC)
    elapsed = (end - min(starts)).total_seconds() if starts else None
    rate = stored / elapsed if elapsed and stored else None
    remaining = max(job["n_expected"] - stored, 0)
    return {
        "job_id": job_id,
        "state": state,
        "input": job["input_path"],
        "model": job["model"],
        "draft": job["draft"],
        "mode": job["mode"],
        "created_at": _utc(job["created_at"]).isoformat(),
        "expected": job["n_expected"],
        "done": stored,
        "ok": counts["ok"],
        "failed": counts["failed"],
        "remaining": remaining,
        "rejected": job["n_rejected"],
        "elapsed_s": elapsed,
        "samples_per_s": rate,
        "tokens_per_s": tokens / elapsed if elapsed and tokens else None,
        "eta_s": remaining / rate if rate and state not in TERMINAL_STATES else None,
        "shard_states": dict(Counter(s["state"] for s in shards)),
        "shards": [
            {**s, "started_at": s["started_at"].isoformat() if s["started_at"] else None}
            for s in shards
        ],
    }


def format_status(status: dict[str, Any]) -> str:
    """The human-readable status: counts, speed, then the shards that are not done."""
    rate = "-" if status["samples_per_s"] is None else f"{status['samples_per_s']:.2f}"
    tokens = "-" if status["tokens_per_s"] is None else f"{status['tokens_per_s']:.1f}"
    lines = [
        f"job {status['job_id']}  {status['state']}  model={status['model']}  "
        f"draft={draft_label(status['model'], status['draft'], status['mode']) or '-'}  "
        f"mode={status['mode']}",
        f"input {status['input']}",
        f"samples: expected {status['expected']}  done {status['done']} "
        f"(ok {status['ok']}, failed {status['failed']})  remaining {status['remaining']}  "
        f"rejected lines {status['rejected']}",
        f"speed: {rate} samples/s, {tokens} tokens/s over {_duration(status['elapsed_s'])}"
        f"  ETA {_duration(status['eta_s'])}",
        "shards: "
        + (", ".join(f"{n} {s}" for s, n in sorted(status["shard_states"].items())) or "none"),
    ]
    pending = [s for s in status["shards"] if s["state"] != "done"]
    if pending:
        lines.append(f"{'shard':>7}  {'state':<9}  {'lines':<15}  {'stored':>11}  tries  worker")
        for s in pending[:SHOWN_SHARDS]:
            span = f"{s['lines'][0]}-{s['lines'][1]}"
            lines.append(
                f"{s['shard']:>7}  {s['state']:<9}  {span:<15}  "
                f"{str(s['stored']) + '/' + str(s['samples']):>11}  {s['attempts']:>5}  "
                f"{s['worker'] or '-'}" + (f"  error: {s['error']}" if s["error"] else "")
            )
        if len(pending) > SHOWN_SHARDS:
            lines.append(f"... {len(pending) - SHOWN_SHARDS} more (--json lists every shard)")
    return "\n".join(lines)


@click.command()
@click.argument("job", required=False)
@click.option("--watch", is_flag=True, help="Refresh until the job ends.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    help="Seconds between refreshes with --watch.",
)
@click.option("--json", "as_json", is_flag=True, help="JSON (one object per refresh).")
@click.option(
    "--rejected",
    "list_rejected",
    is_flag=True,
    help="Instead, list every rejected input line of the job (line, sample id, reason).",
)
@db_url_option
def status(
    job: str | None,
    watch: bool,
    interval: float,
    as_json: bool,
    list_rejected: bool,
    db_url: str | None,
) -> None:
    """Progress of JOB (default: the latest job).

    State; expected, done, failed and rejected counts; throughput and ETA; shards by
    state, and every shard that is not done (queued, running, failed, cancelled).

    \b
    Examples:
      eagle2-batch status                      # the latest job
      eagle2-batch status 3f2c... --watch      # refresh until it ends
      eagle2-batch status 3f2c... --rejected   # the bad input lines and why
    """
    with database(settings_for(db_url, None).database_url) as engine:
        job_id = find_job(engine, job)["id"]
        if list_rejected:
            _list_rejected(engine, job_id, as_json)
            return
        while True:
            current = job_status(engine, job_id)
            if as_json:
                click.echo(json.dumps(current))
            else:
                if watch and sys.stdout.isatty():
                    click.clear()
                click.echo(format_status(current))
            if not watch or current["state"] in TERMINAL_STATES:
                return
            time.sleep(interval)
            if not as_json and not sys.stdout.isatty():
                click.echo("")


def _list_rejected(engine: Engine, job_id: str, as_json: bool) -> None:
    stmt = (
        select(rejected_lines_t.c.line_no, rejected_lines_t.c.sample_id, rejected_lines_t.c.reason)
        .where(rejected_lines_t.c.job_id == job_id)
        .order_by(rejected_lines_t.c.line_no)
    )
    with engine.connect() as conn:
        for line_no, sample_id, reason in conn.execution_options(yield_per=1000).execute(stmt):
            if as_json:
                click.echo(
                    json.dumps({"line_no": line_no, "sample_id": sample_id, "reason": reason})
                )
            else:
                click.echo(f"line {line_no}: {reason}")


# --------------------------------------------------------------------------- cancel, resume


@click.command()
@click.argument("job")
@db_url_option
def cancel(job: str, db_url: str | None) -> None:
    """Cancel JOB: mark it and its unfinished shards cancelled.

    Workers check the job between samples: a running shard stops after its current few
    samples; queued shards are dropped when a worker takes them. Stored samples stay;
    `eagle2-batch resume JOB` continues from there.

    \b
    Example:
      eagle2-batch cancel 3f2c...
    """
    with database(settings_for(db_url, None).database_url) as engine:
        row = find_job(engine, job)
        if not set_job_state(engine, row["id"], "cancelled", expect=["queued", "running"]):
            state = find_job(engine, job)["state"]
            raise click.ClickException(f"job {row['id']} is {state}: nothing to cancel")
        n = set_shards_state(engine, row["id"], "cancelled", expect=["queued", "running"])
    click.echo(f"cancelled job {row['id']} ({n} unfinished shard{'s' * (n != 1)})")


@click.command()
@click.argument("job")
@db_url_option
def resume(job: str, db_url: str | None) -> None:
    """Re-enqueue every unfinished shard of JOB: samples missing from the database, or
    no worker marked it done (its Parquet file may be unwritten).

    Covers a lost broker message, a dead worker, a cancelled or interrupted job. Only
    the missing samples are decoded again: finished ones (ok or failed) are never redone.
    A shard still running elsewhere may be enqueued twice; writes are idempotent.

    \b
    Example:
      eagle2-batch resume 3f2c...
    """
    with database(settings_for(db_url, None).database_url) as engine:
        row = find_job(engine, job)
        job_id = row["id"]
        shards = missing_shards(engine, job_id)
        if not shards:
            state = refresh_job_state(engine, job_id)
            click.echo(f"job {job_id} is {state}: every expected sample is stored, nothing to do")
            return
        if not row["n_expected"]:
            raise click.ClickException(
                f"job {job_id} was never completely created (its submit was interrupted): "
                "submit the input again"
            )
        set_shards_state(engine, job_id, "queued", shards=shards)
        set_job_state(engine, job_id, "queued", expect=["cancelled", "failed", "completed"])
        queue = _enqueue(engine, job_id, row["model"], shards)
    click.echo(
        f"job {job_id}: re-enqueued {len(shards)} shard{'s' * (len(shards) != 1)} on {queue}"
    )


# --------------------------------------------------------------------------- verify


def _parquet_ids(directory: Path, job_id: str) -> tuple[Counter[str], int, int]:
    """(rows per sample id of this job, rows of other jobs, files) in a job's folder."""
    import pyarrow.parquet as pq

    per_id: Counter[str] = Counter()
    foreign = 0
    files = sorted(directory.glob("shard=*.parquet")) if directory.is_dir() else []
    for path in files:
        table = pq.read_table(path, columns=["job_id", "sample_id"])
        for row_job, sample_id in zip(
            table.column("job_id").to_pylist(), table.column("sample_id").to_pylist(), strict=True
        ):
            if row_job == job_id:
                per_id[sample_id] += 1
            else:
                foreign += 1
    return per_id, foreign, len(files)


def _parquet_dir(engine: Engine, job_id: str, out: Path | None) -> Path:
    """--out's job folder; else the folder workers recorded, when this host sees it."""
    if out is None:
        with engine.connect() as conn:
            recorded = conn.execute(
                select(shards_t.c.parquet_path)
                .where(shards_t.c.job_id == job_id, shards_t.c.parquet_path.is_not(None))
                .limit(1)
            ).scalar()
        if recorded and Path(recorded).parent.is_dir():
            return Path(recorded).parent
    return job_dir(out or load_settings().output_dir, job_id)


def verify_job(engine: Engine, job_id: str, out: Path | None) -> dict[str, Any]:
    """Compare manifest, database rows and Parquet rows of a job; JSON-ready report."""
    with engine.connect() as conn:
        manifest = set(
            conn.execute(
                select(requests_t.c.sample_id).where(requests_t.c.job_id == job_id)
            ).scalars()
        )
        # Rows per sample id, counted rather than assumed: the primary key should make
        # duplicates impossible, and verify is what proves it.
        stored = Counter(
            dict(
                conn.execute(
                    select(samples_t.c.sample_id, func.count())
                    .where(samples_t.c.job_id == job_id)
                    .group_by(samples_t.c.sample_id)
                ).all()
            )
        )
    directory = _parquet_dir(engine, job_id, out)
    parquet, foreign, files = _parquet_ids(directory, job_id)
    problems = {
        "missing_in_database": sorted(manifest - stored.keys()),
        "missing_in_parquet": sorted(manifest - parquet.keys()),
        "duplicates_in_database": sorted(i for i, n in stored.items() if n > 1),
        "duplicates_in_parquet": sorted(i for i, n in parquet.items() if n > 1),
        "extra_in_database": sorted(stored.keys() - manifest),
        "extra_in_parquet": sorted(parquet.keys() - manifest),
    }
    return {
        "job_id": job_id,
        "parquet_dir": str(directory),
        "parquet_files": files,
        "manifest": len(manifest),
        "job_state": refresh_job_state(engine, job_id),
        "database_rows": stored.total(),
        "parquet_rows": sum(parquet.values()) + foreign,
        "parquet_rows_of_other_jobs": foreign,
        "counts": {name: len(ids) for name, ids in problems.items()},
        "examples": {name: ids[:SHOWN_IDS] for name, ids in problems.items() if ids},
        "ok": not foreign and not any(problems.values()),
    }


@click.command()
@click.argument("job", required=False)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Output folder holding job=<JOB>/ (default: where workers recorded the files, "
    "else EAGLE2_OUTPUT_DIR).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@db_url_option
def verify(job: str | None, out: Path | None, as_json: bool, db_url: str | None) -> None:
    """Check that JOB's outputs are complete and stored once (default: the latest job).

    Compares the manifest (expected samples), the database rows and the Parquet files:
    reports samples missing from either, sample ids stored more than once in either, and
    rows that the manifest does not expect, with the job's state. Exits non-zero on any
    problem (an unfinished job alone is not one: its missing samples are).

    \b
    Example:
      eagle2-batch verify 3f2c... --out /data/eagle2-out
    """
    with database(settings_for(db_url, None).database_url) as engine:
        report = verify_job(engine, find_job(engine, job)["id"], out)
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo(
            f"job {report['job_id']} ({report['job_state']}): manifest {report['manifest']}, "
            f"database rows "
            f"{report['database_rows']}, Parquet rows {report['parquet_rows']} in "
            f"{report['parquet_files']} files under {report['parquet_dir']}"
        )
        for name, n in report["counts"].items():
            if n:
                shown = ", ".join(report["examples"][name])
                click.echo(f"  {name.replace('_', ' ')}: {n} (e.g. {shown})")
        if report["parquet_rows_of_other_jobs"]:
            click.echo(f"  Parquet rows of other jobs: {report['parquet_rows_of_other_jobs']}")
    if not report["ok"]:
        found = [f"{n} {k.replace('_', ' ')}" for k, n in report["counts"].items() if n]
        if report["parquet_rows_of_other_jobs"]:
            found.append(f"{report['parquet_rows_of_other_jobs']} Parquet rows of other jobs")
        raise click.ClickException(f"verify failed: {', '.join(found)}")
    if not as_json:
        click.echo("ok: every expected sample is stored once in the database and in Parquet")
