"""Speed and memory of job creation: `submit --dry-run` and a real `submit` as the input grows.

Generates JSONL files of 100k and 1M lines (the mix of benchmarks/bench_inputs.py: five
formats, 1% bad lines) and runs the real CLI on each in a fresh process, whose peak RSS
is its own (VmHWM from /proc): first `submit --dry-run` (read, validate, count prompt
tokens with the model's tokenizer), then a real `submit` to a freshly created Postgres
database and a dedicated Redis database (15, flushed before and after), checking that
the manifest and the queue hold what the plan said. Memory must stay flat in the number
of lines (the ids seen spill to disk past 200k: producer/seen_ids.py); a real submit
reads in a forked second process, whose peak counts too.

    python benchmarks/bench_submit.py [--lines 100000 1000000] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_inputs import MIB, rss_mib, write_mixed  # noqa: E402

PG_ADMIN_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
REDIS_URL = "redis://127.0.0.1:6379/15"


def measure(report: Path, argv: list[str]) -> None:
    """Child process: run the CLI once; write time, CPU and memory to `report`."""
    start = time.perf_counter()
    from producer.cli import main

    after_import = rss_mib("VmRSS")
    imported = time.perf_counter()
    cpu = os.times()
    code = 0
    try:
        main(argv, prog_name="eagle2-batch", standalone_mode=False)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    now = os.times()
    # The reading process of a real submit (forked, so it starts at this one's size):
    # the largest resident size any finished child reached, in KiB on Linux.
    child_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    report.write_text(
        json.dumps(
            {
                "exit_code": code,
                "import_s": imported - start,
                "seconds": time.perf_counter() - imported,
                "cpu_seconds": now.user + now.system - cpu.user - cpu.system,
                "child_cpu_seconds": now.children_user + now.children_system,
                "after_import_mib": after_import,
                "peak_rss_mib": max(rss_mib("VmHWM"), child_peak),
            }
        )
    )


def run_child(argv: list[str], env: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the CLI's --json output, the measurements) of one command in a fresh process."""
    with tempfile.NamedTemporaryFile(suffix=".json") as report:
        out = subprocess.run(
            [sys.executable, __file__, "--measure", report.name, "--", *argv],
            env=env,
            capture_output=True,
            text=True,
        )
        measured = json.loads(Path(report.name).read_text() or "{}")
    if out.returncode or measured.get("exit_code"):
        raise SystemExit(f"{' '.join(argv)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]), measured


def per_line_costs(path: Path, model: str, n: int = 2000) -> tuple[float, float, float]:
    """Microseconds per request: the exact prompt token count one request at a time, the
    same in one batch encode (what the counter does near the context limit), and the
    producer's counter."""
    from transformers import AutoTokenizer

    from eagle2_core.registry import encode_chat, resolve_model
    from producer.inputs import Request, read_requests
    from producer.prompt_length import prompt_token_counter

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model), local_files_only=True)
    requests = []
    for item in read_requests(path):
        if isinstance(item, Request):
            requests.append(item)
            if len(requests) == n:
                break
    count = prompt_token_counter(tokenizer, 8192)
    start = time.perf_counter()
    for r in requests:
        encode_chat(tokenizer, r.messages)
    exact = time.perf_counter() - start
    start = time.perf_counter()
    prompt_token_counter(tokenizer, 1)(requests)  # no bound is below 1: all exact
    batched = time.perf_counter() - start
    start = time.perf_counter()
    count(requests)
    fast = time.perf_counter() - start
    return tuple(t / len(requests) * 1e6 for t in (exact, batched, fast))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("argv", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure, args.argv)
        return

    import psycopg
    import redis
    from psycopg import sql

    from eagle2_core.registry import resolve_model
    from migrations import upgrade
    from workers.celery_app import queue_for

    resolve_model(args.model)  # a GGUF alias is dequantised once, not inside a measurement
    broker = redis.Redis.from_url(REDIS_URL)
    env = {
        k: v for k, v in os.environ.items() if k not in ("EAGLE2_DATABASE_URL", "EAGLE2_OUTPUT_DIR")
    }
    env.update(EAGLE2_BROKER_URL=REDIS_URL, OMP_NUM_THREADS="1")
    common = ["--model", args.model, "--mode", "vanilla", "--shard-size", str(args.shard_size)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env["EAGLE2_OUTPUT_DIR"] = tmp
        for n in args.lines:
            path = Path(tmp) / f"mixed_{n}.jsonl"
            write_mixed(path, n)
            size = path.stat().st_size / MIB
            if n == args.lines[0]:
                exact_us, batched_us, fast_us = per_line_costs(path, args.model)
            plan, dry = run_child(["submit", str(path), "--dry-run", "--json", *common], env)
            rows.append((f"{n:,} lines", "submit --dry-run", n, size, plan, dry))

            name = f"eagle2_bench_{uuid.uuid4().hex[:8]}"
            with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            try:
                url = PG_URL.format(name=name)
                upgrade(url)
                broker.flushdb()
                result, real = run_child(
                    ["submit", str(path), "--json", *common], {**env, "EAGLE2_DATABASE_URL": url}
                )
                queued = broker.llen(queue_for(args.model))
                assert queued == plan["shards"] == result["shards"], (queued, plan, result)
                assert result["requests"] == plan["requests"]
                rows.append((f"{n:,} lines", "submit (Postgres + Redis)", n, size, result, real))
            finally:
                broker.flushdb()
                with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
                    conn.execute(
                        sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                            sql.Identifier(name)
                        )
                    )
            path.unlink()

    print(
        "| input | command | size MiB | good | rejected | shards | wall s | lines/s "
        "| CPU s (main + reader) | RSS after import MiB | peak RSS MiB (either process) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, command, n, size, plan, r in rows:
        print(
            f"| {label} | {command} | {size:,.0f} | {plan['requests']:,} | {plan['rejected']:,} "
            f"| {plan['shards']:,} | {r['seconds']:.1f} | {n / r['seconds']:,.0f} "
            f"| {r['cpu_seconds']:.1f} + {r['child_cpu_seconds']:.1f} "
            f"| {r['after_import_mib']:.0f} | {r['peak_rss_mib']:.0f} |"
        )
    print(
        f"\nprompt token check per request ({args.model} tokenizer, 2,000 requests): exact "
        f"encode_chat {exact_us:.0f} us, the same batched {batched_us:.0f} us, producer counter "
        f"{fast_us:.0f} us"
    )


if __name__ == "__main__":
    main()
