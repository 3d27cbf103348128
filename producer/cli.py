"""The `eagle2-batch` command line: a thin click group over the package's modules."""

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="eagle2-batch")
def main() -> None:
    """Large offline generation jobs with lossless EAGLE-2 speculative decoding."""


main.add_command(__import__("producer.db_cli", fromlist=["db"]).db)
main.add_command(__import__("producer.stats", fromlist=["stats"]).stats)
main.add_command(__import__("producer.export", fromlist=["export"]).export)
main.add_command(__import__("producer.run_cli", fromlist=["run"]).run)
main.add_command(__import__("producer.submit_cli", fromlist=["submit"]).submit)
main.add_command(__import__("producer.submit_cli", fromlist=["status"]).status)
main.add_command(__import__("producer.submit_cli", fromlist=["cancel"]).cancel)
main.add_command(__import__("producer.submit_cli", fromlist=["resume"]).resume)
main.add_command(__import__("producer.submit_cli", fromlist=["verify"]).verify)
main.add_command(__import__("producer.worker_cli", fromlist=["worker"]).worker)
main.add_command(__import__("producer.train_cli", fromlist=["train_draft"]).train_draft)
main.add_command(__import__("producer.models_cli", fromlist=["models"]).models)
main.add_command(__import__("producer.bench_cli", fromlist=["bench"]).bench)
