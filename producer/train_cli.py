"""`eagle2-batch train-draft`: train an EAGLE draft head for a target, end to end.

Stages, each resumable under OUT:
  answers   the target answers the selected prompts through the product's own batch
            path (`eagle2-batch run --mode vanilla`, SQLite + Parquet in OUT/answers),
            read back from that SQLite database;
  features  one target forward per conversation -> OUT/features/{train,val}/*.safetensors;
  train     the EAGLE objective, checkpoints in OUT/checkpoints (continue with --resume);
  evaluate  held-out loss / top-1 and tau of EAGLE-2 decoding on a few prompts;
  head      OUT/head: config.json + model.safetensors (public EAGLE format), the draft
            vocabulary (draft_vocab.safetensors) and README.md.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from sqlalchemy import select

from eagle2_core.config import DRAFT_VOCAB_SIZE, REFERENCE_TREE_TOKENS, DecodeConfig
from eagle2_core.registry import DEFAULT_MODEL, ModelLoadError, encode_chat, shipped_draft
from workers.db import iter_samples, jobs_t, make_engine

if TYPE_CHECKING:  # torch: imported where used, so other commands start fast
    from eagle2_core.engine import Engine
    from eagle2_core.models import Target
    from eagle2_core.train.data import Conversation
    from eagle2_core.train.loop import TrainConfig


def _messages(obj: dict[str, Any]) -> list[dict] | None:
    """The first user turn of a prompt line (`prompt`, `messages` or benchmark `turns`)."""
    if isinstance(obj.get("prompt"), str):
        return [{"role": "user", "content": obj["prompt"]}]
    if isinstance(obj.get("messages"), list):
        return obj["messages"]
    if isinstance(obj.get("turns"), list) and obj["turns"]:
        return [{"role": "user", "content": obj["turns"][0]}]
    return None


def _lines(path: Path) -> Iterator[tuple[str, list[dict]]]:
    """(id, messages) per usable line; the id is the line's `id`, else its line number."""
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            obj = json.loads(line)
            messages = _messages(obj)
            if messages is not None:
                yield str(obj.get("id", obj.get("question_id", line_no))), messages


def select_prompts(
    path: Path, max_train: int, max_val: int
) -> tuple[list[tuple[str, list[dict]]], list[tuple[str, list[dict]]]]:
    """Hash-ordered training and validation prompts: an even spread over the file's sources.

    The order is fixed by the ids alone, so a larger --max-samples keeps the earlier
    selection as its prefix and the answers and shards already made stay valid.
    """

    from eagle2_core.train.data import is_validation

    def rank(item: tuple[str, list[dict]]) -> str:
        return hashlib.sha256(f"select:{item[0]}".encode()).hexdigest()

    items = sorted(_lines(path), key=rank)
    train_items = [i for i in items if not is_validation(i[0])][:max_train]
    val_items = [i for i in items if is_validation(i[0])][:max_val]
    return train_items, val_items


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
        with engine.connect() as conn:
            job_ids = conn.execute(select(jobs_t.c.id).order_by(jobs_t.c.created_at)).scalars()
            job_ids = list(job_ids)
        for job_id in job_ids:
            for row in iter_samples(engine, job_id, columns=columns):
                if row["status"] == "ok" and row["output_text"] is not None:
                    answers.setdefault(row["sample_id"], row)
    finally:
        engine.dispose()
    return answers


def generate_answers(
    input_path: Path,
    answers_dir: Path,
    model: str,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    device: str,
    batch_size: int,
) -> None:
    """Answer the prompts with the embedded batch path; it resumes what an earlier run began.

    Samples that fail (a prompt longer than the context, say) are left out, not fatal.
    """
    from producer.cli import main as cli  # imported here: producer.cli imports this module

    args = [
        "run", str(input_path), "--out", str(answers_dir), "--model", model,
        "--mode", "vanilla", "--max-new-tokens", str(max_new_tokens),
        "--temperature", str(temperature), "--seed", str(seed), "--device", device,
        "--db-url", answers_url(answers_dir), "--batch-size", str(batch_size),
    ]  # fmt: skip
    try:
        cli.main(args=args, prog_name="eagle2-batch", standalone_mode=False)
    except click.ClickException as exc:
        click.echo(f"answers: {exc.format_message()}; training on the answers that exist")


