"""`eagle2-batch export`: a job's stored rows as JSONL, OpenAI Batch output, or Parquet
(producer/export.py)."""

from __future__ import annotations

from pathlib import Path

import click

from producer.cli.options import choice_option, resolve_url, url_option
from producer.export import FORMATS, export_job
from workers.db import make_engine


@click.command()
@click.argument("job")
@choice_option(
    "--format",
    FORMATS,
    "jsonl",
    "jsonl: one output row (completion) per line; openai: OpenAI Batch API output, one "
    "line per request with its n completions as choices; parquet: one file.",
    dest="fmt",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="File to write (replaced atomically).",
)
@url_option
def export(job: str, fmt: str, out: Path, url: str | None) -> None:
    """Write JOB's outputs to a file, in input order.

    Every row carries request_id (the input line's id) and choice_index (which of the
    line's n completions it is; 0 when it asked for one)."""
    engine = make_engine(resolve_url(url))
    try:
        n = export_job(engine, job, fmt, out)
    except KeyError:
        raise click.ClickException(f"no job {job}") from None
    finally:
        engine.dispose()
    what = "requests" if fmt == "openai" else "rows"
    click.echo(f"wrote {n} {what} ({fmt}) to {out}")
