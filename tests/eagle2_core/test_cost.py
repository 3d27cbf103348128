"""The cost table: interpolation, smoothing, and a cache that is measured once."""

from __future__ import annotations

import fcntl
import json
import threading
import time

import pytest
import torch

from eagle2_core import cost
from eagle2_core.cost import CostModel, _interp, _monotone, load_or_measure
from eagle2_core.lean_head import LeanHead
from tests.eagle2_core.tiny import kept, tiny_head, tiny_target


def test_interpolation_is_linear_between_and_beyond_points():
    assert _interp([1, 4, 8], [10.0, 16.0, 40.0], 2) == 12.0
    assert _interp([1, 4, 8], [10.0, 16.0, 40.0], 12) == 64.0  # the last slope goes on
    assert _interp([1, 4, 8], [10.0, 16.0, None], 8) == 24.0  # unmeasured points skipped
    assert _interp([1, 4, 8], [10.0, 16.0, 40.0], 0.5) == 10.0


def test_monotone_takes_out_what_noise_added():
    # 3.0 before a 2.0 and 9.0 above a 6.0 were slowed down: more never costs less
    assert _monotone([[3.0, 2.0, 5.0], [1.0, 6.0, None], [4.0, 9.0, 6.5]]) == [
        [1.0, 2.0, 5.0],
        [1.0, 6.0, None],
        [4.0, 6.5, 6.5],
    ]


def test_each_pass_times_a_point_warm(monkeypatch):
    """A point built anew each pass (its cache is new) runs cold first, and one pass's
    burst must not stick: the warm time is what gets confirmed."""
    monkeypatch.setattr(cost, "_timed_ms", lambda run, device: run())
    burst = {(1, 1): 1}  # the first pass's timed run of (1, 1) is slowed down

    def build(rows: int, n: int):
        calls = 0

        def run() -> float:
            nonlocal calls
            calls += 1
            if calls == 1:
                return 20.0  # a new cache's first read maps its pages
            if burst.get((rows, n)):
                burst[(rows, n)] -= 1
                return 15.0
            return 2.0

        return run

    times = cost._time_grid([(1, 1), (2, 1)], build, torch.device("cpu"))
    assert times == {(1, 1): 2.0, (2, 1): 2.0}


@pytest.fixture
def engine_parts():
    target = tiny_target(eos=None)
    return target, LeanHead.of(tiny_head(target), target, None)


