"""Creating a job from its input, as `submit` and `run` do it (`create_job`), and the dry
run that only counts (`plan_job`): one streaming pass that validates every line and, to
create, writes the job row, the manifest (expected samples; the conversation of a request
of n > 1 completions once, in `prompts`), the rejected lines and the shard rows, in
batches (COPY on Postgres: workers/bulk.py). A progress bar and the first bad lines go to
stderr; every reason to stop (a bad line with strict, an unreadable file) is raised.

The input is parsed in a second process while this one writes: reading and validating
is Python on one core, the writes are the database's work on the other, and in one
process they would take turns (a writer thread waits for the GIL after every chunk it
sends; BENCHMARKS.md, "Submit"). The child is forked, so it shares the loaded tokenizer
and `skip_ids`; it sends encoded batches over a pipe, which blocks it while the parent
is a batch behind, so memory stays bounded.

Nothing is enqueued or decoded here: the caller does that only after `create_job`
returns, so a worker never sees a shard whose manifest is incomplete. A job whose
creation fails part-way is deleted again, never left half-written. Memory stays flat
in the number of lines: one shard and one write batch are held at a time, and the ids
the validator keeps to refuse duplicates spill to disk (producer/seen_ids.py); only
`skip_ids` (a --resume-from job's done ids) is held whole.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from tqdm import tqdm

from producer.inputs import Rejected, Request, Shard, plan_shards, read_requests
from producer.jobs import JobError, JobSpec, storable_option
from producer.tokenizer import ContextCheck, context_check
from workers.bulk import Encoded, encode_rows, write_rows
from workers.db import insert_job, insert_shards, refresh_job_state, update_job
from workers.job_queries import delete_job
from workers.schema import prompts_t, rejected_lines_t, requests_t

# How many rejected lines are quoted on stderr; all of them are stored.
SHOWN_REJECTED = 10
# Manifest rows per write: large enough to amortise a round trip, small enough that a
# batch of long prompts stays a few MB.
_BATCH_ROWS = 5000

_REQUEST_COLUMNS = ("job_id", "sample_id", "line_no", "shard", "payload")
_PROMPT_COLUMNS = ("job_id", "request_id", "payload")
_REJECTED_COLUMNS = ("job_id", "line_no", "sample_id", "reason")
_json = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode

EncodedBatch = tuple[Encoded, Encoded, Encoded, list[dict[str, Any]]]


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
        self.identical += sum(r.n > 1 and spec.settings.greedy(r.overrides) for r in shard.requests)
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

    def counts(self) -> str:
        """'12 samples', or '4 requests, 12 completions' when lines ask for several."""
        if self.completions == self.requests:
            return f"{self.completions} samples"
        return f"{self.requests} requests, {self.completions} completions"

    def dry_run(self, input_path: Path, shard_size: int, as_json: bool) -> str:
        """What a dry run prints: the counts, as text or one JSON object."""
        if as_json:
            return json.dumps({"input": str(input_path), "dry_run": True, **self.as_dict()})
        lines = [f"input     {input_path}", f"lines     {self.lines}", f"good      {self.requests}"]
        if self.completions != self.requests:
            lines.append(f"samples   {self.completions} (completions: n per request)")
        if self.skipped:
            lines.append(f"skipped   {self.skipped} (already done in the --resume-from job)")
        lines += [
            f"rejected  {self.rejected}",
            f"shards    {self.shards} (up to {shard_size} lines each)",
            "dry run: nothing was written or enqueued",
        ]
        return "\n".join(lines)

    def require_samples(self, input_path: Path, job_id: str) -> None:
        """Raise JobError when the job created from this plan has nothing to run."""
        if not self.completions:
            why = (
                f"all {self.skipped} samples were already done" if self.skipped else "no good line"
            )
            raise JobError(
                f"nothing to run in {input_path}: {why} ({self.rejected} rejected); job {job_id}"
            )


@dataclass(frozen=True)
class Reading:
    """The reading process's one argument: which input to scan for which job, and how."""

    input_path: Path
    spec: JobSpec
    context: ContextCheck
    skip_ids: Collection[str]
    strict: bool = False
    job_id: str = ""  # the job whose rows it encodes ('' for a dry run)
    dialect: str = ""  # the database's, which decides the encoding


def plan_job(
    input_path: Path,
    spec: JobSpec,
    context: ContextCheck | None = None,
    *,
    skip_ids: Collection[str] = frozenset(),
    on_lines: Callable[[int], None] | None = None,
) -> Plan:
    """Validate the whole input and count what a job would hold, writing nothing (a dry
    run). `context` defaults to the spec's model's; `on_lines` replaces the progress bar."""
    reading = Reading(Path(input_path), spec, context or context_check(spec.model), skip_ids)
    with _reading_bar() as bar:
        plan = _count(reading, on_lines or bar.update)
    _tell(plan, None)
    return plan


