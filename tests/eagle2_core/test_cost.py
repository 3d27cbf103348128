"""The cost table: interpolation, smoothing, and a cache that is measured once."""

from __future__ import annotations

import json

import pytest

from eagle2_core import cost
from eagle2_core.cost import CostModel, _interp, _monotone, load_or_measure
from eagle2_core.lean_head import LeanHead
from tests.eagle2_core.tiny import tiny_head, tiny_target


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
    (path,) = (tmp_path / "costs").iterdir()
    assert json.loads(path.read_text())["key"] == first.key

    def refuse(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(cost, "measure", refuse)
    assert load_or_measure(target, head, max_batch=4) == first
    assert load_or_measure(target, head, max_batch=2) == first  # a smaller batch


def test_stale_or_too_small_tables_are_measured_again(engine_parts, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE2_CACHE_DIR", str(tmp_path))
    target, head = engine_parts
    first = load_or_measure(target, head, max_batch=2)
    calls = []
    real = cost.measure

    def counting(*args, **kwargs) -> CostModel:
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(cost, "measure", counting)
    load_or_measure(target, head, max_batch=8)  # a larger batch than measured
    (path,) = (tmp_path / "costs").iterdir()
    stale = json.loads(path.read_text())
    stale["measured_at"] = first.measured_at - (cost.STALE_DAYS + 1) * 86400
    path.write_text(json.dumps(stale))
    load_or_measure(target, head, max_batch=8)
    path.write_text("{not json")
    load_or_measure(target, head, max_batch=8)
    assert calls == [8, 8, 8]
