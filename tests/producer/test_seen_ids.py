"""Duplicate ids are found with their first line whether the ids fit in memory or not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producer import inputs
from producer.inputs import Rejected, read_requests
from producer.seen_ids import SeenIds


@pytest.mark.parametrize("limit", [3, 1000])
def test_first_use_is_remembered_before_and_after_spilling(limit):
    seen = SeenIds(memory_ids=limit)
    for line in range(1, 11):
        assert seen.first_line(f"id{line}") is None
        seen.add([f"id{line}", f"id{line}#0"], line)
    assert [seen.first_line(f"id{k}") for k in (1, 5, 10)] == [1, 5, 10]
    assert seen.first_line("id7#0") == 7 and seen.first_line("nope") is None
    assert (seen._disk is not None) == (limit == 3)  # 20 ids spilled past a limit of 3
    seen.close()
    assert seen.first_line("id1") is None


def test_a_large_file_reports_duplicates_like_a_small_one(tmp_path: Path, monkeypatch):
    lines = [{"id": f"s{i}", "prompt": "p"} for i in range(50)]
    lines += [{"id": "s3", "prompt": "p"}, {"id": "s40", "prompt": "p", "n": 2}]
    lines += [{"id": "s49#1", "prompt": "p"}, {"id": "s49", "prompt": "p"}]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    small = [str(r) for r in read_requests(path) if isinstance(r, Rejected)]
    monkeypatch.setattr(inputs, "SeenIds", lambda: SeenIds(memory_ids=10))
    spilled = [str(r) for r in read_requests(path) if isinstance(r, Rejected)]
    assert (
        spilled
        == small
        == [
            'line 51: duplicate sample id "s3": first used on line 4',
            'line 52: duplicate sample id "s40": first used on line 41',
            'line 54: duplicate sample id "s49": first used on line 50',
        ]
    )
