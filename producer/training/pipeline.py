"""Train an EAGLE draft head for a target, end to end (`eagle2-batch train-draft`).

Stages, each resumable under OUT:
  answers   the target answers the selected prompts through the product's own batch
            path (`run_job` in vanilla mode, as `eagle2-batch run --mode vanilla`,
            SQLite + Parquet in OUT/answers), read back from that SQLite database;
  features  one target forward per conversation -> OUT/features/{train,val}/*.safetensors;
  train     the EAGLE objective, checkpoints in OUT/checkpoints (continue with resume);
  evaluate  held-out loss / top-1 and tau of EAGLE-2 decoding on a few prompts;
  head      OUT/head: config.json + model.safetensors (public EAGLE format), the draft
            vocabulary (draft_vocab.safetensors) and README.md.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle2_core.config import DRAFT_VOCAB_SIZE
from eagle2_core.registry import ModelLoadError
from producer.database import open_database, safe_url
from producer.jobs import JobError, make_spec
from producer.local_run import format_run, run_job
from producer.status import job_failure
from producer.training.data import (
    Prompt,
    TrainingError,
    build_conversations,
    job_conversations,
    prompt_lines,
    read_conversations,
    select_prompts,
)
from producer.training.heads import measure_tau, save_head, snapshots, starting_head
from producer.training.model_card import model_card
from workers.db import get_job, iter_samples, make_engine
from workers.job_answers import iter_job_answers
from workers.job_queries import job_ids
from workers.job_settings import DECODE_DEFAULTS, DEFAULT_SHARD_SIZE
from workers.settings import load_settings


@dataclass(frozen=True, kw_only=True)
class DraftTraining:
    """What to train on and how: the options of `eagle2-batch train-draft`, whose
    defaults are these fields' (`training_default`)."""

    model: str
    out: Path
    device: str
    prompts: Path | None = None  # prompts the target answers itself
    conversations: tuple[Path, ...] = ()  # conversations that have answers
    max_conversations: int = 0  # training conversations per file (0: all)
    # answer-token counts at which a copy of the head is kept
    snapshot_tokens: list[int] = field(default_factory=list)
    max_samples: int = 512
    val_samples: int = 32
    epochs: int = 2
    max_new_tokens: int = 128
    temperature: float = 0.0
    batch_size: int = 8
    answer_batch_size: int = 16
    lr: float = 3e-4
    warmup_steps: int = 20
    max_len: int = 1024
    checkpoint_every: int = 100
    eval_prompts: Path | None = None
    eval_samples: int = 10
    precision: str = "auto"  # auto, bf16 or fp32
    seed: int = 0
    init_head: str | None = None  # a head folder or `shipped`
    draft_vocab_size: int = DRAFT_VOCAB_SIZE  # 0: the full vocabulary
    resume: bool = False
    arch: str = "eagle2"  # eagle2: the EAGLE-1/2 head; eagle3: fused layers + training-time test
    ttt_steps: int = 3  # eagle3: draft steps unrolled per batch
    eagle3_features: bool = False  # store EAGLE-3 layer states even for an EAGLE-2 head
    from_job: str | None = None  # a finished job whose answers to train on
    db_url: str | None = None  # the database that holds it (default: EAGLE2_DATABASE_URL)

    @property
    def answering(self) -> AnswerSettings:
        """How the target answers the training prompts."""
        return AnswerSettings(
            self.model,
            self.max_new_tokens,
            self.temperature,
            self.seed,
            self.device,
            self.answer_batch_size,
        )


def training_default(name: str) -> Any:
    """train-draft's default for option `name` (one place for the CLI and --adapt-draft)."""
    return DraftTraining.__dataclass_fields__[name].default


@dataclass(frozen=True)
class AnswerSettings:
    """How the target writes its training answers (vanilla decoding through `run`)."""

    model: str
    max_new_tokens: int
    temperature: float
    seed: int
    device: str
    batch_size: int


def answers_url(directory: Path) -> str:
    """The answers' own SQLite database: never EAGLE2_DATABASE_URL's shared one."""
    return f"sqlite:///{(directory / 'eagle2.db').resolve()}"


def read_answers(directory: Path) -> dict[str, dict[str, Any]]:
    """Successful answers by sample id, from every job `run` stored under directory.

    Read from the database, which holds each sample as soon as it is decoded (Parquet
    only per finished shard), so an interrupted or shrunk selection loses nothing.
    """
    if not (directory / "eagle2.db").exists():
        return {}
    engine = make_engine(answers_url(directory))
    columns = ["sample_id", "output_text", "finish_reason", "status"]
    answers: dict[str, dict[str, Any]] = {}
    try:
        for job_id in job_ids(engine):
            for row in iter_samples(engine, job_id, columns=columns):
                if row["status"] == "ok" and row["output_text"] is not None:
                    answers.setdefault(row["sample_id"], row)
    finally:
        engine.dispose()
    return answers


