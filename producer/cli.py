"""The `eagle2-batch` command line: a thin click group over the package's modules."""

import click

from producer import (
    bench_cli,
    db_cli,
    export,
    models_cli,
    run_cli,
    stats,
    submit_cli,
    train_cli,
    vocab_cli,
    worker_cli,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="eagle2-batch")
def main() -> None:
    """Large offline generation jobs with lossless EAGLE-2 speculative decoding."""


for command in (
    db_cli.db,
    stats.stats,
    export.export,
    run_cli.run,
    submit_cli.submit,
    submit_cli.status,
    submit_cli.cancel,
    submit_cli.resume,
    submit_cli.verify,
    worker_cli.worker,
    train_cli.train_draft,
    vocab_cli.draft_vocab,
    models_cli.models,
    bench_cli.bench,
):
    main.add_command(command)
