"""A job's head versions in the database: packed whole, numbered once, checked on the way
out, and followed by a worker's decoder at a shard's start."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from sqlalchemy import Engine

from eagle2_core.draft import save_draft
from eagle2_core.engine import Engine as DecodeEngine
from tests.eagle2_core.tiny import tiny_head
from tests.workers.manifests import store_job
from tests.workers.test_decoding import chat_target
from workers import head_versions
from workers.decoding import SampleDecoder
from workers.head_versions import Attempt, follow_newest, newest_published, record, versions
from workers.request import Request

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _job(engine: Engine) -> str:
    messages = [[{"role": "user", "content": f"t{5 + i}"}] for i in range(3)]
    requests = [Request(f"q{i}", i + 1, m) for i, m in enumerate(messages)]
    return store_job(engine, requests, 2, {"max_new_tokens": 4, "adapt_draft": True})


def _attempt(head_dir: Path | None, based_on: int = 0) -> Attempt:
    return Attempt(based_on, 40, 1.2, 1.5 if head_dir else 1.1, 3, 2.5, head_dir)


@pytest.fixture(scope="module")
def target():
    return chat_target()


@pytest.fixture
def head_dir(target, tmp_path: Path) -> Path:
    return save_draft(tiny_head(target, seed=9), tmp_path / "head")


def test_a_head_packs_to_the_same_bytes_and_unpacks_to_the_same_files(
    head_dir: Path, tmp_path: Path
) -> None:
    files = head_versions.pack(head_dir)
    assert head_versions.pack(head_dir) == files
    sha = hashlib.sha256(files).hexdigest()
    folder = head_versions.unpack(files, sha, tmp_path / "cache")
    assert folder == tmp_path / "cache" / sha
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in head_dir.iterdir())
    for path in head_dir.iterdir():
        assert (folder / path.name).read_bytes() == path.read_bytes()
    assert head_versions.unpack(files, sha, tmp_path / "cache") == folder  # once per host
    with pytest.raises(ValueError, match="checksum"):
        head_versions.unpack(files[:-1] + b"x", sha, tmp_path / "other")


def test_attempts_are_numbered_in_turn_and_only_winners_are_published(
    engine: Engine, head_dir: Path
) -> None:
    job_id = _job(engine)
    assert newest_published(engine, job_id) is None
    assert record(engine, job_id, _attempt(head_dir)) == (1, True)
    assert record(engine, job_id, _attempt(None, based_on=1)) == (2, False)
    # A second trainer's winner, judged against v0 while v1 was published: stored, not used.
    assert record(engine, job_id, _attempt(head_dir, based_on=0)) == (3, False)
    rows = versions(engine, job_id)
    assert [(r["version"], r["published"], r["based_on"]) for r in rows] == [
        (1, True, 0),
        (2, False, 1),
        (3, False, 0),
    ]
    assert rows[2]["sha256"] is None
    assert "files" not in rows[0] and rows[1]["sha256"] is None
    assert rows[0]["sha256"] == hashlib.sha256(head_versions.pack(head_dir)).hexdigest()
    assert newest_published(engine, job_id) == (1, rows[0]["sha256"])


def test_a_decoder_follows_its_jobs_newest_head_and_goes_back_for_another_job(
    engine: Engine, head_dir: Path, target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EAGLE2_CACHE_DIR", str(tmp_path / "cache"))
    first = tiny_head(target)
    decoder = SampleDecoder(DecodeEngine(target, first), model="tiny-llama", draft="tiny-eagle")
    loaded = decoder.engine
    job_id = _job(engine)
    follow_newest(engine, decoder, job_id, adapts=True)  # nothing published yet
    assert decoder.engine is loaded and decoder.head_version == 0

    record(engine, job_id, _attempt(head_dir))
    follow_newest(engine, decoder, job_id, adapts=True)
    assert decoder.head_version == 1 and decoder.head_of == (job_id, 1)
    swapped = decoder.engine.draft_head.fc.weight
    assert not torch.equal(swapped, loaded.draft_head.fc.weight)
    assert decoder.engine.target is target
    follow_newest(engine, decoder, job_id, adapts=True)  # the same version: no reload
    assert decoder.engine.draft_head.fc.weight is swapped

    follow_newest(engine, decoder, _job(engine), adapts=False)
    assert decoder.engine is loaded and decoder.head_version == 0 and decoder.head_of is None
