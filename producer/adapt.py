"""--adapt-draft: a job fine-tunes its draft head on its own outputs while it runs.

A round, once enough completions are stored: `train-draft --from-job` on the job's ok
samples (training split), starting from the head the job drafts with now; then both heads'
tau on the job's held-out prompts (the validation split of its manifest, never trained on,
decoded greedily with the reference tree: the same numbers on any machine); the new head
is published (workers/head_versions.py) only if its tau is higher. The next round waits for
ADAPT_GROWTH times the data, and rounds stop at the first one that does not win.

Verification is exact, so a head changes how many drafted tokens are accepted, never an
output. `run` runs a round between shards where one is due (`between_shards`); `eagle2-batch
adapt JOB` does the same beside a submitted job's workers. A trainer lost mid-round loses
that round only: nothing is published until the end, in one insert.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from eagle2_core.registry import draft_source
from producer.training.data import TrainingError
from workers.adapt_schedule import round_due
from workers.db import get_job, sample_counts
from workers.head_versions import Attempt, head_folder, newest_published, record
from workers.job_answers import iter_job_prompts
from workers.job_settings import DECODE_DEFAULTS

# Held-out prompts a round measures both heads on (the validation split holds ~2% of a
# job: 20 of 1,000 prompts), decoded EVAL_BATCH at a time.
EVAL_PROMPTS = 32
EVAL_BATCH = 8
# A round trains harder than train-draft's defaults (2 epochs at 3e-4, made for a fresh
# head on broad data): fine-tuning on 333 answers of one job, held-out tau rose 2.53 -> 2.65
# at the defaults, 2.74 at 4 epochs and 2.81 at 4 epochs with lr 1e-3 (BENCHMARKS.md).
# At least MIN_ROUND_STEPS optimizer steps: two passes over 20 answers would barely move it.
ROUND_EPOCHS = 4
ROUND_LR = 1e-3
MIN_ROUND_STEPS = 60


@dataclass(frozen=True)
class Round:
    """A finished round: the version it was stored as and whether workers switch to it."""

    version: int
    published: bool
    attempt: Attempt

    def describe(self) -> str:
        a = self.attempt
        if a.eval_prompts == 0:
            from eagle2_core.train.data import VALIDATION_MODULUS

            return (
                f"draft head v{self.version} not trained: none of the job's prompts is in "
                f"the validation split (ids with sha256 % {VALIDATION_MODULUS} == 0), which "
                "a round needs to judge a head on; kept the old head, no more rounds"
            )
        if self.published:
            verdict = "published"
        elif a.head_dir is not None:  # it won, but another trainer published a newer head
            verdict = "another trainer published a newer head meanwhile: kept that one"
        else:
            verdict = "kept the old head"
        return (
            f"draft head v{self.version} from v{a.based_on} on {a.train_completions} "
            f"completions: tau {_tau(a.tau_before)} -> {_tau(a.tau_after)} on {a.eval_prompts} "
            f"held-out prompts, {a.train_s:.0f} s; {verdict}"
        )


def _tau(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def adapt_round(
    engine: Engine, database_url: str, job: dict[str, Any], work: Path, device: str
) -> Round:
    """Fine-tune the job's current head on its stored outputs, measure both, store the
    attempt (published if it won)."""
    from eagle2_core.draft import read_config
    from eagle2_core.eagle3 import is_eagle3
    from producer.training.pipeline import train_draft_head

    started = time.perf_counter()
    current = newest_published(engine, job["id"])
    based_on = current[0] if current is not None else 0
    if current is not None:
        current_dir = head_folder(engine, job["id"], based_on, work / "heads")
    else:
        current_dir = draft_source(job["model"], job["draft"])
    if current_dir is None:
        raise TrainingError("--adapt-draft: the job drafts with an untrained head")
    completions = sample_counts(engine, job["id"])["ok"]
    prompts = held_out_prompts(engine, job["id"])
    if not prompts:  # nothing could judge a new head: not worth minutes of training
        attempt = Attempt(based_on, completions, None, None, 0, 0.0, head_dir=None)
        return Round(*record(engine, job["id"], attempt), attempt)
    training = _training(
        job,
        database_url,
        current_dir,
        "eagle3" if is_eagle3(read_config(current_dir)) else "eagle2",
        work / f"round-v{based_on}-{completions}",
        device,
        completions,
    )
    new_dir, _ = train_draft_head(training)
    max_new_tokens = job["params"].get("max_new_tokens") or DECODE_DEFAULTS.max_new_tokens
    before, after = _taus(job["model"], [current_dir, new_dir], prompts, max_new_tokens, device)
    won = before is not None and after is not None and after > before
    attempt = Attempt(
        based_on=based_on,
        train_completions=completions,
        tau_before=before,
        tau_after=after,
        eval_prompts=len(prompts),
        train_s=round(time.perf_counter() - started, 1),
        head_dir=new_dir if won else None,
    )
    return Round(*record(engine, job["id"], attempt), attempt)


def held_out_prompts(engine: Engine, job_id: str) -> list[list[dict]]:
    """The first EVAL_PROMPTS prompts of the job's validation split (whether decoded yet or
    not): never trained on, the same ones every round."""
    from eagle2_core.train.data import is_validation

    prompts = []
    for request_id, messages in iter_job_prompts(engine, job_id):
        if is_validation(str(request_id)):
            prompts.append(messages)
            if len(prompts) == EVAL_PROMPTS:
                break
    return prompts


def _taus(
    model: str, heads: list[Path], prompts: list[list[dict]], max_new_tokens: int, device: str
) -> list[float | None]:
    """Each head's greedy tau on the prompts (fp32 target, the reference tree)."""
    from eagle2_core.engine import Engine as Decoding
    from eagle2_core.engine import load_head
    from eagle2_core.models import load_target
    from producer.training.heads import measure_tau

    if not prompts:
        return [None] * len(heads)
    target = load_target(model, device=device)
    questions = [(messages, []) for messages in prompts]
    taus = []
    for head_dir in heads:
        decoding = Decoding(target, *load_head(target, head_dir))
        taus.append(measure_tau(decoding, questions, max_new_tokens, EVAL_BATCH))
    return taus


