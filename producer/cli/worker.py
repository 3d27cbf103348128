"""`eagle2-batch worker`: run this host's Celery workers, one process per GPU or CPU slot."""

from __future__ import annotations

import click

from producer.cli.options import DTYPE_HELP, batch_size_option, dtype_option
from workers.launcher import (
    CONCURRENCY_NOTE,
    LaunchError,
    plan_workers,
    run_workers,
    select_gpus,
    visible_gpus,
)


@click.command()
@click.option(
    "--gpus",
    default=None,
    help="'all' or GPU indices like 0,2: one worker process each (default: all, if any).",
)
@click.option(
    "--cpu",
    type=click.IntRange(min=1),
    default=None,
    help="Run N CPU worker processes instead (they split the cores).",
)
@click.option(
    "--queues",
    default=None,
    help="Comma-separated queues to consume (default: the queue of --model, eagle2.<model>).",
)
@click.option(
    "--model",
    default=None,
    help="The one model these workers serve, loaded at start; shards of another model "
    "fail. Default: the model of the first shard (with --queues), else smollm2-135m.",
)
@click.option(
    "--draft",
    default=None,
    help="Draft head directory on this host, used instead of the job's (or 'random').",
)
@batch_size_option(extra_help=" Per worker process.")
@dtype_option(
    default=None,
    help=DTYPE_HELP + " Default: each job's own --dtype; given here, it wins for this host.",
)
@click.option(
    "--hostname",
    default=None,
    help="Host part of the node names gpu<i>@HOST (default: this host's name); two "
    "launchers on one host need different ones.",
)
@click.option("--loglevel", default="INFO", show_default=True, help="Celery log level.")
@click.option(
    "--concurrency-note",
    is_flag=True,
    help="Explain how the workers use GPUs, processes and shards, and exit.",
)
def worker(
    gpus: str | None,
    cpu: int | None,
    queues: str | None,
    model: str | None,
    draft: str | None,
    batch_size: int | str,
    dtype: str | None,
    hostname: str | None,
    loglevel: str,
    concurrency_note: bool,
) -> None:
    """Start one Celery worker per GPU (or N on CPU); stop them all with SIGTERM or Ctrl-C.

    The database, broker and output folder come from EAGLE2_DATABASE_URL,
    EAGLE2_BROKER_URL and EAGLE2_OUTPUT_DIR; every worker of a job needs the same ones.
    """
    if concurrency_note:
        click.echo(CONCURRENCY_NOTE, nl=False)
        return
    if gpus is not None and cpu is not None:
        raise click.UsageError("give --gpus or --cpu, not both")
    try:
        chosen: list[str] = []
        if cpu is None:
            visible = visible_gpus()
            if not visible:
                raise LaunchError(
                    "no GPU found (CUDA_VISIBLE_DEVICES, nvidia-smi -L): "
                    "pass --cpu N to run CPU workers"
                )
            chosen = select_gpus(gpus or "all", visible)
        specs = plan_workers(
            gpus=chosen,
            cpu=cpu or 0,
            hostname=hostname,
            model=model,
            draft=draft,
            batch_size=batch_size,
            dtype=dtype,
            queues=[q.strip() for q in (queues or "").split(",") if q.strip()],
            loglevel=loglevel,
        )
    except LaunchError as exc:
        raise click.ClickException(str(exc)) from exc
    names = ", ".join(s.name for s in specs)
    click.echo(f"starting {len(specs)} worker(s): {names}", err=True)
    raise SystemExit(run_workers(specs))