def build_conversations(
    target: Target, items: list[tuple[str, list[dict]]], answers: dict, max_len: int
) -> list[Conversation]:
    """Conversations of the prompts that have an answer, in selection order."""
    from eagle2_core.train.data import make_conversation

    conversations = []
    for sample_id, messages in items:
        row = answers.get(sample_id)
        if row is None:
            continue
        conversation = make_conversation(
            target.tokenizer,
            sample_id,
            messages,
            row["output_text"],
            row["finish_reason"] == "stop",
            max_len,
        )
        if conversation is not None:
            conversations.append(conversation)
    return conversations


def model_card(summary: dict[str, Any], config: TrainConfig) -> str:
    """A short README.md for the head: how it was made and what it reaches."""
    from eagle2_core.train.loop import Metrics

    val = summary["validation"] or asdict(Metrics())
    tau = summary["tau"]
    noise = config.noise_width / 2
    lines = [
        f"# EAGLE draft head for `{summary['model']}`",
        "",
        "Trained with `eagle2-batch train-draft`: self-distillation with the EAGLE objective",
        "(SmoothL1 on the next feature + 0.1 x soft cross-entropy through the frozen lm_head).",
        "",
        f"- data: {summary['train_conversations']} conversations, "
        f"{summary['train_answer_tokens']} answer tokens: {_sources(summary)}; the "
        "validation split (sha256(id) % 50 == 0) held out",
        f"- training: {summary['steps']} steps, {config.epochs} epochs of batch "
        f"{config.batch_size}; AdamW lr {config.lr:g}, betas {config.betas}, "
        f"{config.warmup_steps} warm-up steps then {config.schedule}; gradient clip "
        f"{config.grad_clip}; input noise U(-{noise:g}, {noise:g}); "
        f"{'bf16 autocast' if config.autocast else 'fp32'} on {config.device}",
        f"- tokens seen: {summary['tokens_seen']}"
        + (f", starting from the head `{summary['init_head']}`" if summary["init_head"] else ""),
        f"- validation: {summary['validation_conversations']} held-out conversations, "
        f"{val['positions']} positions: loss {val['loss']:.4f}, top-1 agreement with the "
        f"target {val['top1']:.1%}",
        f"- draft vocabulary: {_vocab_line(summary['draft_vocab'])}",
        f"- tau (EAGLE-2, T=0, the reference's 60-node tree; {summary['tau_source']}): "
        f"{_fmt_tau(tau)}",
        "",
        "Format: the public EAGLE checkpoint layout (config.json + model.safetensors, bf16);",
        "the target's embedding table and lm_head are used, not stored; draft_vocab.safetensors",
        "holds the draft vocabulary in EAGLE-3's d2t/t2d format.",
    ]
    return "\n".join(lines) + "\n"


def read_conversations(
    target: Target, path: Path, max_train: int, max_val: int, max_len: int
) -> tuple[list[Conversation], list[Conversation]]:
    """Hash-ordered training and validation conversations of a file with answers (as
    select_prompts orders prompts: a larger pick keeps the smaller as its prefix)."""
    from eagle2_core.train.data import conversation_from_messages, is_validation

    def rank(obj: dict) -> str:
        return hashlib.sha256(f"select:{obj['id']}".encode()).hexdigest()

    lines = []
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise click.ClickException(f"{path}:{line_no}: not JSON ({exc.msg})") from None
            if not isinstance(obj.get("messages"), list):
                raise click.ClickException(f"{path}:{line_no}: no `messages` list")
            obj.setdefault("id", f"line-{line_no}")
            lines.append(obj)
    lines.sort(key=rank)
    train_lines = [o for o in lines if not is_validation(str(o["id"]))]
    val_lines = [o for o in lines if is_validation(str(o["id"]))][:max_val]
    if max_train:
        train_lines = train_lines[:max_train]

    def convert(objs: list[dict]) -> list[Conversation]:
        made = (
            conversation_from_messages(target.tokenizer, str(o["id"]), o["messages"], max_len)
            for o in objs
        )
        return [c for c in made if c is not None]

    return convert(train_lines), convert(val_lines)


def _token_counts(text: str) -> list[int]:
    try:
        return sorted(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not a list of numbers", param_hint="--snapshot-tokens"
        ) from None