def _training(
    job: dict[str, Any],
    database_url: str,
    head: Path,
    arch: str,
    out: Path,
    device: str,
    completions: int,
) -> Any:
    """A round's training: `train-draft --from-job JOB --init-head HEAD` at ROUND_LR for
    ROUND_EPOCHS, or MIN_ROUND_STEPS steps if more; train-draft's defaults otherwise."""
    from producer.training.pipeline import DraftTraining, training_default

    steps_per_epoch = max(1, math.ceil(completions / training_default("batch_size")))
    return DraftTraining(
        model=job["model"],
        from_job=job["id"],
        db_url=database_url,
        init_head=str(head),
        arch=arch,
        out=out,
        device="cuda" if device.startswith("cuda") else "cpu",
        epochs=max(ROUND_EPOCHS, math.ceil(MIN_ROUND_STEPS / steps_per_epoch)),
        lr=ROUND_LR,
        max_samples=0,
        eval_samples=0,  # both heads are measured by the round, on the same prompts
    )


def between_shards(engine: Engine, database_url: str, job_id: str, out: Path, device: str) -> None:
    """`run`'s hook before each shard: a round where one is due, with progress on stderr
    and its working files under OUT/_adapt/<job> (the leading _ keeps Parquet readers of
    OUT out)."""
    due = round_due(engine, job_id)
    if due is None:
        return
    print(
        f"\n--adapt-draft: fine-tuning the draft head on the job's first {due}+ completions",
        file=sys.stderr,
        flush=True,
    )
    done = adapt_round(
        engine, database_url, get_job(engine, job_id), out / "_adapt" / job_id, device
    )
    print(f"--adapt-draft: {done.describe()}", file=sys.stderr, flush=True)
