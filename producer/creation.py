"""Job creation as `submit` and `run` do it: producer/manifest.py's one pass over the input,
with a progress bar and the first bad lines quoted on stderr, and every reason to stop
(a bad line with strict, nothing to run, an unreadable file) raised as JobError."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from tqdm import tqdm

from producer.inputs import InputFileError
from producer.jobs import JobError, JobSpec, context_check
from producer.manifest import Plan, create_job, plan_job
from workers.db import refresh_job_state


@contextmanager
def _reading_bar() -> Iterator[tqdm]:
    """The input's progress bar; an unreadable file becomes a JobError."""
    try:
        with tqdm(desc="reading", unit=" lines", file=sys.stderr, disable=None) as bar:
            yield bar
    except InputFileError as exc:
        raise JobError(str(exc)) from exc


def report_rejected(plan: Plan, job_id: str | None) -> None:
    """Quote the plan's first bad lines on stderr, and say where all of them are stored."""
    if not plan.rejected:
        return
    where = f"all stored: `eagle2-batch status {job_id} --rejected`" if job_id else "nothing stored"
    first = f"; the first {len(plan.examples)}" if len(plan.examples) < plan.rejected else ""
    lines = [f"{plan.rejected} bad line{'s' * (plan.rejected != 1)} ({where}{first}):"]
    lines += [f"  {rejected}" for rejected in plan.examples]
    print("\n".join(lines), file=sys.stderr, flush=True)


def report_identical(plan: Plan) -> None:
    """Say on stderr when greedy requests ask for several completions: they will agree."""
    if plan.identical:
        print(
            f"note: {plan.identical} request{'s' * (plan.identical != 1)} with n > 1 "
            "decode greedily (temperature 0), so their completions are identical; "
            "set --temperature (or a line's temperature) for different samples",
            file=sys.stderr,
            flush=True,
        )


def describe_counts(plan: Plan) -> str:
    """'12 samples', or '4 requests, 12 completions' when lines ask for several."""
    if plan.completions == plan.requests:
        return f"{plan.completions} samples"
    return f"{plan.requests} requests, {plan.completions} completions"


def format_plan(input_path: Path, spec: JobSpec, plan: Plan, as_json: bool) -> str:
    """What a dry run prints: the counts of the plan, as text or one JSON object."""
    if as_json:
        return json.dumps({"input": str(input_path), "dry_run": True, **plan.as_dict()})
    lines = [f"input     {input_path}", f"lines     {plan.lines}", f"good      {plan.requests}"]
    if plan.completions != plan.requests:
        lines.append(f"samples   {plan.completions} (completions: n per request)")
    if plan.skipped:
        lines.append(f"skipped   {plan.skipped} (already done in the --resume-from job)")
    lines += [
        f"rejected  {plan.rejected}",
        f"shards    {plan.shards} (up to {spec.shard_size} lines each)",
        "dry run: nothing was written or enqueued",
    ]
    return "\n".join(lines)


def plan_input(input_path: Path, spec: JobSpec, skip_ids: set[str] | None = None) -> Plan:
    """Validate INPUT and count what a job would hold, writing nothing (a dry run)."""
    context = context_check(spec.model)
    with _reading_bar() as bar:
        plan = plan_job(input_path, spec, context, skip_ids=skip_ids or set(), on_lines=bar.update)
    report_rejected(plan, None)
    report_identical(plan)
    return plan


def build_job(
    engine: Engine,
    input_path: Path,
    spec: JobSpec,
    *,
    strict: bool,
    skip_ids: set[str] | None = None,
    extra_params: dict[str, Any] | None = None,
) -> tuple[str, Plan]:
    """Validate INPUT and write the job; (job id, plan).

    With `strict` the input is read once without writing, and again to write only if no
    line is bad. Bad lines are quoted on stderr at the end.
    """
    skip = skip_ids or set()
    context = context_check(spec.model)
    with _reading_bar() as bar:
        if strict:
            plan = plan_job(input_path, spec, context, skip_ids=skip, on_lines=bar.update)
            if plan.rejected:
                bar.close()
                report_rejected(plan, None)
                raise JobError(
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
    report_rejected(plan, job_id)
    report_identical(plan)
    if not plan.completions:
        refresh_job_state(engine, job_id)
        why = f"all {plan.skipped} samples were already done" if plan.skipped else "no good line"
        raise JobError(
            f"nothing to run in {input_path}: {why} ({plan.rejected} rejected); job {job_id}"
        )
    return job_id, plan