def generate_answers(input_path: Path, answers_dir: Path, settings: AnswerSettings) -> None:
    """Answer the prompts with the embedded batch path; it resumes what an earlier run began.

    Samples that fail (a prompt longer than the context, say) are left out, not fatal.
    """
    try:
        spec = make_spec(
            model=settings.model,
            draft=None,
            mode="vanilla",
            shard_size=DEFAULT_SHARD_SIZE,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=DECODE_DEFAULTS.top_p,
            seed=settings.seed,
            tree_width=DECODE_DEFAULTS.tree_width,
            tree_depth=DECODE_DEFAULTS.tree_depth,
            total_tokens=DECODE_DEFAULTS.total_tokens,
        )
        run = run_job(
            input_path,
            spec,
            database_url=answers_url(answers_dir),
            out=answers_dir,
            device=settings.device,
            batch_size=settings.batch_size,
        )
    except JobError as exc:
        print(f"answers: {exc}; training on the answers that exist", flush=True)
        return
    print(format_run(run), flush=True)
    failure = job_failure(run.status)
    if failure:
        print(f"answers: {failure}; training on the answers that exist", flush=True)


def ensure_answers(
    out: Path, items: list[Prompt], settings: AnswerSettings
) -> dict[str, dict[str, Any]]:
    """Answers to every item: those already in OUT/answers, plus a `run` over the rest.

    Only the unanswered prompts go to `run`, so nothing is decoded twice, whether the
    last call was interrupted or the selection grew. A marker holding the selection's
    digest records a finished `run`, so prompts that failed there (too long, say) do not
    send every later call back to decoding.
    """
    directory = out / "answers"
    digest = hashlib.sha256(json.dumps(items).encode()).hexdigest()
    marker = directory / "complete.sha256"
    answers = read_answers(directory)
    missing = [(i, m) for i, m in items if i not in answers]
    if not missing or (marker.exists() and marker.read_text() == digest):
        return answers
    text = "".join(json.dumps({"id": i, "messages": m}) + "\n" for i, m in missing)
    input_path = directory / "input.jsonl"
    if not input_path.exists() or input_path.read_text(encoding="utf-8") != text:
        directory.mkdir(parents=True, exist_ok=True)
        input_path.write_text(text, encoding="utf-8")  # unchanged input: `run` resumes its job
    print(f"answers: the target answers {len(missing)} prompts (vanilla decoding)", flush=True)
    generate_answers(input_path, directory, settings)
    marker.write_text(digest)
    return read_answers(directory)


def job_answers(target: Any, training: DraftTraining) -> tuple[list, list]:
    """Training and validation conversations from a finished job's own answers (its
    manifest's prompts and system prompt, its ok samples; failed and rejected lines left
    out), split by the usual hash rule."""
    url = training.db_url or load_settings().database_url
    with open_database(url) as engine:
        job = get_job(engine, training.from_job)
        if job is None:
            raise TrainingError(f"--from-job: no job {training.from_job} in {safe_url(url)}")
        if job["model"] != training.model:
            raise TrainingError(
                f"--from-job: job {training.from_job} ran model {job['model']!r}, not "
                f"{training.model!r}: pass --model {job['model']}"
            )
        answers = iter_job_answers(engine, training.from_job)
        return job_conversations(
            target, answers, training.max_conversations, training.val_samples, training.max_len
        )


