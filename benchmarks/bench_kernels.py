"""The decoder's linear layers alone: torch's default F.linear against weights reordered
once for oneDNN (kernels.Linear), for 1-32 rows.

SmolLM2-135M's shapes (q|k|v 960x576, o 576x576, gate|up 3072x576, down 576x1536), 30
layers of random weights (424 MB, so they stream from memory as in a real forward), one
pass over all 120 products per timing, best of 5.

    python benchmarks/bench_kernels.py
"""

from __future__ import annotations

import time

import click
import torch
import torch.nn.functional as F

from eagle2_core.kernels import Linear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


@click.command()
@click.option("--rows", default="1,2,4,8,16,32", show_default=True)
@torch.inference_mode()
def main(rows: str) -> None:
    g = torch.Generator().manual_seed(0)
    weights = {
        k: [torch.randn(*s, generator=g) * 0.02 for _ in range(LAYERS)] for k, s in SHAPES.items()
    }
    prepared = {k: [Linear(w) for w in ws] for k, ws in weights.items()}
    megabytes = sum(w.numel() * 4 for ws in weights.values() for w in ws) / 1e6
    click.echo(f"{megabytes:.0f} MB of weights, {LAYERS} layers x {len(SHAPES)} products")
    click.echo("| rows | F.linear ms | prepared ms | x | prepared GB/s |")
    click.echo("|---|---|---|---|---|")
    for m in (int(r) for r in rows.split(",")):
        inputs = {k: torch.randn(m, s[1], generator=g) for k, s in SHAPES.items()}
        plain = _best(lambda x=inputs: [F.linear(x[k], w) for k in SHAPES for w in weights[k]])
        fast = _best(lambda x=inputs: [layer(x[k]) for k in SHAPES for layer in prepared[k]])
        click.echo(
            f"| {m} | {plain:.1f} | {fast:.1f} | {plain / fast:.2f} | {megabytes / fast:.1f} |"
        )


def _best(run, repeats: int = 5) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    return min(times)


if __name__ == "__main__":
    main()
