"""Shared prefill (what the decoder does) against a prefill per sequence, on the same
prompts in one run, and whether the outputs agree.

For prompts of three lengths: n sampled completions (own seeds) of one prompt decoded as
one batch, best of 2 per variant, variants interleaved so load hits them alike.

With --dataset: a benchmark set's first turns, different prompts that share only the chat
template's leading tokens, prefilled as one batch (one new token each, greedy), best of 3.

    python benchmarks/bench_shared_prefill.py
    python benchmarks/bench_shared_prefill.py --n 4 --max-new-tokens 64 --mode vanilla
    python benchmarks/bench_shared_prefill.py \
        --dataset ../shared/benchmarks/mt_bench/question.jsonl --dtype bf16
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import torch

from eagle2_core.config import DTYPES, MODES, DecodeConfig
from eagle2_core.decoder import common_length
from eagle2_core.engine import BatchDecoder, Engine, load_engine
from eagle2_core.precision import resolve_dtype
from eagle2_core.registry import DEFAULT_MODEL, encode_chat

TEXT = Path(__file__).resolve().parent.parent / "README.md"


class OwnPrefill(BatchDecoder):
    """The baseline: every sequence runs the target over its prompt."""

    shares_prefill = False


def decode(engine: Engine, decoder: type[BatchDecoder], prompts: list[list[int]], configs) -> tuple:
    """(seconds, every completion's tokens) for the prompts' completions as one batch."""
    start = time.perf_counter()
    batch = decoder(engine, len(configs))
    for k, (ids, config) in enumerate(zip(prompts, configs, strict=True)):
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
@click.option(
    "--dataset",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Question file (MT-bench format): time its first turns' prefill instead.",
)
@click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True)
def main(
    model: str, mode: str, n: int, max_new_tokens: int, words: str, dataset: Path | None, dtype
) -> None:
    torch_dtype = resolve_dtype(dtype, "cpu")
    engine = load_engine(model, needs_draft=mode != "vanilla", dtype=torch_dtype)
    if dataset is not None:
        template_prefill(engine, dataset, mode)
        return
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
                runs[decoder].append(decode(engine, decoder, [ids] * n, configs))
        shared = min(s for s, _ in runs[BatchDecoder])
        own = min(s for s, _ in runs[OwnPrefill])
        same = all(a == b for (_, a), (_, b) in zip(*runs.values(), strict=True))
        print(f"{len(ids)} | {shared:.2f} | {own:.2f} | {own / shared:.2f}x | {same}")


def template_prefill(engine: Engine, dataset: Path, mode: str) -> None:
    """Different prompts sharing the chat template's leading tokens: their prefill as one
    batch with the shared tokens run once, against each prompt run whole."""
    tokenizer = engine.target.tokenizer
    prompts = [
        encode_chat(tokenizer, [{"role": "user", "content": json.loads(line)["turns"][0]}])
        for line in dataset.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    configs = [DecodeConfig(mode=mode, max_new_tokens=1)] * len(prompts)
    runs: dict[type, list[tuple]] = {BatchDecoder: [], OwnPrefill: []}
    for _ in range(3):
        for decoder in runs:
            runs[decoder].append(decode(engine, decoder, prompts, configs))
    shared = min(s for s, _ in runs[BatchDecoder])
    own = min(s for s, _ in runs[OwnPrefill])
    same = runs[BatchDecoder][0][1] == runs[OwnPrefill][0][1]
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} tokens, ", end="")
    print(f"{common_length(prompts)} shared, {engine.target.dtype}, {mode}")
    print("shared s | own s | own / shared | first tokens identical")
    print(f"{shared:.2f} | {own:.2f} | {own / shared:.2f}x | {same}")


if __name__ == "__main__":
    main()