def train_draft_head(training: DraftTraining) -> tuple[Path, dict[str, Any]]:
    """Every stage, from the answers to the head; (the head's folder, the summary that
    OUT/summary.json holds). Raises TrainingError (a JobError) with the reason."""
    from eagle2_core.eagle3 import Eagle3Head, reference_layers
    from eagle2_core.engine import Engine
    from eagle2_core.models import load_target
    from eagle2_core.train.data import count_answer_tokens, load_shards, write_feature_shards
    from eagle2_core.train.loop import TrainConfig, train
    from eagle2_core.vocab import DraftVocab, count_tokens

    started = time.perf_counter()
    train_items: list[Prompt] = []
    val_items: list[Prompt] = []
    if training.prompts is not None:
        train_items, val_items = select_prompts(
            training.prompts, training.max_samples, training.val_samples
        )
        if not train_items and training.max_samples and not training.conversations:
            raise TrainingError(f"{training.prompts} has no training prompts")
    answers = {}
    if train_items or val_items:
        answers = ensure_answers(training.out, train_items + val_items, training.answering)

    try:
        target = load_target(training.model, device=training.device)
    except ModelLoadError as exc:
        raise TrainingError(str(exc)) from None
    train_convs = build_conversations(target, train_items, answers, training.max_len)
    val_convs = build_conversations(target, val_items, answers, training.max_len)
    for path in training.conversations:
        given_train, given_val = read_conversations(
            target, path, training.max_conversations, training.val_samples, training.max_len
        )
        train_convs += given_train
        val_convs += given_val
    if training.from_job is not None:
        given_train, given_val = job_answers(target, training)
        train_convs += given_train
        val_convs += given_val
    if not train_convs:
        raise TrainingError(f"no training prompt got an answer; see {training.out / 'answers'}")
    # an EAGLE-3 head reads the inputs of three target layers too; shards that hold them
    # serve an EAGLE-2 head as well, so one extraction can feed both recipes
    eagle3 = training.arch == "eagle3"
    layers = ()
    if eagle3 or training.eagle3_features:
        layers = reference_layers(target.config.num_hidden_layers)
    features = training.out / "features"
    train_data = load_shards(
        write_feature_shards(target, train_convs, features / "train", layers=layers), eagle3
    )
    val_data = load_shards(
        write_feature_shards(target, val_convs, features / "val", layers=layers), eagle3
    )

    config = TrainConfig(
        epochs=training.epochs,
        batch_size=training.batch_size,
        lr=training.lr,
        warmup_steps=training.warmup_steps,
        checkpoint_every=training.checkpoint_every,
        autocast=training.precision == "bf16"
        or (training.precision == "auto" and training.device == "cuda"),
        seed=training.seed,
        device=training.device,
        ttt_steps=training.ttt_steps,
    )
    vocab = None
    if training.draft_vocab_size:
        counts = count_tokens(c.answer_ids for c in train_convs)
        vocab = DraftVocab.most_frequent(counts, training.draft_vocab_size, target.vocab_size)
    head = starting_head(
        training.arch, training.init_head, training.model, training.seed, target, vocab
    )
    if isinstance(head, Eagle3Head):
        vocab = None  # the head carries its own (d2t / t2d)
        vocab_ids = head.vocab.ids
    else:
        vocab_ids = vocab.ids if vocab is not None else None
    result = train(
        head,
        target,
        train_data,
        config,
        training.out / "checkpoints",
        training.resume,
        val_data,
        vocab_ids=vocab_ids,
        on_step=snapshots(training.out / "snapshots", training.snapshot_tokens, vocab, target),
    )
    if result.validation is not None:
        v = result.validation
        by_step = ", ".join(f"{t:.1%}" for t in v.top1_by_step)
        print(
            f"validation: loss {v.loss:.4f}, top-1 {v.top1:.1%} over {v.positions} tokens"
            + (f" (by draft step: {by_step})" if by_step else ""),
            flush=True,
        )

    source = list(prompt_lines(training.eval_prompts)) if training.eval_prompts else val_items
    questions = [(messages, []) for _, messages in source[: training.eval_samples]]
    where = (
        f"{training.eval_prompts.parent.name}/{training.eval_prompts.name}"
        if training.eval_prompts
        else "validation"
    )
    tau = None
    if questions:  # the Engine casts the head to the target's dtype: measure after training
        engine = Engine(target, head.eval(), vocab)
        tau = measure_tau(engine, questions, training.max_new_tokens, training.answer_batch_size)
    summary = {
        "model": training.model,
        "prompts": training.prompts.name if training.prompts is not None else None,
        "conversations": [path.name for path in training.conversations],
        "from_job": training.from_job,
        "temperature": training.temperature,
        "max_new_tokens": training.max_new_tokens,
        "train_conversations": len(train_convs),
        "train_answer_tokens": count_answer_tokens(train_data),
        "validation_conversations": len(val_convs),
        "steps": result.steps,
        "tokens_seen": result.tokens_seen,
        "train": asdict(result.train),
        "validation": asdict(result.validation) if result.validation else None,
        "history": result.history,
        "tau": tau,
        "tau_source": f"{len(questions)} first turns from {where}, "
        f"{training.max_new_tokens} new tokens",
        "init_head": training.init_head,
        "draft_vocab": len(vocab_ids) if vocab_ids is not None else None,
        "arch": training.arch,
        "config": asdict(config),
        "seconds": round(time.perf_counter() - started, 1),
    }
    # what the planner bounds this head's drafting by (plan.accept_ceiling)
    head.held_out_top1 = result.validation.top1 if result.validation else None
    head_dir = save_head(head, training.out / "head", vocab, target, model_card(summary, config))
    (training.out / "summary.json").write_text(json.dumps(summary, indent=2))
    return head_dir, summary
