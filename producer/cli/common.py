"""How the commands reach the library and report what it says: the job spec from the
parsed options, the database, and JobError (every user error the library raises) as a
one-line click error. Apart from options.py, which `bench` imports without a database
library."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click
from sqlalchemy import Engine

from eagle2_core.config import CONTROL_BOUNDS
from producer.database import open_database
from producer.inputs import InputFileError
from producer.jobs import JobError, JobSpec, make_spec
from producer.local_run import Interrupted
from producer.status import job_failure


def _system(options: dict[str, Any]) -> str | None:
    if options["system"] is not None and options["system_file"] is not None:
        raise click.UsageError("give --system or --system-file, not both")
    path = options["system_file"]
    if path is not None:
        data = path.read_bytes()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise click.UsageError(
                f"--system-file {path}: invalid UTF-8 at byte {exc.start + 1} "
                f"(0x{data[exc.start]:02x})"
            ) from None
    return options["system"]


def control_params(options: dict[str, Any]) -> dict[str, Any]:
    """The generation controls the command line set, as a job stores them (unset ones are
    left out, so a job created before them still matches: `run` resumes it)."""
    numbers = [key for key in CONTROL_BOUNDS if key != "top_logprobs"]  # --logprobs K: below
    params = {key: options[key] for key in numbers if options[key] is not None}
    if options["logit_bias"]:
        params["logit_bias"] = dict(options["logit_bias"])
    if options["stop_token_ids"]:
        params["stop_token_ids"] = list(options["stop_token_ids"])
    if options["logprobs"] is not None:
        params.update(logprobs=True, top_logprobs=options["logprobs"])
    if options["response_format"] is not None:
        params["response_format"] = options["response_format"]
    return params


def spec_from_options(options: dict[str, Any]) -> JobSpec:
    """The job spec from the parsed job options (a bad combination is a usage error)."""
    system = _system(options)
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
            tree_width=options["tree_width"],
            tree_depth=options["tree_depth"],
            total_tokens=options["total_tokens"],
            stop=list(options["stop"]) or None,
            **control_params(options),
            system=system,
            n=options["n"],
            dtype=options["dtype"],
            max_attempts=options["max_attempts"],
            adapt_draft=options["adapt_draft"],
            adapt_after=options["adapt_after"],
        )
    except JobError as exc:
        raise click.UsageError(str(exc)) from exc


@contextmanager
def user_errors() -> Iterator[None]:
    """The library's outcomes as the CLI reports them: a JobError or an unreadable input
    as its one-line reason (exit status 1), an interrupted run as how to resume it (exit
    status 130)."""
    try:
        yield
    except (JobError, InputFileError) as exc:
        raise click.ClickException(str(exc)) from exc
    except Interrupted as exc:
        click.echo(f"\n{exc}", err=True)
        sys.exit(130)


@contextmanager
def database(url: str) -> Iterator[Engine]:
    """An engine on a migrated database; its errors, and JobErrors of the block, become
    one-line CLI errors."""
    with user_errors(), open_database(url) as engine:
        yield engine


def exit_for(status: dict[str, Any]) -> None:
    """Exit non-zero with the reason when a finished job did not fully succeed."""
    failure = job_failure(status)
    if failure:
        raise click.ClickException(failure)
