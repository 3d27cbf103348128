"""Built-in names: which models come with a shipped draft head; GGUF copies named for
their content."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

from eagle2_core import registry
from eagle2_core.models import load_target
from eagle2_core.registry import (
    ALIASES,
    DEFAULT_MODEL,
    HEADS_DIR,
    RANDOM_DRAFT,
    DraftUnavailableError,
    cache_root,
    content_key,
    draft_label,
    draft_source,
    encode_chat,
    encode_chats,
    resolve_model,
    shipped_draft,
)
from tests.eagle2_core.tiny import tiny_tokenizer


def test_the_default_alias_ships_a_head() -> None:
    assert shipped_draft(DEFAULT_MODEL) == HEADS_DIR / DEFAULT_MODEL
    assert (HEADS_DIR / DEFAULT_MODEL / "model.safetensors").exists()


def test_a_model_folder_is_never_taken_for_a_shipped_head(tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # a model folder has a config.json too
    assert shipped_draft(str(model)) is None
    assert shipped_draft("no-such-alias") is None


def test_draft_source_names_the_head_or_says_how_to_get_one(tmp_path: Path) -> None:
    assert draft_source(DEFAULT_MODEL, None) == HEADS_DIR / DEFAULT_MODEL
    assert draft_source("anything", str(tmp_path)) == tmp_path
    assert draft_source("anything", RANDOM_DRAFT) is None
    with pytest.raises(DraftUnavailableError, match="--draft DIR.*--mode vanilla"):
        draft_source(str(tmp_path), None)


def test_draft_label_names_the_shipped_head_and_nothing_for_vanilla() -> None:
    assert draft_label(DEFAULT_MODEL, None, "eagle2") == f"shipped:{DEFAULT_MODEL}"
    assert draft_label(DEFAULT_MODEL, "/heads/mine", "eagle1") == "/heads/mine"
    assert draft_label(DEFAULT_MODEL, None, "vanilla") is None


@pytest.mark.parametrize(
    "template", [None, "{% for m in messages %}{{ m['content'] }} {% endfor %}t2"]
)
def test_encode_chats_is_encode_chat_of_each(template: str | None) -> None:
    tokenizer = tiny_tokenizer(96)
    tokenizer.chat_template = template
    chats = [[{"role": "user", "content": "t5 t6"}], [{"role": "user", "content": "t7"}] * 3]
    assert encode_chats(tokenizer, chats) == [encode_chat(tokenizer, m) for m in chats]
    assert encode_chats(tokenizer, []) == []


def test_gguf_copies_are_named_for_their_content(tmp_path: Path, monkeypatch) -> None:
    """Same file name and size in two folders, or a file rewritten in place: each content
    has a cache entry of its own."""
    monkeypatch.setenv("EAGLE2_CACHE_DIR", str(tmp_path / "cache"))
    base, tune = tmp_path / "base" / "model.gguf", tmp_path / "tune" / "model.gguf"
    for path, fill in ((base, b"a"), (tune, b"b")):
        path.parent.mkdir()
        path.write_bytes(fill * 4096)
        entry = cache_root() / f"gguf-model-{content_key(path)}"
        entry.mkdir(parents=True)
        (entry / "config.json").write_text(path.parent.name)  # as if dequantised before
    assert (resolve_model(str(base)) / "config.json").read_text() == "base"
    assert (resolve_model(str(tune)) / "config.json").read_text() == "tune"
    before, stat = content_key(tune), tune.stat()
    tune.write_bytes(b"c" * 4096)  # replaced in place: same size, and the same mtime
    os.utime(tune, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert content_key(tune) != before
    assert content_key(tune) == content_key(tune)  # remembered, not re-read


def test_a_gguf_is_read_for_its_key_once_across_processes(tmp_path: Path, monkeypatch) -> None:
    """A later process takes the key from the cache folder instead of hashing the file
    again; what it finds there is used only if it is a whole digest."""
    monkeypatch.setenv("EAGLE2_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"a" * 4096)
    key = content_key(path)
    registry._digest.cache_clear()  # as a new process
    with monkeypatch.context() as patched:
        patched.setattr(hashlib, "file_digest", _never_read)
        assert content_key(path) == key
    (memo,) = (cache_root() / "digests").iterdir()
    memo.write_text(key[:40])  # cut short
    registry._digest.cache_clear()
    assert content_key(path) == key
    assert len(memo.read_text()) == 64


def test_a_cache_folder_that_cannot_be_written_costs_only_the_reread(
    tmp_path: Path, monkeypatch
) -> None:
    blocked = tmp_path / "cache"
    blocked.write_text("a file, not a folder")
    monkeypatch.setenv("EAGLE2_CACHE_DIR", str(blocked))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"a" * 4096)
    assert content_key(path) == hashlib.sha256(b"a" * 4096).hexdigest()[:32]


def _never_read(*_args: object) -> None:
    raise AssertionError("the file was hashed again")


@pytest.mark.slow
def test_a_second_gguf_of_the_same_name_and_size_decodes_with_its_own_weights(
    tmp_path: Path,
) -> None:
    """Two copies of the default model's GGUF, one with its final norm's weights shuffled:
    the same name and size in two folders. Each loads its own weights and writes its own
    answer, whichever is dequantised first."""
    import gguf
    import numpy as np

    source = registry._alias_dir(ALIASES[DEFAULT_MODEL]) / ALIASES[DEFAULT_MODEL].gguf_file
    tensor = next(t for t in gguf.GGUFReader(source).tensors if t.name == "output_norm.weight")
    original = np.array(tensor.data, dtype=np.float32)
    shuffled = np.random.default_rng(0).permutation(original)
    base, tune = tmp_path / "base" / source.name, tmp_path / "tune" / source.name
    for path, weights in ((base, original), (tune, shuffled)):
        path.parent.mkdir()
        shutil.copyfile(source, path)
        with path.open("r+b") as fh:
            fh.seek(tensor.data_offset)
            fh.write(weights.tobytes())
    assert base.stat().st_size == tune.stat().st_size
    answers = []
    for path, weights in ((base, original), (tune, shuffled)):
        target = load_target(str(path))
        norm = target.model.model.norm.weight.detach().numpy()
        assert np.array_equal(norm, weights)  # its own weights, not the other copy's
        ids = encode_chat(target.tokenizer, [{"role": "user", "content": "Name a colour."}])
        out = target.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        answers.append(out[0, len(ids) :].tolist())
    assert answers[0] != answers[1]
    assert resolve_model(str(base)) != resolve_model(str(tune))