def test_measured_once_then_read_from_the_cache(engine_parts, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE2_CACHE_DIR", str(tmp_path))
    target, head = engine_parts
    first = load_or_measure(target, head, max_batch=4)
    assert first.batch_grid == [1, 2, 4]
    assert all(v > 0 for v in first.verify_ms[0])
    assert first.verify(4, 8) >= first.verify(1, 8) > 0 and first.draft(1, 4) > 0
    (path,) = (tmp_path / "costs").glob("*.json")
    assert json.loads(path.read_text())["key"] == first.key

    def refuse(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(cost, "measure", refuse)
    assert load_or_measure(target, head, max_batch=4) == first
    assert load_or_measure(target, head, max_batch=2) == first  # a smaller batch


def count_measures(monkeypatch) -> list[int]:
    """From now on, the batch size of every table measured, in order."""
    calls: list[int] = []
    real = cost.measure

    def counting(*args, **kwargs) -> CostModel:
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(cost, "measure", counting)
    return calls


def test_two_processes_at_once_measure_one_table(engine_parts, tmp_path, monkeypatch):
    """Two callers that find no table at the same moment: one measures, the other waits
    for its lock and reads that table (two threads: flock holds between two opens of the
    lock file as between two processes)."""
    monkeypatch.setenv("EAGLE2_CACHE_DIR", str(tmp_path))
    target, head = engine_parts
    calls = count_measures(monkeypatch)
    counting = cost.measure

    def slow(*args, **kwargs) -> CostModel:
        time.sleep(0.5)  # both have looked for a table by now
        return counting(*args, **kwargs)

    monkeypatch.setattr(cost, "measure", slow)
    start, told = threading.Barrier(2), []
    tables: list[CostModel] = []

    def load() -> None:
        start.wait()
        tables.append(load_or_measure(target, head, max_batch=2, on_measure=told.append))

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [2] and len(tables) == 2 and tables[0] == tables[1]
    assert len(told) == 2  # each said it waits for a measurement


def test_stale_or_too_small_tables_are_measured_again(engine_parts, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE2_CACHE_DIR", str(tmp_path))
    target, head = engine_parts
    first = load_or_measure(target, head, max_batch=2)
    calls = count_measures(monkeypatch)
    load_or_measure(target, head, max_batch=8)  # a larger batch than measured
    (path,) = (tmp_path / "costs").glob("*.json")
    stale = json.loads(path.read_text())
    stale["measured_at"] = first.measured_at - (cost.STALE_DAYS + 1) * 86400
    path.write_text(json.dumps(stale))
    load_or_measure(target, head, max_batch=8)
    path.write_text("{not json")
    load_or_measure(target, head, max_batch=8)
    assert calls == [8, 8, 8]


def test_other_cpu_kernels_are_measured_again(engine_parts, tmp_path, monkeypatch):
    """A table measured while torch's ops stood in for kernels that failed to build (or
    with an older kernel) is not this build's: it once kept a bf16 job drafting at 80
    rows, 1.3x slower than plain decoding."""
    monkeypatch.setenv("EAGLE2_CACHE_DIR", str(tmp_path))
    target, head = engine_parts
    built = load_or_measure(target, head, max_batch=2)
    assert cost.cpu_kernels.build() is not None  # CI's machine has a compiler
    assert json.loads(built.key)["kernels"] == cost.cpu_kernels.build()
    calls = count_measures(monkeypatch)
    monkeypatch.setattr(cost.cpu_kernels, "build", lambda: None)  # torch's ops instead
    stand_in = load_or_measure(target, head, max_batch=2)
    assert calls == [2] and json.loads(stand_in.key)["kernels"] is None


def table(step_ms: dict[int, float]) -> CostModel:
    """A table of plain-decoding steps only: B rows cost step_ms[B]."""
    grid = sorted(step_ms)
    return CostModel(
        key="k",
        measured_at=0.0,
        batch_grid=grid,
        tree_grid=[1],
        verify_ms=[[step_ms[b]] for b in grid],
        width_grid=[1],
        draft_ms=[[0.0] for _ in grid],
        key_ms=0.0,
    )


def test_auto_batch_takes_the_fastest_size_or_a_smaller_one_as_fast():
    # tokens/s: 1/10, 16/40 = 0.4, 64/100 = 0.64, 256/390 = 0.656 (within 3% of 64's)
    costs = table({1: 10.0, 16: 40.0, 64: 100.0, 256: 390.0})
    assert cost.throughput_batch(costs, max_rows=1000, largest=256) == 64
    assert cost.throughput_batch(costs, max_rows=1000, largest=16) == 16
    # memory holds 40 rows: the best size that fits
    assert cost.throughput_batch(costs, max_rows=40, largest=256) == 40
    # a step that keeps getting cheaper per token keeps growing
    assert cost.throughput_batch(table({1: 10.0, 64: 100.0, 256: 200.0}), 1000, 256) == 256


def test_a_shard_takes_the_rows_that_finish_it_soonest():
    # a CPU's step: flat per row past 32 rows (B=32: 140 ms, 64: 255, 128: 570)
    costs = table({1: 38.0, 16: 104.0, 32: 140.0, 64: 255.0, 128: 570.0})
    # 80 samples: one wave of 80 (~334 ms) beats two of 40 (2 x 170) and three of 32
    assert cost.shard_batch(costs, samples=80, max_rows=1000, largest=128) == 80
    assert cost.shard_batch(costs, samples=20, max_rows=1000, largest=128) == 20
    # memory holds 50 rows: two even waves of 40, not a wave of 50 and one of 30
    assert cost.shard_batch(costs, samples=80, max_rows=50, largest=128) == 40
    # many samples: about the best steady rate's size (64 here), split evenly
    assert cost.throughput_batch(costs, max_rows=1000, largest=128) == 64
    assert 60 <= cost.shard_batch(costs, samples=10_000, max_rows=1000, largest=128) <= 64
    # two waves priced 1% under one (338 ms x 2 against 341 x 1): one wave, which ran 7%
    # faster (no rows joining mid-flight); 10% under: two
    costs = table({1: 35.0, 32: 132.5, 40: 169.0, 64: 278.0, 80: 341.0, 128: 529.0})
    assert cost.shard_batch(costs, samples=80, max_rows=1000, largest=128) == 80
    costs = table({1: 35.0, 32: 132.5, 40: 153.0, 64: 278.0, 80: 341.0, 128: 529.0})
    assert cost.shard_batch(costs, samples=80, max_rows=1000, largest=128) == 40


def test_an_engine_sizes_its_auto_batch_by_the_table_and_free_memory(tmp_path, monkeypatch):
    from eagle2_core import engine as engine_module
    from eagle2_core.engine import Engine
    from eagle2_core.kv import RESERVE_SLOTS

    monkeypatch.setenv("EAGLE2_CACHE_DIR", str(tmp_path))
    target = tiny_target(eos=None)
    engine = Engine(target)
    chosen = engine.auto_batch_size()
    assert chosen in engine.costs().batch_grid and max(engine.costs().batch_grid) == 128
    lean = target.lean
    row = 2 * len(lean.layers) * lean.shape.kv_heads * lean.shape.dim * 4 * RESERVE_SLOTS
    monkeypatch.setattr(engine_module, "free_memory", lambda device: 2 * 3 * row)
    assert engine.auto_batch_size() <= 3  # half the free memory holds 3 rows


def kept_table(tmp_path, key_ms: float = 0.0) -> CostModel:
    """A one- and two-row table as the cache holds it (read from its file): 4 and 8
    nodes of one row cost 9 and 10 ms, as much as 1 and 2 of two rows."""
    table = CostModel(
        key="kept",
        measured_at=time.time(),
        batch_grid=[1, 2],
        tree_grid=[1, 2, 4, 8],
        verify_ms=[[6.0, 7.0, 9.0, 10.0], [9.0, 10.0, 12.0, None]],
        width_grid=[1],
        draft_ms=[[1.0], [1.0]],
        key_ms=key_ms,
    )
    return kept(table, tmp_path)


def test_a_round_faster_than_its_entry_lowers_it_and_what_costs_no_more(tmp_path):
    table = kept_table(tmp_path)
    before = table.verify_curve(1, 8, cost.CONTEXT).tolist()
    assert table.lower(4, [cost.CONTEXT], 5.0)  # one row of 4 nodes took 5 ms
    assert table.verify_ms == [[5.0, 5.0, 5.0, 10.0], [9.0, 10.0, 12.0, None]]
    assert table.verify_curve(1, 8, cost.CONTEXT).tolist() != before  # the planner's too
    assert not table.lower(4, [cost.CONTEXT], 4.95)  # within LOWER_MARGIN: nothing to tell
    # 3 rows of 6 nodes bound the grid point at or below: 2 rows of 4
    assert table.lower(6, [300, 300, 300], 4.0)
    assert table.verify_ms == [[4.0, 4.0, 4.0, 10.0], [4.0, 4.0, 4.0, None]]
    assert not table.lower(8, [cost.CONTEXT] * 2, 1.0)  # never measured: nothing to lower
    assert not table.lower(8, [cost.CONTEXT], 20.0)  # slower: noise, or a busy machine


def test_rows_short_of_the_tables_context_add_back_what_its_keys_could_cost(tmp_path):
    """One row of 4 nodes 156 slots short of CONTEXT: a row of KEY_QUERIES queries read
    each slot once for all of them, so 16 x 156 x key_ms bounds what those slots add."""
    table = kept_table(tmp_path, key_ms=1e-4)
    assert table.lower(4, [100], 5.0)
    assert table.verify_ms[0][2] == pytest.approx(5.0 + 16 * 156 * 1e-4)
    table = kept_table(tmp_path, key_ms=1e-4)
    assert table.lower(32, [100], 5.0)  # more nodes than the probe's queries: each counts
    assert table.verify_ms[0][3] == pytest.approx(5.0 + 32 * 156 * 1e-4)
    # 5 ms + 7.5 for what the missing slots could cost: no faster than the entry's 9
    assert not kept_table(tmp_path, key_ms=3e-3).lower(4, [100], 5.0)


def test_a_made_up_table_learns_nothing(tmp_path):
    table = kept_table(tmp_path)
    made_up = CostModel(**json.loads(table.to_json()))
    assert not made_up.lower(4, [cost.CONTEXT], 5.0)
    assert made_up.verify_ms[0][2] == 9.0


def test_lowered_entries_are_kept_beside_other_processes_and_not_over_a_new_table(tmp_path):
    path = tmp_path / "kept.json"
    mine, theirs = kept_table(tmp_path), cost._read(path)
    mine.lower(4, [cost.CONTEXT], 5.0)
    theirs.lower(2, [cost.CONTEXT] * 2, 8.0)
    mine.keep()
    theirs.keep()
    assert cost._read(path).verify_ms == [[5.0, 5.0, 5.0, 10.0], [8.0, 8.0, 12.0, None]]

    with open(path.with_suffix(".lock"), "a") as lock:  # a process measuring holds it
        fcntl.flock(lock, fcntl.LOCK_EX)
        mine.lower(1, [cost.CONTEXT], 3.0)
        mine.keep()
        assert cost._read(path).verify_ms[0][0] == 5.0
    mine.keep()  # the next keep writes what the last one could not
    assert cost._read(path).verify_ms[0][0] == 3.0

    remeasured = kept_table(tmp_path)  # a table measured anew in the same file
    mine.lower(1, [cost.CONTEXT], 2.0)
    mine.keep()
    assert cost._read(path) == remeasured
    path.unlink()  # removed by hand, to be measured again: not written back
    mine.lower(1, [cost.CONTEXT], 1.0)
    mine.keep()
    assert not path.exists()
