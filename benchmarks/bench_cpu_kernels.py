"""torch's ops against the CPU kernels (cpu_kernels.py) in batched plain decoding, in one
process: blocks of rounds alternate between the two, so the VM's noise falls on both.

    python benchmarks/bench_cpu_kernels.py --batch-size 80 --dtype fp32
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
from profile_batch import first_turns

from eagle2_core import cpu_kernels
from eagle2_core.config import DecodeConfig
from eagle2_core.decoder import BatchDecoder
from eagle2_core.engine import load_engine
from eagle2_core.precision import resolve_dtype
from eagle2_core.registry import DEFAULT_MODEL, encode_chat


@click.command()
@click.option(
    "--dataset",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=Path("../shared/benchmarks/mt_bench/question.jsonl"),
    show_default=True,
)
@click.option("--batch-size", default=80, show_default=True)
@click.option("--dtype", default="fp32", show_default=True)
@click.option("--blocks", default=6, show_default=True, help="Blocks of rounds per side.")
@click.option("--rounds", default=4, show_default=True, help="Timed rounds per block.")
def main(dataset: Path, batch_size: int, dtype: str, blocks: int, rounds: int) -> None:
    engine = load_engine(DEFAULT_MODEL, None, needs_draft=False, dtype=resolve_dtype(dtype, "cpu"))
    config = DecodeConfig(mode="vanilla", max_new_tokens=4 + blocks * 2 * (rounds + 1) + 4)
    decoder = BatchDecoder(engine, batch_size=batch_size)
    for i, text in enumerate(first_turns(dataset, batch_size)):
        messages = [{"role": "user", "content": text}]
        decoder.add(i, encode_chat(engine.target.tokenizer, messages), config)
    kernels = {"norms": cpu_kernels.norms, "attends": cpu_kernels.attends}
    torch_ops = {"norms": lambda x: False, "attends": lambda x, tokens, head_dim: False}
    for _ in range(4):
        decoder.step()
    times: dict[str, list[float]] = {"torch": [], "kernels": []}
    for _ in range(blocks):
        for side, functions in (("torch", torch_ops), ("kernels", kernels)):
            for name, function in functions.items():
                setattr(cpu_kernels, name, function)
            decoder.step()  # the first round after a switch is not timed
            start = time.perf_counter()
            for _ in range(rounds):
                decoder.step()
            times[side].append((time.perf_counter() - start) * 1000 / rounds)
    result = {
        side: {"median_ms": round(statistics.median(t), 1), "min_ms": round(min(t), 1)}
        for side, t in times.items()
    }
    print(json.dumps({"batch": decoder.active, "dtype": dtype, **result}))


if __name__ == "__main__":
    main()
