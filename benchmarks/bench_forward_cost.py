"""What one target forward costs as the number of new tokens grows: the cost model that
decides whether a draft tree (or a batch) pays off on a device.

For q new tokens after a 200-token context: the decoder forward and the lm_head over
the q outputs, best of 3. Speculative decoding wins where q tokens cost little more than
one; a compute-bound device charges nearly every token in full.

    python benchmarks/bench_forward_cost.py
    python benchmarks/bench_forward_cost.py --device cuda --dtype bf16
"""

from __future__ import annotations

import time

import click
import torch
from transformers import DynamicCache

from eagle2_core.models import forward, load_target
from eagle2_core.registry import DEFAULT_MODEL


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@click.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True)
@click.option("--sizes", default="1,4,8,16,32,64,128,256,512", show_default=True)
def main(model: str, device: str, dtype: str, sizes: str) -> None:
    target = load_target(
        model, device=device, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16
    )
    context = 200
    ctx = torch.randint(100, 1000, (1, context), device=device)
    click.echo("| new tokens | forward ms | lm_head ms | total ms | x one token |")
    click.echo("|---|---|---|---|---|")
    one = None
    with torch.inference_mode():
        for q in (int(s) for s in sizes.split(",")):
            x = torch.randint(100, 1000, (1, q), device=device)
            positions = torch.arange(context, context + q, device=device)[None]
            forward_ms, head_ms = [], []
            for _ in range(4):  # the first is a warm-up
                cache = DynamicCache(config=target.model.config)
                forward(target, ctx, torch.arange(context, device=device)[None], cache)
                _sync()
                start = time.perf_counter()
                hidden = forward(target, x, positions, cache)[0]
                _sync()
                middle = time.perf_counter()
                target.lm_head(hidden)
                _sync()
                forward_ms.append((middle - start) * 1000)
                head_ms.append((time.perf_counter() - middle) * 1000)
            total = min(forward_ms[1:]) + min(head_ms[1:])
            one = one or total
            click.echo(
                f"| {q} | {min(forward_ms[1:]):.1f} | {min(head_ms[1:]):.1f} | {total:.1f} "
                f"| {total / one:.1f} |"
            )


if __name__ == "__main__":
    main()
