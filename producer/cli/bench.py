"""`eagle2-batch bench`: transformers' generate, the engine's plain decoding, EAGLE-1 and
EAGLE-2 on the same prompts, in one run."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys

import click

from eagle2_core.config import AUTO
from eagle2_core.registry import DEFAULT_MODEL
from producer.cli.options import TREE_SIZE_HELP, TreeSize, dtype_option, renamed_option
from producer.inputs import read_requests
from producer.validate import Rejected


@click.command()
@click.option(
    "--dataset",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Prompts: a question.jsonl of shared/benchmarks, or any input JSONL.",
)
@click.option(
    "--modes",
    default="vanilla,engine-vanilla,eagle1,eagle2",
    show_default=True,
    help="Comma-separated modes: vanilla is transformers' generate (the baseline), "
    "engine-vanilla the engine's own decoding without a draft (run --mode vanilla), "
    "eagle1 and eagle2 its speculative modes.",
)
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option(
    "--draft",
    default=None,
    help="Draft head directory; default: the head shipped for the model; "
    "'random' = untrained (tau near 1, for checking the plumbing).",
)
@click.option("--limit", type=int, default=None, help="Only the first N questions.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--first-turn-only", is_flag=True, help="Skip follow-up turns (MT-bench turn 2).")
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--tree-width", type=int, default=10, show_default=True, help="Was --top-k.")
@click.option("--tree-depth", type=int, default=5, show_default=True, help="Was --depth.")
@renamed_option("--top-k", "--tree-width")
@renamed_option("--depth", "--tree-depth")
@click.option(
    "--total-tokens", type=TreeSize(), default=AUTO, show_default=True, help=TREE_SIZE_HELP
)
@click.option(
    "--batch-sizes",
    default=None,
    help="Measure a worker's throughput instead, e.g. 4,8,16 or 16,64,auto (auto: the size "
    "--batch-size auto picks here): tokens/s of the whole prompt set for HF batched "
    "generate at each B, EAGLE-2 at B=1, and the engine's batched plain decoding and "
    "batched EAGLE-2 at each B.",
)
@click.option(
    "--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N: where to decode."
)
@dtype_option()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def bench(
    dataset,
    modes,
    model,
    draft,
    limit,
    max_new_tokens,
    first_turn_only,
    temperature,
    tree_width,
    tree_depth,
    total_tokens,
    batch_sizes,
    device,
    dtype,
    as_json,
) -> None:
    """Measure tau, tokens/s and speedup of decoding modes side by side.

    Every question runs in every mode back to back, so machine load affects all modes
    alike. Example:

        eagle2-batch bench --dataset ../shared/benchmarks/mt_bench/question.jsonl --limit 10
    """
    from eagle2_core.bench import BENCH_MODES, ENGINE_VANILLA, identical_outputs, run_bench
    from eagle2_core.config import DecodeConfig
    from eagle2_core.draft import DraftCheckpointError
    from eagle2_core.engine import load_engine
    from eagle2_core.precision import dtype_name, resolve_dtype
    from eagle2_core.registry import DraftUnavailableError, ModelLoadError

    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = set(mode_list) - set(BENCH_MODES)
    if unknown:
        raise click.BadParameter(
            f"unknown mode(s): {', '.join(sorted(unknown))}", param_hint="--modes"
        )
    items = (r for r in read_requests(dataset) if not isinstance(r, Rejected))
    questions = [
        (r.messages, [] if first_turn_only else r.followups) for r in itertools.islice(items, limit)
    ]
    try:
        speculative = set(mode_list) & {"eagle1", "eagle2"}
        engine = load_engine(
            model,
            draft,
            needs_draft=bool(speculative),
            dtype=resolve_dtype(dtype, device),
            device=device,
        )
    except (DraftUnavailableError, DraftCheckpointError, ModelLoadError) as exc:
        raise click.ClickException(str(exc)) from None
    config = DecodeConfig(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        tree_width=tree_width,
        tree_depth=tree_depth,
        total_tokens=total_tokens,
        seed=0,
    )

    def progress(i: int) -> None:
        if not as_json:
            print(f"\rquestion {i + 1}/{len(questions)}", end="", file=sys.stderr, flush=True)

    if batch_sizes:
        sizes = [
            engine.auto_batch_size() if b.strip() == AUTO else int(b)
            for b in batch_sizes.split(",")
            if b.strip()
        ]
        drafted = [m for m in mode_list if m in ("eagle1", "eagle2")]
        config = dataclasses.replace(config, mode=drafted[-1] if drafted else "vanilla")
        _batch_report(engine, questions, config, sizes, dataset, draft, as_json)
        return
    results = run_bench(engine, questions, mode_list, config, on_question=progress)
    baseline, plain = results.get("vanilla"), results.get(ENGINE_VANILLA)
    rows = [r.as_dict(baseline, plain) for r in results.values()]
    report = {
        "dataset": dataset,
        "model": model,
        "draft": draft or "shipped",
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "device": device,
        "dtype": dtype_name(engine.target.dtype),
        "tree": {"width": tree_width, "depth": tree_depth, "total_tokens": total_tokens},
        "modes": rows,
    }
    if temperature == 0:
        report["identical_outputs"] = identical_outputs(results)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    print(file=sys.stderr)
    click.echo(
        f"{'mode':<14} {'questions':>9} {'tokens':>7} {'tau':>6} {'tree':>6} {'tok/s':>8} "
        f"{'speedup':>8} {'vs engine-vanilla':>17}"
    )
    for row in rows:
        click.echo(
            f"{row['mode']:<14} {row['questions']:>9} {row['new_tokens']:>7} "
            f"{_num(row['tau']):>6} {_num(row['tree_size'], 1):>6} {row['tokens_per_s']:>8.1f} "
            f"{_times(row['speedup']):>8} {_times(row.get('vs_engine_vanilla')):>17}"
        )
    if "identical_outputs" in report:
        click.echo(
            f"greedy outputs identical across modes: "
            f"{report['identical_outputs']}/{len(questions)} questions"
        )


def _num(value: float | None, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if value is not None else "-"


def _times(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def _batch_report(engine, questions, config, sizes, dataset, draft, as_json) -> None:
    """Shard throughput at each batch size (`run_batch_bench`), as a table or JSON."""
    from eagle2_core.bench import run_batch_bench
    from eagle2_core.registry import encode_chat

    prompts = [encode_chat(engine.target.tokenizer, messages) for messages, _ in questions]

    def show(result) -> None:
        if not as_json:
            row = result.as_dict()
            draft_share = f"{row['draft_share']:.0%}" if row["draft_share"] is not None else "-"
            click.echo(
                f"{row['name']:<22} {row['batch_size']:>3} {row['new_tokens']:>7} "
                f"{row['seconds']:>8.1f} {row['tokens_per_s']:>7.1f} {_num(row['tau']):>6} "
                f"{_num(row['tree_size'], 1):>6} {draft_share:>6}"
            )

    if not as_json:
        click.echo(
            f"{'decoding':<22} {'B':>3} {'tokens':>7} {'seconds':>8} {'tok/s':>7} "
            f"{'tau':>6} {'tree':>6} {'draft':>6}"
        )
    results = run_batch_bench(engine, prompts, config, sizes, on_result=show)
    alone = results[0].outputs
    identical = {
        r.batch_size: sum(r.outputs[i] == alone[i] for i in alone) for r in results[1:] if r.outputs
    }
    if as_json:
        report = {
            "dataset": dataset,
            "draft": draft or "shipped",
            "prompts": len(prompts),
            "max_new_tokens": config.max_new_tokens,
            "tree": {
                "width": config.tree_width,
                "depth": config.tree_depth,
                "total_tokens": config.total_tokens,
            },
            "results": [r.as_dict() for r in results],
            "identical_to_b1": identical,
        }
        click.echo(json.dumps(report, indent=2))
        return
    for b, n in identical.items():
        click.echo(f"batched B={b}: {n}/{len(alone)} outputs identical to B=1")