def _snapshots(directory: Path, counts: list[int], vocab, target: Target):
    """on_step for train(): a copy of the head each time tokens seen pass a count."""
    from eagle2_core.draft import save_draft

    pending = list(counts)

    def on_step(step: int, tokens_seen: int, head) -> None:
        while pending and tokens_seen >= pending[0]:
            where = save_draft(head, directory / f"tokens-{pending.pop(0)}")
            if vocab is not None:
                vocab.save(where, target.vocab_size)
            (where / "snapshot.json").write_text(
                json.dumps({"step": step, "tokens_seen": tokens_seen})
            )

    return on_step


def _sources(summary: dict[str, Any]) -> str:
    parts = []
    if summary["prompts"]:
        parts.append(
            f"answers written by the target itself to prompts from `{summary['prompts']}` "
            f"(temperature {summary['temperature']}, at most {summary['max_new_tokens']} "
            "new tokens)"
        )
    for name in summary["conversations"]:
        parts.append(f"the answer turns of `{name}`")
    return " and ".join(parts)


def _vocab_line(size: int | None) -> str:
    if size is None:
        return "the target's full vocabulary"
    return f"the {size} tokens most frequent in the training answers (draft_vocab.safetensors)"


def _init_head_dir(init_head: str, model: str) -> Path:
    """--init-head's folder: `shipped` names the package's head for a built-in alias."""
    if init_head != "shipped":
        return Path(init_head)
    shipped = shipped_draft(model)
    if shipped is None:
        raise click.ClickException(f"--init-head shipped: the package ships no head for {model}")
    return shipped


def measure_tau(
    engine: Engine, questions: list[tuple[list[dict], list]], max_new_tokens: int, batch_size: int
) -> float | None:
    """Greedy EAGLE-2 tau (the reference's fixed tree) over the questions' first turns,
    decoded in batches."""
    config = DecodeConfig(
        mode="eagle2", max_new_tokens=max_new_tokens, total_tokens=REFERENCE_TREE_TOKENS
    )
    tokenizer = engine.target.tokenizer
    items = [(i, encode_chat(tokenizer, m), config) for i, (m, _) in enumerate(questions)]
    rounds = cycles = 0
    for _, generation in engine.generate_batch(items, batch_size):
        rounds += generation.stats.round_tokens
        cycles += generation.stats.n_cycles
    return rounds / cycles if cycles else None


def _fmt_tau(tau: float | None) -> str:
    return f"{tau:.2f}" if tau is not None else "not measured"


