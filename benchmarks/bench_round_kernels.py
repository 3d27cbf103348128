"""A decoding round with the greedy-token and SiLU kernels against torch's ops, A/B in one
process: B MT-bench first turns decode together, and blocks of rounds alternate between
the two (ABBA order, so rows finishing along the way fall on both sides alike).

    python benchmarks/bench_round_kernels.py --dtype bf16
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import torch
from profile_batch import first_turns

from eagle2_core import cpu_kernels
from eagle2_core.config import DecodeConfig
from eagle2_core.decoder import BatchDecoder
from eagle2_core.engine import load_engine
from eagle2_core.precision import resolve_dtype
from eagle2_core.registry import DEFAULT_MODEL, encode_chat


def torch_greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.max(dim=-1).indices


@click.command()
@click.option(
    "--dataset",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=Path("../shared/benchmarks/mt_bench/question.jsonl"),
    show_default=True,
)
@click.option("--dtype", default="bf16", show_default=True)
@click.option("--rows", default=80, show_default=True)
@click.option("--blocks", default=6, show_default=True, help="A/B pairs of round blocks.")
@click.option("--rounds", default=5, show_default=True, help="Rounds per block.")
def main(dataset: Path, dtype: str, rows: int, blocks: int, rounds: int) -> None:
    engine = load_engine(DEFAULT_MODEL, None, dtype=resolve_dtype(dtype, "cpu"))
    tokenizer = engine.target.tokenizer
    decoder = BatchDecoder(engine, rows)
    for i, text in enumerate(first_turns(dataset, rows)):
        ids = encode_chat(tokenizer, [{"role": "user", "content": text}])
        decoder.add(i, ids, DecodeConfig(max_new_tokens=128))
    for _ in range(10):  # the joins and the first rounds
        decoder.step()
    sides = {
        "kernels": (cpu_kernels.silu_mul, cpu_kernels.greedy_tokens),
        "torch": (cpu_kernels.torch_silu_mul, torch_greedy),
    }
    ms: dict[str, list[float]] = {name: [] for name in sides}
    for block in range(blocks):
        for name in list(sides) if block % 2 == 0 else list(sides)[::-1]:
            cpu_kernels.silu_mul, cpu_kernels.greedy_tokens = sides[name]
            start = time.perf_counter()
            for _ in range(rounds):
                decoder.step()
            ms[name].append((time.perf_counter() - start) / rounds * 1000)
    ratio = sum(ms["kernels"]) / sum(ms["torch"])
    print(
        json.dumps(
            {
                "dtype": dtype,
                "rows_at_end": len(decoder.rows),
                "round_ms": {name: [round(x, 1) for x in v] for name, v in ms.items()},
                "kernels_over_torch": round(ratio, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