def create_job(
    engine: Engine,
    input_path: Path,
    spec: JobSpec,
    context: ContextCheck | None = None,
    *,
    skip_ids: Collection[str] = frozenset(),
    strict: bool = False,
    extra_params: dict[str, Any] | None = None,
    on_lines: Callable[[int], None] | None = None,
) -> tuple[str, Plan]:
    """Write a job: its row, then manifest, rejected lines and shard rows; (job id, plan).

    Each completion of a request is a manifest row of its own
    (workers.request.Request.completions). `skip_ids` are sample ids left out of the
    manifest (already done elsewhere). With `strict` the input is read once without
    writing, and again to write only if no line is bad (a line gone bad in between
    aborts, and the job is deleted). A job with nothing to run is stored as such (its
    rejected lines are there to read): `Plan.require_samples` tells.
    """
    input_path = Path(input_path).resolve()
    storable_option(str(input_path), "INPUT")
    reading = Reading(input_path, spec, context or context_check(spec.model), skip_ids, strict)
    with _reading_bar() as bar:
        if strict:
            plan = _count(reading, on_lines or bar.update)
            if plan.rejected:
                bar.close()
                _tell(plan, None)
                raise JobError(
                    f"--strict: {plan.rejected} bad line{'s' * (plan.rejected != 1)} "
                    f"in {input_path} (the first {plan.examples[0]}); "
                    "nothing was written or enqueued"
                )
            bar.reset()
        job_id, plan = _write(engine, reading, extra_params, on_lines or bar.update)
    _tell(plan, job_id)
    if not plan.completions:
        refresh_job_state(engine, job_id)
    return job_id, plan


@contextmanager
def _reading_bar() -> Iterator[tqdm]:
    """The input's progress bar on stderr (where it is a terminal)."""
    with tqdm(desc="reading", unit=" lines", file=sys.stderr, disable=None) as bar:
        yield bar


def _scan(
    reading: Reading, plan: Plan, on_lines: Callable[[int], None]
) -> Iterator[tuple[Shard, list[Request]]]:
    """Each shard of the input with the completions of it that run, counted in `plan`."""
    settings = reading.spec.settings
    count, max_context = reading.context
    items = read_requests(
        reading.input_path,
        count_prompt_tokens=count,
        max_context=max_context,
        system=settings.system,
        n=settings.n,
    )
    seed = settings.decode.get("seed")
    for shard in plan_shards(items, settings.shard_size):
        completions = (c for r in shard.requests for c in r.completions(seed))
        keep = [c for c in completions if c.sample_id not in reading.skip_ids]
        plan.add(shard, keep, reading.spec)
        on_lines(len(shard.requests) + len(shard.rejected))
        yield shard, keep


def _tell(plan: Plan, job_id: str | None) -> None:
    """On stderr: the first bad lines and where all of them are stored, and that greedy
    requests of several completions will agree."""
    notes = []
    if plan.rejected:
        where = (
            f"all stored: `eagle2-batch status {job_id} --rejected`" if job_id else "nothing stored"
        )
        first = f"; the first {len(plan.examples)}" if len(plan.examples) < plan.rejected else ""
        notes.append(f"{plan.rejected} bad line{'s' * (plan.rejected != 1)} ({where}{first}):")
        notes += [f"  {rejected}" for rejected in plan.examples]
    if plan.identical:
        notes.append(
            f"note: {plan.identical} request{'s' * (plan.identical != 1)} with n > 1 "
            "decode greedily (temperature 0), so their completions are identical; "
            "set --temperature (or a line's temperature) for different samples"
        )
    for note in notes:
        print(note, file=sys.stderr, flush=True)


def _count(reading: Reading, on_lines: Callable[[int], None]) -> Plan:
    plan = Plan()
    for _ in _scan(reading, plan, on_lines):
        pass
    return plan


def _write(
    engine: Engine,
    reading: Reading,
    extra_params: dict[str, Any] | None,
    on_lines: Callable[[int], None],
) -> tuple[str, Plan]:
    """The job row, then the batches the reading process sends; the job deleted again if
    anything fails part-way."""
    spec, input_path = reading.spec, reading.input_path
    job_id = insert_job(
        engine,
        input_path=str(input_path),
        model=spec.model,
        draft=spec.draft,
        mode=spec.mode,
        params=spec.settings.to_params(**input_fingerprint(input_path), **(extra_params or {})),
    )
    reading = replace(reading, job_id=job_id, dialect=engine.dialect.name)
    try:
        plan = None
        for message in _from_child(reading):
            if isinstance(message, Plan):
                plan = message
            else:
                lines, encoded = message
                _write_batch(engine, encoded)
                on_lines(lines)
        assert plan is not None
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


