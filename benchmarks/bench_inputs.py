"""Speed and memory of `read_requests` as the input grows.

Writes JSONL files of 100k and 1M lines (mixed formats, 1% bad lines) and one of a
few 10 MiB lines to a temporary directory, then reads each in a fresh process so
that its peak RSS is its own (Linux: read from /proc). Memory must stay flat in the
number of lines (only the duplicate-id set grows) and be bounded by the longest
line, not by the file.

    python benchmarks/bench_inputs.py [--lines 100000 1000000] [--big-lines 10]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

MIB = 1024 * 1024
_TEXT = "Summarise the following paragraph in two sentences, keeping every number. " * 3


def _line(i: int) -> str:
    """One line of a realistic mix: prompt 60%, messages 20%, turns 10%, OpenAI 9%, bad 1%."""
    kind = i % 100
    if kind == 99:
        return json.dumps({"id": f"s{i:07d}", "prompt": ""})
    if kind < 60:
        return json.dumps({"id": f"s{i:07d}", "prompt": f"{i}: {_TEXT}", "max_tokens": 128})
    if kind < 80:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": _TEXT}]
        return json.dumps({"id": f"s{i:07d}", "messages": messages, "temperature": 0.7})
    if kind < 90:
        return json.dumps({"question_id": i, "category": "writing", "turns": [_TEXT, "Shorter."]})
    body = {"model": "m", "messages": [{"role": "user", "content": _TEXT}], "max_tokens": 64}
    line = {"custom_id": f"s{i:07d}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    return json.dumps(line)


def write_mixed(path: Path, n_lines: int) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for start in range(0, n_lines, 10_000):
            out.write("".join(_line(i) + "\n" for i in range(start, min(start + 10_000, n_lines))))


def write_big_lines(path: Path, n_lines: int) -> None:
    prompt = "word " * (2 * MIB)  # 10 MiB
    with open(path, "w", encoding="utf-8") as out:
        for i in range(n_lines):
            out.write(json.dumps({"id": f"big{i}", "prompt": prompt}) + "\n")


def rss_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process, from /proc (Linux).

    Not getrusage's ru_maxrss: on Linux a child starts with its parent's high-water
    mark (fork copies it, exec keeps it), which would hide the reader's own peak.
    """
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(path: Path) -> dict[str, float]:
    """Runs in a child process: read the whole file, count, time, peak RSS."""
    from producer.inputs import Rejected, read_requests

    baseline = rss_mib("VmRSS")
    n_ok = n_bad = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for item in read_requests(path):
        if isinstance(item, Rejected):
            n_bad += 1
        else:
            n_ok += 1
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    return {
        "requests": n_ok,
        "rejected": n_bad,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "baseline_rss_mib": baseline,
        "peak_rss_mib": rss_mib("VmHWM"),
    }


def id_set_mib(n_ids: int) -> float:
    """What a dict of n ids -> line number alone costs (the one thing allowed to grow)."""
    tracemalloc.start()
    ids = {f"s{i:07d}": i + 1000 for i in range(n_ids)}
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del ids
    return size / MIB


def run_child(path: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--measure", str(path)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--big-lines", type=int, default=10, help="count of 10 MiB lines")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return

    print(
        "| file | size MiB | requests | rejected | wall s | lines/s | MiB/s | CPU s | lines/CPU-s "
        "| RSS after import MiB | peak RSS MiB | id set alone MiB | rest of the growth MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        cases = []
        for n in args.lines:
            path = Path(tmp) / f"mixed_{n}.jsonl"
            write_mixed(path, n)
            cases.append((f"{n:,} mixed lines", path, n))
        if args.big_lines:
            path = Path(tmp) / "big_lines.jsonl"
            write_big_lines(path, args.big_lines)
            cases.append((f"{args.big_lines} lines of 10 MiB", path, args.big_lines))
        for label, path, n in cases:
            r = run_child(path)
            size = path.stat().st_size / MIB
            id_set = id_set_mib(r["requests"])
            print(
                f"| {label} | {size:,.0f} | {r['requests']:,} | {r['rejected']:,} "
                f"| {r['seconds']:.1f} | {n / r['seconds']:,.0f} | {size / r['seconds']:,.0f} "
                f"| {r['cpu_seconds']:.1f} | {n / r['cpu_seconds']:,.0f} "
                f"| {r['baseline_rss_mib']:.0f} | {r['peak_rss_mib']:.0f} | {id_set:.0f} "
                f"| {r['peak_rss_mib'] - r['baseline_rss_mib'] - id_set:.0f} |"
            )
            path.unlink()


if __name__ == "__main__":
    main()
