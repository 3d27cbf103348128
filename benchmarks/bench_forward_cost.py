"""What one target forward costs as the number of new tokens grows, transformers' forward
next to the engine's (llama.py over kernels.Linear): the cost curve that decides whether
a draft tree (or a batch) pays off on a device.

For q new tokens after a 200-token context: the decoder forward and the lm_head over the
q outputs, best of 5, both paths interleaved so load hits them alike.

    python benchmarks/bench_forward_cost.py
    python benchmarks/bench_forward_cost.py --device cuda --dtype bf16
"""

from __future__ import annotations

import time

import click
import torch
from transformers import DynamicCache

from eagle2_core.llama import forward
from eagle2_core.models import load_target
from eagle2_core.registry import DEFAULT_MODEL

CONTEXT = 200


def _ms(run, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000


@click.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True)
@click.option("--sizes", default="1,2,4,8,16,32,64,128", show_default=True)
@click.option("--repeats", default=5, show_default=True)
@torch.inference_mode()
def main(model: str, device: str, dtype: str, sizes: str, repeats: int) -> None:
    target = load_target(
        model, device=device, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16
    )
    context = torch.randint(100, 1000, (1, CONTEXT), device=device)
    kv = target.kv()
    keys, values = kv.add_row(CONTEXT)
    forward(target.lean, context, torch.arange(CONTEXT, device=device)[None], keys, values, 0)[0]
    cache = DynamicCache(config=target.model.config)
    target.model.model(input_ids=context, cache=cache, use_cache=True)
    click.echo("| new tokens | transformers ms | engine ms | x | engine x one token |")
    click.echo("|---|---|---|---|---|")
    one = None
    for q in (int(s) for s in sizes.split(",")):
        hf_ms, engine_ms = _time_size(target, cache, kv, q, device, repeats)
        one = one or engine_ms
        click.echo(
            f"| {q} | {hf_ms:.1f} | {engine_ms:.1f} | {hf_ms / engine_ms:.2f} "
            f"| {engine_ms / one:.2f} |"
        )


def _time_size(target, cache, kv, q: int, device: str, repeats: int) -> tuple[float, float]:
    """Best ms of q new tokens through transformers and through the engine, interleaved."""
    x = torch.randint(100, 1000, (1, q), device=device)
    positions = torch.arange(CONTEXT, CONTEXT + q, device=device)[None]
    start = kv.reserve_new(q)
    mask = kv.tree_mask(torch.ones(1, q, q, dtype=torch.bool, device=device).tril())
    keys, values = kv.layer_views()
    hf_head = target.model.get_output_embeddings()

    def engine() -> None:
        target.lm_head(forward(target.lean, x, positions, keys, values, start, mask)[0])

    def hf() -> None:
        out = target.model.model(input_ids=x, position_ids=positions, cache=cache, use_cache=True)
        hf_head(out.last_hidden_state)

    hf_ms, engine_ms = [], []
    for _ in range(repeats + 1):  # the first of each is a warm-up
        hf_ms.append(_ms(hf, device))
        cache.crop(-q)  # back to the context alone (this version takes a negative count)
        engine_ms.append(_ms(engine, device))
    return min(hf_ms[1:]), min(engine_ms[1:])


if __name__ == "__main__":
    main()
