"""`eagle2-batch draft-vocab`: the draft vocabulary of a head, from answers the target
wrote (producer/training/draft_vocab.py)."""

from __future__ import annotations

from pathlib import Path

import click

from eagle2_core.config import DRAFT_VOCAB_SIZE
from eagle2_core.registry import DEFAULT_MODEL
from producer.cli.common import user_errors
from producer.cli.options import count_option, folder_option
from producer.training.draft_vocab import write_draft_vocab


@click.command("draft-vocab")
@click.argument("data", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--model", default=DEFAULT_MODEL, show_default=True, help="The target model.")
@folder_option(
    "--out", "The head's folder: draft_vocab.safetensors is written there.", required=True
)
@count_option(
    "--size", DRAFT_VOCAB_SIZE, "Tokens in the draft vocabulary (the most frequent ones)."
)
def draft_vocab(data: tuple[Path, ...], model: str, out: Path, size: int) -> None:
    """Write the draft vocabulary of a head from DATA: files of the target's answers.

    Each DATA file is JSONL with `messages` (assistant turns count), rows of `eagle2-batch
    export --format jsonl` (`output_text`), or a Parquet output file; every file weighs
    the same. Best is the target's own answers, e.g. a `run --mode vanilla` job over
    prompts like those the head will serve:

        eagle2-batch draft-vocab out/answers.jsonl --model MODEL --out HEAD_DIR
    """
    with user_errors():
        vocab, sources, written = write_draft_vocab(data, model, out, size)
    for path, counts in zip(data, sources, strict=True):
        click.echo(f"{path}: {sum(counts.values())} tokens, {vocab.coverage(counts):.1%} covered")
    click.echo(f"{len(vocab)} tokens written to {written}")
