"""A file replaced atomically: whole or not at all, never through a planted symlink, never
mixed with another writer's."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from workers.atomic_file import replacing


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_the_new_contents_replace_the_old_at_the_end(tmp_path: Path) -> None:
    target = tmp_path / "out" / "job.jsonl"  # the folder is made
    with replacing(target, "w", encoding="utf-8") as fh:
        fh.write("first\n")
        assert not target.exists()  # nothing visible until the block ends
    with replacing(target) as fh:
        fh.write(b"second\n")
        assert target.read_text() == "first\n"
    assert target.read_text() == "second\n"
    assert leftovers(target.parent) == []
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask  # as open() would make it


def test_an_error_leaves_the_old_file_and_no_temporary_one(tmp_path: Path) -> None:
    target = tmp_path / "job.parquet"
    target.write_text("old")
    with pytest.raises(RuntimeError), replacing(target) as fh:
        fh.write(b"half of it")
        raise RuntimeError("the database went away")
    assert target.read_text() == "old"
    assert leftovers(tmp_path) == []


def test_a_symlink_at_the_old_temporary_name_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    target = tmp_path / "job.jsonl"
    os.symlink(victim, tmp_path / f".{target.name}.tmp")  # what a fixed temp name invited
    with replacing(target, "w") as fh:
        fh.write("export")
    assert victim.read_text() == "keep me"
    assert target.read_text() == "export"


def test_two_writers_of_one_path_do_not_mix(tmp_path: Path) -> None:
    target = tmp_path / "job.jsonl"
    with replacing(target, "w") as first:
        first.write("A" * 100_000)
        with replacing(target, "w") as second:
            second.write("B" * 10)
            first.write("A" * 100_000)  # interleaved, as two processes would
        assert target.read_text() == "B" * 10
    assert target.read_text() == "A" * 200_000  # the last to finish, whole
    assert leftovers(tmp_path) == []
