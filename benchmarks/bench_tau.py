"""Acceptance length (tau) of a draft head on the evaluation sets: EAGLE-2 next to EAGLE-1.

Greedy (T=0) first turns of each set, decoded in batches. tau measures the head, so the
tree is fixed (the reference's 60 nodes, top_k 10, depth 5, by default): with
`--total-tokens auto` the tree, and so tau, would follow the device and the batch. With a
fixed tree each sequence is decoded exactly as alone. Both modes must give the same
tokens (greedy output is the target's); the script checks it and prints a Markdown table.

    python benchmarks/bench_tau.py --limit 10 --max-new-tokens 128
    python benchmarks/bench_tau.py --draft /work/train/smollm2/head --sets mt_bench
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from eagle2_core.config import REFERENCE_TREE_TOKENS, DecodeConfig
from eagle2_core.engine import load_engine
from eagle2_core.registry import DEFAULT_MODEL, encode_chat

SETS = ("mt_bench", "humaneval", "gsm8k", "alpaca")
SHARED = Path(__file__).resolve().parents[2] / "shared" / "benchmarks"


def first_turns(path: Path, limit: int) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()[:limit]
    return [json.loads(line)["turns"][0] for line in lines]


@click.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--draft", default=None, help="Head directory (default: the shipped head).")
@click.option("--sets", default=",".join(SETS), show_default=True)
@click.option("--benchmarks", type=click.Path(path_type=Path), default=SHARED, show_default=True)
@click.option("--limit", default=10, show_default=True, help="First N questions of each set.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--batch-size", default=8, show_default=True)
@click.option(
    "--total-tokens",
    default=REFERENCE_TREE_TOKENS,
    show_default=True,
    help="EAGLE-2's fixed tree size.",
)
def main(model, draft, sets, benchmarks, limit, max_new_tokens, batch_size, total_tokens) -> None:
    engine = load_engine(model, draft)
    rows = []
    for name in sets.split(","):
        prompts = first_turns(benchmarks / name / "question.jsonl", limit)
        ids = [
            encode_chat(engine.target.tokenizer, [{"role": "user", "content": p}]) for p in prompts
        ]
        outputs, row = {}, {"set": name, "questions": len(ids)}
        for mode in ("eagle2", "eagle1"):
            config = DecodeConfig(
                mode=mode, max_new_tokens=max_new_tokens, total_tokens=total_tokens
            )
            start, rounds, cycles = time.perf_counter(), 0, 0
            for key, gen in engine.generate_batch(
                [(i, p, config) for i, p in enumerate(ids)], batch_size
            ):
                outputs.setdefault(key, []).append(gen.token_ids)
                rounds += gen.stats.round_tokens
                cycles += gen.stats.n_cycles
            row[mode] = rounds / cycles if cycles else float("nan")
            row[f"{mode}_s"] = time.perf_counter() - start
        row["identical"] = sum(a == b for a, b in outputs.values())
        rows.append(row)
        click.echo(json.dumps(row), err=True)
    click.echo("| set | questions | EAGLE-2 tau | EAGLE-1 tau | identical outputs |")
    click.echo("|---|---|---|---|---|")
    for r in rows:
        click.echo(
            f"| {r['set']} | {r['questions']} | {r['eagle2']:.2f} | {r['eagle1']:.2f} | "
            f"{r['identical']}/{r['questions']} |"
        )


if __name__ == "__main__":
    main()