def input_fingerprint(path: Path) -> dict[str, int]:
    """Size and modification time: enough for `run` to tell an edited input from the same one."""
    stat = os.stat(path)
    return {"input_size": stat.st_size, "input_mtime_ns": stat.st_mtime_ns}


def _from_child(reading: Reading) -> Iterator[tuple[int, EncodedBatch] | Plan]:
    """What `_child` sends: (lines read, encoded batch) pairs, then the Plan; an error it
    met is raised here. The child is stopped if this generator is left early."""
    fork = multiprocessing.get_context("fork")
    receive, send = fork.Pipe(duplex=False)
    child = fork.Process(target=_child, args=(send, reading), name="job-reader", daemon=True)
    child.start()
    send.close()
    try:
        while True:
            try:
                kind, payload = receive.recv()
            except EOFError:
                child.join()
                raise JobError(
                    f"reading the input stopped: its process exited with code {child.exitcode}"
                ) from None
            if kind == "error":
                raise payload
            yield payload
            if kind == "plan":
                return
    finally:
        receive.close()
        if child.is_alive():
            child.terminate()
        child.join()


def _child(send: Connection, reading: Reading) -> None:
    """The second process: scan the input, send encoded batches and then the plan."""
    # Ctrl-C stops the reading at once (`run` makes its own process wait for a point
    # outside database writes); the parent deletes the partial job as it gets the error.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    dialect, job_id = reading.dialect, reading.job_id
    try:
        plan = Plan()
        lines = 0

        def count(n: int) -> None:
            nonlocal lines
            lines += n

        batch = _Batch(dialect, job_id)
        for shard, keep in _scan(reading, plan, count):
            if reading.strict and shard.rejected:
                raise JobError(f"--strict: {shard.rejected[0]} (the input changed?)")
            batch.add(shard, keep)
            if len(batch) >= _BATCH_ROWS:
                send.send(("batch", (lines, batch.encoded())))
                batch, lines = _Batch(dialect, job_id), 0
        send.send(("batch", (lines, batch.encoded())))
        send.send(("plan", plan))
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        send.send(("error", exc))
    finally:
        send.close()
        os._exit(0)  # no inherited finalizer may touch the parent's connections


class _Batch:
    """Rows of consecutive shards, written together: the manifest and rejected lines
    encoded for the database (COPY text on Postgres, workers/bulk.py) where they are read,
    so the writing process only sends them."""

    def __init__(self, dialect: str, job_id: str) -> None:
        self.dialect, self.job_id = dialect, job_id
        self.requests: list[tuple[Any, ...]] = []
        self.prompts: list[tuple[Any, ...]] = []
        self.rejected: list[tuple[Any, ...]] = []
        self.shards: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self.requests) + len(self.rejected)

    def add(self, shard: Shard, keep: list[Request]) -> None:
        """One shard: the completions that run (`keep`), the conversation of each request
        of several of them (once), its rejected lines, its row."""
        job_id = self.job_id
        shared = {r.line_id for r in keep if r.n > 1}
        self.prompts.extend(
            (job_id, r.sample_id, _json(r.prompt_payload()))
            for r in shard.requests
            if r.sample_id in shared
        )
        self.requests.extend(
            (job_id, r.sample_id, r.line_no, shard.index, _json(r.to_payload(prompt=r.n == 1)))
            for r in keep
        )
        self.rejected.extend((job_id, r.line_no, r.sample_id, r.reason) for r in shard.rejected)
        if keep:
            self.shards.append(
                {
                    "job_id": job_id,
                    "shard": shard.index,
                    "line_start": shard.first_line,
                    "line_end": _last_line(shard),
                    "n_samples": len(keep),
                }
            )

    def encoded(self) -> EncodedBatch:
        return (
            encode_rows(self.dialect, self.requests),
            encode_rows(self.dialect, self.prompts),
            encode_rows(self.dialect, self.rejected),
            self.shards,
        )


def _write_batch(engine: Engine, encoded: EncodedBatch) -> None:
    requests, prompts, rejected, shards = encoded
    write_rows(engine, requests_t, _REQUEST_COLUMNS, requests)
    write_rows(engine, prompts_t, _PROMPT_COLUMNS, prompts)
    write_rows(engine, rejected_lines_t, _REJECTED_COLUMNS, rejected)
    insert_shards(engine, shards)


def _last_line(shard: Shard) -> int:
    """The shard's last non-blank line (its nominal range may run past the file's end)."""
    return max(items[-1].line_no for items in (shard.requests, shard.rejected) if items)
