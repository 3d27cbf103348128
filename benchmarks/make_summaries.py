"""A job of one kind the shipped draft head never learned: summarise a passage.

The passages are assistant answers of ../shared/datasets/train_conversations.jsonl, one
exchange each, 400-900 characters of prose (not the code sources), none of the 4,000
conversations the shipped head's stage 3 trained on (the same hash order as `train-draft
--conversations`), in that order: both splits, so --adapt-draft has held-out prompts to
judge a head on. Every prompt asks for the same thing, so the job is all summaries, like
an overnight job of 200k. Written in bench_adapt's input format (id, prompt, source
"summarise").

    python benchmarks/make_summaries.py ../shared/datasets/train_conversations.jsonl \\
        /tmp/summaries.jsonl
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from eagle2_core.train.data import is_validation
from producer.training.data import selection_rank

SHIPPED_STAGE3_CONVERSATIONS = 4000  # eagle2_core/heads/smollm2-135m/README.md, stage 3
CODE_SOURCES = ("code_alpaca", "gpteacher_codegen")
INSTRUCTION = "Summarize the following text in two or three sentences.\n\n"


@click.command()
@click.argument("conversations", type=click.Path(exists=True, path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--limit", default=1200, show_default=True)
@click.option("--min-chars", default=400, show_default=True)
@click.option("--max-chars", default=900, show_default=True)
def main(conversations: Path, out: Path, limit: int, min_chars: int, max_chars: int) -> None:
    with conversations.open(encoding="utf-8") as lines:  # not splitlines: texts hold U+2028
        objs = [json.loads(line) for line in lines if line.strip()]
    objs.sort(key=lambda obj: selection_rank(obj["id"]))
    training = [o["id"] for o in objs if not is_validation(o["id"])]
    stage3 = set(training[:SHIPPED_STAGE3_CONVERSATIONS])
    picked = []
    for obj in objs:  # both splits, as a real job: --adapt-draft judges on its validation split
        if obj["id"] in stage3:
            continue
        messages = obj["messages"]
        text = messages[-1]["content"]
        prose = obj["source"] not in CODE_SOURCES
        if prose and len(messages) == 2 and min_chars <= len(text) <= max_chars:
            picked.append({"id": obj["id"], "prompt": INSTRUCTION + text, "source": "summarise"})
    if len(picked) < limit:
        raise click.UsageError(f"only {len(picked)} passages fit, not {limit}")
    out.write_text("".join(json.dumps(p) + "\n" for p in picked[:limit]), encoding="utf-8")
    print(f"{limit} prompts -> {out}")


if __name__ == "__main__":
    main()
