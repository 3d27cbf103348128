"""How often greedy outputs agree across precisions and batch shapes (README, "Precision").

fp32 is token-identical to `generate` whatever the batch; bf16 promises the acceptance
rule, not greedy identity, since a many-row forward rounds differently from a one-row
one. This runs `eagle2-batch run` over the same prompts in each configuration and
counts identical outputs against the first one:

    python benchmarks/bench_agreement.py --limit 20 \\
        --config '--dtype bf16 --mode vanilla --batch-size 1' \\
        --config '--dtype bf16' --config '--dtype fp32'
"""

from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path

import click
from bench_peer import first_turns, run_ours


@click.command()
@click.option(
    "--dataset",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=Path("../shared/benchmarks/mt_bench/question.jsonl"),
    show_default=True,
)
@click.option("--limit", default=20, show_default=True, help="Questions (first turns).")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option(
    "--config",
    "configs",
    multiple=True,
    required=True,
    help="`eagle2-batch run` arguments of one configuration; the first is the reference.",
)
def main(dataset: Path, limit: int, max_new_tokens: int, configs: tuple[str, ...]) -> None:
    items = first_turns(dataset, limit)
    with tempfile.TemporaryDirectory(prefix="bench-agreement-") as tmp:
        runs = [run_ours(items, None, max_new_tokens, shlex.split(c), Path(tmp)) for c in configs]
    reference = {k: r["output_text"] for k, r in runs[0]["outputs"].items()}
    for config, run in zip(configs, runs, strict=True):
        same = sum(reference[k] == r["output_text"] for k, r in run["outputs"].items())
        report = {"config": config, "seconds": round(run["seconds"], 1), "identical": same}
        print(json.dumps({**report, "of": len(reference), "reference": configs[0]}))


if __name__ == "__main__":
    main()
