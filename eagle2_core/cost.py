"""What a round costs on this device: measured once, cached, interpolated.

Speculation pays when a tree's expected accepted tokens per second beat one token per
plain step, and what a forward charges for n tokens differs by orders of magnitude
between devices, models, dtypes and batch sizes: on the 2-core dev CPU a SmolLM2 verify
of 8 tokens costs about what 1 does and 64 cost 3x; a GPU is flat far longer; a batch of
16 rows makes every extra node cost 16 tokens. So the engine measures, per device, model
and dtype:

- verify_ms[B][n]: a target forward over n new tokens in each of B rows after a
  `CONTEXT`-token context, plus the lm_head over all of them;
- draft_ms[B][k]: one draft-head step over k tokens per row plus its draft-vocabulary
  lm_head, log-softmax and top-k;
- key_ms: what one more context slot adds per query token (attention grows with context).

The table is cached as JSON under EAGLE2_CACHE_DIR/costs/ and measured again after
`STALE_DAYS` or when anything in its key changes (device, threads, model shape, dtype,
torch version, the CPU kernels' build). Decoding corrects it: a round that verifies
faster than its entry proves the entry slow (`CostModel.lower`), and the lower entry is
kept in the file for later jobs (`CostModel.keep`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle2_core import cpu_kernels
from eagle2_core.kv import RaggedKV
from eagle2_core.lean_head import LeanHead
from eagle2_core.llama import forward
from eagle2_core.models import Target
from eagle2_core.registry import cache_root

log = logging.getLogger(__name__)

COST_VERSION = 12  # bumped when the engine's kernels change what a forward costs
STALE_DAYS = 14
CONTEXT = 256  # context slots of the measured forwards
LONG_CONTEXT = 1024  # second context, for key_ms
KEY_QUERIES = 16  # query tokens of the row whose forward at both contexts gives key_ms
TREE_GRID = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
WIDTH_GRID = (1, 2, 4, 6, 8, 10, 16)
MAX_CURVE = 128  # the largest tree a curve covers (plan.MAX_NODES)
MAX_TOKENS = 256  # largest B x n measured; beyond it cost grows linearly in tokens
MAX_PASSES = 6  # passes over the grid at most, until each point's best is confirmed
CONFIRM = 0.05  # a second run within this share of the best confirms it
LARGE_TOKENS = 64  # B x n above which two passes suffice (their best is taken)
# --batch-size auto: batch sizes measured up to this many rows (a GPU's; a CPU's gain ends
# far sooner, BENCHMARKS.md), and how close to the best measured rate a smaller batch may
# come and still be chosen.
MAX_AUTO_BATCH = {"cuda": 256, "cpu": 128}
THROUGHPUT_SLACK = 0.03
# A round lowers a verify entry it beats by more than this share (smaller gains would
# rewrite the table for nothing the planner could tell apart).
LOWER_MARGIN = 0.02


@dataclass
class CostModel:
    """Milliseconds of the parts of a round, on a (batch, size) grid."""

    key: str
    measured_at: float
    batch_grid: list[int]
    tree_grid: list[int]
    verify_ms: list[list[float]]  # [batch][tree]; None where B x n > MAX_TOKENS
    width_grid: list[int]
    draft_ms: list[list[float]]  # [batch][width]
    key_ms: float  # per query token per extra context slot
    _curves: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    _path: Path | None = field(default=None, repr=False, compare=False)  # where it is kept
    _lowered: bool = field(default=False, repr=False, compare=False)  # since last kept

    def verify(self, batch: int, n: int, context: int = CONTEXT) -> float:
        """A verify forward of n nodes in each of `batch` rows over `context` slots. Longer
        contexts add their keys' cost; shorter ones cost what the table measured (a
        slope measured under load, extrapolated down, could reach zero or below)."""
        base = _grid(self.batch_grid, self.tree_grid, self.verify_ms, batch, n)
        return base + self.key_ms * batch * n * max(context - CONTEXT, 0)

    def draft(self, batch: int, width: int) -> float:
        """One draft step over `width` tokens in each of `batch` rows."""
        return _grid(self.batch_grid, self.width_grid, self.draft_ms, batch, width)

    def verify_curve(self, batch: int, largest: int, context: int) -> torch.Tensor:
        """verify(batch, n, context) for n = 0..largest (index n; entry 0 unused)."""
        if batch not in self._curves:
            self._curves[batch] = torch.tensor(
                [0.0] + [self.verify(batch, n) for n in range(1, MAX_CURVE + 1)]
            )
        nodes = torch.arange(largest + 1)
        attention = self.key_ms * batch * nodes * max(context - CONTEXT, 0)
        return self._curves[batch][: largest + 1] + attention

    def lower(self, n: int, contexts: list[int], ms: float) -> bool:
        """A verify forward of n nodes in each of len(contexts) rows, after each row's
        context (its own slots: a prefix read from one shared copy not counted), took
        `ms` with the full lm_head (as the table measures it). Noise only ever slows a
        run, so an entry such a round beats was measured slow: three tables measured one
        after another on an idle 2-core VM put one row's 4 nodes at 19.0, 15.6 and 16.6
        ms, and a table lasts STALE_DAYS.

        The grid point at or below (rows, n) takes `ms`, and every point that costs no
        more takes at most that (`_monotone`). Rows with fewer slots than CONTEXT read
        fewer keys, so what CONTEXT slots would add is added back, at most: key_ms comes
        from a row of KEY_QUERIES queries, which read each slot's keys once for all, so
        KEY_QUERIES x key_ms bounds what a slot costs a row of up to that many nodes (one
        row at 100 slots: ~1.5 of 15 ms on the Zen 4 VM). Only a table measured on this
        device learns: a made-up one (tests') stays as made. Whether an entry changed."""
        if self._path is None:
            return False
        slots = sum(max(CONTEXT - c, 0) for c in contexts)
        short = self.key_ms * max(n, KEY_QUERIES) * slots
        row = max(i for i, b in enumerate(self.batch_grid) if b <= max(len(contexts), 1))
        col = max(j for j, t in enumerate(self.tree_grid) if t <= max(n, 1))
        entry = self.verify_ms[row][col]
        if entry is None or ms + short >= entry * (1 - LOWER_MARGIN):
            return False
        self.verify_ms[row][col] = ms + short
        self.verify_ms = _monotone(self.verify_ms)
        self._curves.clear()
        self._lowered = True
        return True

    def keep(self) -> None:
        """Write the entries lowered since the last keep into the cache file, each the
        lower of the file's and this table's (other processes lower theirs). A file
        measured anew or removed meanwhile stays as it is. So does one whose lock is
        held (its holder is measuring, half a minute): the next keep writes them. A
        folder that cannot be written costs only the entries."""
        if self._path is None or not self._lowered:
            return
        try:
            with open(self._path.with_suffix(".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                kept = _read(self._path)
                if kept is not None and kept.measured_at == self.measured_at:
                    kept.verify_ms = _monotone(_lower_of(self.verify_ms, kept.verify_ms))
                    _write(self._path, kept)
                self._lowered = False
        except OSError as exc:  # BlockingIOError: the lock is held
            log.debug("cost table not kept this time: %s", exc)

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if not k.startswith("_")})


def throughput_batch(costs: CostModel, max_rows: int, largest: int) -> int:
    """The batch size whose plain decoding step gives the most tokens per second on this
    device (costs.verify(B, 1) at the table's context), among the measured sizes up to
    `largest` and `max_rows` (what memory holds); the smallest within THROUGHPUT_SLACK of
    the best, since a smaller batch drains a shard's tail faster and holds less cache."""
    sizes = sorted({min(b, max_rows) for b in costs.batch_grid if b <= largest} | {1})
    rates = {b: b / costs.verify(b, 1) for b in sizes}
    best = max(rates.values())
    return min(b for b, rate in rates.items() if rate >= (1 - THROUGHPUT_SLACK) * best)


def shard_batch(costs: CostModel, samples: int, max_rows: int, largest: int) -> int:
    """The rows at once that finish `samples` sequences of about equal length soonest.

    A batch of B decodes them in ceil(samples / B) waves of one step cost each, and the
    last wave runs short of rows: 80 samples at B=32 are 3 waves, two full and one at 16,
    where one wave of 80 costs less than two of 32 on a CPU (BENCHMARKS.md). So each
    number of waves k is priced at its even split B = ceil(samples / k), beside the
    measured sizes. One wave wins within THROUGHPUT_SLACK of the soonest finish: with
    more, rows join mid-flight a few at a time, each with a prefill between rounds, which
    the table does not price. On the AVX2 EPYC (2026-12-03) it put 80 MT-bench prompts at
    338 ms x 2 waves of 40 against 341 ms x 1 of 80, and the whole run took 76.1 s at 40
    rows, 70.9 s at 80. Many samples make waves(B) ~ samples / B, and this comes to
    throughput_batch's choice."""
    cap = max(1, min(max_rows, largest, samples))
    sizes = {math.ceil(samples / k) for k in range(1, samples + 1)} | set(costs.batch_grid)
    fits = sorted((b for b in sizes if b <= cap), reverse=True)

    def finish(b: int) -> float:
        return math.ceil(samples / b) * costs.verify(b, 1)

    soonest = min(fits, key=finish)
    if fits[0] == samples and finish(samples) <= (1 + THROUGHPUT_SLACK) * finish(soonest):
        return samples
    return soonest


def _interp(xs: list[int], ys: list[float | None], x: float) -> float:
    """Piecewise linear through the measured points, linear beyond the last two."""
    points = [(a, b) for a, b in zip(xs, ys, strict=True) if b is not None]
    if len(points) == 1:
        return points[0][1] * x / points[0][0]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (max(x, x0) - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def _grid(rows: list[int], cols: list[int], table: list[list], batch: int, col: int) -> float:
    per_batch = [_interp(cols, line, col) for line in table]
    return max(_interp(rows, per_batch, batch), 0.0)


def device_key(target: Target, head: LeanHead | None) -> str:
    """What the measurements depend on."""
    device = target.device
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = _cpu_name()
    config = target.config
    parts = {
        "version": COST_VERSION,
        "torch": torch.__version__,
        "hardware": hardware,
        "threads": torch.get_num_threads(),
        "model": [
            target.name,
            config.hidden_size,
            config.num_hidden_layers,
            config.intermediate_size,
            target.vocab_size,
            str(target.dtype),
        ],
        "head": None if head is None else [head.shape.heads, head.shape.dim, head.vocab_size],
        # a table measured with torch's ops standing in for broken kernels (or with an
        # older kernel) misjudged drafting at 80 rows: a bf16 job ran 1.3x slower
        "kernels": cpu_kernels.build() if device.type == "cpu" else None,
    }
    return json.dumps(parts, sort_keys=True)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _cache_path(key: str) -> Path:
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "costs" / f"{digest}.json"


def load_or_measure(
    target: Target,
    head: LeanHead | None,
    max_batch: int,
    on_measure: Callable[[Path], object] | None = None,
) -> CostModel:
    """The cached table for this device and model, measured now if missing or stale
    (on_measure(cache file) is told first: it takes half a minute on a CPU).

    One process of a machine measures at a time, under a lock beside the table: two
    started together (the workers of one host, a test run's processes) would each time
    its forwards while the other runs its own, and both tables would be too slow; the
    second waits and reads the first's."""
    key = device_key(target, head)
    path = _cache_path(key)
    model = _cached(path, key, max_batch)
    if model is not None:
        return model
    if on_measure is not None:
        on_measure(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        model = _cached(path, key, max_batch)  # measured meanwhile by the lock's holder
        if model is not None:
            return model
        log.info("measuring forward costs on this device (once; cached in %s)", path)
        started = time.perf_counter()
        model = measure(target, head, max_batch, key)
        log.info("forward costs measured in %.1f s", time.perf_counter() - started)
        _write(path, model)
    model._path = path
    return model


def _cached(path: Path, key: str, max_batch: int) -> CostModel | None:
    """The table at path where it is this key's, fresh, and covers max_batch rows."""
    model = _read(path)
    if model is None:
        return None
    fresh = time.time() - model.measured_at < STALE_DAYS * 86400
    return model if model.key == key and fresh and max(model.batch_grid) >= max_batch else None


def _read(path: Path) -> CostModel | None:
    try:
        model = CostModel(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    model._path = path
    return model


def _write(path: Path, model: CostModel) -> None:
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    staging.write_text(model.to_json())
    staging.replace(path)


def _batch_grid(max_batch: int) -> list[int]:
    grid, b = [], 1
    while b < max_batch:
        grid.append(b)
        b *= 2
    return [*grid, max_batch]


def _timed_ms(run: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1000


def _time_grid(
    points: list[tuple], build: Callable[..., Callable[[], object]], device: torch.device
) -> dict[tuple, float]:
    """The best time of each point, once it is confirmed.

    A shared machine's noise comes in bursts that only ever slow a run down. So the grid
    is passed over repeatedly, each pass a point's run after other points' (a burst then
    spoils different points each pass), and a point is settled when a second run lands
    within CONFIRM of its best: up to MAX_PASSES passes. Large shapes, long and steady, are
    timed twice: once was not enough on a shared VM, where one burst made B=64 cost 330 ms
    against 255 ms in another table and took --batch-size auto from 80 rows to 40.

    Every timed run follows an untimed one of the same point: oneDNN builds a kernel per
    shape, and a point's cache may be new in this pass, whose first read maps its pages
    (twice the time of a warm forward at 64 rows on the AMX Xeon). Warmed on the first
    pass only, a point that first pass's burst spoiled was timed cold ever after, never
    confirmed a faster run, and kept the burst: B=64 cost as much as B=128, so two nodes
    a row looked free and EAGLE-2 drafted at 80 rows, 1.33x slower than plain decoding.
    """
    times: dict[tuple, list[float]] = {point: [] for point in points}

    def settled(point: tuple) -> bool:
        seen = times[point]
        if point[0] * point[1] > LARGE_TOKENS:
            return len(seen) >= 2
        return sum(t <= min(seen, default=math.inf) * (1 + CONFIRM) for t in seen) >= 2

    for _ in range(MAX_PASSES):
        todo = [point for point in points if not settled(point)]
        if not todo:
            break
        for point in todo:
            run = build(*point)
            run()
            times[point].append(_timed_ms(run, device))
    return {point: min(seen) for point, seen in times.items()}


@torch.inference_mode()
def measure(target: Target, head: LeanHead | None, max_batch: int, key: str = "") -> CostModel:
    """Time the grid's forwards on random tokens (costs do not depend on the values)."""
    device = target.device
    batches = _batch_grid(max_batch)
    widths = list(WIDTH_GRID)

    caches: dict[tuple[int, int], RaggedKV] = {}

    def verify_run(b: int, n: int, context: int) -> Callable[[], object]:
        """A forward of n new tokens per row; one cache per (b, context) serves every n
        (nothing is committed, so each run overwrites the same slots)."""
        if (b, context) not in caches:
            caches.clear()  # one at a time: a large batch's cache is hundreds of MB
            kv = caches[(b, context)] = target.kv()
            kv.reserve(b, context + max(TREE_GRID))
            for _ in range(b):
                kv.add_row(context)
            kv.reserve_new(max(TREE_GRID))
        kv = caches[(b, context)]
        ids = torch.randint(0, target.vocab_size, (b, n), device=device)
        positions = (context + torch.arange(n, device=device)).expand(b, n)
        chain = torch.ones(n, n, dtype=torch.bool, device=device).tril().expand(b, n, n)
        start = kv.reserve_new(n)
        mask = kv.tree_mask(chain)
        keys, values = kv.layer_views()
        return lambda: target.lm_head(
            forward(target.lean, ids, positions, keys, values, start, mask)[0]
        )

    points = [(b, n, CONTEXT) for b in batches for n in TREE_GRID if b * n <= MAX_TOKENS]
    probe = KEY_QUERIES
    points += [(1, probe, LONG_CONTEXT)]  # grouped by cache: each is built once per pass
    times = _time_grid(points, verify_run, device)
    verify_ms = _monotone([[times.get((b, n, CONTEXT)) for n in TREE_GRID] for b in batches])
    slope = times[(1, probe, LONG_CONTEXT)] - times[(1, probe, CONTEXT)]
    key_ms = max(slope, 0.0) / (probe * (LONG_CONTEXT - CONTEXT))
    draft_ms = [[0.0] * len(widths) for _ in batches]
    if head is not None:
        times = _time_grid(
            [(b, w) for b in batches for w in widths], lambda b, w: _draft_run(head, b, w), device
        )
        draft_ms = _monotone([[times[(b, w)] for w in widths] for b in batches])
    return CostModel(
        key=key,
        measured_at=time.time(),
        batch_grid=batches,
        tree_grid=list(TREE_GRID),
        verify_ms=verify_ms,
        width_grid=widths,
        draft_ms=draft_ms,
        key_ms=key_ms,
    )


def _lower_of(table: list[list], other: list[list]) -> list[list]:
    """Entry by entry the lower of two tables of one grid (None stays None)."""
    return [
        [None if a is None else min(a, b) for a, b in zip(mine, theirs, strict=True)]
        for mine, theirs in zip(table, other, strict=True)
    ]


def _monotone(table: list[list[float | None]]) -> list[list[float | None]]:
    """More tokens never cost less, so a point costs at most what any larger one does: a
    running minimum from the large end of each row and column takes out what noise
    added (noise never makes a run faster)."""
    rows = []
    for line in table:
        best, row = math.inf, []
        for value in reversed(line):
            best = min(best, value) if value is not None else best
            row.append(best if value is not None else None)
        rows.append(row[::-1])
    for i in range(len(rows) - 2, -1, -1):
        rows[i] = [
            min(v, below) if v is not None and below is not None else v
            for v, below in zip(rows[i], rows[i + 1], strict=True)
        ]
    return rows


def _draft_run(head: LeanHead, b: int, w: int) -> Callable[[], object]:
    """One draft step over w frontier nodes per row, keeping the top w of each (as
    dynamic.py does with a frontier of width w)."""
    device = head.embed.device
    dtype = head.embed.dtype
    shape = (1, b, head.shape.kv_heads, CONTEXT + w, head.shape.dim)
    keys = torch.zeros(shape, dtype=dtype, device=device)
    values = torch.zeros_like(keys)
    tokens = torch.randint(0, head.embed.shape[0], (b, w), device=device)
    features = torch.randn(b, w, head.embed.shape[1], dtype=dtype, device=device)
    positions = (CONTEXT + torch.arange(w, device=device)).expand(b, w)
    mask = torch.ones(b, 1, w, CONTEXT + w, dtype=torch.bool, device=device)

    def run() -> object:
        hidden = head.step(tokens, features, positions, keys, values, CONTEXT, mask)
        return head.log_probs(hidden).topk(min(w, head.vocab_size), dim=-1)

    return run
