"""The n completions of one prompt: one shared prefill (what the decoder does) against a
prefill per completion, on the same prompts in one run, and whether the outputs agree.

For prompts of three lengths: n sampled completions (own seeds) decoded as one batch,
best of 2 per variant, variants interleaved so load hits them alike.

    python benchmarks/bench_shared_prefill.py
    python benchmarks/bench_shared_prefill.py --n 4 --max-new-tokens 64 --mode vanilla
"""

from __future__ import annotations

import time
from pathlib import Path

import click
import torch

from eagle2_core.config import MODES, DecodeConfig
from eagle2_core.engine import BatchDecoder, Engine, load_engine
from eagle2_core.registry import DEFAULT_MODEL, encode_chat

TEXT = Path(__file__).resolve().parent.parent / "README.md"


class OwnPrefill(BatchDecoder):
    """The baseline: every sequence runs the target over its prompt."""

    shares_prefill = False


def decode(engine: Engine, decoder: type[BatchDecoder], ids: list[int], configs) -> tuple:
    """(seconds, every completion's tokens) for the completions decoded as one batch."""
    start = time.perf_counter()
    batch = decoder(engine, len(configs))
    for k, config in enumerate(configs):
        batch.add(k, ids, config)
    done: dict[int, list[int]] = {}
    while not batch.idle:
        done.update((k, g.token_ids) for k, g in batch.step())
    return time.perf_counter() - start, [done[k] for k in sorted(done)]


@click.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--mode", type=click.Choice(MODES), default="eagle2", show_default=True)
@click.option("--n", "n", default=4, show_default=True, help="Completions per prompt.")
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--words", default="40,400,1200", show_default=True, help="Prompt lengths.")
def main(model: str, mode: str, n: int, max_new_tokens: int, words: str) -> None:
    engine = load_engine(model, needs_draft=mode != "vanilla")
    text = TEXT.read_text().split()
    configs = [
        DecodeConfig(mode=mode, max_new_tokens=max_new_tokens, temperature=0.7, seed=k)
        for k in range(n)
    ]
    print(f"{model}, {mode}, n={n}, {max_new_tokens} new tokens, {torch.get_num_threads()} threads")
    print("prompt tokens | shared s | own s | own / shared | identical")
    for count in (int(w) for w in words.split(",")):
        content = "Summarise this:\n" + " ".join(text[:count])
        ids = encode_chat(engine.target.tokenizer, [{"role": "user", "content": content}])
        runs: dict[type, list[tuple]] = {BatchDecoder: [], OwnPrefill: []}
        for _ in range(2):
            for decoder in runs:
                runs[decoder].append(decode(engine, decoder, ids, configs))
        shared = min(s for s, _ in runs[BatchDecoder])
        own = min(s for s, _ in runs[OwnPrefill])
        same = all(a == b for (_, a), (_, b) in zip(*runs.values(), strict=True))
        print(f"{len(ids)} | {shared:.2f} | {own:.2f} | {own / shared:.2f}x | {same}")


if __name__ == "__main__":
    main()
