"""`eagle2-batch train-draft`: train an EAGLE draft head for a target, end to end
(producer/training/pipeline.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from eagle2_core.registry import DEFAULT_MODEL
from producer.cli.common import user_errors
from producer.cli.options import choice_option, count_option, folder_option
from producer.training.model_card import format_tau
from producer.training.pipeline import DraftTraining, train_draft_head, training_default

_JSONL = click.Path(exists=True, dir_okay=False, path_type=Path)


def _token_counts(text: str) -> list[int]:
    try:
        return sorted(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not a list of numbers", param_hint="--snapshot-tokens"
        ) from None


@click.command("train-draft")
@click.option(
    "--model",
    default=DEFAULT_MODEL,
    show_default=True,
    help="Target: built-in alias, model directory or .gguf file.",
)
@click.option(
    "--prompts",
    type=_JSONL,
    help="JSONL prompts ({id, prompt} or {id, messages}) the target answers itself "
    "(self-distillation), e.g. shared/datasets/train_prompts.jsonl. Ids in the "
    "validation split (sha256(id) % 50 == 0) are only used to measure the head.",
)
@click.option(
    "--conversations",
    multiple=True,
    type=_JSONL,
    help="JSONL conversations that already have answers ({id, messages} with assistant "
    "turns), e.g. shared/datasets/train_conversations.jsonl: every answer turn is "
    "trained on, nothing is decoded. Validation-split ids only measure the head. "
    "Repeatable; with --prompts too, all are mixed.",
)
@click.option(
    "--from-job",
    metavar="JOB",
    default=None,
    help="Train on a finished job's own answers: its ok samples with the prompts (and "
    "system prompt) they answered, read from the job's database (--db-url); failed and "
    "rejected lines are left out, validation split by the same hash rule. With "
    "--init-head shipped, fine-tunes the head the job ran with for the next job like it.",
)
@click.option(
    "--db-url",
    metavar="URL",
    default=None,
    help="Database of --from-job (default: EAGLE2_DATABASE_URL, else ./eagle2-out/eagle2.db).",
)
@count_option(
    "--max-conversations",
    0,
    "Training conversations taken from each --conversations file and from --from-job (a "
    "fixed hash-ordered pick; 0: all of them).",
    minimum=0,
)
@click.option(
    "--snapshot-tokens",
    default="",
    help="Comma-separated answer-token counts (e.g. 200000,1000000) at which a copy of "
    "the head is written to OUT/snapshots/tokens-N: the returns on data, from one run.",
)
@folder_option(
    "--out",
    "Working folder: answers, features, checkpoints and the head (OUT/head). What is "
    "there is reused: use a new folder for other answer settings.",
    required=True,
)
@count_option(
    "--max-samples",
    training_default("max_samples"),
    "Training prompts to answer and learn from (a fixed hash-ordered pick); 0 with "
    "--conversations: PROMPTS only give the validation answers.",
    minimum=0,
)
@count_option(
    "--val-samples",
    training_default("val_samples"),
    "Held-out validation prompts to answer and measure on.",
    minimum=0,
)
@count_option("--epochs", training_default("epochs"), "Passes over the training conversations.")
@count_option(
    "--max-new-tokens",
    training_default("max_new_tokens"),
    "Longest answer the target writes (and the length of the tau check).",
)
@click.option(
    "--temperature",
    default=training_default("temperature"),
    show_default=True,
    type=click.FloatRange(0),
    help="Answer sampling temperature; 0 (greedy) trains on the contexts that T=0 decoding visits.",
)
@count_option(
    "--batch-size",
    training_default("batch_size"),
    "Conversations per optimizer step (padded to the longest).",
)
@count_option(
    "--answer-batch-size",
    training_default("answer_batch_size"),
    "Prompts the target answers at once (batched decoding; answers do not change).",
)
@click.option(
    "--lr",
    default=training_default("lr"),
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Peak AdamW learning rate (betas 0.9/0.95), cosine-decayed to 0.",
)
@count_option(
    "--warmup-steps",
    training_default("warmup_steps"),
    "Steps of linear learning-rate warm-up.",
    minimum=0,
)
@count_option(
    "--max-len",
    training_default("max_len"),
    "Conversations are cut to this many tokens.",
    minimum=2,
)
@count_option(
    "--checkpoint-every",
    training_default("checkpoint_every"),
    "Steps between checkpoints in OUT/checkpoints (one more at the end).",
)
@click.option(
    "--eval-prompts",
    type=_JSONL,
    help="JSONL whose first turns measure tau (e.g. shared/benchmarks/mt_bench/"
    "question.jsonl); default: the validation prompts.",
)
@count_option(
    "--eval-samples",
    training_default("eval_samples"),
    "How many prompts the tau check decodes (0: skip it).",
    minimum=0,
)
@choice_option(
    "--device", ["cpu", "cuda"], "cpu", "Where features are extracted and the head is trained."
)
@choice_option(
    "--precision",
    ["auto", "bf16", "fp32"],
    training_default("precision"),
    "bf16: autocast around the head (fp32 master weights); auto: bf16 on cuda, fp32 on cpu "
    "(CPUs without bf16 matrix units run bf16 autocast far slower: 30x measured on AVX2).",
)
@click.option(
    "--seed",
    default=training_default("seed"),
    show_default=True,
    type=int,
    help="Seeds answer sampling, the head's init, data order and input noise.",
)
@click.option(
    "--init-head",
    default=None,
    help="Start from this head's weights instead of a random init, to fine-tune it on "
    "more answers: a head folder (config.json + model.safetensors) or `shipped`, the "
    "head the package ships for MODEL. A checkpoint taken up with --resume wins over it.",
)
@count_option(
    "--draft-vocab-size",
    training_default("draft_vocab_size"),
    "The head drafts from the N tokens most frequent in its training answers (written "
    "beside it as draft_vocab.safetensors); 0: the full vocabulary.",
    minimum=0,
)
@choice_option(
    "--arch",
    ["eagle2", "eagle3"],
    training_default("arch"),
    "eagle2: the EAGLE-1/2 head (fc over [embedding, final feature]); eagle3: features "
    "fused from three target layers, its own lm_head over the draft vocabulary, trained "
    "with training-time test (saved in the public EAGLE-3 layout).",
)
@count_option(
    "--ttt-steps",
    training_default("ttt_steps"),
    "--arch eagle3: draft steps unrolled per batch (the reference uses 7; each costs a "
    "head forward).",
)
@click.option(
    "--eagle3-features",
    is_flag=True,
    help="Store the layer states an EAGLE-3 head reads even when training an EAGLE-2 "
    "head (about 4x the disk), so an --arch eagle3 run on the same data and OUT "
    "reuses this feature extraction instead of redoing it.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue training from OUT/checkpoints. Answers and features always "
    "resume: what is on disk and still matches is not redone.",
)
def train_draft(
    prompts: Path | None,
    conversations: tuple[Path, ...],
    snapshot_tokens: str,
    **options: Any,
) -> None:
    """Train an EAGLE draft head for MODEL on its own answers to PROMPTS and/or on
    CONVERSATIONS that have answers, or on a finished job's answers (--from-job).

    Stages: answers (for PROMPTS) -> features -> train -> evaluate -> head. The head is
    written to OUT/head and can be passed as --draft; OUT/summary.json holds the numbers.

    \b
    Examples:
      eagle2-batch train-draft --prompts train_prompts.jsonl --out work/ --max-samples 2000
      eagle2-batch train-draft --conversations train_conversations.jsonl --out work/ \\
          --prompts train_prompts.jsonl --max-samples 1000 --snapshot-tokens 200000,1000000
      eagle2-batch train-draft --conversations train_conversations.jsonl --out work3/ \\
          --arch eagle3 --max-conversations 2000
      eagle2-batch train-draft --from-job 3f2a... --init-head shipped --out work4/
    """
    if prompts is None and not conversations and options["from_job"] is None:
        raise click.UsageError("give --prompts, --conversations or --from-job")
    training = DraftTraining(
        prompts=prompts,
        conversations=conversations,
        snapshot_tokens=_token_counts(snapshot_tokens),
        **options,
    )
    with user_errors():
        head_dir, summary = train_draft_head(training)
    click.echo(f"head written to {head_dir} (tau {format_tau(summary['tau'])})")
