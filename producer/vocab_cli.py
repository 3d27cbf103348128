"""`eagle2-batch draft-vocab`: the draft vocabulary of a head, from answers the target wrote.

A head trained by `train-draft` gets one already; a public EAGLE-1/2 head does not, and
drafts over the full vocabulary until it has one (slower, never wrong).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import click

from eagle2_core.config import DRAFT_VOCAB_SIZE
from eagle2_core.registry import DEFAULT_MODEL, ModelLoadError, resolve_model


def answer_texts(path: Path) -> Iterator[str]:
    """Assistant turns of `messages` lines, or `output_text` / `turn_outputs` of rows that
    `eagle2-batch export --format jsonl` or the Parquet output wrote."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        column = "turn_outputs" if "turn_outputs" in table.column_names else "output_text"
        for value in table.column(column).to_pylist():
            yield from (value if isinstance(value, list) else [value] if value else [])
        return
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise click.ClickException(f"{path}:{line_no}: not JSON ({exc.msg})") from None
            if isinstance(obj.get("messages"), list):
                for message in obj["messages"]:
                    if message.get("role") == "assistant" and message.get("content"):
                        yield message["content"]
            elif isinstance(obj.get("turn_outputs"), list):
                yield from (t for t in obj["turn_outputs"] if t)
            elif obj.get("output_text"):
                yield obj["output_text"]


@click.command("draft-vocab")
@click.argument("data", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--model", default=DEFAULT_MODEL, show_default=True, help="The target model.")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The head's folder: draft_vocab.safetensors is written there.",
)
@click.option(
    "--size",
    type=click.IntRange(min=1),
    default=DRAFT_VOCAB_SIZE,
    show_default=True,
    help="Tokens in the draft vocabulary (the most frequent ones).",
)
def draft_vocab(data: tuple[Path, ...], model: str, out: Path, size: int) -> None:
    """Write the draft vocabulary of a head from DATA: files of the target's answers.

    Each DATA file is JSONL with `messages` (assistant turns count), rows of `eagle2-batch
    export --format jsonl` (`output_text`), or a Parquet output file; every file weighs
    the same. Best is the target's own answers, e.g. a `run --mode vanilla` job over
    prompts like those the head will serve:

        eagle2-batch draft-vocab out/answers.jsonl --model MODEL --out HEAD_DIR
    """
    from transformers import AutoConfig, AutoTokenizer

    from eagle2_core.train.data import end_of_turn_id
    from eagle2_core.vocab import DraftVocab, count_answers, mix

    try:
        source = resolve_model(model)
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        vocab_size = AutoConfig.from_pretrained(source, local_files_only=True).vocab_size
    except (OSError, ModelLoadError) as exc:
        raise click.ClickException(f"cannot load the tokenizer of {model!r}: {exc}") from None
    stop = end_of_turn_id(tokenizer)
    sources = []
    for path in data:
        counts = count_answers(tokenizer, answer_texts(path), stop)
        if not counts:
            raise click.ClickException(f"{path} holds no answers (see --help for the formats)")
        sources.append(counts)
    vocab = DraftVocab.most_frequent(mix(sources), size, vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    written = vocab.save(out, vocab_size)
    for path, counts in zip(data, sources, strict=True):
        click.echo(f"{path}: {sum(counts.values())} tokens, {vocab.coverage(counts):.1%} covered")
    click.echo(f"{len(vocab)} tokens written to {written}")
