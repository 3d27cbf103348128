"""The draft vocabulary of a head, from answers the target wrote (`eagle2-batch draft-vocab`).

A head trained by `train-draft` gets one already; a public EAGLE-1/2 head does not, and
drafts over the full vocabulary until it has one (slower, never wrong).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from eagle2_core.registry import ModelLoadError, resolve_model
from producer.inputs import json_objects
from producer.jobs import JobError

if TYPE_CHECKING:  # torch: imported where used, so other commands start fast
    from eagle2_core.vocab import DraftVocab


class VocabError(JobError):
    """No draft vocabulary can be made from these files for this model: why, in one line."""


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
    for _, obj in json_objects(path, VocabError):
        if isinstance(obj.get("messages"), list):
            for message in obj["messages"]:
                if message.get("role") == "assistant" and message.get("content"):
                    yield message["content"]
        elif isinstance(obj.get("turn_outputs"), list):
            yield from (t for t in obj["turn_outputs"] if t)
        elif obj.get("output_text"):
            yield obj["output_text"]


def write_draft_vocab(
    data: tuple[Path, ...], model: str, out: Path, size: int
) -> tuple[DraftVocab, list[Counter[int]], Path]:
    """The `size` tokens most frequent in DATA's answers (every file weighs the same),
    written to OUT; (the vocabulary, each file's token counts, the file written)."""
    from transformers import AutoConfig

    from eagle2_core.tokenizer import load_tokenizer
    from eagle2_core.train.data import end_of_turn_id
    from eagle2_core.vocab import DraftVocab, count_answers, mix

    try:
        source = resolve_model(model)
        tokenizer = load_tokenizer(source)
        vocab_size = AutoConfig.from_pretrained(source, local_files_only=True).vocab_size
    except (OSError, ModelLoadError) as exc:
        raise VocabError(f"cannot load the tokenizer of {model!r}: {exc}") from None
    stop = end_of_turn_id(tokenizer)
    sources = []
    for path in data:
        counts = count_answers(tokenizer, answer_texts(path), stop)
        if not counts:
            raise VocabError(f"{path} holds no answers (see --help for the formats)")
        sources.append(counts)
    vocab = DraftVocab.most_frequent(mix(sources), size, vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    return vocab, sources, vocab.save(out, vocab_size)
