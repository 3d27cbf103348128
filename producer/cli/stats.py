"""`eagle2-batch stats`: a job's acceptance and throughput statistics (producer/stats.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import click

from producer.cli.options import resolve_url, url_option
from producer.stats import (
    GROUP_COLUMNS,
    STATS_COLUMNS,
    accumulate,
    format_head_versions,
    format_stats,
    plot_adaptation,
    plot_stats,
    plot_title,
    summarize,
)
from workers.db import get_job, iter_samples, latest_job_id, make_engine
from workers.head_versions import versions
from workers.job_settings import JobSettings


@click.command()
@click.argument("job", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the numbers as JSON.")
@click.option("--by", type=click.Choice(GROUP_COLUMNS), help="Also report per group.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write a PNG (histogram, acceptance by depth, tau by --by or category); for an "
    "--adapt-draft job also PLOT-adaptation.png: tau over its completions, switches marked.",
)
@url_option
def stats(
    job: str | None, as_json: bool, by: str | None, plot: Path | None, url: str | None
) -> None:
    """Acceptance and throughput statistics of JOB (default: the latest job).

    A job run with --adapt-draft is reported by head_version (0: the head it started
    with) unless --by says otherwise, followed by its fine-tuning rounds."""
    engine = make_engine(resolve_url(url))
    try:
        job_id = job or latest_job_id(engine)
        job_row = get_job(engine, job_id) if job_id else None
        if job_row is None:
            raise click.ClickException(f"no job {job_id}" if job_id else "no jobs yet")
        adapting = JobSettings.from_params(job_row["params"]).adapt_draft
        attempts = versions(engine, job_row["id"]) if adapting else None
        by = by or ("head_version" if adapting else None)
        group_by = by or ("category" if plot else None)
        over_time = adapting and plot is not None  # tau over the job: one read for both
        columns = (*STATS_COLUMNS, "created_at") if over_time else STATS_COLUMNS
        points: list[tuple] = []

        def rows() -> Iterator[dict]:
            for row in iter_samples(engine, job_row["id"], columns=columns):
                if over_time and row["mean_accept_length"] is not None:
                    points.append(
                        (row["created_at"], row["mean_accept_length"], row["head_version"])
                    )
                yield row

        overall, groups = accumulate(rows(), group_by)
    finally:
        engine.dispose()
    result = summarize(overall, groups if by else {})
    if attempts is not None:
        result["head_versions"] = attempts
    if as_json:
        job_info = {
            k: job_row[k]
            for k in ("id", "state", "model", "draft", "mode", "n_expected", "n_rejected")
        }
        click.echo(json.dumps({"job": job_info, "by": by, **result}, indent=2, default=str))
    else:
        click.echo(format_stats(job_row, result, by))
        if attempts is not None:
            click.echo("\n" + format_head_versions(attempts))
    if plot is not None:
        plot_stats(plot, plot_title(job_row), overall, groups, group_by or "category")
        if not as_json:
            click.echo(f"\nplot written to {plot}")
    if points:
        adaptation_png = plot.with_name(f"{plot.stem}-adaptation{plot.suffix}")
        plot_adaptation(adaptation_png, plot_title(job_row), points)
        if not as_json:
            click.echo(f"tau over the job's completions written to {adaptation_png}")
