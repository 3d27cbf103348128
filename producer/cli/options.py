"""Options shared by the commands, and the settings they select.

Click and torch-free config only: no database library, so `bench` imports this where
none is installed (benchmarks/gpu_check.sh runs it alone).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from eagle2_core.config import AUTO, DTYPES, MODES
from eagle2_core.registry import DEFAULT_MODEL
from producer.cli.control_options import Decorator, control_options
from producer.validate import MAX_SEED
from workers.job_settings import DECODE_DEFAULTS, DEFAULT_MAX_ATTEMPTS, DEFAULT_SHARD_SIZE
from workers.request import MAX_COMPLETIONS
from workers.settings import Settings, load_settings


def count_option(name: str, default: int, help: str, minimum: int = 1, **extra: Any) -> Decorator:
    """An integer option of at least `minimum` whose --help shows its default: the shape
    most of the commands' numbers take."""
    return click.option(
        name, type=click.IntRange(minimum), default=default, show_default=True, help=help, **extra
    )


def choice_option(
    name: str, choices: Sequence[str], default: str, help: str, dest: str | None = None
) -> Decorator:
    """One of `choices`, the default shown in --help; `dest` names the parameter where the
    option's own name would not do."""
    names = [name, dest] if dest else [name]
    return click.option(
        *names, type=click.Choice(choices), default=default, show_default=True, help=help
    )


def folder_option(name: str, help: str, **extra: Any) -> Decorator:
    """A folder to write into (made if missing), as a Path."""
    return click.option(name, type=click.Path(file_okay=False, path_type=Path), help=help, **extra)


# INPUT of the job-creating commands (submit, run)
input_argument = click.argument(
    "input_path", metavar="INPUT", type=click.Path(exists=True, dir_okay=False, path_type=Path)
)


class TreeSize(click.ParamType):
    """--total-tokens: 'auto' or a number of tree nodes >= 1."""

    name = "auto|N"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        if isinstance(value, int) or value == AUTO:
            return value
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number < 1:
            self.fail(f"{value!r} is neither 'auto' nor an integer >= 1", param, ctx)
        return number


class BatchSize(click.ParamType):
    """--batch-size: 'auto' or a number of sequences >= 1."""

    name = "auto|N"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        if isinstance(value, int) or value == AUTO:
            return value
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number < 1:
            self.fail(f"{value!r} is neither 'auto' nor an integer >= 1", param, ctx)
        return number


BATCH_SIZE_HELP = (
    "Sequences decoded at once (continuous batching; outputs do not change). 'auto' picks "
    "the size that decodes fastest in this machine's measured cost table (up to 128 on a "
    "CPU, 256 on a GPU, within what half the free memory holds)."
)


def batch_size_option(default: str | None = AUTO, extra_help: str = "") -> Decorator:
    """--batch-size auto|N."""
    return click.option(
        "--batch-size",
        type=BatchSize(),
        default=default,
        show_default=default is not None,
        help=BATCH_SIZE_HELP + extra_help,
    )


