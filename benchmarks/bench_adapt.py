"""--adapt-draft against the same job without it: a job of one kind of prompt, both runs
timed as whole `eagle2-batch run` commands, one after the other on the same prompts, after
an untimed one-prompt run (kernels built, the dtype's cost table measured).

Reported: tau of the first, middle and last third of each job's completions (in the order
they were stored; tau = completion tokens / verify cycles over the third), tokens/s, wall
time, the head versions the adapting job tried (data, tau before and after, seconds), and
whether every output is identical (greedy: they must be).

    python benchmarks/bench_adapt.py --prompts ../shared/datasets/train_prompts.jsonl \\
        --source gsm8k_train --limit 1000 --out /tmp/bench-adapt
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click

from workers.db import iter_samples, make_engine
from workers.head_versions import versions


def job_set(prompts: Path, source: str, limit: int, path: Path) -> Path:
    """The first `limit` prompts of `source`, in the file's order, as a job's input file."""
    lines = []
    with prompts.open(encoding="utf-8") as lines_in:  # not splitlines: texts hold U+2028
        objs = [json.loads(line) for line in lines_in if line.strip()]
    for obj in objs:
        if obj.get("source") == source:
            lines.append({"id": obj["id"], "prompt": obj["prompt"]})
    if len(lines) < limit:
        raise click.UsageError(f"{prompts} has {len(lines)} prompts of {source}, not {limit}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(obj) + "\n" for obj in lines[:limit]), encoding="utf-8")
    return path


def run(job: Path, out: Path, options: list[str]) -> tuple[str, float]:
    """(job id, wall seconds) of one `eagle2-batch run`."""
    cli = Path(sys.executable).parent / "eagle2-batch"
    command = [str(cli), "run", str(job), "--out", str(out), *options]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise click.ClickException(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    print(done.stderr[-1500:], file=sys.stderr)
    return done.stdout.strip().splitlines()[-1], seconds


def thirds(rows: list[dict]) -> list[float]:
    """tau of each third of the completions, in the order they were stored."""
    rows = sorted(rows, key=lambda r: (r["created_at"], r["sample_id"]))
    size = len(rows) / 3
    parts = [rows[round(i * size) : round((i + 1) * size)] for i in range(3)]
    return [
        round(sum(r["completion_tokens"] for r in p) / sum(r["n_cycles"] for r in p), 3)
        for p in parts
    ]


def read(out: Path, job_id: str) -> tuple[list[dict], list[dict]]:
    engine = make_engine(f"sqlite:///{out / 'eagle2.db'}")
    try:
        rows = [r for r in iter_samples(engine, job_id) if r["status"] == "ok"]
        return rows, versions(engine, job_id)
    finally:
        engine.dispose()


@click.command()
@click.option("--prompts", type=click.Path(exists=True, path_type=Path), required=True)
@click.option("--source", default="gsm8k_train", show_default=True)
@click.option("--limit", default=1000, show_default=True)
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--batch-size", default="4", show_default=True)
@click.option("--shard-size", default=111, show_default=True)
@click.option("--adapt-after", default=333, show_default=True)
@click.option(
    "--dtype",
    default="fp32",
    show_default=True,
    help="fp32: outputs must be identical; bf16 rounds differently as trees change shape.",
)
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--skip-plain", is_flag=True, help="Only the adapting job.")
def main(
    prompts: Path,
    source: str,
    limit: int,
    max_new_tokens: int,
    batch_size: str,
    shard_size: int,
    adapt_after: int,
    dtype: str,
    out: Path,
    skip_plain: bool,
) -> None:
    job = job_set(prompts, source, limit, out / "job.jsonl")
    options = ["--max-new-tokens", str(max_new_tokens), "--batch-size", batch_size]
    options += ["--shard-size", str(shard_size), "--dtype", dtype]
    warmup = out / "warmup.jsonl"  # untimed: kernels built, this dtype's cost table measured
    warmup.write_text(job.read_text(encoding="utf-8").split("\n", 1)[0] + "\n")
    run(warmup, out / "warmup", options)
    adapt = ["--adapt-draft", "--adapt-after", str(adapt_after)]
    report: dict = {"source": source, "prompts": limit, "options": " ".join(options)}
    runs = [("adapted", adapt)] + ([] if skip_plain else [("plain", [])])
    texts = {}
    for name, extra in runs:
        job_id, seconds = run(job, out / name, options + extra)
        rows, tried = read(out / name, job_id)
        decode_s = sum(r["total_ms"] for r in rows) / 1000
        tokens = sum(r["completion_tokens"] for r in rows)
        report[name] = {
            "wall_s": round(seconds, 1),
            "tok_s": round(tokens / decode_s, 1),
            "tau_thirds": thirds(rows),
            "versions": [
                {k: v for k, v in t.items() if k not in ("job_id", "created_at", "sha256")}
                for t in tried
            ],
        }
        texts[name] = {r["sample_id"]: r["output_text"] for r in rows}
    first, _, last = report["adapted"]["tau_thirds"]
    report["adapted"]["last_over_first"] = round(last / first, 3)
    if "plain" in texts:
        same = sum(texts["plain"].get(k) == v for k, v in texts["adapted"].items())
        report["identical"] = f"{same}/{len(texts['adapted'])}"
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