def ensure_answers(
    out: Path,
    items: list[tuple[str, list[dict]]],
    model: str,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    device: str,
    batch_size: int,
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
    click.echo(f"answers: the target answers {len(missing)} prompts (vanilla decoding)")
    generate_answers(
        input_path, directory, model, max_new_tokens, temperature, seed, device, batch_size
    )
    marker.write_text(digest)
    return read_answers(directory)


@click.command("train-draft")
@click.option(
    "--model",
    default=DEFAULT_MODEL,
    show_default=True,
    help="Target: built-in alias, model directory or .gguf file.",
)
@click.option(
    "--prompts",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL prompts ({id, prompt} or {id, messages}) the target answers itself "
    "(self-distillation), e.g. shared/datasets/train_prompts.jsonl. Ids in the "
    "validation split (sha256(id) % 50 == 0) are only used to measure the head.",
)
@click.option(
    "--conversations",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL conversations that already have answers ({id, messages} with assistant "
    "turns), e.g. shared/datasets/train_conversations.jsonl: every answer turn is "
    "trained on, nothing is decoded. Validation-split ids only measure the head. "
    "Repeatable; with --prompts too, all are mixed.",
)
@click.option(
    "--max-conversations",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="Training conversations taken from each --conversations file (a fixed "
    "hash-ordered pick; 0: all of them).",
)
@click.option(
    "--snapshot-tokens",
    default="",
    help="Comma-separated answer-token counts (e.g. 200000,1000000) at which a copy of "
    "the head is written to OUT/snapshots/tokens-N: the returns on data, from one run.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Working folder: answers, features, checkpoints and the head (OUT/head). "
    "What is there is reused: use a new folder for other answer settings.",
)
@click.option(
    "--max-samples",
    default=512,
    show_default=True,
    type=click.IntRange(1),
    help="Training prompts to answer and learn from (a fixed hash-ordered pick).",
)
@click.option(
    "--val-samples",
    default=32,
    show_default=True,
    type=click.IntRange(0),
    help="Held-out validation prompts to answer and measure on.",
)
@click.option(
    "--epochs",
    default=2,
    show_default=True,
    type=click.IntRange(1),
    help="Passes over the training conversations.",
)
@click.option(
    "--max-new-tokens",
    default=128,
    show_default=True,
    type=click.IntRange(1),
    help="Longest answer the target writes (and the length of the tau check).",
)
@click.option(
    "--temperature",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0),
    help="Answer sampling temperature; 0 (greedy) trains on the contexts that T=0 decoding visits.",
)
@click.option(
    "--batch-size",
    default=8,
    show_default=True,
    type=click.IntRange(1),
    help="Conversations per optimizer step (padded to the longest).",
)
@click.option(
    "--answer-batch-size",
    default=16,
    show_default=True,
    type=click.IntRange(1),
    help="Prompts the target answers at once (batched decoding; answers do not change).",
)
@click.option(
    "--lr",
    default=3e-4,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Peak AdamW learning rate (betas 0.9/0.95), cosine-decayed to 0.",
)
@click.option(
    "--warmup-steps",
    default=20,
    show_default=True,
    type=click.IntRange(0),
    help="Steps of linear learning-rate warm-up.",
)
@click.option(
    "--max-len",
    default=1024,
    show_default=True,
    type=click.IntRange(2),
    help="Conversations are cut to this many tokens.",
)
@click.option(
    "--checkpoint-every",
    default=100,
    show_default=True,
    type=click.IntRange(1),
    help="Steps between checkpoints in OUT/checkpoints (one more at the end).",
)
@click.option(
    "--eval-prompts",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL whose first turns measure tau (e.g. shared/benchmarks/mt_bench/"
    "question.jsonl); default: the validation prompts.",
)
@click.option(
    "--eval-samples",
    default=10,
    show_default=True,
    type=click.IntRange(0),
    help="How many prompts the tau check decodes (0: skip it).",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where features are extracted and the head is trained.",
)
@click.option(
    "--precision",
    type=click.Choice(["auto", "bf16", "fp32"]),
    default="auto",
    show_default=True,
    help="bf16: autocast around the head (fp32 master weights); auto: bf16 on cuda, fp32 on "
    "cpu (CPUs without bf16 matrix units run bf16 autocast far slower: 30x measured on AVX2).",
)
@click.option(
    "--seed",
    default=0,
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
@click.option(
    "--draft-vocab-size",
    type=click.IntRange(min=0),
    default=DRAFT_VOCAB_SIZE,
    show_default=True,
    help="The head drafts from the N tokens most frequent in its training answers "
    "(written beside it as draft_vocab.safetensors); 0: the full vocabulary.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue training from OUT/checkpoints. Answers and features always "
    "resume: what is on disk and still matches is not redone.",
)
def train_draft(
    model: str,
    prompts: Path | None,
    conversations: tuple[Path, ...],
    max_conversations: int,
    snapshot_tokens: str,
    out: Path,
    max_samples: int,
    val_samples: int,
    epochs: int,
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    answer_batch_size: int,
    lr: float,
    warmup_steps: int,
    max_len: int,
    checkpoint_every: int,
    eval_prompts: Path | None,
    eval_samples: int,
    device: str,
    precision: str,
    seed: int,
    init_head: str | None,
    draft_vocab_size: int,
    resume: bool,
) -> None:
    """Train an EAGLE draft head for MODEL on its own answers to PROMPTS and/or on
    CONVERSATIONS that have answers.

    Stages: answers (for PROMPTS) -> features -> train -> evaluate -> head. The head is
    written to OUT/head and can be passed as --draft; OUT/summary.json holds the numbers.

    \b
    Examples:
      eagle2-batch train-draft --prompts train_prompts.jsonl --out work/ --max-samples 2000
      eagle2-batch train-draft --conversations train_conversations.jsonl --out work/ \\
          --prompts train_prompts.jsonl --max-samples 1000 --snapshot-tokens 200000,1000000
    """
    from eagle2_core.draft import DraftCheckpointError, load_draft, new_draft_head, save_draft
    from eagle2_core.engine import Engine
    from eagle2_core.models import load_target
    from eagle2_core.train.data import count_answer_tokens, load_shards, write_feature_shards
    from eagle2_core.train.loop import TrainConfig, train
    from eagle2_core.vocab import DraftVocab, count_tokens

    started = time.perf_counter()
    if prompts is None and not conversations:
        raise click.UsageError("give --prompts, --conversations or both")
    train_items, val_items = [], []
    if prompts is not None:
        train_items, val_items = select_prompts(prompts, max_samples, val_samples)
        if not train_items:
            raise click.ClickException(f"{prompts} has no training prompts")
    answers = {}
    if train_items or val_items:
        answers = ensure_answers(
            out,
            train_items + val_items,
            model,
            max_new_tokens,
            temperature,
            seed,
            device,
            answer_batch_size,
        )

    try:
        target = load_target(model, device=device)
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from None
    train_convs = build_conversations(target, train_items, answers, max_len)
    val_convs = build_conversations(target, val_items, answers, max_len)
    for path in conversations:
        given_train, given_val = read_conversations(
            target, path, max_conversations, val_samples, max_len
        )
        train_convs += given_train
        val_convs += given_val
    if not train_convs:
        raise click.ClickException(f"no training prompt got an answer; see {out / 'answers'}")
    train_data = load_shards(write_feature_shards(target, train_convs, out / "features/train"))
    val_data = load_shards(write_feature_shards(target, val_convs, out / "features/val"))

    config = TrainConfig(
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        warmup_steps=warmup_steps,
        checkpoint_every=checkpoint_every,
        autocast=precision == "bf16" or (precision == "auto" and device == "cuda"),
        seed=seed,
        device=device,
    )
    vocab = None
    if draft_vocab_size:
        counts = count_tokens(c.answer_ids for c in train_convs)
        vocab = DraftVocab.most_frequent(counts, draft_vocab_size, target.vocab_size)
    if init_head is None:
        head = new_draft_head(target.model.config, seed=seed)
    else:
        try:
            head = load_draft(_init_head_dir(init_head, model), target.model.config)
        except DraftCheckpointError as exc:
            raise click.ClickException(f"--init-head: {exc}") from None
    result = train(
        head,
        target,
        train_data,
        config,
        out / "checkpoints",
        resume,
        val_data,
        vocab_ids=vocab.ids if vocab is not None else None,
        on_step=_snapshots(out / "snapshots", _token_counts(snapshot_tokens), vocab, target),
    )
    if result.validation is not None:
        v = result.validation
        click.echo(f"validation: loss {v.loss:.4f}, top-1 {v.top1:.1%} over {v.positions} tokens")

    source = list(_lines(eval_prompts)) if eval_prompts else val_items
    questions = [(messages, []) for _, messages in source[:eval_samples]]
    where = f"{eval_prompts.parent.name}/{eval_prompts.name}" if eval_prompts else "validation"
    tau = None
    if questions:  # the Engine casts the head to the target's dtype: measure after training
        engine = Engine(target, head.eval(), vocab)
        tau = measure_tau(engine, questions, max_new_tokens, answer_batch_size)
    summary = {
        "model": model,
        "prompts": prompts.name if prompts is not None else None,
        "conversations": [path.name for path in conversations],
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "train_conversations": len(train_convs),
        "train_answer_tokens": count_answer_tokens(train_data),
        "validation_conversations": len(val_convs),
        "steps": result.steps,
        "tokens_seen": result.tokens_seen,
        "train": asdict(result.train),
        "validation": asdict(result.validation) if result.validation else None,
        "history": result.history,
        "tau": tau,
        "tau_source": f"{len(questions)} first turns from {where}, {max_new_tokens} new tokens",
        "init_head": init_head,
        "draft_vocab": len(vocab) if vocab is not None else None,
        "config": asdict(config),
        "seconds": round(time.perf_counter() - started, 1),
    }
    head_dir = save_draft(head, out / "head", card=model_card(summary, config))
    if vocab is not None:
        vocab.save(head_dir, target.vocab_size)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    click.echo(f"head written to {head_dir} (tau {_fmt_tau(tau)})")