def renamed_option(old: str, new: str) -> Decorator:
    """An option that was renamed: giving it is a usage error naming the new one."""

    def refuse(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is not None:
            raise click.UsageError(f"{old} was renamed {new}", ctx)

    return click.option(old, hidden=True, expose_value=False, callback=refuse, default=None)


def tree_options(width: int, depth: int) -> list[Decorator]:
    """--tree-width and --tree-depth (once --top-k and --depth: top-k is sampling's now)."""
    return [
        count_option(
            "--tree-depth",
            depth,
            "Draft tree depth: most drafted tokens a cycle can accept (with --total-tokens "
            "auto, the most draft steps a round may take). Was --depth.",
        ),
        count_option(
            "--tree-width",
            width,
            "Children expanded per draft tree node (with --total-tokens auto, the widest a "
            "level may be). Was --top-k, which is now top-k sampling.",
        ),
        renamed_option("--depth", "--tree-depth"),
    ]


TREE_SIZE_HELP = (
    "Tree nodes verified per EAGLE-2 round. 'auto' sizes every round's tree to this "
    "device's measured forward costs and the draft's confidence (it shrinks to the root "
    "alone where speculation cannot pay); a number fixes it."
)

# `db`, `stats` and `export`: the database alone.
url_option = click.option(
    "--url",
    default=None,
    help="Database URL (default: EAGLE2_DATABASE_URL, else the SQLite file in the output dir).",
)

DTYPE_HELP = (
    "Number format of the target: bf16 halves the weights and is native on GPUs and on "
    "CPUs with AMX or AVX512-BF16; fp32 is token-identical to transformers' generate. "
    "auto: bf16 where native, else fp32 (README, 'Precision', says what each promises)."
)


def dtype_option(default: str | None = "auto", help: str = DTYPE_HELP) -> Decorator:
    """--dtype auto|fp32|bf16."""
    return click.option(
        "--dtype",
        type=click.Choice(DTYPES),
        default=default,
        show_default=default is not None,
        help=help,
    )


# The job commands: the database, whose default follows --out where a command has one.
db_url_option = click.option(
    "--db-url",
    "--url",
    "db_url",
    metavar="URL",
    default=None,
    help="Database URL, e.g. postgresql+psycopg://user@host/db "
    "(default: EAGLE2_DATABASE_URL, else OUT/eagle2.db).",
)


def resolve_url(url: str | None) -> str:
    """The --url value, else the configured database URL."""
    return url or load_settings().database_url


def settings_for(db_url: str | None, out: Path | None) -> Settings:
    """Settings from the environment with the command line's --db-url and --out on top
    (--out also moves the default SQLite database, unless a URL is given)."""
    env = dict(os.environ)
    if out is not None:
        env["EAGLE2_OUTPUT_DIR"] = str(out)
    settings = load_settings(env)
    return replace(settings, database_url=db_url) if db_url else settings


def job_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The options every job-creating command takes (submit, run), in --help order."""
    options = [
        click.option(
            "--model",
            default=DEFAULT_MODEL,
            show_default=True,
            help="Target model: a built-in alias (see `eagle2-batch models`), a local "
            "Hugging Face model directory or a .gguf file.",
        ),
        click.option(
            "--draft",
            metavar="DIR",
            default=None,
            help="EAGLE draft head directory (config.json + model.safetensors). "
            "Default: the head shipped for the model alias. Ignored with --mode vanilla.",
        ),
        choice_option(
            "--mode",
            MODES,
            "eagle2",
            "eagle2: dynamic draft tree; eagle1: static tree; vanilla: plain decoding "
            "without a draft (the baseline).",
        ),
        count_option(
            "--max-new-tokens",
            DECODE_DEFAULTS.max_new_tokens,
            "Tokens to generate per answer (a line's max_tokens overrides it).",
        ),
        dtype_option(
            help=DTYPE_HELP + " Stored with the job: its workers follow it on their devices."
        ),
        click.option(
            "--temperature",
            type=click.FloatRange(min=0),
            default=DECODE_DEFAULTS.temperature,
            show_default=True,
            help="0 is greedy; above 0 samples (output distribution unchanged by EAGLE).",
        ),
        click.option(
            "--top-p",
            type=click.FloatRange(0, 1, min_open=True),
            default=DECODE_DEFAULTS.top_p,
            show_default=True,
            help="Nucleus sampling mass (with --temperature > 0).",
        ),
        click.option(
            "--seed",
            type=click.IntRange(0, MAX_SEED),
            default=None,
            help="Sampling seed for reproducible outputs (a line's seed overrides it).",
        ),
        click.option(
            "--n",
            "n",
            type=click.IntRange(1, MAX_COMPLETIONS),
            default=1,
            show_default=True,
            help="Completions per request (a line's n overrides it): each a sample of its "
            "own, id <id>#<k> for k = 0..n-1, seeded from the seed and k. Use with "
            "--temperature > 0; greedy completions are identical.",
        ),
        click.option(
            "--system",
            metavar="TEXT",
            default=None,
            help="A system prompt for the whole job: it opens every conversation that has "
            "no system message of its own (stored with the job).",
        ),
        click.option(
            "--system-file",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            default=None,
            help="As --system, the prompt read from FILE (UTF-8).",
        ),
        click.option(
            "--stop",
            metavar="TEXT",
            multiple=True,
            help="End each answer before the first occurrence of TEXT (finish_reason "
            "stop); repeat for up to 4 strings. A line's `stop` replaces them.",
        ),
        *control_options(),
        click.option(
            "--total-tokens",
            type=TreeSize(),
            default=DECODE_DEFAULTS.total_tokens,
            show_default=True,
            help=TREE_SIZE_HELP,
        ),
        *tree_options(DECODE_DEFAULTS.tree_width, DECODE_DEFAULTS.tree_depth),
        count_option(
            "--shard-size",
            DEFAULT_SHARD_SIZE,
            "Input lines per shard, the unit a worker takes and a resume redoes.",
        ),
        count_option(
            "--max-attempts",
            DEFAULT_MAX_ATTEMPTS,
            "Attempts at a shard that may be lost (its worker died: a segfault, the OOM "
            "killer) before the shard is given up: its unfinished samples are then stored "
            "as failed, with the last loss as their error, and the job ends.",
        ),
        click.option(
            "--adapt-draft",
            is_flag=True,
            help="Let the job teach its own drafter: once --adapt-after completions are "
            "stored, fine-tune the draft head on the job's outputs, measure both heads' "
            "tau on the job's held-out prompts, and switch to the new one at the next "
            "shard if it wins; again after 4x the data while it keeps winning. Outputs "
            "never change; each row records its head_version. `run` trains between "
            "shards; for `submit`, run `eagle2-batch adapt JOB` beside the workers.",
        ),
        click.option(
            "--adapt-after",
            type=click.IntRange(1),
            default=None,
            help="Completions before the first fine-tuning (default: 5% of the job, "
            "at least 200, at most 2000).",
        ),
        click.option(
            "--strict",
            is_flag=True,
            help="Fail if any line is bad, before anything is written or run "
            "(default: store the bad lines, run the good ones).",
        ),
        click.option(
            "--dry-run",
            is_flag=True,
            help="Only validate INPUT and print the plan (lines, good, rejected, shards).",
        ),
        db_url_option,
        folder_option(
            "--out",
            "Output folder: Parquet files and the default SQLite database "
            "(default: EAGLE2_OUTPUT_DIR, else ./eagle2-out).",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command
