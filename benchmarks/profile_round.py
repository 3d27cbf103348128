"""Where an EAGLE-2 round's time goes: target forward, target lm_head, drafting (head
steps, draft lm_head, top-k) and everything else (trees, masks, acceptance, commit,
planning, bookkeeping: the host work).

Wall-clock timers around the engine's own functions (no profiler overhead), over a few
first turns of the validation split of train_prompts.jsonl (the benchmark sets stay for
benchmarks), 128 new tokens, B=1 and B=16.

    python benchmarks/profile_round.py --prompts ../shared/datasets/train_prompts.jsonl
"""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from pathlib import Path

import click

from eagle2_core import decoder
from eagle2_core.config import DecodeConfig
from eagle2_core.engine import load_engine
from eagle2_core.registry import DEFAULT_MODEL, encode_chat
from eagle2_core.train.data import is_validation

SPENT: Counter = Counter()
IN_ROUND = [False]  # prefills run outside rounds: their forwards are not a round's


def timed(owner, name: str, label: str) -> None:
    """Replace owner.name by a wrapper that adds its wall time, inside rounds, to SPENT."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        outer = label == "round"
        if outer:
            IN_ROUND[0] = True
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            if IN_ROUND[0]:
                SPENT[label] += time.perf_counter() - start
            if outer:
                IN_ROUND[0] = False

    setattr(owner, name, wrapper)


PARTS = ("target forward", "target lm_head", "draft head", "draft lm_head")


@click.command()
@click.option("--prompts", type=click.Path(exists=True, path_type=Path), required=True)
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--draft", default=None, help="Default: the head shipped for the model.")
@click.option("--limit", default=8, show_default=True)
@click.option("--batch-sizes", default="1,16", show_default=True)
def main(prompts: Path, model: str, draft: str | None, limit: int, batch_sizes: str) -> None:
    engine = load_engine(model, draft)
    lines = (json.loads(line) for line in prompts.open())
    chosen = itertools.islice((d for d in lines if is_validation(d["id"])), limit)
    ids = [
        encode_chat(engine.target.tokenizer, [{"role": "user", "content": d["prompt"]}])
        for d in chosen
    ]
    timed(decoder, "forward", "target forward")
    timed(engine.target, "lm_head", "target lm_head")
    timed(engine.lean_head, "step", "draft head")
    timed(engine.lean_head, "log_probs", "draft lm_head")
    timed(decoder.BatchDecoder, "_round", "round")
    config = DecodeConfig(max_new_tokens=128)
    for b in (int(x) for x in batch_sizes.split(",")):
        list(engine.generate_batch([(0, ids[0], DecodeConfig(max_new_tokens=8))], b))
        SPENT.clear()
        cycles = tokens = nodes = 0
        for _, generation in engine.generate_batch([(i, p, config) for i, p in enumerate(ids)], b):
            cycles += generation.stats.n_cycles
            tokens += generation.completion_tokens
            nodes += generation.stats.tree_nodes
        total = SPENT["round"]
        click.echo(
            f"B={b}: {len(ids)} prompts, {tokens} tokens, {total:.1f} s in rounds, "
            f"mean tree {nodes / cycles:.1f} nodes"
        )
        for label in PARTS:
            click.echo(f"  {label:<15} {SPENT[label] / total:6.1%}")
        host = total - sum(SPENT[label] for label in PARTS)
        click.echo(f"  {'host work':<15} {host / total:6.1%}  (neither a forward nor an lm_head)")


if __name__ == "__main__":
    main()
