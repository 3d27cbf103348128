"""Where a batched decoding step's time goes: linears, attention, and everything else.

Decodes B prompts at once (the first turns of a benchmark set, repeated to fill the
batch) for a fixed number of rounds after a warm-up, under torch.profiler, and splits
the rounds' wall time into the matrix products (oneDNN / MKL linears, the lm_head),
attention (SDPA, or on a CPU the kernels' rope_attend) and the rest: the share that is
neither is what batching overhead costs (per-sequence Python work, cache copies, masks,
stop checks). Also prints the step's GFLOP (`gflop`): divided by what the products reach on
this machine, the step's floor.

On a GPU (`--device cuda`) the split by host time says little: it adds what the GPU did
(the kernels' summed device time a round, and how many kernels), so a round's wall time
far above its GPU time shows a step bound by the host (launches, Python, syncs).

    python benchmarks/profile_batch.py --batch-sizes 16,64 --dtype fp32
    python benchmarks/profile_batch.py --batch-sizes 1,64 --dtype bf16 --device cuda
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import click
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from eagle2_core import cpu_kernels, llama
from eagle2_core.config import DecodeConfig
from eagle2_core.decoder import BatchDecoder
from eagle2_core.engine import load_engine
from eagle2_core.precision import dtype_name, resolve_dtype
from eagle2_core.registry import DEFAULT_MODEL, encode_chat

LINEAR_OPS = ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear", "aten::bmm")


def first_turns(path: Path, n: int) -> list[str]:
    turns = [json.loads(x)["turns"][0] for x in path.read_text().splitlines() if x.strip()]
    return [turns[i % len(turns)] for i in range(n)]


def split_ops(prof) -> Counter:
    """Self CPU time (ms) of linears, attention and the rest. Attention is everything under
    `llama.attend` or, on a CPU, `cpu_kernels.rope_attend` (timed as a range; that one
    also applies RoPE and writes the cache); the CPU kernels' residual add and RMSNorm
    (a range named "norm") count with the other ops."""
    parts: Counter = Counter()
    for event in prof.events():
        ms = event.self_cpu_time_total / 1000
        if event.name == "attention" or _under_attention(event):
            parts["attention"] += ms
        elif event.name in LINEAR_OPS:
            parts["linear"] += ms
        elif event.name == "norm" or event.name.startswith(("aten::", "mkldnn::")):
            parts["other ops"] += ms
    return parts


def gpu_time(prof, rounds: int) -> dict[str, float]:
    """A round's summed GPU kernel time and kernel count."""
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1000
    return {"gpu_ms": round(busy / rounds, 2), "kernels": round(len(kernels) / rounds)}


def _under_attention(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == "attention":
            return True
        parent = parent.cpu_parent
    return False


def timed(function, name: str):
    """A function inside a profiler range of that name."""

    def wrapped(*args, **kwargs):
        with record_function(name):
            return function(*args, **kwargs)

    return wrapped


@click.command()
@click.option(
    "--dataset",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=Path("../shared/benchmarks/mt_bench/question.jsonl"),
    show_default=True,
)
@click.option("--batch-sizes", default="16,64", show_default=True)
@click.option("--dtype", default="fp32", show_default=True)
@click.option("--mode", default="vanilla", show_default=True)
@click.option("--rounds", default=24, show_default=True, help="Profiled rounds per batch size.")
@click.option("--warmup", default=8, show_default=True)
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--device", default="cpu", show_default=True)
def main(
    dataset: Path,
    batch_sizes: str,
    dtype: str,
    mode: str,
    rounds: int,
    warmup: int,
    model: str,
    device: str,
) -> None:
    llama.attend = timed(llama.attend, "attention")
    cpu_kernels.rope_attend = timed(cpu_kernels.rope_attend, "attention")
    cpu_kernels.add_rms_norm = timed(cpu_kernels.add_rms_norm, "norm")
    torch_dtype = resolve_dtype(dtype, device)
    engine = load_engine(
        model, None, needs_draft=mode != "vanilla", dtype=torch_dtype, device=device
    )
    on_gpu = engine.target.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    tokenizer = engine.target.tokenizer
    config = DecodeConfig(mode=mode, max_new_tokens=warmup + rounds + 8)
    params = sum(p.numel() for p in engine.target.model.parameters())
    embed = engine.target.model.get_input_embeddings().weight.numel()
    for b in [int(x) for x in batch_sizes.split(",")]:
        decoder = BatchDecoder(engine, batch_size=b)
        for i, text in enumerate(first_turns(dataset, b)):
            decoder.add(i, encode_chat(tokenizer, [{"role": "user", "content": text}]), config)
        for _ in range(warmup):
            decoder.step()
        active = decoder.active
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(rounds):
                decoder.step()
            if on_gpu:
                torch.cuda.synchronize()
            wall = (time.perf_counter() - start) * 1000 / rounds
        parts = split_ops(prof)
        per_round = {k: v / rounds for k, v in parts.items()}
        rest = wall - sum(per_round.values())
        neither = 1 - (per_round["linear"] + per_round["attention"]) / wall
        flops = 2 * (params - embed) * active  # one new token per row (plain decoding)
        print(
            json.dumps(
                {
                    "batch": b,
                    "rows": active,
                    "dtype": dtype_name(torch_dtype),
                    "mode": mode,
                    "round_ms": round(wall, 1),
                    "linear_ms": round(per_round["linear"], 1),
                    "attention_ms": round(per_round["attention"], 1),
                    "other_ops_ms": round(per_round["other ops"], 1),
                    "python_ms": round(rest, 1),
                    "neither_share": round(neither, 3),
                    "gflop": round(flops / 1e9, 2),
                    **(gpu_time(prof, rounds) if on_gpu else {}),
                }
            ),
            flush=True,
        )
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
